#!/usr/bin/env python3
"""Soak run of the in-place operator ``gqa_torch.group_query_attention_``.

A long decode loop in the style of continuous batching: a static :class:`gqa_torch.KVCache`
of ``B`` rows, each row serving one request after another. Every step calls the op once, with
one new token for each of the first ``nb`` rows (``nb`` varies: the batch grows and shrinks).
``seqlens_k`` is managed directly from the cache's device-side lengths; finished rows are
emptied with :meth:`KVCache.reset_rows` and start a new request. About a third of the
requests never finish: they run until their row is full, and the next step that includes the
row must be refused by the op itself, exactly then (SPEC §4, flag 16):

- CPU: the op raises :class:`gqa_torch.GQAError` with ``flags == 16`` before writing; the caches
  are checked byte for byte against a snapshot taken before the call.
- CUDA: the op flags the device error word; the step's sync point (``gqa_torch.check_errors()``)
  raises ``GQAError`` with ``flags == 16``; the refused rows' outputs are NaN and the caches
  are byte-identical to the snapshot; the word is then clear and the loop goes on.

The refused rows are then reset and serve a new request.

What the run asserts (any failure raises :class:`SoakFailure`; the script exits non-zero):

1. Capacity errors come exactly on the steps where a row would exceed the capacity (the host
   keeps its own copy of the schedule and of every row's length), never elsewhere, with exactly
   flag 16; the device lengths always match the host's copy.
2. Every output of an accepted step is finite. The caches start NaN-filled and every reset row
   is refilled with NaN, so reading anything outside a row's valid prefix shows.
3. Every ``ref_every`` steps the step is checked against the float64 reference
   (``tests/reference.py``): the output within SPEC §5 tolerances, the caches byte for byte
   (on CUDA the rotated new K rows may differ by RoPE's FMA rounding, 1 ulp of the row).
4. The same seeded schedule run twice gives bit-identical outputs at every step (a 128-bit
   digest per step) and bit-identical final caches and lengths.
5. Memory stays flat after warm-up: CPU: the process RSS sampled every ``sample_every`` steps
   grows by at most ``rss_bound_mib``; CUDA: ``torch.cuda.memory_allocated()`` and
   ``torch.cuda.max_memory_reserved()`` at the end are not above their values after warm-up.

Usage::

    python3 scripts/soak.py                  # 20,000 steps, cuda when available, else cpu
    python3 scripts/soak.py --steps 2000 --device cpu --seed 7

The logic lives here only; ``tests/test_soak_concurrency.py`` imports it.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
_TESTS = os.path.join(_ROOT, "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

import gqa_torch  # noqa: E402
from gqa_torch import errors as gqa_errors  # noqa: E402
from reference import output_error, reference_gqa_  # noqa: E402  (tests/reference.py: the float64 judge)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# SPEC §5: fp32 max relative error; fp16/bf16 norm-wise relative error (per batch row).
FP32_MAX_REL = 1e-5
NORM_REL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}
DIGEST = 16  # bytes of blake2b per step


class SoakFailure(AssertionError):
    """A soak property did not hold."""


@dataclass
class SoakConfig:
    steps: int = 20_000
    device: str = "cpu"
    dtype: str = "fp32"
    batch: int = 4
    num_heads: int = 4
    kv_num_heads: int = 2
    head_dim: int = 32
    capacity: int = 64
    seed: int = 0
    # schedule
    partial_batch_prob: float = 0.25   # a step runs only the first nb < B rows
    separate_qkv_prob: float = 0.25    # q, k, v as three tensors instead of packed
    until_full_prob: float = 0.35      # a new request runs until its row is refused at capacity
    abort_prob: float = 0.002          # a running request is cancelled (row reset early)
    poison_on_reset: bool = True       # reset rows are refilled with NaN
    # checks
    ref_every: int = 100               # 0: never compare with the float64 reference
    sync_every: int = 100              # CUDA: check_errors() with no error expected
    sample_every: int = 1000           # memory samples
    warmup: int = 2000                 # steps before the memory baseline (the first sample from then on)
    check_memory: bool = True
    rss_bound_mib: float = 8.0         # CPU: allowed RSS growth after warm-up
    cuda_allocated_slack: int = 0      # CUDA: allowed growth of memory_allocated() after warm-up (bytes)


@dataclass
class SoakResult:
    config: SoakConfig
    digests: bytearray
    final_digest: str
    capacity_errors: List[Tuple[int, List[int]]]   # (step, refused rows)
    full_steps: int                                # accepted steps in which some row reached total == capacity
    requests_started: int
    requests_finished: int
    aborts: int
    ref_checks: int
    worst_ref_error: float
    memory: Dict[str, object]
    elapsed_s: float


# ---- small helpers -----------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(int_type)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _digest(t: torch.Tensor) -> bytes:
    data = t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=DIGEST).digest()


def rss_bytes() -> int:
    """Current resident set size of this process (psutil, else /proc, else peak RSS)."""
    try:
        import psutil  # type: ignore
        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _compare_cache(name: str, actual: torch.Tensor, expected: torch.Tensor, new_rows: List[Tuple[int, int]],
                   rotated_ulps: int) -> None:
    """Byte-identical, except (when rotated_ulps > 0) the new rows [(b, pos)] of a rotated K,
    which may differ by rotated_ulps units of the row's largest magnitude."""
    a, e = actual.detach().cpu(), expected.cpu()
    differ = _bits(a) != _bits(e)
    if rotated_ulps > 0:
        allowed = torch.zeros(a.shape, dtype=torch.bool)
        for b, pos in new_rows:
            allowed[b, :, pos] = True
        eps = torch.finfo(e.dtype).eps
        scale = e.double().abs().amax(dim=-1, keepdim=True)
        close = (a.double() - e.double()).abs() <= rotated_ulps * eps * scale
        differ = differ & ~(allowed & close)
    if bool(differ.any()):
        raise SoakFailure(f"{name}: {int(differ.sum())} elements differ from the float64 reference, "
                          f"first at {differ.nonzero()[:5].tolist()}")


