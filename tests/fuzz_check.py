"""The property every fuzz case of tests/test_fuzz.py must hold (:func:`check_spec`): a host
rule raises ValueError/TypeError naming its argument, a data-dependent violation raises
GQAError with exactly the oracle's flags, and a valid call matches the float64 reference, with
every byte outside its target rows (guards, padding, other rows, inputs) unchanged. Also the
counters that the module's summary prints and checks, the thread-count and watchdog wrappers.

tests/test_fuzz.py's self-checks replace this module's ``call`` with a misbehaving op."""
from __future__ import annotations

import faulthandler
import re
from collections import Counter
from typing import List, Optional

import pytest
import torch

import gqa_torch
from conftest import FP32_MAX_REL, NORM_REL, bits, output_error, poison_allocator, record_error, ulp_distance
from conftest import call_op as call
from fuzz_cases import (DTYPES, HOST_MUTATIONS, Spec, cache_names, apply_host_mutation, build, capacity,
                        device_view, expected_flags, is_first_prompt, row_past, to_device, violating_rows)
from reference import reference_gqa, reference_gqa_, to_bnsh

WATCHDOG_S = 120  # one case takes milliseconds; a hang is reported (with stacks) after this
DEFAULT_THREADS = torch.get_num_threads()


# ---- counters (reported by the terminal summary and by test_fuzz_summary) ------------------------

STATS_BY_DEVICE = {"cpu": Counter(), "cuda": Counter()}


class SummaryPlugin:
    """Registered by the module fixture: prints the fuzz counters at the end of the run."""

    def pytest_terminal_summary(self, terminalreporter):
        if not any(STATS_BY_DEVICE.values()):
            return
        terminalreporter.section("gqa: property-based fuzzing (tests/test_fuzz.py)")
        for device, stats in STATS_BY_DEVICE.items():
            if stats:
                terminalreporter.write_line(f"  {device}:")
                for line in summary_lines(stats):
                    terminalreporter.write_line("    " + line)


def summary_lines(stats: Counter) -> List[str]:
    total = stats["valid"] + stats["invalid_data"] + stats["invalid_host"]
    lines = [f"cases: {total} = {stats['valid']} valid + {stats['invalid_data'] + stats['invalid_host']} invalid "
             f"({stats['invalid_data']} GQAError, {stats['invalid_host']} ValueError/TypeError)"]
    for op in ("functional", "inplace"):
        lines.append(f"  {op}: {stats['valid:' + op]} valid, {stats['invalid:' + op]} invalid")
    flags = ", ".join(f"{1 << bit}: {stats[f'flag:{1 << bit}']}" for bit in range(6))
    lines.append(f"  GQAError flag bits seen (cases per bit): {flags}")
    hosts = sorted((k[5:], v) for k, v in stats.items() if k.startswith("host:"))
    lines.append("  host mutations: " + ", ".join(f"{k} {v}" for k, v in hosts))
    feats = ["fp32", "fp16", "bf16", "packed", "rotary", "position_ids", "window", "softcap", "smooth", "sink",
             "first_prompt", "long", "strided"]
    lines.append("  valid cases with: " + ", ".join(f"{f} {stats['feat:' + f]}" for f in feats))
    return lines


def with_threads(threads: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) with `threads` intra-op threads (0: torch's default for this
    process); the CPU backend divides its work (query tiles, key splits) by the thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or DEFAULT_THREADS)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(saved)


