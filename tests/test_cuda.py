"""GPU tests: the CUDA backend vs the float64 reference and vs the CPU backend, CUDA graphs,
torch.compile(mode="reduce-overhead"), and the sticky device error word (SPEC §4).

Every test here is skipped, with the reason printed, when this build has no CUDA kernels or
the machine has no CUDA device. Skips never count as passes (conftest fails a run in which
nothing passed).

CUDA may contract RoPE's x0*cos - x1*sin into FMAs, so rotated K rows in the caches may differ
from the reference (and from the CPU backend) by one unit in the last place; everything else
in the caches must be byte-identical.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import random
import re
import time
import warnings

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import (DTYPES, NORM_REL, FP32_MAX_REL, assert_output_close, bits, bits_equal, case_fingerprint,
                      check_caches, hash_str, make_case, memoized, output_error, poison, poison_allocator, record_error,
                      requires_cuda, run_and_check)
from reference import to_bnsh
from test_parity import GRID, RANDOM_CONFIGS, _case_id, build_case

pytestmark = [pytest.mark.cuda, requires_cuda]

ROTARY_ULPS = 1


@pytest.fixture(autouse=True)
def _clean_error_word():
    """Each test starts and ends with a clear error word and the asynchronous default."""
    gqa_torch.set_synchronous_errors(False)
    gqa_torch.clear_errors()
    torch.cuda.synchronize()
    yield
    gqa_torch.set_synchronous_errors(False)
    gqa_torch.clear_errors()
    torch.cuda.synchronize()


def _run_cuda_and_cpu(case_cpu):
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


@pytest.mark.parametrize("row", GRID, ids=[_case_id(r) for r in GRID])
def test_cuda_parity_grid(row):
    """The same pairwise grid as the CPU parity suite, on CUDA (odd head sizes are refused)."""
    case = build_case(row, random.Random(_case_id(row)))
    if case.head_dim % 2:
        with pytest.raises(ValueError, match=r"gqa: query: expected an even head_size on CUDA, got 17"):
            case.to("cuda").run()
        return
    _run_cuda_and_cpu(case)


EVEN_RANDOM_CONFIGS = [c for c in RANDOM_CONFIGS if c["head_dim"] % 2 == 0]


@pytest.mark.parametrize("cfg", EVEN_RANDOM_CONFIGS, ids=[f"random{i}" for i in range(len(EVEN_RANDOM_CONFIGS))])
def test_cuda_random_combinations(cfg):
    """The CPU suite's random feature combinations (even head sizes), on CUDA."""
    cfg = dict(cfg)
    op = cfg.pop("op")
    _run_cuda_and_cpu(make_case(op, **cfg))


def test_cuda_inplace_matches_cpu_backend_caches():
    """In-place: the CUDA caches after a call equal the CPU backend's (rotated rows within 1 ulp)."""
    for dtype in DTYPES.values():
        case = make_case("inplace", batch=3, seq=5, num_heads=8, kv_num_heads=2, head_dim=64, capacity=40,
                         dtype=dtype, rotary="half", sink=True, layout=1)
        cpu, gpu = case.clone(), case.to("cuda")
        out_cpu, out_gpu = cpu.run(), gpu.run()
        tol = 2 * (FP32_MAX_REL if dtype == torch.float32 else NORM_REL[dtype])
        assert output_error(out_gpu.cpu(), out_cpu.double()) <= tol
        check_caches(case, gpu.cache_key.cpu(), gpu.cache_value.cpu(), cpu.cache_key, cpu.cache_value,
                     rotary_ulps=ROTARY_ULPS)


FEATURE_CYCLE = [
    dict(),
    dict(rotary="half"),
    dict(rotary="interleaved", position_ids="random"),
    dict(rotary="half", rotary_dim=32, window=37),
    dict(softcap=2.0, q_amplitude=3.0, sink=True),
    dict(smooth=True, window=5, scale=0.1),
]


@pytest.mark.parametrize("seq", [2, 7, 64, 513])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [0, 1])
def test_cuda_prefill_sizes(seq, dtype, layout):
    """Prefill / chunked prefill with ragged pasts for S in {2, 7, 64, 513}: in-place (batched
    chunks) and functional (first prompt with padding), features rotating with the size."""
    idx = [2, 7, 64, 513].index(seq) + 3 * layout + list(DTYPES).index(dtype)
    feat = FEATURE_CYCLE[idx % len(FEATURE_CYCLE)]
    head_dim = [64, 128, 256, 96][idx % 4]
    case = make_case("inplace", batch=3, seq=seq, num_heads=8, kv_num_heads=2, head_dim=head_dim,
                     capacity=seq + 70, layout=layout, dtype=DTYPES[dtype], packed=idx % 2 == 1, **feat)
    _run_cuda_and_cpu(case)
    case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[seq, max(1, seq // 3)], layout=layout,
                     dtype=DTYPES[dtype], **feat)
    _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_prefill_long(dtype, head_dim):
    """S = 4096, the benchmark's prompt length (every query block of the causal grid, many per
    SM): in place on two rows with their own pasts, and as a padded functional first prompt
    (4096 and 1500 tokens), a different feature set each, against the float64 reference and
    the CPU backend."""
    i = list(DTYPES).index(dtype) + 3 * (head_dim == 128)
    case = make_case("inplace", batch=2, seq=4096, num_heads=8, kv_num_heads=2, head_dim=head_dim,
                     capacity=4096 + 100, layout=i % 2, dtype=DTYPES[dtype], packed=i % 2 == 1,
                     **FEATURE_CYCLE[i % len(FEATURE_CYCLE)])
    _run_cuda_and_cpu(case)
    case = make_case("functional", batch=2, seq=4096, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[4096, 1500], layout=1 - i % 2,
                     dtype=DTYPES[dtype], **FEATURE_CYCLE[(i + 3) % len(FEATURE_CYCLE)])
    _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_prefill_auto_long_prompt(dtype):
    """A prompt of 8192 tokens at head size 128: from 2048 tokens "auto" takes the pipelined
    kernel with three K/V stages (route wgmma_ws_kv_pipe3's) on sm90, below it the same
    kernel with one instantiation of its step (route x_one_step's); in place, with rotary on a
    packed input, against the float64 reference and the CPU backend (test_cuda_prefill_long
    covers 4096)."""
    case = make_case("inplace", batch=1, seq=8192, num_heads=2, kv_num_heads=1, head_dim=128, capacity=8192 + 64,
                     dtype=DTYPES[dtype], packed=dtype == "bf16", **FEATURE_CYCLE[1 + (dtype == "bf16")])
    _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rotary,rotary_dim", [("half", 128), ("half", 16), ("half", 24), ("interleaved", 24),
                                               ("interleaved", 12), ("half", 6)])
def test_cuda_prep_rope_chunking(dtype, rotary, rotary_dim):
    """Prep moves rows in 16-byte units spread over the CTA when every row is aligned and the
    rotary part is whole chunks (half style: R / 2 a multiple of 16 / element size; interleaved:
    R), and one warp per row element by element otherwise: rotary sizes on both sides of that
    line for every dtype, prefill and decode, in place (packed, strided) and functional (past
    copies and zero rows)."""
    for seq in (1, 33):
        case = make_case("inplace", batch=3, seq=seq, num_heads=8, kv_num_heads=2, head_dim=128, capacity=seq + 40,
                         dtype=DTYPES[dtype], packed=seq > 1, strided=seq == 1, rotary=rotary,
                         rotary_dim=rotary_dim, position_ids="random")
        _run_cuda_and_cpu(case)
        case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=128, capacity=50,
                         dtype=DTYPES[dtype], rotary=rotary, rotary_dim=rotary_dim)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("scale,softcap", [(1e-50, 1e-40), (0.0, 1e-40), (-0.3, 1e-40)])
def test_cuda_decode_subnormal_softcap(dtype, scale, softcap):
    """Finding (by analysis, 2026-11-29): the tensor-core decode formed tanh's argument as
    score * scale * (1 / softcap); a subnormal softcap made 1 / softcap inf, and a scale that
    float32 rounds to 0 then gave 0 * inf = NaN instead of uniform weights."""
    case = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=300,
                     past_lengths=[30, 250], dtype=DTYPES[dtype], scale=scale, softcap=softcap)
    _run_cuda_and_cpu(case)


PREFILL_ROUTES = ["mma", "wgmma", "wgmma_ws", "wgmma_ws_cpasync", "wgmma_ws_persistent", "wgmma_ws3",
                  "wgmma_ws_kv", "wgmma_ws_kv_pipe", "wgmma_ws_bn80", "wgmma_ws_kv_pipe_pp", "wgmma_ws_kv_pipe3",
                  "x_head_groups", "x_group_rounds", "x_plain_pp", "x_one_step", "x_narrow_o", "x_q_first", "x_static_walk"]


@pytest.fixture(params=PREFILL_ROUTES)
def prefill_route(request):
    """Pins the prefill kernel (the default, "auto", takes x_one_step's kernels for padded head
    size 64 and for 128 below 2048 tokens, wgmma_ws_kv_pipe3 for 128 from 2048 tokens and
    wgmma_ws_bn80 for 256 on sm90, else mma), so that every kernel stays tested at every head
    size; wgmma_ws_bn80 has a kernel of its own (80-key tiles) at padded head size 256 only
    (head sizes 192 and 256 here), route wgmma_ws_persistent's below. Every route of a test gets
    the same inputs (seeded from the test id without the route), so the CPU side is computed
    once for all of them."""
    name, _, params = request.node.nodeid.partition("[")
    params = re.sub(rf"(?<=^){re.escape(request.param)}(?=[-\]])|(?<=-){re.escape(request.param)}(?=[-\]])", "*",
                    params, count=1)
    seed = abs(hash_str(name + "[" + params)) % (2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    if request.param.startswith("wgmma") and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma prefill needs an sm90 GPU")
    if request.param.startswith("wgmma") and "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the wgmma prefill needs a build for 9.0a (TORCH_CUDA_ARCH_LIST)")
    gqa_torch._C._set_prefill_route(request.param)
    yield request.param
    gqa_torch._C._set_prefill_route("auto")


