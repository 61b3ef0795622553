"""GPU tests of how decode spreads a batch over the SMs (the plan's rules, csrc/core/plan.cpp):
ragged batches in either row order, equal rows in fewer splits or with tail splits, one CTA an
SM, two waves, and the balanced partition (Plan::shares), bad rows included, and a graph replayed
between equal and unequal rows. Each call is checked against the float64 reference and the CPU
backend. Skipped, with the reason printed, without CUDA kernels or a CUDA device.
"""
from __future__ import annotations

import random

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import DTYPES, make_case, requires_cuda
from cuda_common import (FEATURE_CYCLE, capture_in_graph, check_bad_row_poisons_the_call,
                         cuda_kernel_names_or_skip, decode_kernel_bools, decode_loader_codes,
                         decode_pinned, inplace_step, replay_with_fresh_inputs_and_check,
                         run_cuda_and_cpu, shares_forced)


pytestmark = [pytest.mark.cuda, requires_cuda, pytest.mark.usefixtures("clean_error_word")]


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
    with decode_pinned(merge, max_splits, 1 if max_splits else 0, schedule):
        for i, feat in enumerate(FEATURE_CYCLE):
            rng = random.Random(100 + i)
            past = [rng.randint(0, 300) for _ in range(48)]
            past[5], past[17], past[40] = 2090, 700, 700
            case = make_case(["inplace", "functional"][i % 2], batch=48, seq=1, num_heads=32, kv_num_heads=8,
                             head_dim=[64, 128, 256][i % 3], capacity=2100, past_lengths=past, dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            run_cuda_and_cpu(case)


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
    with decode_pinned(schedule=schedule):
        for i, feat in list(enumerate(FEATURE_CYCLE))[features]:
            past = [capacity - 60] * batch
            if (i // 2) % 2:
                past[batch // 2] = capacity // 2  # one shorter row: the batch's rows differ
            case = make_case(["inplace", "functional"][i % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][i % 2], capacity=capacity, past_lengths=past, dtype=DTYPES[dtype],
                             layout=i % 2, **feat)
            run_cuda_and_cpu(case)


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
    with decode_pinned(merge=merge, schedule=schedule):
        for i, feat in list(enumerate(FEATURE_CYCLE))[features]:
            past = [capacity - 60 if i % 3 != 2 else capacity // 3] * batch
            if i % 3 == 1:
                past[batch - 2] = capacity // 2  # one shorter row (in the last wave): the batch's rows differ
            case = make_case(["inplace", "functional"][i % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(i // 2) % 2], capacity=capacity, past_lengths=past,
                             dtype=DTYPES[dtype], layout=i % 2, **feat)
            run_cuda_and_cpu(case)


def test_cuda_decode_equal_rows_tail_bad_row():
    """The bad-row checks where the batch ranks as equal rows whose last wave takes more splits
    (_tail_shape "two"; the bad row's length past the capacity clamps to it, and the bad row is in
    the last wave): no cache byte changes, every output is NaN, and the capacity flag is raised."""
    batch, hq, hkv, capacity, _ = _tail_shape("two")
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=64, capacity=capacity,
                     past_lengths=[capacity - 1] * batch, strided=True, dtype=torch.bfloat16, device="cuda",
                     poison_unused=False)
    case.seqlens_k[batch - 1] = capacity  # total capacity + 1
    check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


def test_cuda_decode_equal_rows_bad_row():
    """The bad-row checks where the batch ranks as equal rows (every row at the capacity, the bad
    row's length past it clamped to it), so that the CTAs past the one split leave before any
    check: still no cache byte changes, every output is NaN, and the capacity flag is raised."""
    batch, hq, hkv, capacity, _ = _equal_rows_shape("one")
    case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128, capacity=capacity,
                     past_lengths=[capacity - 1] * batch, strided=True, dtype=torch.bfloat16, device="cuda",
                     poison_unused=False)
    case.seqlens_k[batch // 2] = capacity  # total capacity + 1
    check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


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
    with decode_pinned(schedule=schedule):
        for j, i in enumerate(features):
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(j // 2) % 2], capacity=capacity,
                             past_lengths=_ragged_pasts(rng, batch, capacity), dtype=DTYPES[dtype], layout=j % 2,
                             **FEATURE_CYCLE[i])
            run_cuda_and_cpu(case)


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
    with decode_pinned(schedule=schedule):
        for j, i in enumerate([0, 1, 4, 2]):
            past = [capacity - 1 - rng.randint(0, capacity // 16 - 1) for _ in range(batch)]
            # (one query token: keys = past + 1)
            past[j % batch], past[(j + 5) % batch] = 15 * capacity // 16 - 1, capacity - 1
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][(j // 2) % 2], capacity=capacity, past_lengths=past,
                             dtype=torch.bfloat16, layout=j % 2, **FEATURE_CYCLE[i])
            run_cuda_and_cpu(case)


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


@pytest.mark.parametrize("dtype,features,items", [("bf16", [0, 2, 1], "3/2"), ("fp16", [4, 3, 0], "3/2"),
                                                   ("bf16", [1, 4, 2], "7/4"), ("fp16", [3, 0, 1], "7/4")])
def test_cuda_decode_shares_on_4096_keys(dtype, features, items):
    """The balanced partition on 4,096-8,191 keys of capacity, where it takes more items than SMs
    and at most 7/4 of them: 18 rows of 8 kv heads at 4,160 keys on 132 SMs (144 items, "3/2")
    and 28 rows (224 items, "7/4", since stop 82). Equal rows, a ragged batch and one full row
    among short ones, features, both ops and layouts, against the reference and the CPU
    backend."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // 8 + 2 if items == "3/2" else 7 * sms // 32
    hq, hkv, capacity = 16, 8, 4160
    plan = gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)
    assert plan["shares"] == sms and sms < batch * hkv and 4 * batch * hkv <= 7 * sms, plan
    assert (2 * batch * hkv <= 3 * sms) == (items == "3/2"), (batch, sms)
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
        run_cuda_and_cpu(case)


def _decode_shares_flags(names):
    """Whether each decode kernel among the profiler's kernel names is the balanced partition's
    (decode_mma_kernel's kShares)."""
    return [shares for _, shares, _ in decode_kernel_bools(names)]


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
    with shares_forced(item_keys):
        _run_shares_cases(random.Random(97), dtype, features, batch, hq, hkv, capacity, head_dim=64)
        case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=64,
                         capacity=capacity, past_lengths=[capacity - 1] * batch, dtype=DTYPES[dtype])
        names = cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
    assert _decode_shares_flags(names) == [True] and decode_loader_codes(names, 64) == [8], names


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
    with shares_forced(item_keys):
        check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")


def test_cuda_decode_shares_forced_at_head_size_128():
    """set_decode_shares("force") at head size 128 on a call whose plan keeps the grid of splits
    (16 rows of 8 kv heads on 2,100 keys): the call takes the partition's kernel and matches the
    reference and the CPU backend, on equal rows, a ragged batch and short rows."""
    _require_tma_decode()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, hq, hkv, capacity = max(2, sms // 8), 32, 8, 2100
    assert gqa_torch._C._decode_plan(batch, hq, hkv, capacity, sms)["shares"] == 0
    with shares_forced():
        _run_shares_cases(random.Random(103), "bf16", [0, 2, 1], batch, hq, hkv, capacity)
        case = make_case("inplace", batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv, head_dim=128,
                         capacity=capacity, past_lengths=[capacity - 1] * batch, dtype=torch.bfloat16)
        names = cuda_kernel_names_or_skip(lambda: case.to("cuda").run())
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
            run_cuda_and_cpu(case)
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
        check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN")
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
    check_bad_row_poisons_the_call(case, "every row of a fused call with a bad row must be NaN", gerr.POSITION)


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
    with decode_pinned(schedule=schedule):
        for j, i in enumerate([0, 1, 4, 2]):
            past = [rng.randint(capacity // 2, capacity - 1) for _ in range(batch)]
            # (one query token: keys = past + 1; the first two cases at the bound, the next two below it)
            past[j % batch], past[(j + 1) % batch] = capacity // 2 - 1 - (j // 2), capacity - 1
            case = make_case(["inplace", "functional"][j % 2], batch=batch, seq=1, num_heads=hq, kv_num_heads=hkv,
                             head_dim=[128, 64][j % 2], capacity=capacity, past_lengths=past,
                             dtype=torch.bfloat16, layout=j % 2, **FEATURE_CYCLE[i])
            run_cuda_and_cpu(case)


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
    graph, static_out = capture_in_graph(lambda: inplace_step(static), warmups=2)
    rng = random.Random(11)
    for lengths in ("equal", "from_half", "equal", "from_empty", "from_half", "from_empty", "equal"):
        if lengths == "equal":
            pasts = [capacity - 1 - rng.randint(0, 50)] * batch
        else:
            low = capacity // 2 if lengths == "from_half" else 0
            pasts = [rng.randint(low, capacity - 1) for _ in range(batch)]
        replay_with_fresh_inputs_and_check(graph, static, static_out, pasts)
