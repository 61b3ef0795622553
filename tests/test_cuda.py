"""GPU tests: the CUDA backend against the float64 reference and the CPU backend over the parity
grid and random combinations, prefill on every route, and the host rules that need a device.
Decode's kernels are tested in test_cuda_decode.py, how decode spreads a batch over the SMs in
test_cuda_decode_batches.py, and CUDA graphs, torch.compile and the error word in
test_cuda_graphs.py; cuda_common.py holds what they share.

Every test here is skipped, with the reason printed, when this build has no CUDA kernels or
the machine has no CUDA device. Skips never count as passes (conftest fails a run in which
nothing passed).

CUDA may contract RoPE's x0*cos - x1*sin into FMAs, so rotated K rows in the caches may differ
from the reference (and from the CPU backend) by one unit in the last place; everything else
in the caches must be byte-identical.
"""
from __future__ import annotations

import math
import random
import re

import pytest
import torch

import gqa_torch
from conftest import (DTYPES, NORM_REL, FP32_MAX_REL, assert_output_close, bits_equal, check_caches, hash_str,
                      make_case, output_error, poison, poison_allocator, requires_cuda)
from test_parity import GRID, RANDOM_CONFIGS, _case_id, build_case
from cuda_common import FEATURE_CYCLE, ROTARY_ULPS, check_bad_row_poisons_the_call, run_cuda_and_cpu


pytestmark = [pytest.mark.cuda, requires_cuda, pytest.mark.usefixtures("clean_error_word")]


@pytest.mark.parametrize("row", GRID, ids=[_case_id(r) for r in GRID])
def test_cuda_parity_grid(row):
    """The same pairwise grid as the CPU parity suite, on CUDA (odd head sizes are refused)."""
    case = build_case(row, random.Random(_case_id(row)))
    if case.head_dim % 2:
        with pytest.raises(ValueError, match=r"gqa: query: expected an even head_size on CUDA, got 17"):
            case.to("cuda").run()
        return
    run_cuda_and_cpu(case)


EVEN_RANDOM_CONFIGS = [c for c in RANDOM_CONFIGS if c["head_dim"] % 2 == 0]


@pytest.mark.parametrize("cfg", EVEN_RANDOM_CONFIGS, ids=[f"random{i}" for i in range(len(EVEN_RANDOM_CONFIGS))])
def test_cuda_random_combinations(cfg):
    """The CPU suite's random feature combinations (even head sizes), on CUDA."""
    cfg = dict(cfg)
    op = cfg.pop("op")
    run_cuda_and_cpu(make_case(op, **cfg))


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
    run_cuda_and_cpu(case)
    case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[seq, max(1, seq // 3)], layout=layout,
                     dtype=DTYPES[dtype], **feat)
    run_cuda_and_cpu(case)


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
    run_cuda_and_cpu(case)
    case = make_case("functional", batch=2, seq=4096, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[4096, 1500], layout=1 - i % 2,
                     dtype=DTYPES[dtype], **FEATURE_CYCLE[(i + 3) % len(FEATURE_CYCLE)])
    run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_prefill_auto_long_prompt(dtype):
    """A prompt of 8192 tokens at head size 128: from 2048 tokens "auto" takes the pipelined
    kernel with three K/V stages (route wgmma_ws_kv_pipe3's) on sm90, below it the same
    kernel with one instantiation of its step (route x_one_step's); in place, with rotary on a
    packed input, against the float64 reference and the CPU backend (test_cuda_prefill_long
    covers 4096)."""
    case = make_case("inplace", batch=1, seq=8192, num_heads=2, kv_num_heads=1, head_dim=128, capacity=8192 + 64,
                     dtype=DTYPES[dtype], packed=dtype == "bf16", **FEATURE_CYCLE[1 + (dtype == "bf16")])
    run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)
        case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=128, capacity=50,
                         dtype=DTYPES[dtype], rotary=rotary, rotary_dim=rotary_dim)
        run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("scale,softcap", [(1e-50, 1e-40), (0.0, 1e-40), (-0.3, 1e-40)])
def test_cuda_decode_subnormal_softcap(dtype, scale, softcap):
    """Finding (by analysis, 2026-11-29): the tensor-core decode formed tanh's argument as
    score * scale * (1 / softcap); a subnormal softcap made 1 / softcap inf, and a scale that
    float32 rounds to 0 then gave 0 * inf = NaN instead of uniform weights."""
    case = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=300,
                     past_lengths=[30, 250], dtype=DTYPES[dtype], scale=scale, softcap=softcap)
    run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)
        case = make_case("functional", batch=2, seq=seq, num_heads=4, kv_num_heads=1, head_dim=head_dim,
                         capacity=None, first_prompt=True, prompt_lengths=[seq, max(1, seq // 3)], layout=i % 2,
                         dtype=DTYPES[dtype], **feat)
        run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)
        case = make_case("functional", batch=3, seq=1500, num_heads=16, kv_num_heads=2, head_dim=head_dim,
                         capacity=None, first_prompt=True, prompt_lengths=[1500, 400, 1100], layout=1 - i % 2,
                         dtype=DTYPES[dtype], **feat)
        run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)
    case = make_case("functional", batch=3, seq=260, num_heads=num_heads, kv_num_heads=kv_heads, head_dim=head_dim,
                     capacity=None, first_prompt=True, prompt_lengths=[260, 75, 193], dtype=DTYPES[dtype])
    run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_prefill_kernel_append_matches_prep(dtype, head_dim, prefill_append):
    """The caches after an in-place prefill of rows with no past (1100 tokens: every CTA walks
    several query blocks, owning some tiles and not others) are the same bytes whether the
    attention kernel or prep appends them, and match the reference (run_cuda_and_cpu)."""
    case = make_case("inplace", batch=2, seq=1100, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=1200,
                     past_lengths=[0, 0], layout=head_dim == 256, dtype=DTYPES[dtype], strided=True)
    run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_prefill_kernel_append_bad_row(dtype, head_dim, prefill_append):
    """A bad row next to a row with no past (which the kernel would append): no cache byte
    changes (guard regions included), every output row is NaN, and check_errors() raises the
    capacity flag."""
    case = make_case("inplace", batch=3, seq=300, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=400,
                     past_lengths=[0, 50, 0], strided=True, dtype=DTYPES[dtype], device="cuda", poison_unused=False)
    case.seqlens_k[1] = 400  # total 401 > capacity
    check_bad_row_poisons_the_call(case, "a bad row anywhere makes every prefill output row NaN")


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
        run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("softcap", [1e4, 1e6, 3e38])
@pytest.mark.parametrize("seq", [1, 64])
def test_cuda_large_softcap(dtype, softcap, seq):
    """A softcap far above the logits is the identity. Finding (by analysis, 2026-11-29): the
    tensor-core prefill computed tanh(y) as 1 - 2/(e^2y + 1), which cancels for small y (every
    logit ~0 with softcap 1e6), and softcap * log2(e) overflowed to inf above 2.4e38."""
    case = make_case("inplace", batch=2, seq=seq, num_heads=8, kv_num_heads=2, head_dim=128, capacity=seq + 100,
                     past_lengths=[30, 90], dtype=DTYPES[dtype], softcap=softcap, q_amplitude=3.0)
    run_cuda_and_cpu(case)


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