@pytest.mark.parametrize("seq", [2, 7, 64, 513, 1100])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 256])
def test_cuda_prefill_routes(seq, dtype, head_dim, prefill_route):
    """Each prefill kernel (mma.sync, and the Hopper wgmma kernels on sm90) on the cases of
    test_cuda_prefill_sizes, every feature in turn, in place (ragged chunks) and functional
    (padded first prompt)."""
    for i, feat in enumerate(FEATURE_CYCLE):
        if seq == 1100 and i % 3:
            continue  # long rows: a third of the features
        case = make_case("inplace", batch=3, seq=seq, num_heads=8, kv_num_heads=2, head_dim=head_dim,
                         capacity=seq + 70, layout=i % 2, dtype=DTYPES[dtype], packed=i % 2 == 1, **feat)
        _run_cuda_and_cpu(case)
        case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                         capacity=None, first_prompt=True, prompt_lengths=[seq, max(1, seq // 3)], layout=i % 2,
                         dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_cuda_prefill_many_blocks_per_sm(dtype, head_dim, prefill_route):
    """More query blocks than SMs several times over (3 rows x 2 KV heads x 94 blocks of 128
    packed rows = 564 on 132 SMs): a persistent CTA walks four or five blocks, in both
    directions of its snake order (at padded head size 256, with one Q tile that each block
    hands back to the loader); in place with ragged pasts, and as a padded first prompt (the
    padding blocks exit early, between blocks with work); every third feature. The other
    kernels see the same large grid. 192 is padded to 256: columns past the head size."""
    for i, feat in enumerate(FEATURE_CYCLE):
        if i % 3:
            continue
        case = make_case("inplace", batch=3, seq=1500, num_heads=16, kv_num_heads=2, head_dim=head_dim,
                         capacity=1600, layout=i % 2, dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)
        case = make_case("functional", batch=3, seq=1500, num_heads=16, kv_num_heads=2, head_dim=head_dim,
                         capacity=None, first_prompt=True, prompt_lengths=[1500, 400, 1100], layout=1 - i % 2,
                         dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


def _assert_same_bits_under_routes(routes, q, make_caches, call):
    """Runs call(caches), the in-place op, under each of two prefill routes pinned, on fresh
    caches from make_caches() and with the output's block freed full of NaN (poison_allocator),
    so that an element left unwritten shows; the output and both caches must be the same bits
    under both routes."""
    results = []
    for pinned in routes:
        caches = make_caches()
        poison_allocator([q.shape], q.dtype, device="cuda")
        gqa_torch._C._set_prefill_route(pinned)
        try:
            out = call(caches)
        finally:
            gqa_torch._C._set_prefill_route("auto")
        assert not out.isnan().any(), f"{pinned}: NaN in the output"
        results.append((out, *caches))
    for name, first, second in zip(("output", "key cache", "value cache"), *results):
        assert bits_equal(first, second), f"{name}: {routes[0]} differs from {routes[1]}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("route,head_dim,seq,kv_heads,plain_route", [
    ("x_head_groups", 128, 32768, 3, "wgmma_ws_kv_pipe3"), ("x_head_groups", 256, 16384, 3, "auto"),
    ("x_head_groups", 64, 32768, 5, "auto"), ("auto", 128, 32768, 7, "wgmma_ws_kv_pipe3"),
    ("x_group_rounds", 128, 32768, 3, "wgmma_ws_kv_pipe3"), ("x_group_rounds", 64, 32768, 5, "auto"),
    ("auto", 128, 8192, 16, "wgmma_ws_kv_pipe3")])
def test_cuda_prefill_head_groups(dtype, route, head_dim, seq, kv_heads, plain_route):
    """The (row, kv head) pairs walked in groups whose K/V take at most 32 MB: route
    x_head_groups always (x_group_rounds with each group in whole rounds of the grid, the last
    part empty, as auto does), auto at head size 128 once all pairs' K/V reach 64 MB in pairs of
    4 MB or more. Here a pair holds 16 MB (groups of 2, the last of 1; of 2, 2, 2, 1 under
    auto), at 64 8 MB (groups of 4, then 1), or 4 MB at 8192 tokens (auto: two groups of 8).
    Each query block is computed alike in any order and the L2 priorities change
    no value, so the output and the appended caches must be the same bits as under
    `plain_route`, the same kernel in the plain order, which test_cuda_prefill_routes holds to
    the reference. The caches start as NaN, and the output's block is freed full of NaN
    (poison_allocator), so a block left unwritten shows."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the grouped order runs in the wgmma kernels: it needs an sm90 GPU and a build for 9.0a")
    torch.manual_seed(seq + head_dim + kv_heads)
    dt = DTYPES[dtype]
    q, k, v = (torch.randn(1, seq, kv_heads * head_dim, device="cuda", dtype=dt) for _ in range(3))
    seqlens = torch.full((1,), seq - 1, dtype=torch.int32, device="cuda")

    def make_caches():
        return [torch.full((1, kv_heads, seq + 64, head_dim), float("nan"), device="cuda", dtype=dt) for _ in range(2)]

    def call(caches):
        return gqa_torch.group_query_attention_(q, k, v, caches[0], caches[1], seqlens, num_heads=kv_heads,
                                                kv_num_heads=kv_heads)

    _assert_same_bits_under_routes((route, plain_route), q, make_caches, call)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seq", [300, 2048])
@pytest.mark.parametrize("feature", ["plain", "softcap", "window", "smooth_sink"])
@pytest.mark.parametrize("route,d,other_route", [
    ("x_one_step", 64, "wgmma_ws3"), ("x_one_step", 128, "wgmma_ws_kv_pipe3"), ("x_one_step", 256, "wgmma_ws_bn80"),
    ("auto", 128, "x_narrow_o"), ("auto", 256, "x_narrow_o"), ("x_q_first", 128, "auto"), ("x_q_first", 256, "auto"),
    ("auto", 64, "x_static_walk"), ("auto", 128, "x_static_walk"), ("auto", 256, "x_static_walk")])
def test_cuda_prefill_route_same_bits(dtype, seq, feature, route, d, other_route):
    """Pairs of routes whose arithmetic is the same, so the output and the appended caches must
    be the same bits under `route` as under `other_route` (each held to the reference by the
    route tests; the turns and the L2 priorities change no value):
    - x_one_step builds auto's warp-specialised kernels with one instantiation of their step
      (Config::kOneStep: the mask and the softcap as run-time passes; in the pipelined order at
      128, taken at every length, P copied between the register arrays);
    - auto stores O from registers (its kernels at 128 and 256) in 16-byte chunks after the
      quads swap words (Args::wide_o), x_narrow_o in 4-byte words (each quad half a sector);
    - x_q_first is auto with each block's Q staged before its first K/V tile (Args::q_first: the
      loader's order alone);
    - auto takes its query blocks from a counter (Args::dynamic_walk), x_static_walk in fixed
      rounds: the same blocks, computed alike, on other SMs.
    Row 0 has a past of 100 keys (the first tiles cross the past's end), row 1 none; the caches
    start as NaN past the rows' pasts and the output's block is freed full of NaN, so an
    unwritten element shows."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip(f"route {route} takes wgmma kernels: it needs an sm90 GPU and a build for 9.0a")
    torch.manual_seed(seq + len(feature) + d)
    dt, heads, kv_heads, past = DTYPES[dtype], 8, 2, 100
    q = torch.randn(2, seq, heads * d, device="cuda", dtype=dt)
    k, v = (torch.randn(2, seq, kv_heads * d, device="cuda", dtype=dt) for _ in range(2))
    seqlens = torch.tensor([past + seq - 1, seq - 1], dtype=torch.int32, device="cuda")
    history = [torch.randn(kv_heads, past, d, device="cuda", dtype=dt) for _ in range(2)]
    attrs = {"plain": {}, "softcap": {"softcap": 30.0}, "window": {"local_window_size": 200},
             "smooth_sink": {"smooth_softmax": True}}[feature]
    sink = torch.randn(heads, device="cuda", dtype=torch.float32) if feature == "smooth_sink" else None

    def make_caches():
        caches = [torch.full((2, kv_heads, past + seq + 64, d), float("nan"), device="cuda", dtype=dt)
                  for _ in range(2)]
        for cache, old in zip(caches, history):
            cache[0, :, :past] = old
        return caches

    def call(caches):
        return gqa_torch.group_query_attention_(q, k, v, caches[0], caches[1], seqlens, head_sink=sink,
                                                num_heads=heads, kv_num_heads=kv_heads, **attrs)

    _assert_same_bits_under_routes((route, other_route), q, make_caches, call)


def _call_with_timeline(setter, records, call):
    """`call()` with a kernel timeline (`setter`, one of the `_C._set_*_timeline`) stamping
    `records`, switched off again whatever happens."""
    setter(records)
    try:
        return call()
    finally:
        setter(None)


@pytest.mark.parametrize("head_dim,seq", [(64, 1024), (128, 1024), (128, 2048), (256, 1024)])
def test_cuda_prefill_timeline(head_dim, seq):
    """The diagnostic per-block timeline (`_C._set_prefill_timeline`, benchmarks/block_timeline.py)
    on auto's warp-specialised kernels (three computing warpgroups of 64 rows at head size 64,
    two elsewhere; the pipelined order at 128, the plain one elsewhere): every
    query block is stamped once by each computing warpgroup, in record block * 4 + warpgroup,
    with its work item, a CTA of the grid, its key tiles and SM clocks in order; the output is
    the same bits as without the stamps; switched off, a call writes nothing to the buffer."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the timeline is stamped by the warp-specialised wgmma kernels: it needs an sm90 GPU and a build for 9.0a")
    torch.manual_seed(head_dim + seq)
    heads, kv_heads, dt = 8, 2, torch.bfloat16
    q = torch.randn(1, seq, heads * head_dim, device="cuda", dtype=dt)
    k, v = (torch.randn(1, seq, kv_heads * head_dim, device="cuda", dtype=dt) for _ in range(2))
    seqlens = torch.full((1,), seq - 1, dtype=torch.int32, device="cuda")
    records = torch.zeros(4 * kv_heads * math.ceil(seq * 4 / 64), 8, dtype=torch.int64, device="cuda")

    def call():
        caches = [torch.full((1, kv_heads, seq, head_dim), float("nan"), device="cuda", dtype=dt) for _ in range(2)]
        return gqa_torch.group_query_attention_(q, k, v, caches[0], caches[1], seqlens, num_heads=heads,
                                                kv_num_heads=kv_heads)

    plain = call()
    stamped = _call_with_timeline(gqa_torch._C._set_prefill_timeline, records, call)
    torch.cuda.synchronize()
    assert bits_equal(stamped, plain), "the stamps changed the output"
    rows = records.cpu()
    # Fields: entry, Q staged, first tile done (pipelined order only), loop done, exit (SM
    # clocks), global ns, SM << 32 | key tiles, CTA << 32 | work item.
    used = torch.nonzero(rows[:, 4] != 0).squeeze(1)
    warpgroups = 3 if head_dim == 64 else 2
    block_rows = 64 * warpgroups
    blocks = kv_heads * math.ceil(seq * (heads // kv_heads) / block_rows)
    assert used.tolist() == [blk * 4 + wg for blk in range(blocks) for wg in range(warpgroups)], \
        "each query block is stamped once by each computing warpgroup"
    r = rows[used]
    assert ((r[:, 7] & 0xFFFFFFFF) == used // 4).all(), "the work item field"
    assert ((r[:, 0] > 0) & (r[:, 0] <= r[:, 1]) & (r[:, 1] <= r[:, 3]) & (r[:, 3] <= r[:, 4])).all(), \
        "entry <= Q staged <= loop done <= exit"
    if head_dim == 128:  # auto's pipelined kernels (one step below 2048 tokens, two copies from there)
        assert ((r[:, 1] <= r[:, 2]) & (r[:, 2] <= r[:, 3])).all(), "Q staged <= first tile done <= loop done"
    else:
        assert not r[:, 2].any(), "the plain order stamps no first tile"
    tiles = r[:, 6] & 0xFFFFFFFF
    assert ((tiles >= 1) & (tiles <= seq)).all(), "key tiles"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (((r[:, 7] >> 32) < sms) & ((r[:, 6] >> 32) < 2 * sms)).all(), "CTA and SM ids"
    records.zero_()
    call()
    torch.cuda.synchronize()
    assert not records.any(), "switched off, a call stamped the buffer"


def test_cuda_decode_timeline_only_in_its_build():
    """The decode kernel's per-CTA stamps (`_C._set_decode_timeline`, benchmarks/decode_timeline.py)
    exist only in a build with GQA_DECODE_TIMELINE=1. Without them a valid buffer is refused with a
    message that says how to get them, and a call afterwards writes nothing to it; with them,
    every CTA of a call that computes stamps its record in order, and the output is the same bits."""
    torch.manual_seed(11)
    b, heads, kv_heads, d, cap, dt = 2, 8, 2, 128, 1024, torch.bfloat16
    q = torch.randn(b, 1, heads * d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, 1, kv_heads * d, device="cuda", dtype=dt) for _ in range(2))
    caches = [torch.randn(b, kv_heads, cap, d, device="cuda", dtype=dt) for _ in range(2)]
    seqlens = torch.tensor([700, 1000], dtype=torch.int32, device="cuda")
    records = torch.zeros(4096, 16, dtype=torch.int64, device="cuda")

    def call():
        kc, vc = (c.clone() for c in caches)
        return gqa_torch.group_query_attention_(q, k, v, kc, vc, seqlens, num_heads=heads, kv_num_heads=kv_heads)

    plain = call()
    if not gqa_torch.build_info().get("decode_timeline", False):
        with pytest.raises(ValueError, match=r"gqa: decode timeline: this build has no decode stamps; rebuild with "
                                             r"GQA_DECODE_TIMELINE=1"):
            gqa_torch._C._set_decode_timeline(records)
        call()
        torch.cuda.synchronize()
        assert int(records.abs().sum()) == 0, "a refused buffer was written"
        return
    stamped = _call_with_timeline(gqa_torch._C._set_decode_timeline, records, call)
    torch.cuda.synchronize()
    assert bits_equal(stamped, plain), "the stamps changed the output"
    r = records[records[:, 7] != 0].cpu()  # exit_ns: the CTAs that computed
    assert len(r) > 0, "no CTA stamped"
    # entry_ns, entry, waited, checked, q_ready, loop_done, exit, exit_ns (decode_timeline.py)
    assert ((r[:, 1] <= r[:, 2]) & (r[:, 2] <= r[:, 3]) & (r[:, 3] <= r[:, 4]) & (r[:, 4] <= r[:, 5]) &
            (r[:, 5] <= r[:, 6]) & (r[:, 0] <= r[:, 7])).all(), "the stamps are in order"
    rows = sorted({int(x) >> 32 for x in r[:, 9]})
    assert rows == [0, 1], "both rows' CTAs stamped"


@pytest.fixture(params=["auto", "cp_async"])
def prefill_q_loader(request):
    """Pins how the warp-specialised prefill stages Q: "auto" (by TMA, where G divides 64, the
    scale is positive and every row of the block is a query row; by cp.async for the other
    blocks of the same launch) or "cp_async" for every block."""
    gqa_torch._C._set_prefill_q_loader(request.param)
    yield request.param
    gqa_torch._C._set_prefill_q_loader("auto")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (8, 2), (32, 2)], ids=["g1", "g3", "g4", "g16"])
def test_cuda_prefill_q_loader(dtype, head_dim, heads, prefill_q_loader):
    """The Q tile by TMA or cp.async under auto's kernel: G = 1, 3 (no TMA box: cp.async), 4 and
    16; head size 80 (TMA zero-fills the columns past it); in place with ragged pasts and packed,
    strided or plain q (with RoPE, q comes from prep's rotated copy); a padded first prompt
    (blocks with padding rows take cp.async, the others TMA, in one launch); a negative scale
    (cp.async, which flips q's sign)."""
    num_heads, kv_heads = heads
    for i, feat in enumerate([dict(), dict(rotary="half", packed=True), dict(strided=True, softcap=2.0),
                              dict(scale=-0.08, window=50)]):
        case = make_case("inplace", batch=2, seq=300, num_heads=num_heads, kv_num_heads=kv_heads, head_dim=head_dim,
                         capacity=420, layout=i % 2, dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)
    case = make_case("functional", batch=3, seq=260, num_heads=num_heads, kv_num_heads=kv_heads, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[260, 75, 193], dtype=DTYPES[dtype])
    _run_cuda_and_cpu(case)


@pytest.fixture(params=["auto", "prep"])
def prefill_append(request):
    """Who writes an in-place prefill's new rows to the caches (no RoPE): "auto" (the
    warp-specialised attention kernel, for rows with no past, on sm90 in a 9.0a build; prep
    elsewhere) or "prep" (prep always)."""
    gqa_torch._C._set_prefill_append(request.param)
    yield request.param
    gqa_torch._C._set_prefill_append("auto")


@pytest.mark.parametrize("seq", [7, 300])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_cuda_prefill_kernel_append(seq, dtype, head_dim, prefill_route):
    """In place without RoPE, rows with no past: the warp-specialised kernels read their K/V
    from the new rows and write them to the caches themselves, each tile from the block that
    owns it (TMA stores for whole tiles, plain stores for the tile across the row's end, and
    every tile by plain stores on the cp.async route). S = 7 is one partial tile; 300 has two
    or three whole tiles and a partial one. Rows with a past (prep appends them) in the same
    launch; packed and separate inputs, both cache layouts, caches inside poisoned guard
    regions (strided), head size 80 (TMA boxes past the head size), G = 4 and 3. Every route;
    only the warp-specialised ones append in the kernel."""
    for i, (pasts, heads, feat) in enumerate([([0, 45, 0], (8, 2), dict(strided=True)),
                                              ([0, 0], (12, 4), dict(packed=True, softcap=2.0, window=90)),
                                              ([0], (8, 2), dict(sink=True, smooth=True))]):
        case = make_case("inplace", batch=len(pasts), seq=seq, num_heads=heads[0], kv_num_heads=heads[1],
                         head_dim=head_dim, capacity=seq + 60, past_lengths=pasts, layout=i % 2,
                         dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_prefill_kernel_append_matches_prep(dtype, head_dim, prefill_append):
    """The caches after an in-place prefill of rows with no past (1100 tokens: every CTA walks
    several query blocks, owning some tiles and not others) are the same bytes whether the
    attention kernel or prep appends them, and match the reference (_run_cuda_and_cpu)."""
    case = make_case("inplace", batch=2, seq=1100, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=1200,
                     past_lengths=[0, 0], layout=head_dim == 256, dtype=DTYPES[dtype], strided=True)
    _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_prefill_kernel_append_bad_row(dtype, head_dim, prefill_append):
    """A bad row next to a row with no past (which the kernel would append): no cache byte
    changes (guard regions included), every output row is NaN, and check_errors() raises the
    capacity flag."""
    case = make_case("inplace", batch=3, seq=300, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=400,
                     past_lengths=[0, 50, 0], strided=True, dtype=DTYPES[dtype], device="cuda", poison_unused=False)
    case.seqlens_k[1] = 400  # total 401 > capacity
    _check_bad_row_poisons_the_call(case, "a bad row anywhere makes every prefill output row NaN")


def _check_bad_row_poisons_the_call(case, message, flags=gerr.CAPACITY):
    """Runs an in-place case with a bad row (by default one past the capacity): every output is
    NaN (`message` otherwise), no cache byte changes (guard regions included), and
    check_errors() raises `flags` alone."""
    before = case.clone()
    out = case.run()
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), message
    _assert_untouched_except_valid_rows(before, case, written_rows=[])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags


@pytest.mark.parametrize("seq", [2, 33])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("prefill_route", ["mma", "wgmma"], indirect=True)  # the kernels with a split form
def test_cuda_prefill_split_k(seq, dtype, head_dim, prefill_route):
    """A short chunk on a long cache (speculative verification, small chunks): few query
    blocks (at most 8 CTAs here) and a capacity of 4100, so the plan splits every query block's
    key range (into 4) and the merge combines the parts. Every feature, both ops and layouts;
    one row's chunk ends exactly at the capacity, the other's in the middle of a split, and the
    unused cache rows hold NaN (a part must read only visible keys, as zeros past the end)."""
    for i, feat in enumerate(FEATURE_CYCLE):
        case = make_case(["inplace", "functional"][i % 2], batch=2, seq=seq, num_heads=8, kv_num_heads=2,
                         head_dim=head_dim, capacity=4100, past_lengths=[4100 - seq, 1500 + 37 * i],
                         layout=(i // 2) % 2, dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


@pytest.fixture(params=["auto", "kernel", "arrival"])
def decode_merge(request):
    """Runs the test with each way of merging the tensor-core decode kernel's splits: "auto"
    (up to 16 splits inside the launch, by the last split to finish; else the merge kernel),
    "kernel" (the merge kernel) and "arrival" (the last split CTA to finish, at every split
    count)."""
    gqa_torch._C._set_decode_merge(request.param)
    yield request.param
    gqa_torch._C._set_decode_merge("auto")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("batch,past", [(1, [4000]), (4, [1, 900, 3000, 257]), (2, [255, 256])])
@pytest.mark.parametrize("op", ["inplace", "functional"])
def test_cuda_decode(dtype, batch, past, op, decode_merge):
    """Decode (S = 1) with short and long ragged rows: split-K and its merge (by the last split
    to finish or by the merge kernel), every feature."""
    for i, feat in enumerate(FEATURE_CYCLE):
        capacity = max(past) + 16
        case = make_case(op, batch=batch, seq=1, num_heads=8, kv_num_heads=[1, 2, 8][i % 3], head_dim=[64, 128][i % 2],
                         capacity=capacity, past_lengths=past, dtype=DTYPES[dtype], layout=i % 2, **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("features", ["auto", "general"])
def test_cuda_decode_plain_kernel(dtype, head_dim, features):
    """Calls that use no RoPE, softcap, window, sink or smooth softmax take the decode kernel
    compiled without them ("auto"); the general kernel ("general") must give them the same
    results. In place (the fused path: the new key is patched into the warp that reads it) and
    functional, ragged rows over one and several splits, and a 20-head group (two head chunks)."""
    with _switch_pinned(gqa_torch._C._set_decode_features, features):
        for i, op in enumerate(["inplace", "functional"]):
            case = make_case(op, batch=4, seq=1, num_heads=[8, 20][i], kv_num_heads=[2, 1][i], head_dim=head_dim,
                             capacity=3016, past_lengths=[0, 63, 700, 2999], dtype=DTYPES[dtype], layout=i)
            _run_cuda_and_cpu(case)


def _decode_kernel_bools(names):
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


def _decode_keys_as_rows_flags(names):
    """Whether each decode kernel among the profiler's kernel names is the keys-as-rows form
    (decode_mma_kernel's last template argument, kKeysM)."""
    return [keys_m for _, _, keys_m in _decode_kernel_bools(names)]


@pytest.mark.parametrize("hq,hkv,head_dim,loader,keys_as_rows", [
    (8, 8, 128, "auto", True), (32, 8, 128, "auto", True), (28, 4, 96, "auto", True), (16, 2, 80, "auto", True),
    (64, 8, 64, "auto", True), (72, 8, 128, "auto", False), (32, 2, 128, "auto", False), (32, 8, 256, "auto", False),
    (32, 8, 128, "regs_k", False)], ids=["g1", "g4", "g7_96", "g8_80", "g8_64", "g9", "g16", "d256", "regs_k"])
def test_cuda_decode_keys_as_rows_where_a_kv_head_has_at_most_8_heads(hq, hkv, head_dim, loader, keys_as_rows):
    """The decode kernel takes the keys as its mmas' rows (S^T = K Q^T) where a kv head has at
    most 8 query heads, at head sizes up to 128, with every loader but K in registers; the heads
    stay the rows at 9 or more heads, at head size 256 and with K in registers. Each call is
    checked against the reference and the CPU backend first, with and without features."""
    if loader == "regs_k" and (torch.cuda.get_device_capability()[0] != 9
                               or "9.0a" not in gqa_torch.build_info()["cuda_archs"]):
        pytest.skip("K in registers (a TMA loader) needs an sm90 GPU and a 9.0a build")
    with _switch_pinned(gqa_torch._C._set_decode_loader, loader):
        cases = [make_case("inplace", batch=3, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=head_dim,
                           capacity=2100, past_lengths=[2049, 700, 5], dtype=torch.bfloat16, **feat)
                 for feat in (dict(), dict(rotary="half", softcap=2.0, sink=True))]
        for case in cases:
            _run_cuda_and_cpu(case)
        for case in cases:
            names = _cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
            assert _decode_keys_as_rows_flags(names) == [keys_as_rows], names


@pytest.fixture(params=["cp_async", "cp_async_shallow", "cp_async_one_ahead", "tma", "tma_one_ahead", "tma_shallow",
                        "tma_wide", "regs_k"])
def decode_loader(request):
    """Pins the decode kernel's loader (the default, "auto", picks per shape: on an sm90 GPU in a
    9.0a build TMA at head sizes 80, 96, 128 and 256, one tile ahead at 128 where more CTAs than
    SMs stream splits of 1,024-4,096 keys and at 80 and 96 where the grid is one wave at two CTAs
    an SM, at 256 with four warps a CTA where the grid, or its equal rows' part, is one wave at
    one CTA an SM, at 64 in three stages where more than three CTAs an SM stream short splits in
    row order and else with 32 keys a warp a stage where the splits hold 512 keys or more; else
    cp.async: in three stages at 64 where the grid is one wave at one CTA an SM of short splits,
    and at 80 and 96 where the grid is one wave at one CTA an SM (at 96 of splits of fewer than
    512 keys), or, without TMA, one tile ahead where it is one wave at two CTAs an SM), so that
    every loader stays tested there. "cp_async_shallow" (three stages) exists at head size 64,
    "cp_async_one_ahead" at 80 and 96, "tma_one_ahead" at 80, 96 and 128, "tma_shallow" (three
    stages) and "tma_wide" (32 keys a warp a stage) at 64 and "regs_k" (K into registers, V by
    TMA) at 64 and 128; elsewhere the first two run as "cp_async", the next three as "tma" and
    the last as auto. The four-warp layout's own pin, "tma_four_warps", is
    test_cuda_decode_head_size_256_warps's."""
    tma = request.param not in ("cp_async", "cp_async_shallow", "cp_async_one_ahead")
    if tma and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA decode loaders need an sm90 GPU")
    if tma and "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the TMA decode loaders need a build for 9.0a (TORCH_CUDA_ARCH_LIST)")
    gqa_torch._C._set_decode_loader(request.param)
    yield request.param
    gqa_torch._C._set_decode_loader("auto")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("op", ["inplace", "functional"])
def test_cuda_decode_loaders(dtype, head_dim, op, decode_loader):
    """Each tensor-core decode loader at every fast head size: rows whose length leaves a short
    last slice in a warp (1, 15, 17, 63 and 65 keys) and one long enough that every pipeline
    stage is reused (2000 keys), a group of 20 query heads (two head chunks, so two CTAs read
    the row the in-place op appends), and every feature."""
    for i, feat in enumerate(FEATURE_CYCLE):
        case = make_case(op, batch=6, seq=1, num_heads=[8, 20][i % 2], kv_num_heads=[2, 1][i % 2], head_dim=head_dim,
                         capacity=2016, past_lengths=[0, 14, 16, 62, 64, 1999], dtype=DTYPES[dtype], layout=i % 2,
                         **feat)
        _run_cuda_and_cpu(case)


def _decode_loader_codes(names, head_dim):
    """The loader template argument (DecodeLoader in decode_mma.cuh) of each decode kernel at
    `head_dim` among the profiler's kernel names, demangled or not."""
    codes = []
    for name in names:
        m = (re.search(rf"decode_mma_kernel<[^,<>]+,\s*{head_dim},\s*(\d+)", name)
             or re.search(rf"decode_mma_kernelI\w+?Li{head_dim}ELi(\d+)E", name))
        if m:
            codes.append(int(m.group(1)))
    return codes


def _loader_test_pasts(rows, batch, capacity):
    """The loader tests' past lengths: every row full ("equal") or spread over the capacity
    ("ragged", a stride of 997 keys)."""
    if rows == "equal":
        return [capacity - 1] * batch
    return [(capacity - 1 - 997 * i) % capacity for i in range(batch)]


def _check_decode_and_its_loader(head_dim, code, context, **shape):
    """The in-place decode call on `shape` (make_case's keywords) without features and with RoPE,
    softcap, a sink and larger logits, each against the reference and the CPU backend; then the
    loader code (DecodeLoader) of the decode kernel each call launches, which must be `code`
    (`context` goes into the assertion's message)."""
    cases = [make_case("inplace", seq=1, head_dim=head_dim, **shape, **feat)
             for feat in (dict(), dict(rotary="half", softcap=2.0, q_amplitude=3.0, sink=True))]
    for case in cases:
        _run_cuda_and_cpu(case)
    # (After every correctness check, which compute-sanitizer runs too.)
    for case in cases:
        names = _cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
        assert _decode_loader_codes(names, head_dim) == [code], (context, names)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch,hq,hkv,rows,loader", [
    (1, 32, 8, "equal", "auto"), (1, 32, 8, "equal", "tma"), (1, 32, 8, "equal", "cp_async"),
    (8, 32, 8, "ragged", "auto"), (33, 8, 4, "equal", "auto"), (33, 8, 4, "ragged", "auto"),
    (34, 8, 4, "ragged", "auto"), (34, 8, 4, "ragged", "tma"), (34, 8, 4, "ragged", "tma_four_warps"),
    (18, 16, 8, "equal", "auto"), (18, 16, 8, "ragged", "auto")])
def test_cuda_decode_head_size_256_warps(dtype, batch, hq, hkv, rows, loader):
    """At head size 256 the decode kernel runs four warps a CTA, loading by TMA (loader code 3),
    where its grid is one wave at one CTA an SM (on an H200: B = 1 with 8 kv heads in 16 splits,
    B = 8 in 2), or where a batch of equal rows would take such a wave in a larger grid (B = 33
    with 4 kv heads and 4,160 keys of capacity: 2 splits, 264 CTAs, of which equal rows use 132;
    equal and ragged rows alike, as the plan fixes the kernel), or where the plan gives a batch
    of equal rows' last wave of one CTA an SM more splits (B = 18 with 8 kv heads and 2,100 keys:
    144 slots, the last 12 in 8 splits each; equal and ragged rows alike). It runs two warps by
    TMA (code 1) where more CTAs stream (B = 34: 136 CTAs of one split of 300 keys, not ranked)
    or by cp.async under its pin (code 0); the "tma_four_warps" pin takes four warps whatever the
    grid (two waves at B = 34). Each matches the reference and the CPU backend, in place,
    without features (the plan's kernel without them) and with RoPE, softcap, a sink and ragged
    rows."""
    if loader != "cp_async" and (torch.cuda.get_device_capability()[0] != 9
                                 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]):
        pytest.skip("the TMA decode loaders need an sm90 GPU and a build for 9.0a")
    capacity = {1: 2048, 8: 1100, 18: 2100, 33: 4160, 34: 300}[batch]
    pasts = _loader_test_pasts(rows, batch, capacity)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms, head_dim=256)
    slots = batch * hkv
    four_warps = (plan["max_splits"] * slots <= sms or 0 < plan["equal_rows_splits"] * slots <= sms
                  or plan["equal_rows_tail_splits"] > 0 or loader == "tma_four_warps")
    if batch == 18:
        assert plan["equal_rows_tail_splits"] > 0, (plan, sms)  # (the case's point; 132 SMs: 8 splits of 12 slots)
    code = 0 if loader == "cp_async" else (3 if four_warps else 1)
    with _switch_pinned(gqa_torch._C._set_decode_loader, loader):
        _check_decode_and_its_loader(256, code, (plan, sms), batch=batch, num_heads=hq, kv_num_heads=hkv,
                                     capacity=capacity, past_lengths=pasts, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_decode_head_size_256_last_wave_functional(dtype):
    """The functional op on test_cuda_decode_head_size_256_warps's B = 18 shape (on an sm90 GPU
    with an sm90a build: 144 slots, the last 12 in 8 splits, four warps a CTA; the prep kernel
    runs apart, and the presents are new tensors): equal rows in BNSH without features, then
    ragged rows in BSNH with RoPE, softcap, a sink and larger logits, against the reference and
    the CPU backend."""
    capacity = 2100
    for rows, layout, feat in (("equal", 0, dict()),
                               ("ragged", 1, dict(rotary="half", softcap=2.0, q_amplitude=3.0, sink=True))):
        case = make_case("functional", batch=18, seq=1, num_heads=16, kv_num_heads=8, head_dim=256,
                         capacity=capacity, past_lengths=_loader_test_pasts(rows, 18, capacity),
                         dtype=DTYPES[dtype], layout=layout, **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch,hq,hkv,capacity,rows,loader,code", [
    (16, 32, 8, 4096, "equal", "auto", 8), (16, 32, 8, 4096, "ragged", "auto", 8),
    (64, 32, 8, 2048, "equal", "auto", 8), (4, 32, 8, 1024, "equal", "auto", 4), (1, 14, 2, 1024, "equal", "auto", 4),
    (1, 14, 2, 32768, "equal", "auto", 8), (1, 32, 8, 8192, "equal", "auto", 8), (8, 12, 12, 1024, "ragged", "auto", 8),
    (16, 32, 8, 4096, "equal", "regs_k", 2), (1, 14, 2, 1024, "equal", "cp_async", 0),
    (64, 32, 8, 2048, "equal", "cp_async_shallow", 4), (72, 32, 8, 1024, "ragged", "auto", 7),
    (34, 32, 8, 4096, "equal", "auto", 8), (34, 32, 8, 2048, "equal", "tma", 1),
    (16, 32, 8, 4096, "equal", "tma_shallow", 7), (48, 32, 8, 2048, "ragged", "auto", 8),
    (48, 32, 8, 2048, "equal", "auto", 8), (1, 14, 2, 1024, "equal", "tma_wide", 8)])
def test_cuda_decode_head_size_64_loaders(dtype, batch, hq, hkv, capacity, rows, loader, code):
    """At head size 64 auto loads K and V by TMA in three stages of 16 keys a warp (loader code
    7, four CTAs an SM) where more than three CTAs an SM stream splits of 2,048 keys of capacity
    or fewer in row order (on an H200: B72 32/8 with 1,024 keys, one split a row); elsewhere by
    TMA in three stages of 32 keys a warp (code 8) where the splits hold 512 keys of capacity or
    more, whatever the grid (B16 32/8 with 4,096 keys in 2 splits, of which equal rows take 1,
    equal and ragged rows alike, as the plan fixes the kernel; B64 with 2,048 keys, ranked
    longest first; B1 32/8 with 8,192 keys in 16 splits; B8 12/12 with 1,024 keys in one; B34
    and B48, whose last wave of equal rows takes more splits, Plan::equal_rows_tail_splits, by
    the rows' one split; B1 14/2 with 32,768 keys in 64 splits); and by cp.async in three stages
    (code 4) where the splits are shorter (B4 32/8 L1024, B1 14/2 L1024). K into registers (code
    2), five-stage cp.async (code 0) at B1 14/2, three-stage cp.async with many CTAs, five TMA
    stages of 16 keys (code 1) at B34 L2048, three at B16 and 32-key slices at B1 14/2 run under
    their pins.
    The expected codes are listed per case (an H200's 132 SMs), and the plan premises they rest
    on are asserted. Each matches the reference and the CPU backend, in place, without features
    and with RoPE, softcap, a sink and ragged rows."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the TMA decode loaders need an sm90 GPU and a build for 9.0a")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if sms != 132 and loader == "auto":
        pytest.skip(f"auto's expected loaders are listed for 132 SMs; this GPU has {sms}")
    pasts = _loader_test_pasts(rows, batch, capacity)
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms, head_dim=64)
    row_splits = plan["ragged_splits"] or plan["max_splits"]
    premises = {  # (row splits, longest first, equal rows' splits, the last wave's splits)
        (16, 4096): (2, True, 1, 0), (64, 2048): (1, True, 0, 0), (72, 1024): (1, False, 0, 0),
        (34, 4096): (1, True, 1, 8), (48, 2048): (1, True, 1, 2), (4, 1024): (4, False, 0, 0),
        (1, 8192): (16, False, 0, 0), (8, 1024): (1, False, 0, 0), (1, 32768): (64, False, 0, 0)}
    if (batch, capacity) in premises:
        got = (row_splits, plan["longest_first"], plan["equal_rows_splits"], plan["equal_rows_tail_splits"])
        assert got == premises[(batch, capacity)], plan
    with _switch_pinned(gqa_torch._C._set_decode_loader, loader):
        _check_decode_and_its_loader(64, code, (plan, sms), batch=batch, num_heads=hq, kv_num_heads=hkv,
                                     capacity=capacity, past_lengths=pasts, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch,capacity,rows,loader,code", [
    (64, 1024, "equal", "auto", 6), (8, 8192, "ragged", "auto", 6), (8, 1024, "equal", "auto", 1),
    (34, 4200, "equal", "auto", 1), (15, 4096, "equal", "auto", 1), (8, 1024, "equal", "tma_one_ahead", 6),
    (64, 1024, "ragged", "tma", 1)])
def test_cuda_decode_head_size_128_loaders(dtype, batch, capacity, rows, loader, code):
    """At head size 128 auto's TMA keeps one tile in flight ahead (loader code 6) where the grid
    has more CTAs than SMs, its splits hold 1,024-4,096 keys of capacity and a batch of equal
    rows would not run one CTA an SM (on an H200, 32/8 heads: B64 L1024, one split a row; B8
    L8192, 8 splits), and two (code 1) elsewhere: with shorter splits (B8 L1024, 2 splits of 512
    keys), longer ones (B34 L4200, one split) and where equal rows run one CTA an SM (B15 L4096:
    2 splits, of which equal rows take 1). Each runs under its pin whatever the grid. Each
    matches the reference and the CPU backend, in place, without features and with RoPE,
    softcap, a sink and ragged rows."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the TMA decode loaders need an sm90 GPU and a build for 9.0a")
    pasts = _loader_test_pasts(rows, batch, capacity)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = gqa_torch._C._decode_plan(batch, 32, 8, capacity, sms, head_dim=128)
    if loader == "auto":  # the case's premise
        ctas, split_keys = plan["max_splits"] * batch * 8, capacity // plan["max_splits"]
        equal_rows_one_wave = 0 < plan["equal_rows_splits"] * batch * 8 <= sms
        assert (code == 6) == (ctas > sms and 1024 <= split_keys <= 4096 and not equal_rows_one_wave), (plan, sms)
    with _switch_pinned(gqa_torch._C._set_decode_loader, loader):
        _check_decode_and_its_loader(128, code, (plan, sms), batch=batch, num_heads=32, kv_num_heads=8,
                                     capacity=capacity, past_lengths=pasts, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch,head_dim,capacity,rows,loader,code", [
    (8, 80, 2048, "ragged", "auto", 6), (8, 96, 1024, "equal", "auto", 6), (1, 96, 1024, "equal", "auto", 0),
    (4, 96, 4096, "equal", "auto", 1), (16, 80, 1024, "ragged", "auto", 1), (1, 96, 4096, "equal", "auto", 1),
    (2, 80, 2048, "equal", "auto", 0),
    (8, 96, 1024, "equal", "cp_async", 0), (1, 80, 1024, "equal", "cp_async_one_ahead", 5),
    (1, 80, 1024, "equal", "tma_one_ahead", 6), (8, 96, 1024, "equal", "tma", 1)])
