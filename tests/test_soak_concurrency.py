"""Soak and concurrency checks of the in-place operator ``gqa_torch.group_query_attention_``.

- A short soak through the same code as ``scripts/soak.py`` (imported, not copied): continuous
  batching with rows reset and restarted, rows driven past their capacity and refused on time
  with flag 16 and nothing written, periodic float64 reference checks, a bit-identical rerun,
  flat memory. On CPU always; on CUDA when a GPU is there (the device error word path).
- Harness self-checks: the soak's checks fail when the op misbehaves (no capacity error, a
  wrong output, a leak, a non-deterministic rerun), so a passing soak means something.
- Concurrency: two Python threads calling the op at once, each with its own inputs and caches,
  give results bit-identical to sequential runs (CPU; and on CUDA with per-thread streams and
  on the default stream); two CUDA streams running calls concurrently give results
  bit-identical to a sequential run, which itself matches the float64 reference.

Seeds come from conftest's per-test seeding (fresh inputs per test, reproducible alone);
``GQA_SOAK_SEED`` overrides the soak seed.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import random
import sys
import threading
from dataclasses import dataclass, replace
from typing import List, Optional

import pytest
import torch

import gqa_torch
from conftest import assert_cache_matches, assert_output_close, bits_equal, requires_cuda
from reference import reference_gqa_

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import soak  # noqa: E402  (scripts/soak.py: the one copy of the soak logic)

JOIN_TIMEOUT_S = 120


def _seed() -> int:
    env = os.environ.get("GQA_SOAK_SEED")
    return int(env) if env else random.getrandbits(31)


def _short_config(device: str = "cpu", **overrides) -> soak.SoakConfig:
    base = dict(steps=1500, warmup=500, sample_every=250, ref_every=60, sync_every=50, seed=_seed(),
                rss_bound_mib=4.0)
    if device == "cuda":
        base.update(device="cuda", dtype="bf16", batch=6, num_heads=8, kv_num_heads=2, head_dim=128, capacity=96,
                    warmup=750)
    base.update(overrides)
    return soak.SoakConfig(**base)


@contextlib.contextmanager
def _intra_op_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def one_intra_op_thread():
    """CPU soak runs at one intra-op thread: the soak is about the schedule, the error path, the
    rerun and memory, and a few thousand tiny calls through a 2-thread OpenMP team cost seconds
    of spin-waiting on a busy 2-core CI machine. (scripts/soak.py runs at the default count; the
    thread-count independence of results is test_parity's, and the concurrent decode-loop test
    below keeps the default count.)"""
    with _intra_op_threads(1):
        yield


@pytest.fixture
def _clean_error_word():
    if gqa_torch.cuda_kernels_available():
        gqa_torch.set_synchronous_errors(False)
        gqa_torch.clear_errors()
        torch.cuda.synchronize()
    yield
    if gqa_torch.cuda_kernels_available():
        gqa_torch.clear_errors()
        torch.cuda.synchronize()


# ---- the short soak ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def test_short_soak(device, _clean_error_word, one_intra_op_thread):
    """1,500 steps of the soak (both runs), with every property of scripts/soak.py asserted."""
    cfg = _short_config(device)
    first, second = soak.soak(cfg)  # raises SoakFailure on any broken property
    # The schedule did what it is for (these depend on the random schedule, not on constants).
    assert len(first.capacity_errors) >= 5, f"seed {cfg.seed}: too few capacity errors to mean anything"
    assert first.full_steps >= 5, f"seed {cfg.seed}: rows rarely reached total == capacity"
    assert first.requests_finished > 0 and first.requests_started > cfg.batch
    assert first.ref_checks >= cfg.steps // cfg.ref_every - len(first.capacity_errors)
    assert first.worst_ref_error <= (soak.FP32_MAX_REL if cfg.dtype == "fp32" else soak.NORM_REL[soak.DTYPES[cfg.dtype]])
    refused_rows = [r for _, rows in first.capacity_errors for r in rows]
    assert all(0 <= r < cfg.batch for r in refused_rows)
    # Each refused step came exactly when its rows had been filled: rerun agrees on the steps.
    assert [s for s, _ in first.capacity_errors] == [s for s, _ in second.capacity_errors]
    assert "rss_growth" in first.memory and "rss_growth" in second.memory
    text = "\n".join(soak.summary(first, second))
    assert "rerun bit-identical: yes" in text


def test_soak_entry_point_exit_status(capsys, monkeypatch, one_intra_op_thread):
    """scripts/soak.py's main(): exit status 0 and a summary on a passing run; non-zero and the
    reason when a property breaks (here: an op whose outputs drift from the reference)."""
    args = ["--steps", "1200", "--device", "cpu", "--seed", str(_seed()), "--warmup", "1000", "--ref-every", "200"]
    rc = soak.main(args)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "SOAK PASSED" in out and "capacity errors:" in out and "RSS" in out
    real = gqa_torch.group_query_attention_
    monkeypatch.setattr(gqa_torch, "group_query_attention_", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    rc = soak.main(args)
    out = capsys.readouterr().out
    assert rc == 1 and "SOAK FAILED" in out and "float64 reference" in out, out


# ---- the soak's checks can fail ------------------------------------------------------------------

def _quick(**overrides) -> soak.SoakConfig:
    return _short_config(**{**dict(steps=600, warmup=250, sample_every=50, ref_every=20), **overrides})


def test_soak_detects_a_missing_capacity_error(monkeypatch, one_intra_op_thread):
    """An op that swallows the capacity error (writes nothing, returns zeros) fails the soak."""
    real = gqa_torch.group_query_attention_

    def lenient(query, key, value, key_cache, value_cache, seqlens_k, *args, **kwargs):
        try:
            return real(query, key, value, key_cache, value_cache, seqlens_k, *args, **kwargs)
        except gqa_torch.GQAError:
            return torch.zeros(query.shape[0], query.shape[1], kwargs["num_heads"] * key_cache.shape[-1])

    monkeypatch.setattr(gqa_torch, "group_query_attention_", lenient)
    with pytest.raises(soak.SoakFailure, match="no capacity error was raised"):
        soak.run_soak(_quick(check_memory=False))


def test_soak_detects_a_wrong_output(monkeypatch, one_intra_op_thread):
    real = gqa_torch.group_query_attention_

    def skewed(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0, 0, random.randrange(out.shape[-1])] += 1e-3
        return out

    monkeypatch.setattr(gqa_torch, "group_query_attention_", skewed)
    with pytest.raises(soak.SoakFailure, match="output error vs the float64 reference"):
        soak.run_soak(_quick(check_memory=False))


def test_soak_detects_a_write_outside_the_new_rows(monkeypatch, one_intra_op_thread):
    """A stray write into the last cache slot of row 0 (not this step's target) is caught by the
    byte-for-byte cache comparison with the reference."""
    real = gqa_torch.group_query_attention_

    def stray(query, key, value, key_cache, value_cache, seqlens_k, *args, **kwargs):
        out = real(query, key, value, key_cache, value_cache, seqlens_k, *args, **kwargs)
        if int(seqlens_k[0]) < key_cache.shape[2] - 1:
            value_cache[0, 0, -1, 0] = random.random()  # a new value each time: always a change
        return out

    monkeypatch.setattr(gqa_torch, "group_query_attention_", stray)
    with pytest.raises(soak.SoakFailure, match="value cache: .* elements differ"):
        soak.run_soak(_quick(check_memory=False))


def test_soak_detects_a_leak(monkeypatch, one_intra_op_thread):
    """Memory kept per call (64 KiB) after warm-up exceeds the RSS bound.

    The leak maps fresh anonymous pages and touches them: a malloc'd buffer could land on heap
    pages that earlier tests already made resident, and then RSS would not move."""
    real = gqa_torch.group_query_attention_
    kept: List[mmap.mmap] = []

    def leaky(*args, **kwargs):
        pages = mmap.mmap(-1, 64 * 1024)
        pages.write(os.urandom(64 * 1024))
        kept.append(pages)
        return real(*args, **kwargs)

    monkeypatch.setattr(gqa_torch, "group_query_attention_", leaky)
    with pytest.raises(soak.SoakFailure, match="RSS grew"):
        soak.run_soak(_quick(steps=1000, warmup=200, sample_every=100, ref_every=0, rss_bound_mib=4.0))
    assert len(kept) == 1000


def test_soak_rerun_comparison_detects_a_difference(one_intra_op_thread):
    """compare_runs sees outputs: two different seeds never compare equal, and the reported
    step is the first one whose outputs differ."""
    a = soak.run_soak(_quick(check_memory=False, ref_every=0))
    b = soak.run_soak(replace(a.config, seed=a.config.seed + 1))
    with pytest.raises(soak.SoakFailure, match="rerun differs: the outputs of step 0 "):
        soak.compare_runs(a, b)
    soak.compare_runs(a, soak.run_soak(a.config))


# ---- concurrency: CPU threads ----------------------------------------------------------------

def _run_in_threads(targets):
    """Runs the callables at once (a barrier releases them together); returns their results and
    re-raises the first exception from any thread."""
    barrier = threading.Barrier(len(targets))
    results: List[object] = [None] * len(targets)
    errors: List[BaseException] = []

    def body(i, fn):
        try:
            barrier.wait(timeout=JOIN_TIMEOUT_S)
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return results


def test_threads_soak_schedules_match_sequential(one_intra_op_thread):
    """Two soak schedules (capacity errors raised in one thread while the other computes) run in
    two threads at once give bit-identical outputs, caches and error steps to sequential runs."""
    seed = _seed()
    cfg_a = _short_config(steps=1000, seed=seed, ref_every=100, check_memory=False)
    cfg_b = replace(cfg_a, seed=seed + 1, batch=3, capacity=48, num_heads=6, kv_num_heads=3)
    seq_a, seq_b = soak.run_soak(cfg_a), soak.run_soak(cfg_b)
    assert seq_a.capacity_errors and seq_b.capacity_errors
    for _ in range(2):
        par_a, par_b = _run_in_threads([lambda: soak.run_soak(cfg_a), lambda: soak.run_soak(cfg_b)])
        soak.compare_runs(seq_a, par_a)
        soak.compare_runs(seq_b, par_b)


@dataclass
class _Workload:
    """A decode loop on its own caches: per step a fresh packed qkv [B, 1, W] and seqlens_k
    growing by one per step from random starting lengths."""
    qkv: List[torch.Tensor]
    seqlens: List[torch.Tensor]
    key0: torch.Tensor
    value0: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    sink: Optional[torch.Tensor]
    attrs: dict


def _make_workload(steps, B, Hq, Hkv, D, C, dtype, device, cos=None, sin=None, window=-1) -> _Workload:
    starts = torch.randint(C // 3, C - steps, (B,), dtype=torch.int32)
    W = (Hq + 2 * Hkv) * D
    qkv = [torch.randn(B, 1, W).to(dtype).to(device) for _ in range(steps)]
    seqlens = [(starts + i).to(device) for i in range(steps)]  # total = start + i + 1
    key0 = torch.randn(B, Hkv, C, D).to(dtype).to(device)
    value0 = torch.randn(B, Hkv, C, D).to(dtype).to(device)
    if cos is None:
        angle = torch.rand(C + 4, D // 2, dtype=torch.float64) * (2 * math.pi)
        cos, sin = torch.cos(angle).float().to(device), torch.sin(angle).float().to(device)
    sink = torch.randn(Hq).to(device)
    attrs = dict(num_heads=Hq, kv_num_heads=Hkv, do_rotary=True, local_window_size=window)
    return _Workload(qkv, seqlens, key0, value0, cos, sin, sink, attrs)


def _run_workload(w: _Workload, stream=None):
    """Runs the decode loop on fresh copies of the caches (on `stream` when given, then waits
    for it); returns (outputs, key_cache, value_cache)."""
    ctx = contextlib.nullcontext()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream)
    with ctx:
        k, v = w.key0.clone(), w.value0.clone()
        outs = []
        for qkv, seqlens in zip(w.qkv, w.seqlens):
            outs.append(gqa_torch.group_query_attention_(qkv, None, None, k, v, seqlens, w.cos, w.sin, None,
                                                         w.sink, **w.attrs))
    if stream is not None:
        stream.synchronize()
    return outs, k, v


def _assert_same(a, b, what):
    outs_a, k_a, v_a = a
    outs_b, k_b, v_b = b
    assert len(outs_a) == len(outs_b), what
    for i, (x, y) in enumerate(zip(outs_a, outs_b)):
        assert bits_equal(x.cpu(), y.cpu()), f"{what}: output of step {i} differs from the sequential run"
    assert bits_equal(k_a.cpu(), k_b.cpu()), f"{what}: key cache differs from the sequential run"
    assert bits_equal(v_a.cpu(), v_b.cpu()), f"{what}: value cache differs from the sequential run"


def _check_steps_against_reference(w: _Workload, result, steps):
    """Replays the workload through the float64 reference up to the last listed step, checks the
    outputs of the listed steps, and returns the reference's caches after the last one."""
    outs, _, _ = result
    k, v = w.key0.cpu().clone(), w.value0.cpu().clone()
    with _intra_op_threads(1):  # many small float64 ops: no OpenMP team to spin-wait on
        return _replay_reference(w, outs, k, v, steps)


def _replay_reference(w: _Workload, outs, k, v, steps):
    for i in range(max(steps) + 1):
        qkv, seqlens = w.qkv[i].cpu(), w.seqlens[i].cpu()
        ref_out, ref_k, ref_v = reference_gqa_(qkv, None, None, k, v, seqlens, w.cos.cpu(), w.sin.cpu(), None,
                                               w.sink.cpu(), **w.attrs)
        if i in steps:
            assert_output_close(outs[i], ref_out, None, suite="concurrency")
        k, v = ref_k, ref_v  # the reference's caches carry on (the op's are checked at the end)
    return k, v


def test_threads_decode_loops_match_sequential():
    """Two threads, each its own caches and fresh inputs (cos/sin shared, read-only), 80 decode
    steps each at once, at the default intra-op thread count (each thread's calls run their own
    OpenMP team), two rounds: outputs and caches bit-identical to sequential runs, which match
    the float64 reference."""
    steps = 80
    w_a = _make_workload(steps, B=4, Hq=8, Hkv=2, D=64, C=512, dtype=torch.float32, device="cpu")
    w_b = _make_workload(steps, B=3, Hq=8, Hkv=2, D=64, C=512, dtype=torch.float32, device="cpu",
                         cos=w_a.cos, sin=w_a.sin, window=200)
    seq_a, seq_b = _run_workload(w_a), _run_workload(w_b)
    for w, seq in ((w_a, seq_a), (w_b, seq_b)):
        ref_k, ref_v = _check_steps_against_reference(w, seq, {0, random.randrange(1, steps - 1), steps - 1})
        assert bits_equal(seq[1], ref_k) and bits_equal(seq[2], ref_v), "caches differ from the reference"
    for round_ in range(2):
        par_a, par_b = _run_in_threads([lambda: _run_workload(w_a), lambda: _run_workload(w_b)])
        _assert_same(seq_a, par_a, f"thread A, round {round_}")
        _assert_same(seq_b, par_b, f"thread B, round {round_}")


def test_threads_errors_stay_in_their_thread():
    """One thread makes calls that the op refuses (GQAError, flag 16) while the other runs valid
    decode steps: every bad call raises in its own thread and writes nothing, and the good
    thread's results are bit-identical to a sequential run."""
    steps = 150
    w_good = _make_workload(steps, B=4, Hq=8, Hkv=2, D=64, C=384, dtype=torch.float32, device="cpu")
    seq = _run_workload(w_good)
    bad_k = torch.randn(2, 2, 64, 64)
    bad_v = torch.randn(2, 2, 64, 64)
    k_before, v_before = bad_k.clone(), bad_v.clone()
    raised = []

    def bad_calls():
        for _ in range(steps):
            qkv = torch.randn(2, 1, (8 + 4) * 64)
            seqlens = torch.tensor([random.randrange(0, 64), 64 + random.randrange(0, 8)], dtype=torch.int32)
            try:
                gqa_torch.group_query_attention_(qkv, None, None, bad_k, bad_v, seqlens, num_heads=8, kv_num_heads=2)
            except gqa_torch.GQAError as exc:
                raised.append(exc.flags)
        return True

    par, _ = _run_in_threads([lambda: _run_workload(w_good), bad_calls])
    _assert_same(seq, par, "good thread")
    assert raised == [gqa_torch.errors.CAPACITY] * steps
    assert bits_equal(bad_k, k_before) and bits_equal(bad_v, v_before), "a refused call wrote into its caches"


# ---- concurrency: CUDA streams and threads -------------------------------------------------------

def _cuda_workloads(n, steps=40):
    ws = []
    for i in range(n):
        ws.append(_make_workload(steps, B=4, Hq=16, Hkv=4, D=128, C=1024, dtype=torch.bfloat16, device="cuda",
                                 window=-1 if i % 2 == 0 else 300))
    return ws


def _check_cuda_sequential(ws, seqs):
    """The sequential CUDA runs themselves: a few steps against the float64 reference."""
    for w, seq in zip(ws, seqs):
        steps = len(w.qkv)
        k_ref, v_ref = _check_steps_against_reference(w, seq, {0, steps - 1})
        rows = [int(s) for s in w.seqlens[0].cpu()]
        # All rows written by the loop are rotated K rows: allow RoPE's FMA rounding (1 ulp) there.
        assert_cache_matches(seq[1].cpu(), k_ref, rotated_rows=[(b, r, r + steps) for b, r in enumerate(rows)],
                             rotary_ulps=1, name="key cache")
        assert_cache_matches(seq[2].cpu(), v_ref, name="value cache")


@pytest.mark.cuda
@requires_cuda
def test_cuda_two_streams_concurrent(_clean_error_word):
    """Two workloads launched step by step alternately on two side streams (so their kernels
    overlap): outputs and caches bit-identical to sequential runs on the current stream, which
    match the float64 reference; no error flag."""
    ws = _cuda_workloads(2)
    seqs = [_run_workload(w) for w in ws]
    torch.cuda.synchronize()
    gqa_torch.check_errors()
    _check_cuda_sequential(ws, seqs)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for round_ in range(3):
        current = torch.cuda.current_stream()
        caches, outs = [], [[], []]
        for w, s in zip(ws, streams):
            s.wait_stream(current)
            with torch.cuda.stream(s):
                caches.append((w.key0.clone(), w.value0.clone()))
        for i in range(len(ws[0].qkv)):
            for j, (w, s) in enumerate(zip(ws, streams)):
                with torch.cuda.stream(s):
                    k, v = caches[j]
                    outs[j].append(gqa_torch.group_query_attention_(w.qkv[i], None, None, k, v, w.seqlens[i], w.cos,
                                                                    w.sin, None, w.sink, **w.attrs))
        for s in streams:
            current.wait_stream(s)
        torch.cuda.synchronize()
        gqa_torch.check_errors()
        for j in range(2):
            _assert_same(seqs[j], (outs[j], caches[j][0], caches[j][1]), f"stream {j}, round {round_}")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("streams", ["own_streams", "current_stream"])
def test_cuda_two_threads(streams, _clean_error_word):
    """Two Python threads, each its own caches and inputs, calling the op at once (each on its own
    stream, or both on the default stream): results bit-identical to sequential runs."""
    ws = _cuda_workloads(2)
    seqs = [_run_workload(w) for w in ws]
    torch.cuda.synchronize()
    gqa_torch.check_errors()
    _check_cuda_sequential(ws, seqs)
    device = torch.cuda.current_device()

    def worker(w):
        def fn():
            torch.cuda.set_device(device)
            s = torch.cuda.Stream() if streams == "own_streams" else None
            result = _run_workload(w, stream=s)
            torch.cuda.synchronize()
            return result
        return fn

    for round_ in range(3):
        results = _run_in_threads([worker(w) for w in ws])
        gqa_torch.check_errors()
        for j in range(2):
            _assert_same(seqs[j], results[j], f"thread {j} ({streams}), round {round_}")
