"""The recycling cache of the CPU operators' large outputs (csrc/torch/cpu_output_cache.cpp,
gqa_torch.memory): outputs of 8 MB or more come from blocks that earlier outputs freed.

What must hold: a recycled block's old contents never show (the blocks are poisoned with NaN
before they are reused), the counters and the byte limit behave as documented, idle blocks are
freed, blocks can be freed from any thread, and bad limits are refused with their messages.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import gqa_torch
from conftest import make_case, run_and_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_RECYCLED = 8 << 20


def decode_case(capacity: int = 17000, **overrides):
    """A functional decode whose presents are 8.7 MB each at the default capacity (fp32)."""
    args = dict(batch=1, seq=1, num_heads=4, kv_num_heads=2, head_dim=64, capacity=capacity,
                past_lengths=[capacity - 500], extra_total=5, rotary="half")
    args.update(overrides)
    return make_case("functional", **args)


def present_bytes(case) -> int:
    _, present_key, _ = case.clone().run()
    return present_key.nbytes


def info():
    return gqa_torch.cpu_output_cache_info()


@pytest.fixture(autouse=True)
def empty_cache():
    """Each test starts with an empty cache of 1 GiB (whatever GQA_CPU_OUTPUT_CACHE_MB says), and
    leaves it empty at the process's limit."""
    limit = info()["limit_bytes"]
    gqa_torch.release_cpu_output_cache()
    gqa_torch.set_cpu_output_cache_limit(1 << 30)
    yield
    gqa_torch.set_cpu_output_cache_limit(limit)
    gqa_torch.release_cpu_output_cache()


def run_then_poison_large_outputs(case) -> int:
    """Runs `case`, fills each of its outputs of 8 MB or more with NaN and frees them, so the cache
    holds only poisoned blocks. Returns how many there were."""
    results = case.clone().run()
    results = results if isinstance(results, tuple) else (results,)
    large = [t for t in results if t.nbytes >= MIN_RECYCLED]
    for t in large:
        t.fill_(float("nan"))
    return len(large)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recycled_blocks_are_written_whole(dtype):
    """A call served from blocks that hold NaN returns exactly what the reference says: the
    copied past, the new rows, the zero tail of each present, and the output of a long prompt."""
    capacity = 17000 if dtype == torch.float32 else 34000  # presents of 8 MB or more
    cases = [decode_case(capacity, dtype=dtype),
             make_case("inplace", batch=1, seq=1100, num_heads=16, kv_num_heads=4, head_dim=128,
                       capacity=1200, past_lengths=[40], rotary="half", dtype=dtype)]
    if dtype != torch.float32:  # the long prompt's output is 8 MB or more in fp32 only
        cases = cases[:1]
    for case in cases:
        gqa_torch.release_cpu_output_cache()
        poisoned = run_then_poison_large_outputs(case)
        assert poisoned >= 1
        assert info()["cached_blocks"] == poisoned
        hits = info()["hits"]
        run_and_check(case)
        assert info()["hits"] - hits == poisoned  # every large output took a poisoned block


def test_counts_hits_misses_and_keeps_small_outputs_out():
    case = decode_case()
    nbytes = present_bytes(case)
    assert nbytes >= MIN_RECYCLED
    blocks = info()
    assert blocks["cached_blocks"] == 2  # the two presents, freed above
    # A block has 1/16 headroom, rounded up to 2 MB pages.
    assert 2 * nbytes <= blocks["cached_bytes"] <= 2 * (nbytes + nbytes // 16 + (2 << 20))

    before = info()
    present_bytes(case)
    after = info()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 0)

    small = make_case("functional", batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=16, capacity=64,
                      past_lengths=[30, 50])
    present_bytes(small)
    assert {k: info()[k] for k in ("hits", "misses", "cached_blocks")} == {
        k: after[k] for k in ("hits", "misses", "cached_blocks")}


def test_limit_bounds_what_the_cache_holds():
    case = decode_case()
    present_bytes(case)
    one_block = info()["cached_bytes"] // 2

    gqa_torch.set_cpu_output_cache_limit(one_block)  # the older of the two blocks goes
    assert (info()["cached_blocks"], info()["cached_bytes"]) == (1, one_block)

    gqa_torch.set_cpu_output_cache_limit(0)  # disabled: holds nothing, every large output is fresh
    assert (info()["cached_blocks"], info()["cached_bytes"]) == (0, 0)
    before = info()
    run_and_check(case)
    after = info()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (0, 2)
    assert (after["cached_blocks"], after["cached_bytes"]) == (0, 0)

    gqa_torch.set_cpu_output_cache_limit(one_block - 1)  # a block larger than the limit is not kept
    present_bytes(case)
    assert info()["cached_blocks"] == 0