def test_cuda_decode_head_sizes_80_96_loaders(dtype, batch, head_dim, capacity, rows, loader, code):
    """At head sizes 80 and 96 auto loads by TMA (each slice row in two 64-column boxes, the
    second padded with zeros), one tile in flight ahead (loader code 6) where the grid is one
    wave at two CTAs an SM (on an H200: B8 32/32, 256 CTAs of one split) and a batch of equal
    rows would not run one CTA an SM, two ahead (code 1) elsewhere: where equal rows would run
    so (B4 32/32 L4096: 2 splits, of which equal rows take 1), in more waves (B16 L1024, 512
    CTAs) and at 96 where the grid is one wave at one CTA an SM with splits of 512 keys or more
    (B1 L4096: 4 splits of 1,024); by cp.async (code 0) in such a wave at 80 (B2 L2048: 2 splits
    of 1,024) and at 96 with shorter splits (B1 L1024: 4 splits of 256). Each runs under its pin
    whatever the grid. Each matches the reference and the CPU backend, in place, without
    features and with RoPE, softcap, a sink and ragged rows."""
    if code in (1, 6) and (torch.cuda.get_device_capability()[0] != 9
                           or "9.0a" not in gqa_torch.build_info()["cuda_archs"]):
        pytest.skip("the TMA decode loaders need an sm90 GPU and a build for 9.0a")
    pasts = _loader_test_pasts(rows, batch, capacity)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = gqa_torch._C._decode_plan(batch, 32, 32, capacity, sms, head_dim=head_dim)
    if loader == "auto":  # the case's premise
        ctas, split_keys = plan["max_splits"] * batch * 32, capacity // plan["max_splits"]
        equal_rows_one_wave = 0 < plan["equal_rows_splits"] * batch * 32 <= sms
        one_wave_cp_async = ctas <= sms and (head_dim == 80 or split_keys < 512)
        one_ahead = sms < ctas <= 2 * sms and not equal_rows_one_wave
        assert code == (0 if one_wave_cp_async else 6 if one_ahead else 1), (plan, sms)
    with _switch_pinned(gqa_torch._C._set_decode_loader, loader):
        _check_decode_and_its_loader(head_dim, code, (plan, sms), batch=batch, num_heads=32, kv_num_heads=32,
                                     capacity=capacity, past_lengths=pasts, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("softcap", [1e4, 1e6, 3e38])
@pytest.mark.parametrize("seq", [1, 64])
def test_cuda_large_softcap(dtype, softcap, seq):
    """A softcap far above the logits is the identity. Finding (by analysis, 2026-11-29): the
    tensor-core prefill computed tanh(y) as 1 - 2/(e^2y + 1), which cancels for small y (every
    logit ~0 with softcap 1e6), and softcap * log2(e) overflowed to inf above 2.4e38."""
    case = make_case("inplace", batch=2, seq=seq, num_heads=8, kv_num_heads=2, head_dim=128, capacity=seq + 100,
                     past_lengths=[30, 90], dtype=DTYPES[dtype], softcap=softcap, q_amplitude=3.0)
    _run_cuda_and_cpu(case)


def test_cuda_poisoned_outputs_are_overwritten():
    """Outputs come from the caching allocator; blocks freed full of NaN must be fully
    overwritten (first-prompt padding rows with exact zeros)."""
    for _ in range(3):
        case = make_case("functional", batch=3, seq=33, num_heads=4, kv_num_heads=2, head_dim=64, capacity=None,
                         first_prompt=True, prompt_lengths=[33, 1, 20], dtype=torch.float16, device="cuda")
        shape_out = (3, 33, 4 * 64)
        junk = [poison(torch.empty(shape_out, dtype=torch.float16, device="cuda")) for _ in range(4)]
        del junk
        out, pk, pv = case.run()
        assert torch.isfinite(out).all() and torch.isfinite(pk).all() and torch.isfinite(pv).all()
        assert (out[1, 1:] == 0).all() and (out[2, 20:] == 0).all()


# ---- CUDA graphs ------------------------------------------------------------------------------------

def _capture(call, warmups=1, during_capture=None):
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


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("max_splits", [2, 3, 6, 16])
def test_cuda_decode_split_shapes(dtype, max_splits, decode_merge):
    """Split counts from 2 to 16 (up to auto's limit for the in-launch merge) with the smallest
    split one key, on rows of 1 to 700 keys: 9 keys in 6 splits of 2 leave the sixth split
    empty (zero weight), short rows use fewer splits than the grid has, one row one split (the
    kernel writes it directly), and every feature."""
    gqa_torch._C._set_decode_split_override(max_splits, 1)
    try:
        for i, feat in enumerate(FEATURE_CYCLE):
            case = make_case(["inplace", "functional"][i % 2], batch=5, seq=1, num_heads=[8, 20][i % 2],
                             kv_num_heads=[2, 1][i % 2], head_dim=[64, 128, 256][i % 3], capacity=720,
                             past_lengths=[0, 4, 8, 16, 699], dtype=DTYPES[dtype], layout=i % 2, **feat)
            _run_cuda_and_cpu(case)
    finally:
        gqa_torch._C._set_decode_split_override(0, 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("max_splits", [66, 128])
def test_cuda_decode_merge_kernel_many_splits(dtype, max_splits):
    """The merge kernel over many splits (up to 128, the most: every warp's whole share of the
    splits in one round of loads), at head sizes whose rows fit that round (40 on the generic
    kernel, 64, 80, 128) and one that takes a second (256), fp32 on the generic kernel. Rows of
    1 to 700 keys, so that short rows use fewer splits than the grid has (a warp with none at
    all, and one split: the decode kernel writes the row), with every feature."""
    with _decode_pinned("kernel", max_splits, 1):
        for i, feat in enumerate(FEATURE_CYCLE):
            case = make_case(["inplace", "functional"][i % 2], batch=5, seq=1, num_heads=[8, 20][i % 2],
                             kv_num_heads=[2, 1][i % 2], head_dim=[64, 256, 80, 128, 40, 64][i], capacity=720,
                             past_lengths=[0, 4, 9, 130, 699], dtype=DTYPES[dtype], layout=i % 2, **feat)
            _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("hq,hkv,head_dim,capacity,max_splits", [
    (14, 2, 64, 32768, 64), (28, 4, 128, 8192, 32), (16, 4, 128, 32768, 32)])
def test_cuda_decode_power_of_two_splits(dtype, hq, hkv, head_dim, capacity, max_splits):
    """At B = 1 with 2 or 4 kv heads the plan rounds the splits that fill 132 SMs (66, 33) down
    to a power of two (core/plan.cpp), merged by the merge kernel. A full row and a row a few
    keys shorter (with RoPE, softcap, a sink and larger logits), in place, match the reference
    and the CPU backend."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = gqa_torch._C._decode_plan(1, hq, hkv, capacity, sms, head_dim=head_dim)
    if sms != 132:
        pytest.skip(f"the plan's splits are listed for 132 SMs; this GPU has {sms}: {plan}")
    assert plan["max_splits"] == max_splits, plan
    for past, feat in [(capacity - 1, dict()),
                       (capacity - 7, dict(rotary="half", softcap=2.0, q_amplitude=3.0, sink=True))]:
        case = make_case("inplace", batch=1, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=head_dim,
                         capacity=capacity, past_lengths=[past], dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch,hq,hkv,head_dim,capacity,past_lengths", [
    (1, 14, 2, 64, 32768, [999]), (1, 40, 2, 128, 32768, [700]), (2, 14, 2, 64, 32768, [1999, 32767]),
    (3, 40, 2, 128, 4096, [99, 4095, 1499]), (3, 28, 4, 128, 8192, [8191, 0, 640])])
def test_cuda_decode_short_rows_leave_the_last_splits(dtype, batch, hq, hkv, head_dim, capacity, past_lengths):
    """Rows far shorter than the plan's splits x 64 keys use only their first splits, and the
    CTAs of the others leave (decode_mma.cuh). Rows of 1 to 32,768 keys at B = 1 to 3 in the
    plain grid (not ranked longest first), with two head chunks a kv head (20 query heads a kv
    head) and 132 CTAs (3 x 4 kv heads x 11 splits), with and without features, in place, match
    the reference and the CPU backend. The plan's premises are asserted on 132 SMs (an H200),
    for which the shapes were chosen; elsewhere the cases still run."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if sms == 132:
        plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms, head_dim=head_dim)
        assert not plan["longest_first"], plan  # the plain grid: splits from the grid's x index
        assert 64 * plan["max_splits"] > min(past_lengths) + 1, plan  # some splits left unused
    for feat in [dict(), dict(rotary="interleaved", softcap=3.0, q_amplitude=3.0, sink=True)]:
        case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=head_dim,
                         capacity=capacity, past_lengths=past_lengths, dtype=DTYPES[dtype], **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_decode_arrival_merge_long_and_uneven_splits(dtype, head_dim):
    """The in-launch merge by the last split to finish, in 3 splits, on splits of 16 and 17
    tiles in one (row, kv head) slot (1,024 and 1,025 keys at head sizes 64 and 128, 512 and
    513 at 256, where a tile is 32 keys), splits of 32 tiles and of six, and a row of one key
    (two empty splits), with every feature, both ops and layouts. Three, four and seven query
    heads a kv head: at head size 256 the merging CTA's threads take two columns of four at a
    time (decode_arrival.cuh), and with three and seven heads the last pair has one past the
    end."""
    tile_keys = 32 if head_dim == 256 else 64
    edge = 16 * tile_keys
    # 3 splits of ceil(n / 3) keys: n = 3 edge + 2 gives two splits of edge + 1 and one of edge.
    lengths = [3 * edge + 2, 6 * edge, edge, 1, 3 * edge - 5]  # visible keys a row
    with _decode_pinned("arrival", 3, 1):
        for i, feat in enumerate(FEATURE_CYCLE):
            case = make_case(["inplace", "functional"][i % 2], batch=len(lengths), seq=1, num_heads=[8, 6, 14][i % 3],
                             kv_num_heads=2, head_dim=head_dim, capacity=6 * edge + 1,
                             past_lengths=[n - 1 for n in lengths], dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype,schedule,merge,max_splits", [
    ("fp16", "auto", "auto", 0), ("bf16", "auto", "auto", 0), ("bf16", "rows", "auto", 0),
    ("fp16", "longest_first", "auto", 3), ("bf16", "longest_first", "kernel", 3),
    ("bf16", "longest_first", "arrival", 2), ("bf16", "longest_first", "arrival", 5)])