def watched(fn, *args, **kwargs):
    """Runs fn under a watchdog: a hang dumps every thread's stack and exits (CI fails loudly
    instead of stalling)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        return fn(*args, **kwargs)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- the property ----------------------------------------------------------------------------------

def assert_same_bytes(now: torch.Tensor, before: torch.Tensor, what: str):
    diff = bits(now) != bits(before)
    if bool(diff.any()):
        idx = diff.nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} elements changed, first (flat) at {idx}")


def assert_close_bits(now: torch.Tensor, expected: torch.Tensor, loose: Optional[torch.Tensor], what: str):
    """Byte equality, except where ``loose`` (a bool mask, or None) allows one ulp."""
    if loose is None:
        assert_same_bytes(now, expected, what)
        return
    diff = bits(now) != bits(expected)
    strict = diff & ~loose
    if bool(strict.any()):
        idx = strict.nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: {int(strict.sum())} elements changed, first (flat) at {idx}")
    worst = int(ulp_distance(now[loose], expected[loose]).max()) if bool(loose.any()) else 0
    assert worst <= 1, f"{what}: rotated new K rows differ by {worst} ulp (at most 1 allowed)"


def check_spec(spec: Spec) -> str:
    """Runs one case and checks it; returns "valid", "gqa_error" or "host_error"."""
    on_cpu = spec.device == "cpu"
    built = build(spec)
    cpu_args = built.args
    storages = {}
    args = cpu_args if on_cpu else to_device(cpu_args, spec.device, storages)
    if not on_cpu:  # the inputs and the buffer to watch are the device copies
        built.inputs = {k: device_view(v, spec.device, storages) for k, v in built.inputs.items()}
        built.buffer = device_view(built.buffer, spec.device, storages)
        gqa_torch.check_errors()  # a flag left over by the previous case is a failure of that case
    inputs_before = {k: v.clone() for k, v in built.inputs.items()}
    buffer_before = built.buffer.clone() if built.buffer is not None else None

    def inputs_unchanged():
        for name, before in inputs_before.items():
            assert_same_bytes(built.inputs[name], before, f"input {name} (with its margins)")

    def buffer_unchanged():
        if built.buffer is not None:
            assert_same_bytes(built.buffer, buffer_before, "in-place cache buffer after a rejected call")

    kind = f"{spec.device} {spec.op} B={spec.B} S={spec.S} Hkv={spec.Hkv} G={spec.G} D={spec.D} {spec.dtype}"
    odd_on_cuda = not on_cpu and spec.D % 2 == 1
    if spec.host is not None or odd_on_cuda:
        if spec.host is not None:
            _, exc, pattern = HOST_MUTATIONS[spec.host]
            key_name, value_name = cache_names(spec)
            pattern = pattern.format(key=key_name, value=value_name)
            mutated = apply_host_mutation(spec, cpu_args)
            mutated = mutated if on_cpu else to_device(mutated, spec.device, storages)
        else:  # the CUDA kernels need an even head size (a host rule of the CUDA backend)
            exc, pattern, mutated = ValueError, "query", args
        with pytest.raises((ValueError, TypeError)) as info:
            with_threads(spec.threads, call, spec.op, mutated)
        err = info.value
        rule = spec.host or "odd head size on CUDA"
        assert not isinstance(err, gqa_torch.GQAError), f"host rule {rule} raised a GQAError: {err}"
        assert isinstance(err, exc), f"host rule {rule}: expected {exc.__name__}, got {type(err).__name__}: {err}"
        first = str(err).splitlines()[0]
        assert re.search(rf"gqa: {re.escape(pattern)}\b", first), (
            f"host rule {rule}: message does not name {pattern!r}: {first}")
        inputs_unchanged()
        buffer_unchanged()
        return "host_error"

    flags = expected_flags(spec)
    if flags:
        with pytest.raises(gqa_torch.GQAError) as info:
            out = with_threads(spec.threads, call, spec.op, args)
            if not on_cpu and spec.op == "inplace":
                # Deferred on CUDA (SPEC §4): the violating rows are NaN, then the sync point raises.
                for b in violating_rows(spec):
                    assert bool(torch.isnan(out[b]).all()), f"{kind}: row {b} violates SPEC §4 but its output is not NaN"
                gqa_torch.check_errors()
        err = info.value
        assert err.flags == flags, (f"{kind}: GQAError.flags = {err.flags}, expected {flags} "
                                    f"(seqlens_k={spec.seqlens}); message: {err}")
        inputs_unchanged()
        buffer_unchanged()
        if not on_cpu:
            gqa_torch.check_errors()  # raising cleared the word
        return "gqa_error"

    # ---- valid: reference first (on CPU copies), then the op
    ref_args = tuple(cpu_args[k] for k in ("query", "key", "value", "cache_key", "cache_value", "seqlens_k"))
    tail = (cpu_args["cos_cache"], cpu_args["sin_cache"], cpu_args["position_ids"], cpu_args["head_sink"])
    new_k_loose = not on_cpu and spec.rotary is not None  # rotated K rows: one ulp of FMA contraction allowed
    if spec.op == "functional":
        ref_out, ref_k, ref_v = reference_gqa(*ref_args, cpu_args["total_sequence_length"], *tail, **cpu_args["attrs"])
        shape = (spec.B, spec.Hkv, capacity(spec), spec.D)
        poison_allocator([ref_out.shape, shape, shape], DTYPES[spec.dtype], device=spec.device)
        out, present_k, present_v = with_threads(spec.threads, call, spec.op, args)
        loose_k = None
        if new_k_loose:  # in the present's own layout (BSNH when kv_layout is 1)
            loose_k = torch.zeros(ref_k.shape, dtype=torch.bool)
            for b, seqlen in enumerate(spec.seqlens):
                p = row_past(spec, seqlen)
                to_bnsh(loose_k, spec.layout)[b, :, p:p + spec.S] = True
        for name, actual, expected, loose in (("present_key", present_k, ref_k, loose_k),
                                              ("present_value", present_v, ref_v, None)):
            assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype), name
            assert_close_bits(actual.cpu(), expected, loose, f"{kind}: {name} vs the reference")
    else:
        ref_out, ref_k, ref_v = reference_gqa_(*ref_args, *tail, **cpu_args["attrs"])
        poison_allocator([ref_out.shape], DTYPES[spec.dtype], device=spec.device)
        out = with_threads(spec.threads, call, spec.op, args)
        # The expected buffer: as before, except rows [past_b, past_b + S) of each row.
        expected = buffer_before.cpu()
        loose = torch.zeros(expected.shape, dtype=torch.bool) if new_k_loose else None
        shape, strides, key_off, value_off = built.cache_view
        for off, ref in ((key_off, ref_k), (value_off, ref_v)):
            dst = to_bnsh(expected.as_strided(shape, strides, off), spec.layout)
            src = to_bnsh(ref, spec.layout)
            for b, seqlen in enumerate(spec.seqlens):
                p = row_past(spec, seqlen)
                dst[b, :, p:p + spec.S] = src[b, :, p:p + spec.S]
                if loose is not None and off == key_off:
                    to_bnsh(loose.as_strided(shape, strides, off), spec.layout)[b, :, p:p + spec.S] = True
        assert_close_bits(built.buffer.cpu(), expected, loose,
                           f"{kind}: cache buffer (guards, padding, other rows, new rows)")
    if not on_cpu:
        gqa_torch.check_errors()  # a valid call sets no flag
    inputs_unchanged()
    out = out.cpu()
    assert out.shape == (spec.B, spec.S, spec.Hq * spec.D)
    assert not bool(torch.isnan(out).any()), f"{kind}: NaN in a valid output"
    check_output(out, ref_out, kind)
    if is_first_prompt(spec):
        for b, seqlen in enumerate(spec.seqlens):
            assert bool((out[b, seqlen + 1:] == 0).all()), f"row {b}: first-prompt padding output must be 0"
    return "valid"


def check_output(out: torch.Tensor, ref: torch.Tensor, kind: str) -> None:
    """SPEC §5 per batch row: fp32 max|d|/max|ref| <= 1e-5, fp16/bf16 ||d||/||ref|| <= 1e-3 / 4e-3.

    One allowance: a row whose reference the storage dtype itself cannot hold to within half
    the tolerance (its rounding error ``floor`` > tol/2, which needs subnormal outputs, e.g. a
    head sink or smooth softmax's 0 outweighing every key by e^12 in fp16) must be within
    ``floor + tol``: as good as rounding the exact result allows. In the normal range rounding
    alone is at most eps/2 < tol/2, so the allowance never loosens an ordinary row.
    """
    assert torch.isfinite(out).all(), f"{kind}: non-finite output values"
    tol = FP32_MAX_REL if out.dtype == torch.float32 else NORM_REL[out.dtype]
    worst = 0.0
    for b in range(ref.shape[0]):
        err = output_error(out[b:b + 1], ref[b:b + 1])
        floor = output_error(ref[b:b + 1].to(out.dtype), ref[b:b + 1])
        allowed = tol if floor <= tol / 2 else floor + tol
        assert err <= allowed, f"{kind}: row {b}: output error {err:.3g} > {allowed:.3g} (rounding floor {floor:.3g})"
        if floor <= tol / 2:
            worst = max(worst, err)
    record_error("fuzz", out.dtype, worst)


def record(spec: Spec, outcome: str):
    stats = STATS_BY_DEVICE[spec.device]
    if outcome == "valid":
        stats["valid"] += 1
        stats[f"valid:{spec.op}"] += 1
        feats = [spec.dtype] + [name for name, on in (
            ("packed", spec.packed), ("rotary", spec.rotary), ("position_ids", spec.position_ids and spec.rotary),
            ("window", spec.window > 0), ("softcap", spec.softcap > 0), ("smooth", spec.smooth),
            ("sink", spec.sink), ("first_prompt", is_first_prompt(spec)), ("strided", spec.strided),
            ("long", max(r + 1 for r in spec.seqlens) > 1024)) if on]
        for f in feats:
            stats["feat:" + f] += 1
    else:
        stats["invalid_data" if outcome == "gqa_error" else "invalid_host"] += 1
        stats[f"invalid:{spec.op}"] += 1
        if outcome == "host_error":
            stats[f"host:{spec.host or 'odd_head_size_cuda'}"] += 1
        else:
            flags = expected_flags(spec)
            for bit in range(6):
                if flags & (1 << bit):
                    stats[f"flag:{1 << bit}"] += 1
