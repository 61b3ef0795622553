"""The decode plan (csrc/core/plan.cpp), checked on the host: its split counts and where it
takes the batch's rows longest first. The GPU tests (test_cuda.py) check the kernels that run
each choice against the reference."""
from __future__ import annotations

import pytest

from gqa_torch import _C


@pytest.mark.parametrize("batch,hq,hkv,capacity,max_splits,longest_first", [
    (1, 32, 8, 1024, 16, False),      # one row: nothing to order
    (1, 14, 2, 32768, 64, False),
    (8, 32, 8, 1024, 2, False),       # 128 CTAs, fewer than the SMs: all start at once
    (8, 32, 8, 8192, 8, True),        # splits of 2,048 keys two CTAs an SM (256 CTAs), twice for a ragged batch
    (8, 32, 8, 32768, 8, True),       # 512 CTAs: the ragged B8 row of bench_decode.py
    (32, 32, 8, 8192, 2, True),       # the ragged B32 row
    (64, 32, 8, 1024, 1, False),      # 512 CTAs, but splits of 1,024 keys of capacity
    (64, 32, 8, 2048, 1, True),       # ... and of 2,048
    (16, 64, 8, 8191, 2, True),       # (8,192 keys of capacity take the balanced partition: below)
    (2, 128, 1, 4096, 64, False),     # 2 x 64 splits x 8 head chunks of 16 query heads, 64 keys each
    (2, 128, 1, 262144, 64, True),    # ... of 4,096 keys
    (40, 16, 4, 2100, 2, True),       # 160 CTAs, two waves of them for a ragged batch
    (33, 4, 4, 2048, 1, False),       # 132 CTAs: exactly the SMs
    (33, 4, 4, 4096, 2, True),        # ... two an SM, as their splits hold 2,048 keys
    (2, 32, 8, 32768, 16, True),      # 16 splits of 2,048 keys: two CTAs an SM, not 8 of 4,096
])
def test_decode_plan_takes_rows_longest_first_with_more_ctas_than_sms(batch, hq, hkv, capacity, max_splits,
                                                                       longest_first):
    """Longest first with two rows or more, more CTAs (rows x kv heads x head chunks x splits)
    than the 132 SMs, and at least 2,048 keys of capacity a split. The split counts: one CTA an
    SM, at least one split every 4,096 keys of capacity while the rows' CTAs fit twice over,
    and two CTAs an SM where their splits still hold 2,048 keys."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132)
    assert (plan["max_splits"], plan["longest_first"]) == (max_splits, longest_first)


@pytest.mark.parametrize("batch,capacity,max_splits_128,two_warps_256,four_warps_256", [
    (8, 1024, 2, 4, 2),     # splits of 256 keys two CTAs an SM at head size 256 with two warps only
    (8, 512, 2, 2, 2),      # ... not of 128
    (1, 8192, 16, 16, 16),  # 33 splits would hold 248 keys
    (1, 16384, 16, 33, 16),
    (1, 1024, 16, 16, 16),
    (2, 8192, 8, 16, 8),
    (8, 8192, 8, 4, 2),     # 2,048 keys: two CTAs an SM at every head size with two warps (head size 128: twice
                            # for a ragged batch)
    (8, 32768, 8, 8, 8),    # a split every 4,096 keys of capacity: more CTAs than SMs either way
])
def test_decode_plan_ctas_an_sm_at_head_size_256(batch, capacity, max_splits_128, two_warps_256, four_warps_256):
    """At head size 256 a decode CTA of two warps takes two CTAs an SM from splits of 256 keys of
    capacity, where other head sizes need 2,048 (32 query and 8 kv heads). Where the kernel has
    four warps a CTA there (an sm90 device and an sm90a build), one CTA an SM: one wave of the
    plain split count."""
    assert _C._decode_plan(batch, 32, 8, capacity, 132)["max_splits"] == max_splits_128
    assert _C._decode_plan(batch, 32, 8, capacity, 132, head_dim=128)["max_splits"] == max_splits_128
    assert _C._decode_plan(batch, 32, 8, capacity, 132, head_dim=256, tma_kernels=False)["max_splits"] == two_warps_256
    assert _C._decode_plan(batch, 32, 8, capacity, 132, head_dim=256)["max_splits"] == four_warps_256


@pytest.mark.parametrize("batch,hq,hkv,capacity,max_splits,equal_rows_splits", [
    (16, 64, 8, 8191, 2, 1),    # 128 of 132 SMs at one split (8,192 keys take the balanced partition)
    (16, 64, 8, 4160, 2, 1),
    (33, 4, 4, 4096, 2, 1),     # 132 CTAs a split: every SM
    (30, 32, 4, 8191, 2, 1),    # 120 CTAs a split: 91% of the SMs
    (29, 32, 4, 8191, 4, 2),    # 116: 88%; two CTAs an SM take the plan's 2 splits, a ragged batch 4
    (30, 64, 8, 8191, 2, 1),    # 240 CTAs, more than the SMs: as many as fill two CTAs an SM (8,192 keys, or
                                # 133-231 CTAs on 4,096 or more: the partition)
    (8, 32, 8, 32768, 8, 4),    # the B8 L32768 row: 8 splits for a ragged batch, one wave of 4
    (8, 32, 8, 16448, 5, 4),
    (32, 32, 8, 8192, 2, 1),    # 256 CTAs a split: one wave at two an SM
    (8, 32, 8, 8192, 8, 4),     # 4 splits fill two CTAs an SM: twice as many for a ragged batch
    (4, 32, 8, 32768, 16, 8),   # ... 8 here
    (2, 32, 8, 32768, 16, 0),   # ... 16 here, and 32 would be past the in-launch merge's bound
    (16, 64, 8, 2048, 1, 0),    # one split already (and one CTA an SM: no ranking)
    (64, 32, 8, 8192, 1, 0),
    (16, 256, 8, 8192, 2, 1),   # two head chunks: 256 CTAs a split, one wave at two an SM
    (8, 32, 8, 1024, 2, 0),     # no ranking (all CTAs start at once)
])
def test_decode_plan_gives_equal_rows_one_wave(batch, hq, hkv, capacity, max_splits, equal_rows_splits):
    """Where the plan takes more splits than one wave to spread a ragged batch's long rows
    (chunks of 4,096 keys), a batch of equal rows takes fewer (the kernel tells it from its
    ranking, so only with longest_first): one where one CTA a (row, kv head, head chunk) fills
    90% of the 132 SMs or more, else as many as fill two CTAs an SM."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132)
    assert (plan["max_splits"], plan["equal_rows_splits"]) == (max_splits, equal_rows_splits)
    assert plan["longest_first"] or equal_rows_splits == 0


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,one_cta_per_sm", [
    (16, 64, 8, 8191, 128, True),    # 256 CTAs of 2 splits, 264 slots (8,192 keys: the balanced partition)
    (16, 64, 8, 4160, 128, True),
    (30, 32, 4, 8191, 128, True),    # 240 CTAs
    (33, 4, 4, 4096, 128, True),     # 264 CTAs: exactly one wave at two an SM
    (16, 64, 8, 8192, 64, False),    # measured at head size 128 only
    (16, 64, 8, 8192, 256, False),
    (17, 64, 8, 8191, 128, False),   # 272 CTAs: two waves at two an SM already
    (16, 64, 8, 16384, 128, False),  # 4 splits: 512 CTAs
    (32, 32, 8, 8192, 128, False),   # equal rows take one split, but two CTAs an SM stream it
    (8, 32, 8, 32768, 128, False),   # equal rows take 4 splits: two CTAs an SM
    (16, 64, 8, 2048, 128, False),   # one split: no equal rows' grid
    (1, 32, 8, 8192, 128, False),
])
def test_decode_plan_keeps_one_cta_an_sm_where_a_ragged_batch_would_be_one_wave(batch, hq, hkv, capacity, head_dim,
                                                                               one_cta_per_sm):
    """One CTA an SM (the launch asks for more than half an SM's shared memory) where the plan's
    grid is one wave at two CTAs an SM and a batch of equal rows takes one split: a ragged batch
    then runs in two waves, longest first, and equal rows stream one CTA an SM either way."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)
    assert plan["one_cta_per_sm"] is one_cta_per_sm, plan
    if one_cta_per_sm:
        assert plan["longest_first"] and plan["equal_rows_splits"] == 1, plan


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,two_waves,near_equal", [
    (8, 32, 8, 8192, 128, True, 8),      # bench_decode.py's B8 L8192 row: 4 splits, 256 CTAs, 264 slots
    (8, 32, 8, 16384, 128, True, 11),    # the doubled splits hold 2,048 keys
    (4, 32, 8, 16384, 128, True, 8),     # 8 splits to 16 of 1,024 keys
    (4, 32, 8, 32768, 128, True, 11),
    (4, 32, 8, 32767, 128, True, 8),     # ... of 2,047
    (40, 16, 4, 2100, 128, True, 8),     # 160 CTAs of one split
    (8, 32, 8, 8192, 64, False, 0),      # measured at head size 128 only
    (8, 32, 8, 8192, 256, False, 0),
    (2, 32, 8, 32768, 128, False, 0),    # 32 splits: past the in-launch merge's 16
    (8, 32, 8, 32768, 128, False, 0),    # equal rows take 4 of the plan's 8 splits already
    (16, 64, 8, 8191, 128, False, 15),   # one CTA an SM instead
    (64, 32, 8, 8192, 128, False, 0),    # 512 CTAs: two waves already
    (8, 32, 8, 4096, 128, False, 0),     # 128 CTAs, fewer than the SMs: no ranking
    (1, 32, 8, 8192, 128, False, 0),
])
def test_decode_plan_takes_two_waves_for_a_ragged_batch_where_its_grid_is_one(batch, hq, hkv, capacity, head_dim,
                                                                            two_waves, near_equal):
    """Twice the splits for a ragged batch where the plan's grid is one wave at two CTAs an SM and
    every CTA of it works for equal rows too (Plan::ragged_two_waves): equal rows keep the one wave
    (equal_rows_splits), and so do ragged rows whose shortest sees at least 8/16 of the longest
    one's keys, or 11/16 where the doubled splits hold 2,048 keys of capacity
    (near_equal_sixteenths); where the launch keeps to one CTA an SM, 15/16."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)
    assert plan["ragged_two_waves"] is two_waves, plan
    assert plan["near_equal_sixteenths"] == near_equal, plan
    if two_waves:
        assert plan["longest_first"] and plan["max_splits"] == 2 * plan["equal_rows_splits"] <= 16, plan


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,two_splits", [
    (25, 32, 8, 4096, 128, True),     # 200 items: more than 3/2 of the 132 SMs (with TMA kernels on 4,096
                                      # keys or more, the balanced partition instead)
    (26, 32, 8, 2048, 128, True),
    (26, 64, 8, 4096, 128, True),
    (52, 28, 4, 8191, 128, True),     # two_per_sm's two splits
    (28, 32, 8, 6144, 128, True),
    (28, 32, 8, 4096, 128, True),     # 224: at most 7/4
    (29, 32, 8, 4096, 128, False),    # 232: more
    (24, 32, 8, 2048, 128, False),    # 192: at most 3/2
    (26, 32, 8, 1024, 128, False),    # one split for every batch: no ranking
    (26, 32, 8, 4096, 64, False),     # measured at head size 128 only
    (26, 32, 8, 8192, 128, False),    # the balanced partition's 16 splits an item
])
def test_decode_plan_gives_equal_rows_two_splits_past_3_2_of_the_sms(batch, hq, hkv, capacity, head_dim, two_splits):
    """Where the plan's two splits would leave equal rows one split a row in one wave at two CTAs
    an SM (the ragged batches' two waves, or two_per_sm on 4,096-8,191 keys), and the items
    number more than 3/2 of the SMs and at most 7/4, equal rows take the two splits too (no
    equal rows' rule at all), at head size 128: on a device without the TMA kernels, and with
    them below 4,096 keys of capacity (from 4,096 the balanced partition takes those items)."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim, tma_kernels=False)
    if capacity < 4096:
        assert plan == _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim), plan
    if two_splits:
        assert plan["max_splits"] == 2 and plan["longest_first"] and plan["shares"] == 0, plan
        assert plan["equal_rows_splits"] == plan["near_equal_sixteenths"] == 0, plan
        assert not plan["ragged_two_waves"] and not plan["one_cta_per_sm"], plan
    else:
        assert plan["equal_rows_splits"] != 0 or plan["max_splits"] != 2 or plan["shares"] != 0, plan


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,tail_splits,tail_items", [
    (48, 32, 8, 2048, 64, 2, 120),    # 384 slots: 264 in the first wave at two an SM, 120 after it
    (48, 32, 8, 2048, 128, 2, 120),
    (40, 32, 8, 2048, 64, 4, 56),     # 56 after it: four splits fill 224 of the 264 slots
    (34, 32, 8, 4096, 128, 8, 8),     # 8 after it: 33 splits would fill them, at most 8
    (34, 32, 8, 2100, 96, 8, 8),      # ... 262 keys a split
    (34, 32, 8, 2047, 64, 0, 0),      # ... but 2,047 keys of capacity are not ranked
    (100, 32, 8, 2048, 64, 8, 8),     # 800 slots: three whole waves and 8
    (64, 32, 8, 2048, 64, 0, 0),      # 512 slots: the second wave 248, more than half full
    (33, 32, 8, 2048, 64, 0, 0),      # 264 slots: exactly one wave
    (48, 32, 8, 1024, 64, 0, 0),      # splits of 1,024 keys: not ranked
    (48, 32, 8, 2048, 256, 0, 0),     # head size 256, four warps one CTA an SM: the last of 384 slots' waves
                                      # of 132 holds 120, more than half full
    (17, 32, 8, 2048, 256, 8, 4),     # ... 136 slots: a wave and 4 (33 splits would fill it, at most 8)
    (24, 16, 8, 4096, 256, 2, 60),    # ... 192 slots: a wave and 60
    (17, 32, 8, 1024, 256, 0, 0),     # ... splits of 1,024 keys: not ranked
    (48, 32, 8, 8192, 128, 2, 120),   # one split a row of 8,192 keys: two of 4,096 in the last wave
    (20, 256, 8, 8192, 128, 0, 0),    # 320 slots (two head chunks), but two splits a row already
    (64, 32, 8, 8192, 128, 0, 0),     # the benchmark grid's B64 and B16 rows: none takes it
    (64, 32, 8, 32768, 128, 0, 0),
    (16, 64, 8, 8192, 128, 0, 0),
    (32, 28, 4, 4096, 128, 0, 0),     # model shapes of ab_decode.py --models with more CTAs than SMs
    (64, 8, 4, 2048, 256, 0, 0),
])
def test_decode_plan_splits_the_last_wave_of_equal_rows(batch, hq, hkv, capacity, head_dim, tail_splits, tail_items):
    """Where one split a row leaves a batch of equal rows' last wave (two CTAs an SM; one at head
    size 256, with four warps a CTA) at most half full, that wave's slots take as many splits as
    fill it (at most 8, of 256 keys or more): max_splits is theirs, and equal rows and ragged
    batches keep one split a row; elsewhere none of it."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)
    assert (plan["equal_rows_tail_splits"], plan["equal_rows_tail_items"]) == (tail_splits, tail_items), plan
    if tail_splits:
        assert plan["longest_first"] and plan["max_splits"] == tail_splits, plan
        assert plan["equal_rows_splits"] == 1 and plan["ragged_splits"] == 1, plan
    else:
        assert plan["ragged_splits"] == 0, plan