def test_cuda_decode_ragged_batch_row_orders(dtype, schedule, merge, max_splits):
    """A ragged batch of 48 rows of 8 kv heads (384 CTAs at one split a row, more than any
    GPU's SMs, and 2,100 keys of capacity), where the plan takes the rows longest first: rows
    of 1 to 301 keys, one near the capacity and a tie of two long ones. Auto (longest first,
    one split a row), row order pinned, and longest first pinned with 2 to 5 splits merged
    every way, so that each merge finds its row's partials where the reordered CTAs left them.
    Every feature, both ops and layouts, head sizes 64, 128 and 256."""
    plan = gqa_torch._C._decode_plan(48, 32, 8, 2100, torch.cuda.get_device_properties(0).multi_processor_count)
    assert plan["longest_first"] and (plan["ragged_splits"] or plan["max_splits"]) == 1, plan
    with _decode_pinned(merge, max_splits, 1 if max_splits else 0, schedule):
        for i, feat in enumerate(FEATURE_CYCLE):
            rng = random.Random(100 + i)
            past = [rng.randint(0, 300) for _ in range(48)]
            past[5], past[17], past[40] = 2090, 700, 700
            case = make_case(["inplace", "functional"][i % 2], batch=48, seq=1, num_heads=32, kv_num_heads=8,
                             head_dim=[64, 128, 256][i % 3], capacity=2100, past_lengths=past, dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            _run_cuda_and_cpu(case)


def _equal_rows_shape(kind):
    """(batch, q heads, kv heads, capacity, plan) of a decode call whose plan, on this GPU, gives a
    batch of equal rows fewer splits than a ragged batch (Plan::equal_rows_splits). "one": one CTA
    a (row, kv head) fills the SMs (16 rows of 8 kv heads on an H200), so equal rows take one
    split where the plan's 4,160 keys take two; "two_per_sm": half as many rows, where the chunks
    of 4,096 keys take five splits and equal rows as many as fill two CTAs an SM (four on an
    H200). Two query heads a kv head: the plan counts kv heads, and the float64 reference's time
    query heads."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if kind == "one":
        batch, hq, hkv, capacity = max(2, sms // 8), 16, 8, 4160
    else:
        batch, hq, hkv, capacity = max(2, sms // 16), 16, 8, 16448
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["longest_first"] and 0 < plan["equal_rows_splits"] < plan["max_splits"], plan
    assert (plan["equal_rows_splits"] == 1) == (kind == "one"), plan
    return batch, hq, hkv, capacity, plan


@pytest.mark.parametrize("kind,dtype,schedule,features", [
    ("one", "bf16", "auto", slice(None)), ("one", "fp16", "auto", slice(1, None, 2)),
    ("two_per_sm", "bf16", "auto", slice(0, 3)), ("one", "bf16", "keep_splits", slice(2, 4)),
    ("one", "bf16", "two_per_sm", slice(0, 2))])
def test_cuda_decode_equal_rows_take_fewer_splits(kind, dtype, schedule, features):
    """A batch whose rows all see as many keys takes the plan's fewer splits for equal rows (its
    CTAs take their coordinates from the linear block index, and those past the working ones
    leave), and the same batch with one row shorter takes the plan's own splits, merged in the
    launch; the schedule "keep_splits" pins the plan's splits for both, and the schedule
    "two_per_sm" two CTAs an SM where auto keeps to one (the shape "one" at head size 128,
    Plan::one_cta_per_sm). Every feature in bf16 (a slice of them
    in the other settings, which differ from it in one thing each), both ops and layouts, head sizes
    128 (the TMA loader) and 64 (K loaded into registers), against the reference and the CPU
    backend (under a local window every row sees the window's keys: equal rows again)."""
    batch, hq, hkv, capacity, _ = _equal_rows_shape(kind)
    with _decode_pinned(schedule=schedule):
        for i, feat in list(enumerate(FEATURE_CYCLE))[features]:
            past = [capacity - 60] * batch
            if (i // 2) % 2:
                past[batch // 2] = capacity // 2  # one shorter row: the batch's rows differ
            case = make_case(["inplace", "functional"][i % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][i % 2], capacity=capacity, past_lengths=past, dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            _run_cuda_and_cpu(case)


def _tail_shape(kind):
    """(batch, q heads, kv heads, capacity, plan) of a decode call whose plan, on this GPU, gives
    the last wave of a batch of equal rows more splits (Plan::equal_rows_tail_splits): one split
    a row (2,100 keys of capacity, ranked), more (row, kv head) slots than two CTAs an SM hold,
    and the last wave at most half full. "two": a last wave of more than a third of the slots
    (two splits each; 45 rows of 8 kv heads on an H200, 96 slots past the first wave's 264);
    "eight": a last wave of a few slots (35 rows, 16 slots past it: 8 splits each). Two query
    heads a kv head."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wave = 2 * sms
    batch = (wave + wave // 3) // 8 + 1 if kind == "two" else wave // 8 + 2
    hq, hkv, capacity = 16, 8, 2100
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    tail = batch * hkv % wave
    assert plan["longest_first"] and plan["ragged_splits"] == 1 and plan["equal_rows_splits"] == 1, plan
    assert plan["equal_rows_tail_items"] == tail and plan["max_splits"] == plan["equal_rows_tail_splits"], plan
    assert (plan["equal_rows_tail_splits"] == 2) == (kind == "two") and plan["equal_rows_tail_splits"] >= 2, plan
    return batch, hq, hkv, capacity, plan


@pytest.mark.parametrize("kind,dtype,schedule,merge,features", [
    ("two", "bf16", "auto", "auto", slice(None)), ("eight", "bf16", "auto", "auto", slice(0, 6)),
    ("two", "fp16", "auto", "arrival", slice(1, None, 2)), ("two", "bf16", "keep_splits", "auto", slice(2, 4)),
    ("eight", "bf16", "auto", "kernel", slice(0, 2)), ("two", "bf16", "rows", "auto", slice(4, 6))])
def test_cuda_decode_equal_rows_tail_splits(kind, dtype, schedule, merge, features):
    """A batch of equal rows whose last wave takes more splits (_tail_shape: its CTAs take their
    coordinates from a one-dimensional grid's linear index, the last wave's rows split in two or
    eight and merged by the last to arrive), the same batch with one row shorter (ragged: one
    split a row, ranked, the CTAs past them leave), and equal rows shorter than the capacity.
    Pinned: the schedules "keep_splits" and "rows" and the merge kernel, which keep every batch to
    one split a row (a three-dimensional grid). Every feature in bf16 under auto (a slice of them in
    the other settings), both ops and layouts, head sizes 128 and 64, against the reference and
    the CPU backend."""
    batch, hq, hkv, capacity, _ = _tail_shape(kind)
    with _decode_pinned(merge=merge, schedule=schedule):
        for i, feat in list(enumerate(FEATURE_CYCLE))[features]:
            past = [capacity - 60 if i % 3 != 2 else capacity // 3] * batch
            if i % 3 == 1:
                past[batch - 2] = capacity // 2  # one shorter row (in the last wave): the batch's rows differ
            case = make_case(["inplace", "functional"][i % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(i // 2) % 2], capacity=capacity, past_lengths=past,
                             dtype=DTYPES[dtype], layout=i % 2, **feat)
            _run_cuda_and_cpu(case)


def test_cuda_decode_equal_rows_tail_bad_row():
    """The bad-row checks where the batch ranks as equal rows whose last wave takes more splits
    (_tail_shape "two"; the bad row's length past the capacity clamps to it, and the bad row is in
    the last wave): no cache byte changes, every output is NaN, and the capacity flag is raised."""
    batch, hq, hkv, capacity, _ = _tail_shape("two")
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=64, capacity=capacity,
                     past_lengths=[capacity - 1] * batch, strided=True, dtype=torch.bfloat16, device="cuda",
                     poison_unused=False)
    case.seqlens_k[batch - 1] = capacity  # total capacity + 1
    _check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


def test_cuda_decode_equal_rows_bad_row():
    """The bad-row checks where the batch ranks as equal rows (every row at the capacity, the bad
    row's length past it clamped to it), so that the CTAs past the one split leave before any
    check: still no cache byte changes, every output is NaN, and the capacity flag is raised."""
    batch, hq, hkv, capacity, _ = _equal_rows_shape("one")
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                     past_lengths=[capacity - 1] * batch, strided=True, dtype=torch.bfloat16, device="cuda",
                     poison_unused=False)
    case.seqlens_k[batch // 2] = capacity  # total capacity + 1
    _check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


def _ragged_pasts(rng, batch, capacity):
    """Past lengths of a ragged batch: random ones, rows shorter than a split's least keys (so
    that those rows take fewer splits than the plan), an empty cache, and a tie of two rows at
    the capacity."""
    past = [rng.randint(0, capacity - 1) for _ in range(batch)]
    special = [0, 30, 63, capacity - 1, capacity - 1][:batch]  # (a GPU with few SMs has few rows)
    past[:len(special)] = special
    rng.shuffle(past)
    return past


def _check_ragged_batches(shape, seed, schedule, dtype, features):
    """A ragged batch (_ragged_pasts, drawn from `seed`) at `shape` (batch, q heads, kv heads,
    capacity) under the decode schedule `schedule`, one a feature of FEATURE_CYCLE (the indices
    `features`): ops and layouts alternating, head sizes 128 and 64 in pairs, against the
    reference and the CPU backend."""
    batch, hq, hkv, capacity = shape
    rng = random.Random(seed)
    with _decode_pinned(schedule=schedule):
        for j, i in enumerate(features):
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(j // 2) % 2], capacity=capacity,
                             past_lengths=_ragged_pasts(rng, batch, capacity), dtype=DTYPES[dtype], layout=j % 2,
                             **FEATURE_CYCLE[i])
            _run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype,schedule,features", [
    ("bf16", "auto", [0, 1, 2, 4]), ("fp16", "auto", [4, 0]), ("bf16", "two_per_sm", [0, 2])])
def test_cuda_decode_ragged_batch_one_cta_an_sm(dtype, schedule, features):
    """A ragged batch where the plan keeps the launch to one CTA an SM (Plan::one_cta_per_sm: 16
    rows of 8 kv heads on an H200, two splits a row, so two waves of CTAs dispatched longest
    first), and the same with two CTAs an SM pinned: rows from empty to the capacity, rows with
    fewer splits than the plan, a tie; features without a local window (which would make the rows
    equal), both ops and layouts, head sizes 128 and 64 (where the plan keeps two CTAs an SM),
    against the reference and the CPU backend."""
    batch, hq, hkv, capacity, plan = _equal_rows_shape("one")
    assert plan["one_cta_per_sm"], plan
    _check_ragged_batches((batch, hq, hkv, capacity), 31, schedule, dtype, features)


@pytest.mark.parametrize("schedule", ["auto", "two_per_sm"])
def test_cuda_decode_nearly_equal_rows_one_cta_an_sm(schedule):
    """Rows whose visible keys differ by at most 1/16 of the longest one's, at the shape where the
    launch keeps to one CTA an SM: auto gives them the equal rows' one split (a CTA a row and kv
    head, in row order), "two_per_sm" the plan's two splits. A row exactly at the bound (15/16 of
    the capacity) and one at the capacity; features, both ops and layouts, head sizes 128 and 64
    (where the launch keeps two CTAs an SM, so the rows take the plan's splits), against the
    reference and the CPU backend."""
    batch, hq, hkv, capacity, plan = _equal_rows_shape("one")
    assert plan["one_cta_per_sm"] and capacity % 16 == 0, plan
    rng = random.Random(47)
    with _decode_pinned(schedule=schedule):
        for j, i in enumerate([0, 1, 4, 2]):
            past = [capacity - 1 - rng.randint(0, capacity // 16 - 1) for _ in range(batch)]
            # (one query token: keys = past + 1)
            past[j % batch], past[(j + 5) % batch] = 15 * capacity // 16 - 1, capacity - 1
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(j // 2) % 2], capacity=capacity, past_lengths=past,
                             dtype=torch.bfloat16, layout=j % 2, **FEATURE_CYCLE[i])
            _run_cuda_and_cpu(case)


def _shares_shape():
    """(batch, q heads, kv heads, capacity, plan) of a decode call whose plan takes the balanced
    partition (Plan::shares, a grid of one CTA an SM): 3/32 of the SMs' count in rows of 8 kv
    heads (12 rows, 96 items on an H200: between half the SMs and all of them), 8,256 keys. Two
    query heads a kv head."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, 3 * sms // 32), 16, 8, 8256
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and plan["max_splits"] == 16, plan
    return batch, hq, hkv, capacity, plan


@pytest.mark.parametrize("dtype,features,grid,item_keys", [
    ("bf16", [0, 1, 2, 3, 4, 0], "auto", -1), ("fp16", [4, 0, 2], "auto", -1),
    ("bf16", [1, 0, 2], "auto", 0), ("bf16", [0, 3, 2], "items", 256), ("fp16", [2, 1, 0], "two_per_sm", 128),
    ("bf16", [0, 4, 2], "auto", 5000)])
def test_cuda_decode_shares(dtype, features, grid, item_keys):
    """The balanced partition (Plan::shares), every CTA an equal share of the batch's keys: equal
    rows (each item split over two CTAs, most CTAs serving the ends of two items), a ragged batch
    (items split over up to a few CTAs, several short items in one CTA), and one full row among
    rows of at most 65 keys (its items span many CTAs each, and many short items share one);
    features, both ops and layouts, at head size 128, against the reference and the CPU
    backend. Over the plan's grid and item weight, no weight, one CTA an item, two CTAs an SM,
    and a weight past the short rows' keys (CTAs whose shares hold only the weight of an item,
    and so serve none of its keys)."""
    batch, hq, hkv, capacity, _ = _shares_shape()
    rng = random.Random(61)
    gqa_torch._C._set_decode_shares(grid, item_keys)
    try:
        _run_shares_cases(rng, dtype, features, batch, hq, hkv, capacity)
    finally:
        gqa_torch._C._set_decode_shares("auto", -1)


@pytest.mark.parametrize("dtype,features", [("bf16", [2, 0, 1]), ("fp16", [3, 4, 0])])
def test_cuda_decode_shares_more_items_than_sms(dtype, features):
    """The balanced partition where the items outnumber the SMs (3/2 of them: 24 rows of 8 kv
    heads on an H200), so that every CTA serves more than one item: equal rows, a ragged batch and
    one full row among short ones, features, both ops and layouts, against the reference and the
    CPU backend."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, 3 * sms // 16), 16, 8, 8256
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and batch * hkv > sms, plan
    _run_shares_cases(random.Random(71), dtype, features, batch, hq, hkv, capacity)


@pytest.mark.parametrize("dtype,features", [("bf16", [0, 2, 1]), ("fp16", [4, 3, 0])])
def test_cuda_decode_shares_on_4096_keys(dtype, features):
    """The balanced partition on 4,096-8,191 keys of capacity, where it takes more items than SMs
    and at most 3/2 of them (18 rows of 8 kv heads at 4,160 keys on 132 SMs: 144 items): equal
    rows, a ragged batch and one full row among short ones, features, both ops and layouts,
    against the reference and the CPU backend."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = sms // 8 + 2, 16, 8, 4160
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and sms < batch * hkv and 2 * batch * hkv <= 3 * sms, plan
    _run_shares_cases(random.Random(89), dtype, features, batch, hq, hkv, capacity)


@pytest.mark.parametrize("dtype,hq,features", [("bf16", 64, [0, 1, 2]), ("fp16", 48, [4, 3, 0])])
def test_cuda_decode_shares_wide_groups(dtype, hq, features):
    """The balanced partition with 8 and 6 query heads a kv head (_shares_shape's rows and keys),
    where the CTA that merges an item's splits takes two units of four columns a thread (both
    units at 8 heads; the second for half the threads at 6): equal rows, a ragged batch and one
    full row among short ones, features, both ops and layouts, against the reference and the CPU
    backend."""
    batch, _, hkv, capacity, _ = _shares_shape()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and plan["max_splits"] == 16, plan
    _run_shares_cases(random.Random(83), dtype, features, batch, hq, hkv, capacity)


def _shares_batch_where(hq, hkv, capacity, wanted):
    """The fewest rows (2-128) at which the decode plan for `hq`/`hkv` heads and `capacity` keys
    takes the balanced partition with `wanted(items, sms)` true of its items, rows x kv heads
    (one head chunk a kv head: at most 16 query heads each); fails where none does."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in range(2, 129):
        plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
        if plan["shares"] == sms and wanted(batch * hkv, sms):
            return batch
    pytest.fail(f"no batch of {hq}/{hkv} heads and {capacity} keys takes the partition as wanted on {sms} SMs")


@pytest.mark.parametrize("dtype,features", [("bf16", [1, 2, 0]), ("fp16", [0, 4, 3])])
def test_cuda_decode_shares_fewer_items_than_half_the_sms(dtype, features):
    """The balanced partition where the items number half the SMs or fewer (5 rows of 8 kv heads
    at 16,448 keys on an H200: 40 items, whose equal rows' grid of 6 splits at two CTAs an SM
    would leave 24 of its 264 slots empty), so that every item spans several CTAs and most CTAs
    serve the end of one item and the start of the next: equal rows, a ragged batch and one
    full row among short ones, features, both ops and layouts, against the reference and the
    CPU backend."""
    hq, hkv, capacity = 16, 8, 16448
    batch = _shares_batch_where(hq, hkv, capacity, lambda items, sms: 2 * items <= sms)
    _run_shares_cases(random.Random(79), dtype, features, batch, hq, hkv, capacity)


@pytest.mark.parametrize("dtype,features", [("bf16", [2, 1]), ("fp16", [4, 3])])
def test_cuda_decode_shares_twice_the_sms_items_on_long_caches(dtype, features):
    """The balanced partition past 7/4 of the SMs' count of items, which the plan takes on caches
    of 16,384 keys or more (33 rows of 8 kv heads on an H200: 264 items, two an SM), so that
    every CTA walks several items: a ragged batch and one full row among short ones (whose short
    items crowd many into one CTA's share), features, both ops and layouts, against the reference
    and the CPU backend."""
    hq, hkv, capacity = 8, 8, 16448
    batch = _shares_batch_where(hq, hkv, capacity, lambda items, sms: items >= 2 * sms)
    _run_shares_cases(random.Random(83), dtype, features, batch, hq, hkv, capacity, first=1)


def _run_shares_cases(rng, dtype, features, batch, hq, hkv, capacity, first=0, head_dim=128):
    """test_cuda_decode_shares's cases, one a FEATURE_CYCLE index of `features`: in turn equal
    rows, a ragged batch, and one full row among short ones (from the `first` of those)."""
    for j, i in enumerate(features, start=first):
        if j % 3 == 0:
            past = [capacity - 1] * batch
        elif j % 3 == 1:
            past = _ragged_pasts(rng, batch, capacity)
        else:
            past = [rng.randint(0, 64) for _ in range(batch)]
            past[rng.randrange(batch)] = capacity - 1
        case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                         head_dim=head_dim, capacity=capacity, past_lengths=past, dtype=DTYPES[dtype], layout=j % 2,
                         **FEATURE_CYCLE[i])
        _run_cuda_and_cpu(case)


def _decode_shares_flags(names):
    """Whether each decode kernel among the profiler's kernel names is the balanced partition's
    (decode_mma_kernel's kShares)."""
    return [shares for _, shares, _ in _decode_kernel_bools(names)]


@contextlib.contextmanager
def _shares_forced(item_keys=-1):
    """The balanced partition forced on wherever its kernel is built (set_decode_shares "force",
    with this item weight; -1: 512) inside the block, and auto afterwards whatever happens."""
    gqa_torch._C._set_decode_shares("force", item_keys)
    try:
        yield
    finally:
        gqa_torch._C._set_decode_shares("auto", -1)


def _require_tma_decode():
    """Skips, saying why, where the decode kernel has no TMA loaders (not an sm90 GPU, or a build
    without 9.0a code): the balanced partition's kernel is built on them alone."""
    if torch.cuda.get_device_capability()[0] != 9 or "9.0a" not in gqa_torch.build_info()["cuda_archs"]:
        pytest.skip("the balanced partition's kernel (a TMA loader) needs an sm90 GPU and a 9.0a build")


@pytest.mark.parametrize("dtype,features,rows,item_keys", [
    ("bf16", [0, 1, 2, 3, 4, 0], "shares", -1), ("fp16", [4, 0, 2], "shares", 1024),
    ("bf16", [2, 0, 1], "more", -1), ("fp16", [3, 4, 0], "more", 0), ("bf16", [1, 2, 0], "few", 2048)])
def test_cuda_decode_shares_head_size_64(dtype, features, rows, item_keys):
    """The balanced partition at head size 64 (its kernel on the TMA loader's 32-key slices),
    forced on: _shares_shape's 96 items of 8,256 keys, 3/2 of the SMs' count of items of 4,160
    keys (every CTA serves more than one item) and an eighth of them on 2,112 keys (each item
    spans several CTAs), at item weights from 0 to 2,048 keys; equal rows, a ragged batch and one
    full row among short ones, features, both ops and layouts, against the reference and the
    CPU backend. Then the kernel that ran must be the partition's, on the 32-key slices."""
    _require_tma_decode()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = {"shares": (max(2, 3 * sms // 32), 16, 8, 8256),
                                "more": (max(2, 3 * sms // 16), 32, 8, 4160),
                                "few": (max(2, sms // 64), 64, 8, 2112)}[rows]
    with _shares_forced(item_keys):
        _run_shares_cases(random.Random(97), dtype, features, batch, hq, hkv, capacity, head_dim=64)
        case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=64,
                         capacity=capacity, past_lengths=[capacity - 1] * batch, dtype=DTYPES[dtype])
        names = _cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
    assert _decode_shares_flags(names) == [True] and _decode_loader_codes(names, 64) == [8], names


@pytest.mark.parametrize("bad_row,item_keys", [(0, -1), ("middle", 1024), ("last", -1)])
def test_cuda_decode_shares_head_size_64_bad_row(bad_row, item_keys):
    """The bad-row checks under the balanced partition at head size 64, forced on (fused in
    place; _shares_shape's rows): a ragged batch whose bad row (its length past the capacity) is
    the first, one in the middle or the last. No cache byte changes, every output is NaN, and
    check_errors() raises the capacity flag alone."""
    _require_tma_decode()
    batch, hq, hkv, capacity, _ = _shares_shape()
    past = _ragged_pasts(random.Random(101), batch, capacity)
    row = {0: 0, "middle": batch // 2, "last": batch - 1}[bad_row]
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=64, capacity=capacity,
                     past_lengths=past, strided=True, dtype=torch.bfloat16, device="cuda", poison_unused=False)
    case.seqlens_k[row] = capacity  # total capacity + 1
    with _shares_forced(item_keys):
        _check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


def test_cuda_decode_shares_forced_at_head_size_128():
    """set_decode_shares("force") at head size 128 on a call whose plan keeps the grid of splits
    (16 rows of 8 kv heads on 2,100 keys): the call takes the partition's kernel and matches the
    reference and the CPU backend, on equal rows, a ragged batch and short rows."""
    _require_tma_decode()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, sms // 8), 32, 8, 2100
    assert gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)["shares"] == 0
    with _shares_forced():
        _run_shares_cases(random.Random(103), "bf16", [0, 2, 1], batch, hq, hkv, capacity)
        case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128,
                         capacity=capacity, past_lengths=[capacity - 1] * batch, dtype=torch.bfloat16)
        names = _cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
    assert _decode_shares_flags(names) == [True], names


@pytest.mark.parametrize("dtype,feature,nearly,grid", [
    ("bf16", 0, False, "auto"), ("fp16", 3, False, "auto"), ("bf16", 1, True, "auto"), ("fp16", 2, False, "cut")])
def test_cuda_decode_shares_equal_rows_one_cta_an_item(dtype, feature, nearly, grid):
    """The balanced partition's equal rows whose items fill 7/8 of the grid or more: each CTA
    serves one whole item (no merge), the CTAs past the items idle (shares_walk). Nearly equal
    rows (one a key shorter) take the balanced shares instead, and so do equal rows with the grid
    "cut" pinned (nearly every CTA serves the end of one item and the start of the next, whose
    first tiles it issues before its own merge). 15 rows of 8 kv heads (120 items of 132 SMs on
    an H200), both ops, against the reference and the CPU backend."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, -(-7 * sms // 64)), 16, 8, 8256
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and 8 * batch * hkv >= 7 * sms and batch * hkv <= sms, plan
    past = [capacity - 1] * batch
    if nearly:
        past[batch // 2] -= 1
    gqa_torch._C._set_decode_shares(grid, -1)
    try:
        for op, layout in (("inplace", 0), ("functional", 1)):
            case = make_case(op, batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                             past_lengths=past, dtype=DTYPES[dtype], layout=layout, **FEATURE_CYCLE[feature])
            _run_cuda_and_cpu(case)
    finally:
        gqa_torch._C._set_decode_shares("auto", -1)


@pytest.mark.parametrize("bad_row,grid", [(0, "auto"), ("middle", "auto"), ("last", "cut")])
def test_cuda_decode_shares_bad_row(bad_row, grid):
    """The bad-row checks under the balanced partition (fused in place), where the error word and
    the row checks run in each CTA's first segment only and the CTA that serves row 0's first
    item raises the flags: a ragged batch whose bad row (its length past the capacity) is the
    first, one in the middle (its items no CTA's first segment) or the last. No cache byte changes, every output is NaN,
    and check_errors() raises the capacity flag alone."""
    batch, hq, hkv, capacity, _ = _shares_shape()
    rng = random.Random(67)
    past = _ragged_pasts(rng, batch, capacity)
    row = {0: 0, "middle": batch // 2, "last": batch - 1}[bad_row]
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                     past_lengths=past, strided=True, dtype=torch.bfloat16, device="cuda", poison_unused=False)
    case.seqlens_k[row] = capacity  # total capacity + 1
    gqa_torch._C._set_decode_shares(grid, -1)
    try:
        _check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")
    finally:
        gqa_torch._C._set_decode_shares("auto", -1)


def test_cuda_decode_shares_bad_position_among_short_rows():
    """A bad position (past the RoPE tables) under the balanced partition, fused in place, where
    every row holds at most 9 keys: each CTA's share is then shorter than an item's weight, so
    the first CTA serves nothing (shares_walk) and another must raise the flags. No cache byte
    changes, every output is NaN, and check_errors() raises the position flag alone."""
    batch, hq, hkv, capacity, _ = _shares_shape()
    rng = random.Random(73)
    past = [rng.randint(0, 8) for _ in range(batch)]
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                     past_lengths=past, strided=True, rotary="half", position_ids="offset", max_positions=32,
                     dtype=torch.bfloat16, device="cuda", poison_unused=False)
    case.position_ids[batch // 2, 0] = 32
    _check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN", gerr.POSITION)


def _two_waves_shape():
    """(batch, q heads, kv heads, capacity, plan) of a decode call whose plan runs a ragged batch
    in two waves (Plan::ragged_two_waves): SMs / 16 rows of 8 kv heads (8 on an H200), whose 4
    splits a row fill two CTAs an SM once, and 8 for a ragged batch. Two query heads a kv head, as
    _equal_rows_shape."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, sms // 16), 16, 8, 8256
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["ragged_two_waves"] and plan["max_splits"] == 2 * plan["equal_rows_splits"], plan
    assert plan["near_equal_sixteenths"] == 8 and capacity % 2 == 0, plan
    return batch, hq, hkv, capacity, plan


@pytest.mark.parametrize("dtype,schedule,features", [
    ("bf16", "auto", [0, 1, 2, 4]), ("fp16", "auto", [4, 0]), ("bf16", "one_wave", [0, 2])])
def test_cuda_decode_ragged_batch_two_waves(dtype, schedule, features):
    """A ragged batch where the plan doubles the splits of its one wave (Plan::ragged_two_waves),
    and the same with one wave pinned: rows from empty to the capacity, rows with fewer splits
    than the plan, a tie; features without a local window (which would make the rows equal), both
    ops and layouts, head sizes 128 and 64 (where the plan keeps one wave), against the reference
    and the CPU backend."""
    batch, hq, hkv, capacity, _ = _two_waves_shape()
    _check_ragged_batches((batch, hq, hkv, capacity), 53, schedule, dtype, features)


@pytest.mark.parametrize("schedule", ["auto", "one_wave"])
def test_cuda_decode_nearly_equal_rows_two_waves(schedule):
    """Rows whose shortest sees half the longest one's keys, at the shape where a ragged batch
    takes two waves: auto gives them the equal rows' one wave (their 4 splits a row, in row order),
    and the same batch with that row one key shorter two waves; "one_wave" the plan's one wave for
    both. A row exactly at the bound and one at the capacity; features, both ops and layouts,
    head sizes 128 and 64 (where the plan keeps one wave), against the reference and the CPU
    backend."""
    batch, hq, hkv, capacity, _ = _two_waves_shape()
    rng = random.Random(59)
    with _decode_pinned(schedule=schedule):
        for j, i in enumerate([0, 1, 4, 2]):
            past = [rng.randint(capacity // 2, capacity - 1) for _ in range(batch)]
            # (one query token: keys = past + 1; the first two cases at the bound, the next two below it)
            past[j % batch], past[(j + 1) % batch] = capacity // 2 - 1 - (j // 2), capacity - 1
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][j % 2], capacity=capacity, past_lengths=past,
                             dtype=torch.bfloat16, layout=j % 2, **FEATURE_CYCLE[i])
            _run_cuda_and_cpu(case)


@pytest.mark.parametrize("kind", ["one", "two_waves", "tail"])
def test_cuda_graph_decode_replays_between_equal_and_unequal_rows(kind):
    """One captured in-place decode step (RoPE) replayed while its batch turns from equal rows to
    unequal ones and back: at the shape "one", one split for equal rows and two for the others,
    merged by the last to arrive; at "two_waves", one wave of splits for equal and nearly equal
    rows (lengths from half the capacity) and two for rows from empty; at "tail" (_tail_shape
    "two"), two splits for the last wave of equal rows and one split a row otherwise. Every replay
    matches the reference, output and caches, so the arrival counters are zero again whichever
    count the replay before took."""
    shapes = {"one": lambda: _equal_rows_shape("one"), "two_waves": _two_waves_shape, "tail": lambda: _tail_shape("two")}
    batch, hq, hkv, capacity, _ = shapes[kind]()
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                     past_lengths=[capacity // 2] * batch, rotary="half", max_positions=capacity + 5, dtype=torch.bfloat16,
                     device="cuda", poison_unused=False)
    static = case.clone()
    graph, static_out = _capture(lambda: _inplace_step(static), warmups=2)
    rng = random.Random(11)
    for lengths in ("equal", "from_half", "equal", "from_empty", "from_half", "from_empty", "equal"):
        if lengths == "equal":
            pasts = [capacity - 1 - rng.randint(0, 50)] * batch
        else:
            low = capacity // 2 if lengths == "from_half" else 0
            pasts = [rng.randint(low, capacity - 1) for _ in range(batch)]
        _replay_with_fresh_inputs_and_check(graph, static, static_out, pasts)


def _cuda_kernel_names(call):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _cuda_kernel_names_or_skip(call):
    """_cuda_kernel_names(call), or a skip where the profiler records none: under
    compute-sanitizer, which keeps CUPTI from starting (the tests of which kernel ran are kept
    apart from those of what it computed, so that the sanitizers run the latter whole)."""
    names = _cuda_kernel_names(call)
    if not names:
        pytest.skip("torch.profiler recorded no CUDA kernels here (CUPTI unavailable)")
    return names


@contextlib.contextmanager
def _decode_pinned(merge="auto", max_splits=0, min_split_keys=0, schedule="auto"):
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
def _switch_pinned(switch, value):
    """One of the decode kernel's named switches (`gqa_torch._C._set_decode_*`) set to `value`
    inside the block, and given back to "auto" afterwards whatever happens."""
    switch(value)
    try:
        yield
    finally:
        switch("auto")


def _assert_each_matches_reference(outs, cases, befores):
    """Each in-place decode output, and its case's caches, against the float64 reference of the
    case's state before the call."""
    for out, case, before in zip(outs, cases, befores):
        ref_out, ref_k, ref_v = before.reference()
        assert_output_close(out, ref_out, before, suite="cuda")
        check_caches(before, case.cache_key, case.cache_value, ref_k, ref_v, rotary_ulps=ROTARY_ULPS)


@pytest.mark.parametrize("batch,head_dim,merge,splits", [
    (8, 128, "kernel", 2), (8, 128, "auto", 2), (1, 128, "auto", 16), (1, 64, "auto", 16), (1, 256, "auto", 16),
    (8, 96, "auto", 2), (1, 128, "auto", 17), (1, 128, "arrival", 16), (1, 64, "arrival", 16),
    (8, 128, "arrival", 2), (1, 256, "arrival", 16), (1, 128, "arrival", 17), (1, 128, "kernel", 16),
    (1, 256, "kernel", 16)])
def test_cuda_decode_merge_switch_picks_the_kernels(batch, head_dim, merge, splits):
    """32/8 heads, B = 8 in 2 splits and B = 1 in 16 (the H200 plan's counts) or 17, pinned.
    "kernel" runs the merge kernel after the decode kernel; "arrival" merges in the launch, by
    the last split to finish, at every head size and split count; "auto" does so up to 16
    splits, and beyond runs the merge kernel."""
    case = make_case("inplace", batch=batch, seq=1, num_heads=32, kv_num_heads=8, head_dim=head_dim, capacity=2048,
                     past_lengths=[2000] * batch, dtype=torch.bfloat16, device="cuda")
    in_launch = merge == "arrival" or (merge == "auto" and splits <= 16)
    with _decode_pinned(merge, splits):
        names = _cuda_kernel_names_or_skip(lambda: case.clone().run())
    assert any("decode_mma_kernel" in n for n in names), names
    assert any("merge_kernel" in n for n in names) == (not in_launch), names


@pytest.mark.parametrize("merge,max_splits,schedule", [("auto", 0, "auto"), ("arrival", 0, "auto"),
                                                       ("arrival", 5, "auto"), ("arrival", 5, "longest_first"),
                                                       ("kernel", 3, "longest_first")])
def test_cuda_graph_decode_replay_50_steps(merge, max_splits, schedule):
    """A decode step captured once and replayed 50 times while seqlens_k, position_ids and the
    inputs change: every replay is checked against the reference (output and caches). With the
    plan's splits (2 here; auto merges them in the launch, by the last to finish) and with the
    splits merged by the last one to finish, in 2 and in up to 5 splits (the captured arrival
    counters must be zero again after every replay); and with the rows taken longest first,
    which the captured kernel ranks anew from each replay's lengths."""
    with _decode_pinned(merge, max_splits, 1 if max_splits else 0, schedule):
        _graph_decode_replay_50_steps()


@pytest.mark.parametrize("merge,schedule", [("auto", "auto"), ("arrival", "auto"), ("arrival", "longest_first")])
def test_cuda_decode_on_two_streams_at_once(merge, schedule):
    """Decode calls in flight on two streams at once, each in 16 splits merged in the launch by
    the last split to finish: every output and cache matches the reference. Each stream has its
    own arrival counters; shared ones would let a split of one call count as another call's
    last and merge partials not yet written."""
    cases = [make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=1500,
                       past_lengths=[1400 - 37 * i, 700 + 53 * i], dtype=torch.bfloat16, device="cuda")
             for i in range(12)]
    befores = [c.clone() for c in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    with _decode_pinned(merge, 16, 1, schedule):
        outs = []
        for i, case in enumerate(cases):
            with torch.cuda.stream(streams[i % 2]):
                outs.append(case.run())
        torch.cuda.synchronize()
    gqa_torch.check_errors()
    _assert_each_matches_reference(outs, cases, befores)


def test_cuda_decode_graph_beside_eager_calls_on_its_capture_stream():
    """A decode graph captured on stream s1 (16 splits merged by the last to finish) is replayed
    on stream s2 while eager calls run on s1: the capture took arrival counters of its own, not
    s1's, so neither side counts the other's splits, and every output and cache matches the
    reference. (Each replay appends the same row and reads the same keys, so five replays leave
    what one leaves.)"""
    with _decode_pinned("arrival", 16, 1):
        def decode_case(i):
            return make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=1500,
                             past_lengths=[1400 - 41 * i, 700 + 29 * i], dtype=torch.bfloat16, device="cuda",
                             poison_unused=False)

        static = decode_case(0)
        start_k, start_v = static.cache_key.clone(), static.cache_value.clone()

        def step():
            return gqa_torch.group_query_attention_(*static.op_args(), **static.attrs)

        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s1):
            graph_out = step()
        static.cache_key.copy_(start_k)
        static.cache_value.copy_(start_v)
        before_graph = static.clone()
        eager = [decode_case(i) for i in range(1, 11)]
        befores = [c.clone() for c in eager]
        torch.cuda.synchronize()
        outs = []
        for i, case in enumerate(eager):
            if i % 2 == 0:
                with torch.cuda.stream(s2):
                    graph.replay()
            with torch.cuda.stream(s1):
                outs.append(case.run())
        torch.cuda.synchronize()
    gqa_torch.check_errors()
    ref_out, ref_k, ref_v = before_graph.reference()
    assert_output_close(graph_out, ref_out, before_graph, suite="cuda_graph")
    check_caches(before_graph, static.cache_key, static.cache_value, ref_k, ref_v, rotary_ulps=ROTARY_ULPS)
    _assert_each_matches_reference(outs, eager, befores)


def _under_compute_sanitizer():
    """True when compute-sanitizer runs this process: it sets NV_SANITIZER_INJECTION_* variables
    for the library it injects (seen with compute-sanitizer 13.0 on the H200)."""
    return any(k.startswith("NV_SANITIZER_INJECTION") for k in os.environ)


def _settled_lanes_held(timeout_s=10.0):
    """The lanes of arrival counters held on this device, once the count has stopped changing
    (a destroyed graph's lane comes back from a CUDA thread, some time after the graph goes), or
    the last count seen after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last, steady = None, 0
    while True:
        gc.collect()
        torch.cuda.synchronize()
        held = gqa_torch._C._arrival_lanes_held(torch.cuda.current_device())
        steady = steady + 1 if held == last else 0
        last = held
        if steady >= 5 or time.monotonic() > deadline:
            return held
        time.sleep(0.02)


def test_cuda_graph_lanes_come_back_with_their_graphs():
    """Each CUDA graph that captures a decode call holds a lane of arrival counters of its own
    (graphs replayed on two streams at once must not share counters), and destroying the graph
    gives the lane back. Five live graphs hold five more lanes and give all five back. Then 300
    captures in turn, each destroyed before the next (there are 256 lanes), leave the count
    where it started, and every 50th replay matches the reference. (Each capture used to keep its
    lane for good: past the 256th, decode calls merged their splits in the slower merge kernel.)
    The captures take no warm-up on side streams, whose eager calls would hold lanes of their
    own."""
    with _decode_pinned("arrival", 16, 1):
        static = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=600,
                           past_lengths=[500, 300], dtype=torch.bfloat16, device="cuda", poison_unused=False)
        _inplace_step(static)  # (the error word and this stream's lane exist before the count)
        start = _settled_lanes_held()
        graphs = []
        for _ in range(5):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _inplace_step(static)
            graphs.append(graph)
        assert _settled_lanes_held() == start + 5
        del graphs, graph
        held = _settled_lanes_held()
        if held != start and _under_compute_sanitizer():
            pytest.skip(f"under compute-sanitizer the destroyed graphs' user objects were not released "
                        f"({held - start} of 5 lanes still held): the lanes cannot come back here")
        assert held == start
        for i in range(300):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _inplace_step(static)
            if i % 50 == 49:
                _replay_with_fresh_inputs_and_check(graph, static, out, [100 + i, 17 + i])
            else:
                graph.replay()
            del graph, out
        assert _settled_lanes_held() == start


def _lane_warnings(capture, capfd):
    """The "every lane is held" warnings given while `capture()` runs. A TORCH_WARN in a custom
    op reaches C++'s warning handler, which writes it to stderr (seen with torch 2.11), not
    Python's warnings; both are read."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = capture()
    said = [str(w.message) for w in caught] + capfd.readouterr().err.splitlines()
    return result, [text for text in said if "lanes of decode arrival counters" in text]


def test_cuda_decode_with_every_lane_held_warns_and_merges_in_the_kernel(capfd):
    """With all 256 lanes of arrival counters held (live graphs that each captured a decode
    call), a capture that needs a lane of its own finds none: it warns, naming the lanes and how
    to give them back, and its decode call merges the splits in the merge kernel, whose replay
    matches the reference. A second such capture does not warn again; once a graph is destroyed
    its lane serves the next capture, and the one after it, finding every lane held again, warns
    again. Destroying the graphs gives every lane back, and the next capture takes one again and
    matches too."""
    device = torch.cuda.current_device()

    def capture(pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = _inplace_step(static)
        return graph, out

    with _decode_pinned("arrival", 16, 1):
        static = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=600,
                           past_lengths=[500, 300], dtype=torch.bfloat16, device="cuda", poison_unused=False)
        _inplace_step(static)  # (the error word and this stream's lane exist before the count)
        start = _settled_lanes_held()
        assert start < 256
        graphs, pool = [], None
        while gqa_torch._C._arrival_lanes_held(device) < 256 and len(graphs) < 300:
            graphs.append(capture(pool)[0])
            pool = graphs[-1].pool()
        assert _settled_lanes_held() == 256

        (laneless, laneless_out), said = _lane_warnings(lambda: capture(pool), capfd)
        assert len(said) == 1, said
        assert "all 256 lanes" in said[0] and "Destroying CUDA graphs" in said[0], said
        assert _settled_lanes_held() == 256
        _replay_with_fresh_inputs_and_check(laneless, static, laneless_out, [431, 250])
        (second, second_out), said = _lane_warnings(lambda: capture(pool), capfd)
        assert said == []
        _replay_with_fresh_inputs_and_check(second, static, second_out, [98, 577])

        del graphs[0]
        held = _settled_lanes_held()
        if held == 256 and _under_compute_sanitizer():
            pytest.skip("under compute-sanitizer a destroyed graph's user object was not released: its lane "
                        "cannot come back here")
        assert held == 255
        (taker, _), said = _lane_warnings(lambda: capture(pool), capfd)
        assert said == [] and _settled_lanes_held() == 256
        (third, _), said = _lane_warnings(lambda: capture(pool), capfd)
        assert len(said) == 1, said

        del graphs, laneless, laneless_out, second, second_out, taker, third
        assert _settled_lanes_held() == start
        graph, out = capture(None)
        assert _settled_lanes_held() == start + 1
        _replay_with_fresh_inputs_and_check(graph, static, out, [377, 512])


def _inplace_step(static):
    """The in-place op on a case's tensors, for capture: each replay reads and writes them."""
    return gqa_torch.group_query_attention_(*static.op_args(), **static.attrs)


def _replay_with_fresh_inputs_and_check(graph, static, static_out, pasts):
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


def _graph_decode_replay_50_steps():
    B, Hq, Hkv, D, C = 3, 8, 2, 64, 96
    rng = random.Random(5)
    case = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                     past_lengths=[5, 10, 20], rotary="half", position_ids="random", max_positions=200, sink=True,
                     window=40, device="cuda", poison_unused=False)
    static = case.clone()
    start_k, start_v = static.cache_key.clone(), static.cache_value.clone()

    graph, static_out = _capture(lambda: _inplace_step(static), warmups=2)
    static.cache_key.copy_(start_k)
    static.cache_value.copy_(start_v)
    torch.cuda.synchronize()

    for _ in range(50):
        static.position_ids.copy_(torch.randint(0, 200, (B, 1), dtype=torch.int64))
        _replay_with_fresh_inputs_and_check(graph, static, static_out, [rng.randint(0, C - 1) for _ in range(B)])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_cuda_decode_bad_row_on_tensor_cores(dtype, head_dim, decode_loader, decode_merge):
    """A bad row among valid ones on the tensor-core decode kernel (fused in place), with each
    loader and each merge: no cache byte changes (guard regions included), every output is NaN
    (a bad row anywhere poisons the fused call), a later valid call is NaN too while the word is
    set, and check_errors() raises the capacity flag. Every row takes 2 splits (pinned): the
    merge's error path, where the last split to arrive (or the merge kernel) writes NaN."""
    gqa_torch._C._set_decode_split_override(2, 0)
    try:
        _check_bad_row_on_tensor_cores(dtype, head_dim)
    finally:
        gqa_torch._C._set_decode_split_override(0, 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_decode_bad_row_with_rows_longest_first(head_dim):
    """The bad-row checks with the rows taken longest first (the bad row's length, past the
    capacity, is clamped to it for the ranking, so it ranks first), in 3 splits merged by the
    last to finish."""
    with _decode_pinned("arrival", 3, 0, "longest_first"):
        _check_bad_row_on_tensor_cores("bf16", head_dim)


def _check_bad_row_on_tensor_cores(dtype, head_dim):
    case = make_case("inplace", batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=2048,
                     past_lengths=[1900, 3, 700], strided=True, dtype=DTYPES[dtype], device="cuda",
                     poison_unused=False)
    case.seqlens_k[1] = 2048  # total 2049 > capacity
    before = case.clone()
    out = case.run()
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "every row of a fused call with a bad row must be NaN"
    _assert_untouched_except_valid_rows(before, case, written_rows=[])
    valid = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=2048,
                      past_lengths=[1900, 700], strided=True, dtype=DTYPES[dtype], device="cuda")
    poisoned = valid.clone()
    assert torch.isnan(poisoned.run()).all(), "the set word poisons later calls until it is cleared"
    torch.cuda.synchronize()
    _assert_untouched_except_valid_rows(valid, poisoned, written_rows=[])  # nor do they append
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == gerr.CAPACITY
    run_and_check(valid, rotary_ulps=ROTARY_ULPS, suite="cuda")  # cleared: the next call is right


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("early", ["off", "auto"])
def test_cuda_decode_early_tiles_switch(head_dim, early):
    """The decode kernel's first K/V tiles issued after the error word and the row checks
    ("off") or before them ("auto"): ragged rows in place and functional with three
    feature sets, then the bad-row checks, where a valid row's CTAs have copies in flight when
    the checks fail and must wait for them before they leave."""
    with _switch_pinned(gqa_torch._C._set_decode_early_tiles, early):
        _check_ragged_rows_three_features(head_dim)
        _check_bad_row_on_tensor_cores("bf16", head_dim)


def _check_ragged_rows_three_features(head_dim):
    """Three ragged decode calls (rows of 1,099, 5 and 300 past keys), in place and
    functional, in both cache layouts, with the first three feature sets, against the
    reference and the CPU backend."""
    for i, feat in enumerate(FEATURE_CYCLE[:3]):
        case = make_case(["inplace", "functional"][i % 2], batch=3, seq=1, num_heads=8, kv_num_heads=2,
                         head_dim=head_dim, capacity=1100, past_lengths=[1099, 5, 300], dtype=torch.bfloat16,
                         layout=i % 2, **feat)
        _run_cuda_and_cpu(case)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_cuda_decode_l2_prefetch_switch(head_dim, prefetch):
    """The decode kernel's L2 prefetch before the PDL wait (its split's first keys and its
    query rows), off or on (auto's small calls): ragged rows in place and functional, in
    both cache layouts (one request for contiguous keys, one a row otherwise), with three
    feature sets; then a captured two-call sequence in which the second call reads the row the
    first appended (lines the second may have asked for before the first wrote them); then the
    bad-row checks."""
    with _switch_pinned(gqa_torch._C._set_decode_l2_prefetch, prefetch):
        _check_ragged_rows_three_features(head_dim)
        _check_append_then_read_in_one_graph(head_dim)
        _check_bad_row_on_tensor_cores("bf16", head_dim)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("fetch", ["sectors", "128B", "256B"])
def test_cuda_decode_l2_fetch_switch(head_dim, fetch, decode_loader):
    """How much L2 fetches around each of the decode kernel's TMA copies (the maps' promotion),
    pinned, under each loader (cp.async and regs_k's K loads always ask for 128 bytes, so the
    switch moves nothing under cp.async and only the V maps under regs_k): ragged rows in place
    and functional, in both cache layouts, with three feature sets, then the bad-row checks."""
    with _switch_pinned(gqa_torch._C._set_decode_l2_fetch, fetch):
        _check_ragged_rows_three_features(head_dim)
        _check_bad_row_on_tensor_cores("bf16", head_dim)


def _check_append_then_read_in_one_graph(head_dim):
    """Two in-place decode steps captured back to back in one CUDA graph (the second launched
    under the first's tail): the second step's keys include the one the first appended."""
    torch.manual_seed(head_dim)
    b, hq, hkv, cap = 2, 8, 2, 700
    kc = torch.randn(b, hkv, cap, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = [torch.randn(b, 1, hq * head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    nk = [torch.randn(b, 1, hkv * head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    nv = [torch.randn(b, 1, hkv * head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    lens = [torch.tensor([650, 64], device="cuda", dtype=torch.int32), None]
    lens[1] = lens[0] + 1
    kc0, vc0 = kc.clone(), vc.clone()
    outs = [None, None]

    def steps():
        for s in range(2):
            outs[s] = gqa_torch.group_query_attention_(q[s], nk[s], nv[s], kc, vc, lens[s], num_heads=hq,
                                                       kv_num_heads=hkv)

    steps()  # warm-up outside the capture
    kc.copy_(kc0)
    vc.copy_(vc0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    kc.copy_(kc0)
    vc.copy_(vc0)
    for out in outs:  # the graph's outputs, poisoned: an element the replay does not write shows
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    gqa_torch.check_errors()
    expected_k, expected_v = kc0.clone(), vc0.clone()
    for s in range(2):
        ref = torch.empty(b, 1, hq * head_dim, dtype=torch.float64)
        for r in range(b):
            pos = int(lens[s][r])  # the row's new key goes here; the step sees keys [0, pos]
            expected_k[r, :, pos] = nk[s][r, 0].view(hkv, head_dim)
            expected_v[r, :, pos] = nv[s][r, 0].view(hkv, head_dim)
            keys, values = expected_k[r, :, :pos + 1].double(), expected_v[r, :, :pos + 1].double()
            qd = q[s][r, 0].view(hkv, hq // hkv, head_dim).double()
            scores = torch.einsum("hgd,hkd->hgk", qd, keys) / head_dim ** 0.5
            ref[r, 0] = torch.einsum("hgk,hkd->hgd", scores.softmax(-1), values).reshape(-1).cpu()
        assert_output_close(outs[s], ref, suite="cuda")  # (the float64 reference, per batch row)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v), "the caches hold both steps' appends"


def test_cuda_graph_replay_with_bad_row_sets_flags():
    """A bad seqlens_k during a replay sets the word; check_errors() after the replay raises
    with the flags, and the bad row's output is NaN."""
    case = make_case("inplace", batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=64, capacity=32,
                     past_lengths=[3, 4], device="cuda", poison_unused=False)

    def check_errors_refused():
        with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
            gqa_torch.check_errors()

    graph, out = _capture(case.run, during_capture=check_errors_refused)
    case.seqlens_k.copy_(torch.tensor([5, 40], dtype=torch.int32, device="cuda"))  # row 1: total 41 > 32
    k_before = case.cache_key.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    assert bits_equal(case.cache_key[1], k_before[1])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == gerr.CAPACITY
    gqa_torch.check_errors()  # cleared


def _captured_decode_loop(case, steps, poison_at=None, bad_row=1, resume_after=2):
    """Runs a decode loop of `steps` graph replays of one captured in-place call (fresh copies of
    the case's caches, the same per-step inputs from a fixed seed). With `poison_at`, that step's
    seqlens_k of `bad_row` is past the capacity; `resume_after` more steps then run while the
    word is still set, the word is checked (its GQAError returned) and cleared, and the loop
    repeats the poisoned step and goes on with valid inputs. Returns per executed step the
    output and both caches (clones), and the GQAError (or None)."""
    static = case.clone()
    C = static.cache_key.shape[2]
    gen = torch.Generator().manual_seed(11)
    inputs = [tuple(torch.randn(t.shape, generator=gen).to(t.dtype) for t in (static.query, static.key, static.value))
              for _ in range(steps)]
    pasts = static.seqlens_k.cpu()  # the case's past lengths (S = 1: seqlens_k = past)

    def load(t, poisoned=False):
        for dst, src in zip((static.query, static.key, static.value), inputs[t]):
            dst.copy_(src)
        seq = pasts + t  # one new token per step: total = past + t + 1
        if poisoned:
            seq[bad_row] = C + 5
        static.seqlens_k.copy_(seq)

    def call():
        return gqa_torch.group_query_attention_(static.query, static.key, static.value, static.cache_key,
                                                static.cache_value, static.seqlens_k, **static.attrs)

    load(0)  # the warm-up call writes exactly what step 0 writes
    graph, out = _capture(call)

    record, error = [], None

    def replay(t, poisoned=False):
        load(t, poisoned)
        graph.replay()
        torch.cuda.synchronize()
        record.append((t, out.clone(), static.cache_key.clone(), static.cache_value.clone()))

    t = 0
    while t < steps:
        if t == poison_at and error is None:
            replay(t, poisoned=True)
            for later in range(t + 1, min(steps, t + 1 + resume_after)):
                replay(later)  # valid inputs, but the word is still set
            with pytest.raises(gqa_torch.GQAError) as info:
                gqa_torch.check_errors()
            error = info.value
            gqa_torch.check_errors()  # raising cleared it
            continue  # the poisoned step again, now valid
        replay(t)
        gqa_torch.check_errors()
        t += 1
    return record, error


def test_poisoned_step_in_a_captured_decode_loop():
    """SPEC §4 under CUDA graphs: one replay of a captured decode loop gets an out-of-range
    seqlens_k for one row. That replay and the later ones (valid inputs) write nothing and
    output NaN, because the word is sticky; the flags decode to the capacity message; up to
    the poisoned step every output and cache byte equals a clean run's; after the word is
    cleared, the loop repeats the poisoned step and every later step equals the clean run."""
    case = make_case("inplace", batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=64, capacity=40,
                     past_lengths=[4, 9, 17], device="cuda", poison_unused=False)
    steps, poison_at, resume_after = 10, 4, 2
    clean, no_error = _captured_decode_loop(case, steps)
    assert no_error is None and [t for t, *_ in clean] == list(range(steps))
    poisoned, error = _captured_decode_loop(case, steps, poison_at=poison_at, resume_after=resume_after)

    assert error.flags == gerr.CAPACITY, error.flags
    assert gerr.FLAG_MESSAGES[4] in str(error), str(error)  # bit 4 is flag 16
    order = [t for t, *_ in poisoned]
    assert order == list(range(poison_at + 1 + resume_after)) + list(range(poison_at, steps)), order

    clean_by_step = {t: rest for t, *rest in clean}
    for t, out, k, v in poisoned[:poison_at]:  # before the poisoned step: identical to the clean run
        c_out, c_k, c_v = clean_by_step[t]
        assert bits_equal(out, c_out) and bits_equal(k, c_k) and bits_equal(v, c_v), f"step {t}"
    _, k_before, v_before = clean_by_step[poison_at - 1]
    for t, out, k, v in poisoned[poison_at:poison_at + 1 + resume_after]:  # poisoned step and the skipped ones
        assert torch.isnan(out).all(), f"step {t}: outputs must be NaN while the word is set"
        assert bits_equal(k, k_before) and bits_equal(v, v_before), f"step {t}: a cache was written"
    for t, out, k, v in poisoned[poison_at + 1 + resume_after:]:  # after clear: the loop runs on correctly
        c_out, c_k, c_v = clean_by_step[t]
        assert torch.isfinite(out).all(), f"step {t} after clear"
        assert bits_equal(out, c_out) and bits_equal(k, c_k) and bits_equal(v, c_v), f"step {t} after clear"


# ---- torch.compile(mode="reduce-overhead") -------------------------------------------------------

class _Decoder(torch.nn.Module):
    def __init__(self, layers, batch, capacity, hq, hkv, d):
        super().__init__()
        self.hq, self.hkv = hq, hkv
        self.proj = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(hq * d, (hq + 2 * hkv) * d) / d ** 0.5) for _ in range(layers)])
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.randn(batch, hkv, capacity, d))
            self.register_buffer(f"v{i}", torch.randn(batch, hkv, capacity, d))
        self.layers = layers

    def mark_caches_static(self):
        # The caches are mutated in place; as static addresses CUDA graphs may capture that.
        for i in range(self.layers):
            torch._dynamo.mark_static_address(getattr(self, f"k{i}"))
            torch._dynamo.mark_static_address(getattr(self, f"v{i}"))

    def forward(self, x, seqlens_k, cos, sin):
        for i in range(self.layers):
            qkv = x @ self.proj[i]
            out = gqa_torch.group_query_attention_(qkv, None, None, getattr(self, f"k{i}"), getattr(self, f"v{i}"),
                                                   seqlens_k, cos, sin, num_heads=self.hq, kv_num_heads=self.hkv,
                                                   do_rotary=True)
            x = x + out
        return x


@torch.no_grad()
def test_compile_reduce_overhead_multilayer_decode():
    """torch.compile(mode="reduce-overhead", fullgraph=True) over a 4-layer decode step, run for
    12 steps with growing ragged seqlens: equal to eager at every step, caches too, and
    inductor captured it in CUDA graphs (no cudagraph skip)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    B, C, Hq, Hkv, D = 2, 64, 8, 2, 64
    eager = _Decoder(4, B, C, Hq, Hkv, D).cuda()
    compiled_model = copy.deepcopy(eager)
    compiled_model.mark_caches_static()
    compiled = torch.compile(compiled_model, mode="reduce-overhead", fullgraph=True)
    angle = torch.rand(128, D // 2, device="cuda") * 6.28
    cos, sin = angle.cos(), angle.sin()
    seqlens = torch.tensor([3, 17], dtype=torch.int32, device="cuda")
    skips_before = counters["inductor"].get("cudagraph_skips", 0)
    x = torch.randn(B, 1, Hq * D, device="cuda")
    for step in range(12):
        torch.compiler.cudagraph_mark_step_begin()
        y_c = compiled(x, seqlens, cos, sin).clone()
        y_e = eager(x, seqlens, cos, sin)
        torch.testing.assert_close(y_c, y_e, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        for i in range(4):
            torch.testing.assert_close(getattr(compiled_model, f"k{i}"), getattr(eager, f"k{i}"), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(getattr(compiled_model, f"v{i}"), getattr(eager, f"v{i}"), rtol=1e-4, atol=1e-4)
        x = y_e / y_e.norm(dim=-1, keepdim=True) * 8
        seqlens = seqlens + 1
    assert counters["inductor"].get("cudagraph_skips", 0) == skips_before, "inductor skipped CUDA graphs"
    gqa_torch.check_errors()


# ---- the error word -----------------------------------------------------------------------------------

def _bad_inplace_case(bad: str, strided=True, rotary=False):
    """B = 3, row 1 broken by `bad`; caches are views into guarded, poisoned buffers."""
    case = make_case("inplace", batch=3, seq=2, num_heads=4, kv_num_heads=2, head_dim=64, capacity=16,
                     past_lengths=[3, 5, 7], strided=strided, rotary="half" if rotary or bad == "position" else None,
                     position_ids="offset" if bad == "position" else None, max_positions=32, device="cuda",
                     poison_unused=False)
    expected = {
        "overflow": (2**31 - 1, gerr.TOTAL_OVERFLOW | gerr.CAPACITY),
        "negative": (0, gerr.PAST_NEGATIVE | gerr.QUERY_NEGATIVE),
        "capacity": (16, gerr.CAPACITY),
        "position": (None, gerr.POSITION),
    }[bad]
    if bad == "position":
        case.position_ids[1, 1] = 32
    else:
        case.seqlens_k[1] = expected[0]
    return case, expected[1]


def _assert_untouched_except_valid_rows(case_before, case_after, written_rows):
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


@pytest.mark.parametrize("bad", ["overflow", "negative", "capacity", "position"])
def test_error_word_inplace_deferred(bad):
    """In-place, asynchronous default: no exception at the call; the violating row writes
    nothing (guard regions and rows outside the targets byte-identical) and its output is NaN;
    check_errors() raises GQAError with the flags and clears them."""
    case, flags = _bad_inplace_case(bad)
    before = case.clone()
    out = case.run()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all(), "the violating row's output must be NaN"
    _assert_untouched_except_valid_rows(before, case, written_rows=[0, 2])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags, f"flags {info.value.flags} != {flags}"
    assert info.value.violations == gerr.decode_flags(flags)
    gqa_torch.check_errors()  # cleared: no second raise
    assert int(gqa_torch._C.error_word(torch.cuda.current_device()).item()) == 0


def test_error_word_is_sticky_until_cleared():
    """After a flagged call, later valid calls skip their writes and output NaN, until
    check_errors() raises and clears; then calls work again and match the reference."""
    case, flags = _bad_inplace_case("capacity")
    case.run()
    good = make_case("inplace", batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=64, capacity=16,
                     past_lengths=[1, 2], strided=True, device="cuda", poison_unused=False)
    for _ in range(3):
        before = good.clone()
        out = good.run()
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "calls after a flagged one must be poisoned (NaN)"
        _assert_untouched_except_valid_rows(before, good, written_rows=[])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags
    run_and_check(good, rotary_ulps=ROTARY_ULPS, suite="cuda")
    gqa_torch.check_errors()


@pytest.mark.parametrize("bad,flags", [("past_capacity", gerr.PAST_CAPACITY), ("negative", 6), ("capacity", 16),
                                       ("position", 32)])
def test_error_word_functional_raises_synchronously(bad, flags):
    """The functional op checks the word after its launch, raises GQAError and clears it."""
    case = make_case("functional", batch=2, seq=2, num_heads=4, kv_num_heads=2, head_dim=64, capacity=6,
                     past_lengths=[2, 4], rotary="half", position_ids="offset", max_positions=16, device="cuda",
                     poison_unused=False)
    if bad == "past_capacity":
        case.total_sequence_length = 12
        case.seqlens_k[1] = 10  # past 9 > 6, total 11 <= 12
    elif bad == "negative":
        case.seqlens_k[0] = 0
    elif bad == "capacity":
        case.seqlens_k[0] = 6  # total 7 > C = 6, past 5 <= 6
    else:
        case.position_ids[0, 0] = -3
    with pytest.raises(gqa_torch.GQAError) as info:
        case.run()
    assert info.value.flags == flags
    assert "wrote nothing" in str(info.value)
    gqa_torch.check_errors()  # already cleared


def test_synchronous_errors_switch_makes_inplace_raise():
    case, flags = _bad_inplace_case("negative")
    gqa_torch.set_synchronous_errors(True)
    assert gqa_torch.synchronous_errors()
    before = case.clone()
    with pytest.raises(gqa_torch.GQAError) as info:
        case.run()
    assert info.value.flags == flags
    _assert_untouched_except_valid_rows(before, case, written_rows=[0, 2])
    gqa_torch.check_errors()  # the raising call cleared it
    gqa_torch.set_synchronous_errors(False)
    case, flags = _bad_inplace_case("negative")
    case.run()  # deferred again
    with pytest.raises(gqa_torch.GQAError):
        gqa_torch.check_errors()


def test_check_errors_device_argument():
    gqa_torch.check_errors(torch.device("cuda"))
    gqa_torch.check_errors("cuda:0")
    with pytest.raises(ValueError, match="gqa: check_errors: expected a CUDA device, got cpu"):
        gqa_torch.check_errors("cpu")


def test_cuda_kernels_available_asks_about_the_device():
    """The kernels run on this GPU (its code is in the build); the device argument is checked."""
    assert gqa_torch.cuda_kernels_available() and gqa_torch.cuda_kernels_available("cuda:0")
    assert gqa_torch.cuda_kernels_available(torch.device("cuda"))
    assert gqa_torch._C._cuda_device_support(0) == 0
    with pytest.raises(ValueError, match="gqa: cuda_kernels_available: expected a CUDA device, got cpu"):
        gqa_torch.cuda_kernels_available("cpu")
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"gqa: device index {count} out of range"):
        gqa_torch._C._cuda_device_support(count)


# ---- host rules that need a device ---------------------------------------------------------------

def test_device_mismatch_rules():
    case = make_case("inplace", batch=2, seq=1, head_dim=16, capacity=8, rotary="half", position_ids="offset",
                     sink=True, device="cuda", poison_unused=False)
    for name in ("key", "value", "cache_key", "seqlens_k", "cos_cache", "sin_cache", "position_ids", "head_sink"):
        bad = case.clone()
        setattr(bad, name, getattr(case, name).cpu())
        if name == "cache_key":
            bad.cache_value = case.cache_value.cpu()
        arg = {"cache_key": "key_cache"}.get(name, name)
        with pytest.raises(ValueError, match=rf"gqa: {arg}: expected a tensor on cuda:0 \(the device of query\), "
                                             r"got one on cpu"):
            bad.run()


def test_odd_head_size_refused_on_cuda():
    case = make_case("inplace", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=17, capacity=4, device="cuda",
                     poison_unused=False)
    with pytest.raises(ValueError, match=r"gqa: query: expected an even head_size on CUDA, got 17"):
        case.run()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_half_precision_no_worse_than_sdpa(dtype):
    """SPEC §5 on CUDA: within the dtype bound and at most 1.5x the error of
    F.scaled_dot_product_attention on the same rounded inputs (prefill, no RoPE)."""
    import torch.nn.functional as F
    dt = DTYPES[dtype]
    B, S, Hq, Hkv, D = 2, 256, 8, 2, 128
    case = make_case("inplace", batch=B, seq=S, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=S,
                     past_lengths=[0, 0], dtype=dt, device="cuda", poison_unused=False)
    before = case.clone()
    ref_out, _, _ = before.reference()
    out = case.run()
    err = assert_output_close(out, ref_out, case, suite="cuda")
    q = before.query.view(B, S, Hq, D).transpose(1, 2)
    k = before.key.view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    v = before.value.view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, Hq * D)
    sdpa_err = output_error(sdpa.cpu(), ref_out)
    assert err <= max(1.5 * sdpa_err, NORM_REL[dt] / 10), f"gqa {err:.3g} vs SDPA {sdpa_err:.3g}"
