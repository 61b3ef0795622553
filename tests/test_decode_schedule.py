"""The decode plan's split counts and the balanced schedule's arithmetic (csrc/core/plan.h and
plan.cpp), checked on the host against a Python model. The decode kernel deals its CTAs from
the same pure functions, so a wrong count here would leave rows unmerged or CTAs unlaunched;
the GPU tests (test_cuda.py, the "balanced" decode fixture) cover the device side."""
from __future__ import annotations

import random

import pytest

from gqa_torch import _C


def _model_splits(keys, target, max_splits, min_split_keys):
    total = sum(max(k, 0) for k in keys)
    chunk = max(min_split_keys, -(-total // target))
    return [1 if k <= 0 else min(max_splits, -(-k // chunk)) for k in keys]


@pytest.mark.parametrize("seed", range(20))
def test_balanced_splits_match_the_model_and_fit_the_grid(seed):
    """Random ragged batches: each row's count matches the model, lies in [1, max_splits], and
    the batch's sum never exceeds target + rows (the grid the launcher sizes)."""
    rng = random.Random(seed)
    rows = rng.randint(1, 300)
    keys = [rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, 70_000)]) for _ in range(rows)]
    target = rng.randint(1, 4 * rows)
    max_splits = rng.randint(1, 128)
    min_split_keys = rng.choice([1, 16, 64, 1024])
    splits = _C._balanced_splits(keys, target, max_splits, min_split_keys)
    assert splits == _model_splits(keys, target, max_splits, min_split_keys)
    assert all(1 <= s <= max_splits for s in splits)
    assert sum(splits) <= target + rows


@pytest.mark.parametrize("rows,length,per_row", [(32, 8192, 2), (8, 32768, 8), (64, 1024, 1), (16, 8192, 2), (5, 700, 3)])
def test_balanced_splits_of_a_uniform_batch_are_the_plans(rows, length, per_row):
    """A batch of equal rows, with target = rows x the plan's count, takes the plan's count on
    every row, so the balanced schedule runs a uniform batch as the row schedule does."""
    assert _C._balanced_splits([length] * rows, rows * per_row, 4 * per_row, 64) == [per_row] * rows


def test_balanced_splits_give_long_rows_more():
    """One long row among short ones takes more splits (up to the cap), the short ones one."""
    keys = [8192] + [200] * 31  # chunk ceil(14392 / 64) = 225 keys
    splits = _C._balanced_splits(keys, 64, 8, 64)
    assert splits[0] == 8 and splits[1:] == [1] * 31
    keys = [8192, 6000, 4000, 2000] * 8  # chunk 2524 keys
    splits = _C._balanced_splits(keys, 64, 8, 64)
    assert splits[:4] == [4, 3, 2, 1]


def test_balanced_splits_refuse_nonpositive_counts():
    with pytest.raises(ValueError, match="target, max_splits and min_split_keys must be positive"):
        _C._balanced_splits([10], 0, 1, 1)


@pytest.mark.parametrize("batch,hq,hkv,capacity,max_splits,balanced,slots", [
    (1, 32, 8, 1024, 16, False, 16),      # B = 1: one row, nothing to balance
    (8, 32, 8, 1024, 2, False, 2),        # 128 CTAs, fewer than the SMs: all resident
    (8, 32, 8, 32768, 8, True, 32),       # 512 CTAs: balanced, a row up to 4x the plan's splits
    (32, 32, 8, 8192, 2, True, 8),        # the ragged B32 row of bench_decode.py
    (64, 32, 8, 1024, 1, True, 4),
    (16, 64, 8, 8192, 2, True, 8),
    (40, 16, 4, 200, 1, True, 4),         # 160 CTAs; slots capped by the capacity's 64-key tiles
    (40, 16, 4, 100, 1, True, 2),
    (1, 14, 2, 32768, 66, False, 66),
    (2, 128, 1, 4096, 64, True, 64),      # 64 tiles of capacity; 8 head chunks a kv head
])
def test_decode_plan_offers_the_balanced_schedule(batch, hq, hkv, capacity, max_splits, balanced, slots):
    """The plan offers the balanced schedule with two rows or more and more CTAs than SMs, and
    then lets a row take up to four times its split count (never more 64-key tiles than the
    capacity holds, nor more than 128)."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132)
    assert (plan["max_splits"], plan["balanced"], plan["split_slots"]) == (max_splits, balanced, slots)