# ---- the run -----------------------------------------------------------------------------------

def default_device() -> str:
    return "cuda" if gqa_torch.cuda_kernels_available() else "cpu"


class _Rows:
    """The host's copy of the schedule: each row's length and request."""

    def __init__(self, batch: int, capacity: int, rng: random.Random, cfg: SoakConfig):
        self.capacity, self.rng, self.cfg = capacity, rng, cfg
        self.lengths = [0] * batch
        self.targets: List[Optional[int]] = [None] * batch
        self.started = 0
        for b in range(batch):
            self.new_request(b)

    def new_request(self, b: int) -> None:
        self.lengths[b] = 0
        # None: run until the op refuses the row at capacity; else finish at `target` tokens.
        self.targets[b] = None if self.rng.random() < self.cfg.until_full_prob else self.rng.randint(1, self.capacity)
        self.started += 1


def run_soak(cfg: SoakConfig, log: Optional[Callable[[str], None]] = None) -> SoakResult:
    """One seeded soak run; raises SoakFailure when a property does not hold."""
    device = torch.device(cfg.device)
    is_cuda = device.type == "cuda"
    if is_cuda and not gqa_torch.cuda_kernels_available():
        raise SoakFailure("soak: device cuda asked for, but no CUDA kernels/device are available")
    dtype = DTYPES[cfg.dtype]
    B, Hq, Hkv, D, C = cfg.batch, cfg.num_heads, cfg.kv_num_heads, cfg.head_dim, cfg.capacity
    if cfg.check_memory and not 0 < cfg.warmup < cfg.steps:
        raise ValueError(f"soak: warmup must be in (0, steps), got {cfg.warmup}")
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)

    cache = gqa_torch.KVCache(1, B, Hkv, D, C, dtype=dtype, device=device)
    key_cache, value_cache = cache.layer(0)
    if cfg.poison_on_reset:
        key_cache.fill_(math.nan)
        value_cache.fill_(math.nan)
    # Random angles, one row per position; C + 8 rows so that a refused step (position C)
    # breaks only the capacity bound (flag 16), not the rotary one (flag 32).
    angle = torch.rand(C + 8, D // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
    cos_cache, sin_cache = torch.cos(angle).float().to(device), torch.sin(angle).float().to(device)
    head_sink = (torch.randn(Hq, generator=gen) * 1.5).to(device)
    attrs = dict(num_heads=Hq, kv_num_heads=Hkv, do_rotary=True)
    rotated_ulps = 1 if is_cuda else 0
    tol = FP32_MAX_REL if dtype == torch.float32 else NORM_REL[dtype]

    rows = _Rows(B, C, rng, cfg)
    digests = bytearray(cfg.steps * DIGEST)
    capacity_errors: List[Tuple[int, List[int]]] = []
    full_steps = finished = aborts = ref_checks = 0
    worst_ref = 0.0
    memory: Dict[str, object] = {"rss_samples": []}
    if is_cuda:
        gqa_torch.clear_errors()
        torch.cuda.synchronize()
    start = time.perf_counter()

    def sample(step: int) -> None:
        # The device lengths must be the host's copy (one sync on CUDA, every sample_every steps).
        got = cache.lengths_host(0).tolist()
        if got != rows.lengths:
            raise SoakFailure(f"step {step}: device lengths {got} != host lengths {rows.lengths}")
        if not cfg.check_memory:
            return
        baseline = step >= cfg.warmup and "rss_warm" not in memory  # the first sample after warm-up
        if is_cuda:
            torch.cuda.synchronize()
            if baseline:
                memory["cuda_allocated_warm"] = torch.cuda.memory_allocated()
                memory["cuda_max_reserved_warm"] = torch.cuda.max_memory_reserved()
        rss = rss_bytes()
        memory["rss_samples"].append((step, rss))
        if baseline:
            memory["rss_warm"] = rss
            memory["warm_step"] = step

    sample(0)
    for step in range(cfg.steps):
        # -- continuous batching: finished and cancelled requests free their rows.
        freed = []
        for b in range(B):
            target = rows.targets[b]
            if target is not None and rows.lengths[b] >= target:
                freed.append(b)
                finished += 1
            elif rows.lengths[b] > 0 and rng.random() < cfg.abort_prob:
                freed.append(b)
                aborts += 1
        if freed:
            _reset(cache, freed, cfg.poison_on_reset)
            for b in freed:
                rows.new_request(b)

        nb = B if rng.random() >= cfg.partial_batch_prob else rng.randint(1, B - 1) if B > 1 else 1
        refused = [b for b in range(nb) if rows.lengths[b] + 1 > C]
        separate = rng.random() < cfg.separate_qkv_prob
        check_ref = cfg.ref_every > 0 and step % cfg.ref_every == cfg.ref_every - 1 and not refused

        # -- fresh inputs (a seeded generator: the rerun sees the same ones)
        width = (Hq + 2 * Hkv) * D
        qkv = torch.randn(nb, 1, width, generator=gen).to(dtype)
        if separate:
            q, k, v = (qkv[..., :Hq * D].contiguous(), qkv[..., Hq * D:(Hq + Hkv) * D].contiguous(),
                       qkv[..., (Hq + Hkv) * D:].contiguous())
            inputs = (q.to(device), k.to(device), v.to(device))
        else:
            inputs = (qkv.to(device), None, None)
        kc, vc = key_cache[:nb], value_cache[:nb]
        seqlens_k = cache.lengths[0, :nb]  # S = 1: seqlens_k = lengths + S - 1, read on the device

        snapshot = None
        if refused or check_ref:
            snapshot = (kc.clone(), vc.clone(), seqlens_k.clone())

        # -- the step
        flags = None
        out = None
        try:
            out = gqa_torch.group_query_attention_(*inputs, kc, vc, seqlens_k, cos_cache, sin_cache, None,
                                                   head_sink, **attrs)
            if is_cuda and (refused or step % cfg.sync_every == cfg.sync_every - 1):
                gqa_torch.check_errors()  # the loop's sync point
        except gqa_torch.GQAError as exc:
            flags = exc.flags
        if not refused and flags is not None:
            raise SoakFailure(f"step {step}: unexpected GQAError flags={flags} (nb={nb}, lengths {rows.lengths})")
        if refused:
            if flags is None:
                raise SoakFailure(f"step {step}: rows {refused} exceed capacity {C} (lengths {rows.lengths[:nb]}) "
                                  f"but no capacity error was raised")
            if flags != gqa_errors.CAPACITY:
                raise SoakFailure(f"step {step}: capacity error with flags {flags}, expected {gqa_errors.CAPACITY}")
            if not is_cuda and out is not None:
                raise SoakFailure(f"step {step}: the CPU op returned an output for a refused call")
            if is_cuda:
                if out is not None:  # (None only when gqa_torch.set_synchronous_errors(True) made the call raise)
                    bad = [b for b in refused if not bool(torch.isnan(out[b]).all())]
                    if bad:
                        raise SoakFailure(f"step {step}: refused rows {bad} have non-NaN outputs")
                try:
                    gqa_torch.check_errors()  # cleared by the raise: must not raise again
                except gqa_torch.GQAError as exc:
                    raise SoakFailure(f"step {step}: the error word was not cleared ({exc})") from None
            if not (_bits_equal(kc, snapshot[0]) and _bits_equal(vc, snapshot[1])):
                raise SoakFailure(f"step {step}: the refused call wrote into the caches")
            capacity_errors.append((step, refused))
            digests[step * DIGEST:(step + 1) * DIGEST] = (
                _digest(out) if out is not None else hashlib.blake2b(b"refused", digest_size=DIGEST).digest())
            # the refused rows are reset and serve new requests; nothing advanced
            _reset(cache, refused, cfg.poison_on_reset)
            for b in refused:
                rows.new_request(b)
        else:
            if not bool(torch.isfinite(out).all()):
                raise SoakFailure(f"step {step}: non-finite output (nb={nb}, lengths {rows.lengths[:nb]})")
            digests[step * DIGEST:(step + 1) * DIGEST] = _digest(out)
            if check_ref:
                worst_ref = max(worst_ref, _check_reference(step, inputs, snapshot, out, kc, vc, cos_cache,
                                                            sin_cache, head_sink, attrs, tol, rotated_ulps))
                ref_checks += 1
            if any(rows.lengths[b] + 1 == C for b in range(nb)):
                full_steps += 1
            cache.lengths[0, :nb] += 1
            for b in range(nb):
                rows.lengths[b] += 1
        del out, inputs, snapshot

        done = step + 1
        if done % cfg.sample_every == 0 or done == cfg.steps:
            sample(done)
        if log is not None and (done % 1000 == 0 or done == cfg.steps):
            rate = done / (time.perf_counter() - start)
            mem = _memory_line(is_cuda, memory)
            log(f"  step {done:>6}/{cfg.steps}  capacity errors {len(capacity_errors):>4}  "
                f"requests {rows.started:>5}  ref checks {ref_checks:>3}  {mem}  {rate:,.0f} steps/s")

    if is_cuda:
        torch.cuda.synchronize()
        try:
            gqa_torch.check_errors()
        except gqa_torch.GQAError as exc:
            raise SoakFailure(f"end of the run: unexpected error flags ({exc})") from None
        if cfg.check_memory:
            memory["cuda_allocated_end"] = torch.cuda.memory_allocated()
            memory["cuda_max_reserved_end"] = torch.cuda.max_memory_reserved()
    final = hashlib.blake2b(digest_size=DIGEST)
    for t in (cache.key, cache.value, cache.lengths):
        final.update(_digest(t))
    result = SoakResult(config=cfg, digests=digests, final_digest=final.hexdigest(), capacity_errors=capacity_errors,
                        full_steps=full_steps, requests_started=rows.started, requests_finished=finished,
                        aborts=aborts, ref_checks=ref_checks, worst_ref_error=worst_ref, memory=memory,
                        elapsed_s=time.perf_counter() - start)
    if cfg.check_memory:
        check_memory(result)
    return result


def _reset(cache: gqa_torch.KVCache, rows: List[int], poison: bool) -> None:
    cache.reset_rows(rows)
    if poison:  # a new request must never see the old one's keys
        index = torch.tensor(rows, dtype=torch.long, device=cache.device)
        cache.key[0].index_fill_(0, index, math.nan)
        cache.value[0].index_fill_(0, index, math.nan)


def _check_reference(step, inputs, snapshot, out, kc, vc, cos_cache, sin_cache, head_sink, attrs, tol,
                     rotated_ulps) -> float:
    """The step against the float64 reference, from the inputs and the caches before the call."""
    k_before, v_before, seqlens = (t.cpu() for t in snapshot)
    cpu = [t.cpu() if t is not None else None for t in inputs]
    ref_out, ref_k, ref_v = reference_gqa_(*cpu, k_before, v_before, seqlens, cos_cache.cpu(), sin_cache.cpu(),
                                           None, head_sink.cpu(), **attrs)
    err = output_error(out, ref_out)
    if not err <= tol:
        raise SoakFailure(f"step {step}: output error vs the float64 reference {err:.3g} > {tol:.3g}")
    new_rows = [(b, int(s)) for b, s in enumerate(seqlens.tolist())]
    _compare_cache(f"step {step}: key cache", kc, ref_k, new_rows, rotated_ulps)
    _compare_cache(f"step {step}: value cache", vc, ref_v, new_rows, 0)
    return err


def _memory_line(is_cuda: bool, memory: Dict[str, object]) -> str:
    samples = memory.get("rss_samples") or []
    text = f"RSS {samples[-1][1] / 2**20:.1f} MiB" if samples else ""
    if is_cuda:
        text += f"  cuda allocated {torch.cuda.memory_allocated() / 2**20:.2f} MiB, " \
                f"max reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB"
    return text


def check_memory(result: SoakResult) -> None:
    """Memory stays flat after warm-up (see the module docstring)."""
    cfg, memory = result.config, result.memory
    warm = memory["rss_warm"]
    after = [rss for step, rss in memory["rss_samples"] if step >= memory["warm_step"]]
    growth = max(after) - warm
    memory["rss_growth"] = growth
    if cfg.device.startswith("cpu") and growth > cfg.rss_bound_mib * 2**20:
        raise SoakFailure(f"RSS grew by {growth / 2**20:.2f} MiB after warm-up (bound {cfg.rss_bound_mib} MiB): "
                          f"{[(s, round(r / 2**20, 2)) for s, r in memory['rss_samples']]}")
    if cfg.device.startswith("cuda"):
        alloc_growth = memory["cuda_allocated_end"] - memory["cuda_allocated_warm"]
        reserved_growth = memory["cuda_max_reserved_end"] - memory["cuda_max_reserved_warm"]
        if alloc_growth > cfg.cuda_allocated_slack:
            raise SoakFailure(f"torch.cuda.memory_allocated() grew by {alloc_growth} bytes after warm-up")
        if reserved_growth > 0:
            raise SoakFailure(f"torch.cuda.max_memory_reserved() grew by {reserved_growth} bytes after warm-up")


def compare_runs(a: SoakResult, b: SoakResult) -> None:
    """Two runs of the same seeded schedule must agree bit for bit, step by step."""
    if a.digests != b.digests:
        first = next(i for i in range(a.config.steps)
                     if a.digests[i * DIGEST:(i + 1) * DIGEST] != b.digests[i * DIGEST:(i + 1) * DIGEST])
        raise SoakFailure(f"rerun differs: the outputs of step {first} are not bit-identical")
    if a.final_digest != b.final_digest:
        raise SoakFailure("rerun differs: the final caches/lengths are not bit-identical")
    if a.capacity_errors != b.capacity_errors:
        raise SoakFailure("rerun differs: capacity errors at different steps")


def soak(cfg: SoakConfig, log: Optional[Callable[[str], None]] = None) -> Tuple[SoakResult, SoakResult]:
    """The whole soak: the seeded run, its rerun, and the bit-for-bit comparison."""
    if log:
        log(f"soak run 1: {describe(cfg)}")
    first = run_soak(cfg, log)
    if log:
        log("soak run 2 (the same seed: must be bit-identical)")
    second = run_soak(cfg, log)
    compare_runs(first, second)
    if not first.capacity_errors:
        raise SoakFailure("the schedule never drove a row past its capacity")
    return first, second


def describe(cfg: SoakConfig) -> str:
    return (f"{cfg.steps} steps on {cfg.device}, {cfg.dtype}, B={cfg.batch}, Hq={cfg.num_heads}, "
            f"Hkv={cfg.kv_num_heads}, D={cfg.head_dim}, capacity={cfg.capacity}, seed={cfg.seed}")


def summary(first: SoakResult, second: SoakResult) -> List[str]:
    cfg = first.config
    steps = [s for s, _ in first.capacity_errors]
    per_row = [0] * cfg.batch
    for _, rows in first.capacity_errors:
        for b in rows:
            per_row[b] += 1
    lines = [
        f"soak summary: {describe(cfg)}",
        f"  steps: {cfg.steps} per run, 2 runs; {first.elapsed_s:.1f} s + {second.elapsed_s:.1f} s "
        f"({cfg.steps / first.elapsed_s:,.0f} steps/s)",
        f"  requests: {first.requests_started} started, {first.requests_finished} finished, {first.aborts} aborted",
        f"  capacity errors: {len(steps)} refused steps (flag 16), refused rows per batch row {per_row}; "
        f"first at steps {steps[:8]}, last at {steps[-3:]}",
        f"  accepted steps with a row filled to exactly the capacity: {first.full_steps}",
        f"  float64 reference checks: {first.ref_checks}, worst output error {first.worst_ref_error:.3e}",
        f"  rerun bit-identical: yes ({cfg.steps} step digests and the final caches)",
    ]
    for name, res in (("run 1", first), ("run 2", second)):
        mem = res.memory
        if not cfg.check_memory:
            continue
        if cfg.device.startswith("cuda"):
            lines.append(f"  memory {name}: cuda allocated {mem['cuda_allocated_warm']} B after warm-up, "
                         f"{mem['cuda_allocated_end']} B at the end; max reserved {mem['cuda_max_reserved_warm']} B "
                         f"-> {mem['cuda_max_reserved_end']} B")
        samples = mem["rss_samples"]
        lines.append(f"  memory {name}: RSS {samples[0][1] / 2**20:.1f} MiB at start, {mem['rss_warm'] / 2**20:.1f} MiB "
                     f"after warm-up (step {mem['warm_step']}), {samples[-1][1] / 2**20:.1f} MiB at the end; max growth "
                     f"after warm-up {mem['rss_growth'] / 2**20:+.2f} MiB (bound {cfg.rss_bound_mib} MiB on CPU)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when the kernels are available)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--kv-num-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--capacity", type=int, default=None)
    parser.add_argument("--ref-every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=None, help="memory baseline after this many steps (default: a tenth of the steps, on a sample point)")
    parser.add_argument("--rss-bound-mib", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = args.device or default_device()
    if device.startswith("cuda"):  # GPU-sized defaults: the fast decode kernels
        base = SoakConfig(device=device, dtype="bf16", batch=8, num_heads=16, kv_num_heads=4, head_dim=128,
                          capacity=256)
    else:
        base = SoakConfig(device=device)
    sample_every = base.sample_every if args.steps >= 2 * base.sample_every else max(1, args.steps // 4)
    warmup = args.warmup if args.warmup is not None else max(sample_every, args.steps // 10 // sample_every * sample_every)
    cfg = replace(base, steps=args.steps, seed=args.seed, ref_every=args.ref_every, warmup=warmup,
                  sample_every=sample_every,
                  rss_bound_mib=args.rss_bound_mib,
                  **{k: v for k, v in dict(dtype=args.dtype, batch=args.batch, num_heads=args.num_heads,
                                           kv_num_heads=args.kv_num_heads, head_dim=args.head_dim,
                                           capacity=args.capacity).items() if v is not None})
    print(f"gqa_torch {gqa_torch.__version__}, torch {torch.__version__}, build {gqa_torch.build_info().get('mode')}, "
          f"{torch.get_num_threads()} intra-op threads", flush=True)
    try:
        first, second = soak(cfg, log=lambda line: print(line, flush=True))
    except SoakFailure as exc:
        print(f"SOAK FAILED: {exc}", flush=True)
        return 1
    for line in summary(first, second):
        print(line)
    print("SOAK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