@pytest.mark.parametrize("batch,hq,hkv,capacity", [(17, 32, 8, 2048), (24, 16, 8, 4096), (34, 8, 4, 4096)])
def test_decode_plan_sizes_the_last_wave_at_head_size_256_only_with_four_warps(batch, hq, hkv, capacity):
    """At head size 256 the last wave is one CTA an SM's only where the kernel has four warps a
    CTA (an sm90 device and an sm90a build): with two warps, two an SM, these batches are one
    wave, and no slot takes more splits."""
    four = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=256)
    assert four["equal_rows_tail_splits"] >= 2 and four["equal_rows_tail_items"] == batch * hkv - 132, four
    two = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=256, tma_kernels=False)
    assert two["equal_rows_tail_splits"] == two["equal_rows_tail_items"] == two["ragged_splits"] == 0, two


def test_decode_plan_refuses_bad_shapes():
    with pytest.raises(ValueError, match="expected positive sizes with kv_heads dividing q_heads"):
        _C._decode_plan(2, 6, 4, 100, 132)
    with pytest.raises(ValueError, match="expected positive sizes with kv_heads dividing q_heads"):
        _C._decode_plan(2, 8, 4, 100, 132, head_dim=0)


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,max_splits", [
    (1, 14, 2, 32768, 64, 64),    # 132 / 2 kv heads = 66 splits: 64 idles 4 SMs, within 1/16
    (1, 28, 4, 8192, 128, 32),    # 33 -> 32
    (1, 16, 4, 32768, 128, 32),
    (2, 14, 2, 32768, 128, 32),   # 4 (row, kv head) pairs: 33 -> 32
    (1, 28, 4, 8192, 256, 33),    # not at head size 256
    (1, 28, 4, 8192, 80, 33),     # nor at 80
    (1, 24, 3, 8192, 128, 44),    # 32 would idle a quarter of the SMs
    (1, 32, 8, 8192, 128, 16),    # a power of two already
    (1, 14, 2, 1024, 64, 16),     # 1,024 keys feed 16 splits of 64 at most
])
def test_decode_plan_takes_a_power_of_two_of_splits_where_it_idles_few_sms(batch, hq, hkv, capacity, head_dim,
                                                                          max_splits):
    """At head sizes 64 and 128 the splits that give one CTA an SM round down to a power of two
    where that leaves at most 1/16 of the SMs more idle (132 SMs)."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)
    assert plan["max_splits"] == max_splits, plan


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim", [
    (20, 32, 8, 4096, 64), (12, 32, 8, 8192, 64), (16, 64, 8, 8192, 128), (6, 64, 8, 16384, 128),
    (30, 32, 8, 16384, 128), (20, 32, 8, 4096, 128)])
def test_decode_plan_takes_the_partition_only_with_its_tma_kernel(batch, hq, hkv, capacity, head_dim):
    """The balanced partition's kernel runs on a TMA loader (an sm90 device and an sm90a build):
    without one its bands take a plain grid of 16 splits an item in the rows' order, at head
    sizes 64 and 128 alike (one shape from each band), with none of the grid of splits' rules."""
    assert _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)["shares"] == 132
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim, tma_kernels=False)
    assert plan["shares"] == plan["share_item_keys"] == 0, plan
    assert plan["max_splits"] == 16 and not plan["longest_first"], plan
    assert not plan["one_cta_per_sm"] and not plan["ragged_two_waves"], plan
    assert plan["equal_rows_splits"] == plan["near_equal_sixteenths"] == plan["ragged_splits"] == 0, plan
    assert plan["equal_rows_tail_splits"] == plan["equal_rows_tail_items"] == 0, plan