def test_release_keeps_blocks_in_use():
    case = decode_case()
    _, present_key, _ = case.clone().run()
    expected = present_key.clone()
    gqa_torch.release_cpu_output_cache()
    present_bytes(case)  # reuses nothing of present_key's, which is still alive
    assert torch.equal(present_key, expected)
    assert info()["cached_blocks"] == 2
    del present_key
    assert info()["cached_blocks"] == 3
    gqa_torch.release_cpu_output_cache()
    assert (info()["cached_blocks"], info()["cached_bytes"]) == (0, 0)


def test_a_recycled_tensor_resizes_and_frees_like_any_other():
    _, present_key, _ = decode_case().run()
    values = present_key.clone()
    present_key.resize_(present_key.numel() + (4 << 20))  # a larger storage, from the same allocator
    assert torch.equal(present_key[:values.numel()].view_as(values), values)
    del present_key
    assert info()["cached_blocks"] >= 2


def test_idle_blocks_are_freed():
    """A block that no output reused while 256 large outputs were allocated is freed; before that
    it stays. Calls whose presents are too small for it (it would waste more than a quarter)
    allocate their own blocks and recycle those."""
    present_bytes(decode_case(capacity=34000))  # two blocks of 17 MB
    big = info()["cached_bytes"]
    present_bytes(decode_case())  # two blocks of 8.7 MB: the 17 MB ones do not fit them
    small_case = decode_case()
    for _ in range(60):  # 2 x 61 = 122 allocations since the big blocks were freed
        small_case.clone().run()
    assert info()["cached_bytes"] > big
    for _ in range(70):  # 2 x 131 = 262
        small_case.clone().run()
    assert info()["cached_blocks"] == 2 and info()["cached_bytes"] < big


def test_blocks_freed_and_taken_on_other_threads():
    """Threads allocate and free large outputs at once; each result equals the one-thread result
    (to fp32 rounding: a thread of its own may split the keys for another thread count), and
    every block comes back to the cache."""
    case = decode_case()
    expected = case.clone().run()
    errors = []

    def worker():
        try:
            for _ in range(4):
                got = case.clone().run()
                if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, expected)):
                    errors.append("a result differs")
        except Exception as exc:  # noqa: BLE001  (reported below, with the thread's error)
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = [case.clone().run()[1] for _ in range(2)]  # freed on another thread
    freeing = threading.Thread(target=held.clear)
    freeing.start()
    freeing.join()
    assert info()["cached_blocks"] >= 2


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, None])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match="set_cpu_output_cache_limit: expected an int of 0 or more bytes"):
        gqa_torch.set_cpu_output_cache_limit(bad)
    with pytest.raises((ValueError, TypeError)):
        gqa_torch._C._set_cpu_output_cache_limit(-1)


def import_with(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GQA_CPU_OUTPUT_CACHE_MB=value, PYTHONPATH=ROOT)
    code = "import gqa_torch; print(gqa_torch.cpu_output_cache_info()['limit_bytes'])"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_environment_sets_the_limit():
    result = import_with("")  # unset: 2 GiB, or an eighth of the machine's memory where less
    assert result.returncode == 0, result.stderr
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    assert int(result.stdout) == min(2 << 30, physical // 8)
    result = import_with("64")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(64 << 20)
    result = import_with("lots")
    assert result.returncode != 0
    assert "GQA_CPU_OUTPUT_CACHE_MB must be a whole number of MB, 0 or more (0 disables the cache), got 'lots'" \
        in result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no fork")
@pytest.mark.filterwarnings("ignore:This process.*is multi-threaded:DeprecationWarning")
def test_a_forked_child_uses_the_cache():
    """A child forked while other threads allocate and free large outputs (a DataLoader worker)
    inherits the cache unlocked: its own calls finish and return the parent's results. (The lock
    is held for microseconds of each 2 ms call, so eight forks exercise the fork handlers that
    keep it consistent but cannot force a fork inside it.)"""
    case = decode_case()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's count: the key splits, and so the rounding, follow it
    try:
        expected = case.clone().run()
    finally:
        torch.set_num_threads(threads_before)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            case.clone().run()

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        children = []
        for _ in range(8):
            pid = os.fork()
            if pid == 0:  # the child: exit at once, with its verdict as the status
                ok = False
                try:
                    torch.set_num_threads(1)  # as a DataLoader worker does (OpenMP's pool is not forked)
                    got = case.clone().run()
                    ok = all(torch.equal(a, b) for a, b in zip(got, expected))
                except BaseException as exc:  # noqa: BLE001  (the child reports, then exits)
                    print(f"forked child: {exc!r}", file=sys.stderr)
                finally:
                    os._exit(0 if ok else 1)
            children.append(pid)
        for pid in children:
            deadline = time.monotonic() + 120
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    pytest.fail("a forked child hung on a large output (the cache's lock was left held)")
                time.sleep(0.05)
            assert os.waitstatus_to_exitcode(status) == 0, "a forked child's result differs"
    finally:
        stop.set()
        for t in threads:
            t.join()
