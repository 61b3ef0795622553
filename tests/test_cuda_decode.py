"""GPU tests of the decode kernels (S = 1): every loader at every fast head size, the split
counts and both merges, bad rows on the tensor-core kernels, and the decode switches (early
tiles, the L2 prefetch and fetch). Each call is checked against the float64 reference and the
CPU backend (cuda_common.run_cuda_and_cpu); where a test pins a kernel, the profiler's kernel
names show that it ran. Skipped, with the reason printed, without CUDA kernels or a CUDA
device.
"""
from __future__ import annotations

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import DTYPES, assert_output_close, make_case, requires_cuda, run_and_check
from cuda_common import (FEATURE_CYCLE, ROTARY_ULPS, assert_untouched_except_valid_rows,
                         cuda_kernel_names_or_skip, decode_kernel_bools, decode_loader_codes,
                         decode_pinned, run_cuda_and_cpu, switch_pinned)


pytestmark = [pytest.mark.cuda, requires_cuda, pytest.mark.usefixtures("clean_error_word")]


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
        run_cuda_and_cpu(case)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("features", ["auto", "general"])
def test_cuda_decode_plain_kernel(dtype, head_dim, features):
    """Calls that use no RoPE, softcap, window, sink or smooth softmax take the decode kernel
    compiled without them ("auto"); the general kernel ("general") must give them the same
    results. In place (the fused path: the new key is patched into the warp that reads it) and
    functional, ragged rows over one and several splits, and a 20-head group (two head chunks)."""
    with switch_pinned(gqa_torch._C._set_decode_features, features):
        for i, op in enumerate(["inplace", "functional"]):
            case = make_case(op, batch=4, seq=1, num_heads=[8, 20][i], kv_num_heads=[2, 1][i], head_dim=head_dim,
                             capacity=3016, past_lengths=[0, 63, 700, 2999], dtype=DTYPES[dtype], layout=i)
            run_cuda_and_cpu(case)


def _decode_keys_as_rows_flags(names):
    """Whether each decode kernel among the profiler's kernel names is the keys-as-rows form
    (decode_mma_kernel's last template argument, kKeysM)."""
    return [keys_m for _, _, keys_m in decode_kernel_bools(names)]


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
    with switch_pinned(gqa_torch._C._set_decode_loader, loader):
        cases = [make_case("inplace", batch=3, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=head_dim,
                           capacity=2100, past_lengths=[2049, 700, 5], dtype=torch.bfloat16, **feat)
                 for feat in (dict(), dict(rotary="half", softcap=2.0, sink=True))]
        for case in cases:
            run_cuda_and_cpu(case)
        for case in cases:
            names = cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
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
        run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)
    # (After every correctness check, which compute-sanitizer runs too.)
    for case in cases:
        names = cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
        assert decode_loader_codes(names, head_dim) == [code], (context, names)


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
    with switch_pinned(gqa_torch._C._set_decode_loader, loader):
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
        run_cuda_and_cpu(case)


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
    with switch_pinned(gqa_torch._C._set_decode_loader, loader):
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
    with switch_pinned(gqa_torch._C._set_decode_loader, loader):
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
    with switch_pinned(gqa_torch._C._set_decode_loader, loader):
        _check_decode_and_its_loader(head_dim, code, (plan, sms), batch=batch, num_heads=32, kv_num_heads=32,
                                     capacity=capacity, past_lengths=pasts, dtype=DTYPES[dtype])


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
            run_cuda_and_cpu(case)
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
    with decode_pinned("kernel", max_splits, 1):
        for i, feat in enumerate(FEATURE_CYCLE):
            case = make_case(["inplace", "functional"][i % 2], batch=5, seq=1, num_heads=[8, 20][i % 2],
                             kv_num_heads=[2, 1][i % 2], head_dim=[64, 256, 80, 128, 40, 64][i], capacity=720,
                             past_lengths=[0, 4, 9, 130, 699], dtype=DTYPES[dtype], layout=i % 2, **feat)
            run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)


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
        run_cuda_and_cpu(case)


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
    with decode_pinned("arrival", 3, 1):
        for i, feat in enumerate(FEATURE_CYCLE):
            case = make_case(["inplace", "functional"][i % 2], batch=len(lengths), seq=1, num_heads=[8, 6, 14][i % 3],
                             kv_num_heads=2, head_dim=head_dim, capacity=6 * edge + 1,
                             past_lengths=[n - 1 for n in lengths], dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            run_cuda_and_cpu(case)


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
    with decode_pinned(merge, splits):
        names = cuda_kernel_names_or_skip(lambda: case.clone().run())
    assert any("decode_mma_kernel" in n for n in names), names
    assert any("merge_kernel" in n for n in names) == (not in_launch), names


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
    with decode_pinned("arrival", 3, 0, "longest_first"):
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
    assert_untouched_except_valid_rows(before, case, written_rows=[])
    valid = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=2048,
                      past_lengths=[1900, 700], strided=True, dtype=DTYPES[dtype], device="cuda")
    poisoned = valid.clone()
    assert torch.isnan(poisoned.run()).all(), "the set word poisons later calls until it is cleared"
    torch.cuda.synchronize()
    assert_untouched_except_valid_rows(valid, poisoned, written_rows=[])  # nor do they append
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
    with switch_pinned(gqa_torch._C._set_decode_early_tiles, early):
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
        run_cuda_and_cpu(case)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_cuda_decode_l2_prefetch_switch(head_dim, prefetch):
    """The decode kernel's L2 prefetch before the PDL wait (its split's first keys and its
    query rows), off or on (auto's small calls): ragged rows in place and functional, in
    both cache layouts (one request for contiguous keys, one a row otherwise), with three
    feature sets; then a captured two-call sequence in which the second call reads the row the
    first appended (lines the second may have asked for before the first wrote them); then the
    bad-row checks."""
    with switch_pinned(gqa_torch._C._set_decode_l2_prefetch, prefetch):
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
    with switch_pinned(gqa_torch._C._set_decode_l2_fetch, fetch):
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
