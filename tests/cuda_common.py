"""What the CUDA test files share (not a test file): the check of one call against the float64
reference and the CPU backend, the feature cycle, the graph capture, the profiler's kernel
names, the pins of the decode switches (each restored to "auto" when its block ends), and the
checks of a bad row's call. Their fixtures (clean_error_word, decode_merge) are in conftest.py.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import (NORM_REL, FP32_MAX_REL, assert_output_close, bits, case_fingerprint, check_caches,
                      memoized, output_error, record_error, run_and_check)
from reference import to_bnsh


# RoPE's x0*cos - x1*sin may be contracted into FMAs on CUDA, so rotated K rows in the caches may
# differ from the reference (and from the CPU backend) by this many units in the last place.
ROTARY_ULPS = 1


def run_cuda_and_cpu(case_cpu):
    """Runs the same inputs on the CPU backend and on CUDA; checks CUDA against the reference
    (output, caches, guard regions, poisoned allocations) and against the CPU backend. The
    reference and the CPU backend's result are computed once per input (conftest.memoized):
    the route tests give every prefill kernel the same inputs."""
    cuda_checked = case_cpu.to("cuda")
    cuda_case = case_cpu.to("cuda")
    inputs = case_fingerprint(case_cpu)
    # (reference() leaves its inputs alone: it writes into copies of the caches.)
    reference = memoized("reference", inputs, lambda: case_cpu.reference())
    err = run_and_check(cuda_checked, rotary_ulps=ROTARY_ULPS, suite="cuda", reference=reference)
    torch.cuda.synchronize()
    gqa_torch.check_errors()  # a valid call sets no flag

    def cpu_backend():
        cpu_case = case_cpu.clone()
        if cpu_case.op == "functional":
            return cpu_case.run()
        return cpu_case.run(), cpu_case.cache_key, cpu_case.cache_value

    cpu_out, cpu_k, cpu_v = memoized("cpu_backend", inputs, cpu_backend)
    if case_cpu.op == "functional":
        cuda_out, cuda_k, cuda_v = cuda_case.run()
    else:
        cuda_out, cuda_k, cuda_v = cuda_case.run(), cuda_case.cache_key, cuda_case.cache_value
    tol = 2 * (FP32_MAX_REL if cpu_out.dtype == torch.float32 else NORM_REL[cpu_out.dtype])
    diff = output_error(cuda_out.cpu(), cpu_out.double())
    record_error("cuda_vs_cpu", cpu_out.dtype, diff)
    assert diff <= tol, f"CUDA vs CPU backend: {diff:.3g} > {tol:.3g}"
    check_caches(case_cpu, cuda_k.cpu(), cuda_v.cpu(), cpu_k, cpu_v, rotary_ulps=ROTARY_ULPS)
    gqa_torch.check_errors()
    return err


FEATURE_CYCLE = [
    dict(),
    dict(rotary="half"),
    dict(rotary="interleaved", position_ids="random"),
    dict(rotary="half", rotary_dim=32, window=37),
    dict(softcap=2.0, q_amplitude=3.0, sink=True),
    dict(smooth=True, window=5, scale=0.1),
]


def check_bad_row_poisons_the_call(case, message, flags=gerr.CAPACITY):
    """Runs an in-place case with a bad row (by default one past the capacity): every output is
    NaN (`message` otherwise), no cache byte changes (guard regions included), and
    check_errors() raises `flags` alone."""
    before = case.clone()
    out = case.run()
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), message
    assert_untouched_except_valid_rows(before, case, written_rows=[])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags


def decode_kernel_bools(names):
    """decode_mma_kernel's last three template arguments (kPlain, kShares, kKeysM) for each
    decode kernel among the profiler's kernel names, demangled or not."""
    bools = []
    for name in names:
        m = re.search(r"decode_mma_kernel<([^<>]*)>", name)
        if m:
            bools.append(tuple(v.strip() in ("true", "1", "(bool)1") for v in m.group(1).split(",")[-3:]))
            continue
        m = re.search(r"decode_mma_kernelI\w*?((?:Lb[01]E){3})E", name)
        if m:
            bools.append(tuple(m.group(1)[i + 2] == "1" for i in (0, 4, 8)))
    return bools