def test_decode_plan_without_tma_kernels_outside_the_partition_bands():
    """Outside the partition's bands a device without TMA loaders keeps the grid of splits' own
    rules (B8 64/8 L16384: 64 items, 4 splits for its equal rows at two CTAs an SM)."""
    plan = _C._decode_plan(8, 64, 8, 16384, 132, tma_kernels=False)
    assert plan == _C._decode_plan(8, 64, 8, 16384, 132), plan
    assert plan["shares"] == 0 and plan["max_splits"] < 16 and plan["longest_first"], plan


@pytest.mark.parametrize("batch,hq,hkv,capacity,head_dim,takes_it", [
    (16, 64, 8, 8192, 128, True),     # bench_decode.py's B16 64/8 row: 128 items
    (12, 64, 8, 16384, 128, True),    # Llama 3 70B's heads, 12 rows: 96 items
    (9, 64, 8, 16384, 128, True),     # 72: more than half the SMs
    (30, 32, 4, 8192, 128, True),
    (128, 4, 1, 8192, 128, True),     # the most rows the walk takes (one a thread of the CTA)
    (8, 256, 8, 8192, 128, True),     # two head chunks of 16 query heads: 128 items
    (8, 64, 8, 16384, 128, False),    # 64 items: the equal rows' grid (4 splits) fills 256 of 264 slots
    (6, 64, 8, 16384, 128, True),     # 48: 5 splits fill 240 of 264, under 15/16
    (6, 32, 8, 8192, 128, True),      # 48: 2 splits, 96 CTAs of 132 SMs (at most 3/4)
    (5, 32, 8, 8192, 128, False),     # 40: 3 splits, 120 CTAs of 132 SMs
    (3, 64, 8, 32768, 128, False),    # 24: 11 splits fill all 264
    (2, 64, 8, 8192, 128, False),     # 16: fewer than 1/8 of the SMs
    (17, 64, 8, 8192, 128, True),     # 136: more than the SMs
    (28, 64, 8, 8192, 128, True),     # 224: at most 7/4 of the SMs
    (29, 64, 8, 8192, 128, False),    # 232: more than that, on 8,192 keys
    (29, 64, 8, 16384, 128, True),    # ... on 16,384 keys: up to 4 x the SMs
    (66, 32, 8, 32768, 128, True),    # 528
    (67, 32, 8, 32768, 128, False),   # 536
    (129, 4, 1, 8192, 128, False),    # more rows than the walk takes
    (16, 64, 8, 8191, 128, False),    # rows of fewer than 8,192 keys of capacity: 128 items, not more than the SMs
    (17, 32, 8, 4096, 128, True),     # 136 items on 4,096 keys: more than the SMs
    (24, 32, 8, 4096, 128, True),     # 192: at most 3/2 of them
    (25, 32, 8, 4096, 128, True),     # 200: more, at most 7/4 (stop 82)
    (28, 32, 8, 6144, 128, True),     # 224
    (26, 64, 8, 4096, 128, True),
    (29, 32, 8, 4096, 128, False),    # 232: more than 7/4
    (26, 32, 8, 4095, 128, False),    # 208 items on fewer than 4,096 keys
    (40, 28, 4, 8191, 128, True),     # 160
    (20, 32, 8, 4095, 128, False),    # 160 items on fewer than 4,096 keys
    (20, 32, 8, 4096, 64, True),      # head size 64: 160 items on 4,096 keys
    (24, 32, 8, 4096, 64, True),      # 192: at most 3/2 of the SMs
    (25, 32, 8, 4096, 64, False),     # 200: more
    (20, 32, 8, 4095, 64, False),     # fewer than 4,096 keys
    (16, 64, 8, 8192, 64, False),     # 128 items: 7/8 of the SMs or more, and not more
    (17, 64, 8, 8192, 64, True),      # 136
    (12, 32, 8, 4096, 64, True),      # 96: more than 2/3 of the SMs, under 7/8
    (11, 32, 8, 16384, 64, False),    # 88: 2/3 of them
    (14, 32, 8, 4096, 64, True),      # 112
    (15, 32, 8, 4096, 64, False),     # 120: 7/8 or more
    (48, 14, 2, 4096, 64, True),      # 96 items of 7 query heads a kv head
    (16, 64, 8, 8192, 256, False),
    (1, 32, 8, 32768, 128, False),    # one row
])
def test_decode_plan_takes_the_balanced_partition(batch, hq, hkv, capacity, head_dim, takes_it):
    """Plan::shares: at head size 128, 2-128 rows of 8,192 keys of capacity or more take a grid of
    one CTA an SM, each walking an equal share of the batch's keys, each item weighed by its keys
    plus 512, where the items (row, kv head, head chunk) number more than half the 132 SMs and at
    most 7/4 of them; or 1/8 of them to half, where the equal rows' grid of splits would leave
    1/16 of its slots empty or more at two CTAs an SM, or 1/4 of the SMs idle at one; or more
    than 7/4 of them and up to 4 x on 16,384 keys of capacity or more; on 4,096-8,191 keys, more
    than the SMs' count and at most 7/4 of it. At head size 64, on 4,096 keys or more, more than
    the SMs' count to 3/2 of it, and more than 2/3 of the SMs' count to under 7/8 of it. An item
    spans at most 16 CTAs (max_splits), and the grid-of-splits schedule is off."""
    plan = _C._decode_plan(batch, hq, hkv, capacity, 132, head_dim=head_dim)
    assert plan["shares"] == (132 if takes_it else 0), plan
    assert plan["share_item_keys"] == (512 if takes_it else 0), plan
    if takes_it:
        assert plan["max_splits"] == 16, plan
        assert not plan["longest_first"] and not plan["one_cta_per_sm"] and not plan["ragged_two_waves"], plan
        assert plan["equal_rows_splits"] == plan["near_equal_sixteenths"] == plan["ragged_splits"] == 0, plan
        assert plan["equal_rows_tail_splits"] == plan["equal_rows_tail_items"] == 0, plan