def decode_loader_codes(names, head_dim):
    """The loader template argument (DecodeLoader in decode_mma.cuh) of each decode kernel at
    `head_dim` among the profiler's kernel names, demangled or not."""
    codes = []
    for name in names:
        m = (re.search(rf"decode_mma_kernel<[^,<>]+,\s*{head_dim},\s*(\d+)", name)
             or re.search(rf"decode_mma_kernelI\w+?Li{head_dim}ELi(\d+)E", name))
        if m:
            codes.append(int(m.group(1)))
    return codes


def capture_in_graph(call, warmups=1, during_capture=None):
    """Warms `call` up on a side stream, then captures one call of it in a CUDA graph (and runs
    `during_capture` inside the capture). Returns the graph and the captured call's output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
        if during_capture is not None:
            during_capture()
    torch.cuda.synchronize()
    return graph, out


@contextlib.contextmanager
def shares_forced(item_keys=-1):
    """The balanced partition forced on wherever its kernel is built (set_decode_shares "force",
    with this item weight; -1: 512) inside the block, and auto afterwards whatever happens."""
    gqa_torch._C._set_decode_shares("force", item_keys)
    try:
        yield
    finally:
        gqa_torch._C._set_decode_shares("auto", -1)


def cuda_kernel_names(call):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def cuda_kernel_names_or_skip(call):
    """cuda_kernel_names(call), or a skip where the profiler records none: under
    compute-sanitizer, which keeps CUPTI from starting (the tests of which kernel ran are kept
    apart from those of what it computed, so that the sanitizers run the latter whole)."""
    names = cuda_kernel_names(call)
    if not names:
        pytest.skip("torch.profiler recorded no CUDA kernels here (CUPTI unavailable)")
    return names


@contextlib.contextmanager
def decode_pinned(merge="auto", max_splits=0, min_split_keys=0, schedule="auto"):
    """The decode merge, row order and the plan's split counts pinned inside the block (0: the
    plan's), and all given back to auto afterwards whatever happens."""
    gqa_torch._C._set_decode_merge(merge)
    gqa_torch._C._set_decode_schedule(schedule)
    gqa_torch._C._set_decode_split_override(max_splits, min_split_keys)
    try:
        yield
    finally:
        gqa_torch._C._set_decode_merge("auto")
        gqa_torch._C._set_decode_schedule("auto")
        gqa_torch._C._set_decode_split_override(0, 0)


@contextlib.contextmanager
def switch_pinned(switch, value):
    """One of the decode kernel's named switches (`gqa_torch._C._set_decode_*`) set to `value`
    inside the block, and given back to "auto" afterwards whatever happens."""
    switch(value)
    try:
        yield
    finally:
        switch("auto")


def inplace_step(static):
    """The in-place op on a case's tensors, for capture: each replay reads and writes them."""
    return gqa_torch.group_query_attention_(*static.op_args(), **static.attrs)


def replay_with_fresh_inputs_and_check(graph, static, static_out, pasts):
    """Sets the captured step's lengths to `pasts` (total = past + 1) and its q, k and v to fresh
    random values, replays it, and checks the output and the caches against the float64
    reference of the state before the replay."""
    static.seqlens_k.copy_(torch.tensor(pasts, dtype=torch.int32))
    for t in (static.query, static.key, static.value):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    before = static.clone()
    graph.replay()
    torch.cuda.synchronize()
    gqa_torch.check_errors()
    ref_out, ref_k, ref_v = before.reference()
    assert_output_close(static_out, ref_out, before, suite="cuda_graph")
    check_caches(before, static.cache_key, static.cache_value, ref_k, ref_v, rotary_ulps=ROTARY_ULPS)


def assert_untouched_except_valid_rows(case_before, case_after, written_rows):
    """Everything of the cache buffers (guard region included) is byte-identical, except the
    target rows of the rows in written_rows, which may hold the new K/V."""
    layout = case_before.attrs["kv_layout"]
    for base_b, base_a, view_a in ((case_before.cache_base[0], case_after.cache_base[0], case_after.cache_key),
                                   (case_before.cache_base[1], case_after.cache_base[1], case_after.cache_value)):
        may_change = torch.zeros(base_a.shape, dtype=torch.bool)
        mv = may_change.as_strided(view_a.shape, view_a.stride(), view_a.storage_offset() - base_a.storage_offset())
        for b in written_rows:
            g = case_before.geometry()[b]
            to_bnsh(mv, layout)[b, :, g.past:g.total] = True
        same = bits(base_a.cpu()) == bits(base_b.cpu())
        assert bool(same[~may_change].all()), "a write landed outside the valid rows' targets (or in the guard region)"
