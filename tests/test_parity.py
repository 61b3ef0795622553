"""CPU backend vs the float64 reference (SPEC §3, §5).

The main sweep is a pairwise covering array over feature x scenario x dtype x layout x packed
x op x head shape x strides: every pair of values of any two factors is run at least once (for
example every feature in every dtype, every scenario in both layouts), in about a hundred
small cases instead of the ~40k of the full product. Each case checks the output within SPEC
§5 tolerances, the caches byte for byte, the guard regions and NaN canaries of unused rows.

Then targeted tests: right-padded prefill into the in-place cache followed by decode,
multi-step decode loops, seqlens_k shapes, position_ids without RoPE, SDPA comparison for
half precision, large logits, determinism, long rows that split the key range.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

import gqa_torch
from conftest import (DTYPES, NORM_REL, assert_output_close, bits_equal, check_caches, make_case,
                      record_error, run_and_check, output_error)
from pairwise import pairwise
from reference import reference_gqa, reference_rotated_qkv

FEATURES = {
    "plain": dict(),
    "rope_half": dict(rotary="half"),
    "rope_interleaved": dict(rotary="interleaved"),
    "rope_partial": dict(rotary="half", rotary_dim="partial"),
    "rope_partial_interleaved": dict(rotary="interleaved", rotary_dim="partial"),
    "rope_position_ids": dict(rotary="half", position_ids="random"),
    "rope_lowp_cos": dict(rotary="interleaved", cos_dtype="query"),
    "window": dict(window="random"),
    "softcap": dict(softcap=1.5, q_amplitude=3.0),
    "smooth_softmax": dict(smooth=True),
    "head_sink": dict(sink=True),
    "scale": dict(scale=0.37),
    "all": dict(rotary="interleaved", rotary_dim="partial", position_ids="offset", window=3, softcap=2.0,
                q_amplitude=2.0, smooth=True, sink=True, scale=0.2),
}

# (num_heads, kv_num_heads, head_dim): GQA, MQA (Hkv=1), odd-ish widths, MHA, D=256, odd D.
SHAPES = [(4, 2, 16), (8, 1, 32), (6, 3, 40), (4, 4, 24), (2, 1, 256), (8, 2, 72), (3, 1, 17)]

SCENARIOS = ["decode", "prefill", "chunked", "padded_prompt", "shared_capacity", "long_decode"]


def _valid(row) -> bool:
    if row["scenario"] == "padded_prompt" and row["op"] != "functional":
        return False  # first-prompt padding is a functional-op mode; the in-place analogue is tested below
    if row["scenario"] == "long_decode" and row["shape"][2] == 256 and row["dtype"] != "fp32":
        return True
    return True


GRID = pairwise(
    {
        "feature": list(FEATURES),
        "scenario": SCENARIOS,
        "dtype": list(DTYPES),
        "layout": [0, 1],
        "packed": [False, True],
        "op": ["functional", "inplace"],
        "shape": SHAPES,
        "strided": [False, True],
    },
    valid=_valid,
)


def _case_id(row) -> str:
    hq, hkv, d = row["shape"]
    return (f"{row['feature']}-{row['scenario']}-{row['dtype']}-{'bsnh' if row['layout'] else 'bnsh'}-"
            f"{'packed' if row['packed'] else 'sep'}-{row['op']}-h{hq}.{hkv}.d{d}{'-strided' if row['strided'] else ''}")


def build_case(row, rng: random.Random):
    hq, hkv, d = row["shape"]
    dtype = DTYPES[row["dtype"]]
    feat = dict(FEATURES[row["feature"]])
    if feat.get("rotary_dim") == "partial":
        feat["rotary_dim"] = max(2, (d // 2) // 2 * 2)
    elif feat.get("rotary") is not None:
        feat["rotary_dim"] = d if d % 2 == 0 else d - 1  # R must be even
    if feat.get("cos_dtype") == "query":
        feat["cos_dtype"] = dtype
    if feat.get("window") == "random":
        feat["window"] = rng.choice([1, 2, 5])
    op = row["op"]
    common = dict(num_heads=hq, kv_num_heads=hkv, head_dim=d, layout=row["layout"], packed=row["packed"],
                  dtype=dtype, strided=row["strided"], **feat)
    sc = row["scenario"]
    if sc == "decode":
        return make_case(op, batch=3, seq=1, capacity=12, **common)
    if sc == "prefill":
        if op == "functional":
            return make_case(op, batch=2, seq=7, capacity=None, first_prompt=True, prompt_lengths=[7, 7], **common)
        return make_case(op, batch=2, seq=7, capacity=10, past_lengths=[0, 0], **common)
    if sc == "chunked":  # S > 1 with a past, B > 1, each row its own past (extension)
        return make_case(op, batch=3, seq=5, capacity=14 if op == "inplace" else 9, **common)
    if sc == "padded_prompt":
        return make_case(op, batch=3, seq=9, capacity=None, first_prompt=True, empty_past=rng.random() < 0.5,
                         **common)
    if sc == "shared_capacity":  # capacity well above every row's total
        if op == "functional":
            return make_case(op, batch=2, seq=1, capacity=24, past_lengths=[rng.randint(0, 10), rng.randint(0, 10)],
                             **common)
        return make_case(op, batch=2, seq=2, capacity=24, past_lengths=[rng.randint(0, 10), rng.randint(0, 10)],
                         **common)
    if sc == "long_decode":  # long rows: several key tiles, and key splits when B*Hkv is small
        past = [rng.randint(1030, 1090)]
        return make_case(op, batch=1, seq=1, capacity=1100, past_lengths=past, **common)
    raise AssertionError(sc)


@pytest.mark.parametrize("row", GRID, ids=[_case_id(r) for r in GRID])
def test_parity_grid(row):
    rng = random.Random(_case_id(row))
    case = build_case(row, rng)
    run_and_check(case)


def random_config(index: int) -> dict:
    """A random combination of everything (features stacked freely), seeded by its index:
    complements the pairwise grid with higher-order interactions."""
    rng = random.Random(9000 + index)
    hq, hkv, d = rng.choice(SHAPES)
    op = rng.choice(["functional", "inplace"])
    seq = rng.choice([1, 1, 2, 3, 5, 8, 13])
    batch = rng.randint(1, 4)
    rotary = rng.choice([None, "half", "interleaved"])
    cfg = dict(op=op, batch=batch, seq=seq, num_heads=hq, kv_num_heads=hkv, head_dim=d,
               layout=rng.randint(0, 1), packed=rng.random() < 0.4, dtype=rng.choice(list(DTYPES.values())),
               strided=rng.random() < 0.3, rotary=rotary,
               window=rng.choice([-1, -1, 1, 2, 4, 9]), softcap=rng.choice([0.0, 0.0, 1.0, 4.0]),
               smooth=rng.random() < 0.3, sink=rng.random() < 0.3, scale=rng.choice([0.0, 0.0, 0.05, 0.4]))
    if rotary:
        even_d = d - d % 2
        cfg["rotary_dim"] = rng.choice([even_d, max(2, even_d // 2 // 2 * 2), 2])
        cfg["position_ids"] = rng.choice([None, "random", "offset"])
        if cfg["dtype"] != torch.float32 and rng.random() < 0.5:
            cfg["cos_dtype"] = cfg["dtype"]
    if op == "functional" and rng.random() < 0.3:
        cfg.update(capacity=None, first_prompt=True,
                   prompt_lengths=[seq] + [rng.randint(1, seq) for _ in range(batch - 1)])
    elif op == "functional":
        cfg.update(capacity=rng.randint(1, 20))
    else:
        cfg.update(capacity=seq + rng.randint(0, 20))
    return cfg


RANDOM_CONFIGS = [random_config(i) for i in range(80)]


@pytest.mark.parametrize("cfg", RANDOM_CONFIGS, ids=[f"random{i}" for i in range(len(RANDOM_CONFIGS))])
def test_parity_random_combinations(cfg):
    cfg = dict(cfg)
    op = cfg.pop("op")
    run_and_check(make_case(op, **cfg))


def test_grid_covers_every_feature_dtype_layout():
    """The covering array really has every feature in every dtype, layout, op and packing."""
    seen = {(r["feature"], r["dtype"]) for r in GRID}
    assert seen == {(f, d) for f in FEATURES for d in DTYPES}
    for factor, values in (("layout", [0, 1]), ("packed", [False, True]), ("op", ["functional", "inplace"])):
        assert {(r["feature"], r[factor]) for r in GRID} == {(f, v) for f in FEATURES for v in values}
    assert {(r["scenario"], r["dtype"]) for r in GRID} == {(s, d) for s in SCENARIOS for d in DTYPES}


# ---- targeted tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [0, 1])
def test_right_padded_prefill_then_decode_inplace(dtype, layout):
    """SPEC §3: prefill right-padded prompts with seqlens_k = S - 1 for every row; valid query
    rows are exact (causality hides the padding keys). Then decode with seqlens_k = len_b: the
    new token overwrites the first padding row and the result equals an unpadded history."""
    dt = DTYPES[dtype]
    B, S, Hq, Hkv, D, C = 3, 8, 4, 2, 16, 12
    lengths = [8, 3, 5]
    case = make_case("inplace", batch=B, seq=S, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                     past_lengths=[0] * B, layout=layout, dtype=dt, rotary="half", sink=True)
    before = case.clone()
    out = case.run()
    # Valid rows of row b must equal attention over the unpadded prompt of lengths[b] tokens.
    for b, n in enumerate(lengths):
        sub = before.clone()
        sub.query, sub.key, sub.value = (t[b:b + 1, :n] for t in (before.query, before.key, before.value))
        sub.cache_key, sub.cache_value = before.cache_key[b:b + 1].clone(), before.cache_value[b:b + 1].clone()
        sub.seqlens_k = torch.tensor([n - 1], dtype=torch.int32)
        ref_out, _, _ = sub.reference()
        assert_output_close(out[b:b + 1, :n], ref_out, None)
    # Decode step: token n of row b goes to row n (seqlens_k = n), overwriting padding.
    step = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                     past_lengths=lengths, layout=layout, dtype=dt, rotary="half", poison_unused=False)
    step.cache_key, step.cache_value = case.cache_key, case.cache_value
    step.cos_cache, step.sin_cache, step.head_sink = case.cos_cache, case.sin_cache, case.head_sink
    step_before = step.clone()
    ref_out, ref_k, ref_v = step_before.reference()
    out2 = step.run()
    assert_output_close(out2, ref_out, step)
    check_caches(step_before, step.cache_key, step.cache_value, ref_k, ref_v)
    # And the decode result equals a history that never had padding: rebuild from scratch.
    for b, n in enumerate(lengths):
        q_hist = torch.cat([before.query[b:b + 1, :n], step_before.query[b:b + 1]], dim=1)
        k_hist = torch.cat([before.key[b:b + 1, :n], step_before.key[b:b + 1]], dim=1)
        v_hist = torch.cat([before.value[b:b + 1, :n], step_before.value[b:b + 1]], dim=1)
        full, _, _ = reference_gqa(q_hist, k_hist, v_hist, None, None, torch.tensor([n], dtype=torch.int32), n + 1,
                                   case.cos_cache, case.sin_cache, None, case.head_sink, **case.attrs)
        assert_output_close(out2[b:b + 1], full[:, n:n + 1], None)


@pytest.mark.parametrize("dtype,layout,packed", [("fp32", 0, False), ("fp16", 1, True), ("bf16", 0, True)])
def test_decode_loop_inplace_matches_functional_and_reference(dtype, layout, packed):
    """Several decode steps with ragged rows: the in-place op on a fixed-capacity cache, the
    functional op threading present -> past, and the reference all agree at every step; the
    in-place cache equals the functional present in its first rows."""
    dt = DTYPES[dtype]
    B, Hq, Hkv, D, C = 3, 6, 2, 32, 20
    start = [2, 7, 0]
    inplace = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                        past_lengths=start, layout=layout, packed=packed, dtype=dt, rotary="interleaved",
                        window=6, smooth=True)
    # Functional past: the same first rows, capacity = the longest past.
    dim = 2 if layout == 0 else 1
    P = max(start)
    past_k = inplace.cache_key.narrow(dim, 0, P).clone()
    past_v = inplace.cache_value.narrow(dim, 0, P).clone()
    for step in range(5):
        lengths = [s + step for s in start]
        if step > 0:
            fresh = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                              past_lengths=lengths, layout=layout, packed=packed, dtype=dt)
            inplace.query, inplace.key, inplace.value = fresh.query, fresh.key, fresh.value
            inplace.seqlens_k = fresh.seqlens_k
        before = inplace.clone()
        ref_out, ref_k, ref_v = before.reference()
        out = inplace.run()
        assert_output_close(out, ref_out, inplace)
        check_caches(before, inplace.cache_key, inplace.cache_value, ref_k, ref_v)
        # Functional op on the same step, with total_sequence_length = max total.
        f_out, pk, pv = gqa_torch.group_query_attention(
            inplace.query, inplace.key, inplace.value, past_k, past_v, inplace.seqlens_k,
            max(lengths) + 1, inplace.cos_cache, inplace.sin_cache, None, None, **inplace.attrs)
        assert bits_equal(f_out, out), "functional and in-place outputs differ on the same inputs"
        for b, n in enumerate(lengths):
            for present, cache in ((pk, inplace.cache_key), (pv, inplace.cache_value)):
                assert bits_equal(present[b].narrow(dim - 1, 0, n + 1), cache[b].narrow(dim - 1, 0, n + 1))
        past_k, past_v = pk, pv


def test_functional_no_past_with_larger_total_sequence_length():
    """No past, total_sequence_length > S: not a first prompt; C = total_sequence_length, every
    row must have total_b = S, and rows S..C-1 of the present are zero."""
    case = make_case("functional", batch=2, seq=3, capacity=None, past_lengths=[0, 0], extra_total=4,
                     rotary="half")
    assert case.total_sequence_length == 7
    run_and_check(case)


def test_functional_past_capacity_above_total():
    """C = max(P, total_sequence_length) = P when the past buffer is the larger."""
    case = make_case("functional", batch=2, seq=2, capacity=16, past_lengths=[3, 1], layout=1, sink=True)
    assert case.total_sequence_length == 5
    out, pk, _ = case.clone().run()
    assert pk.shape[1] == 16
    run_and_check(case)


def test_first_prompt_with_every_row_padded():
    """A first prompt where no row is full (S == total_sequence_length still decides the mode)."""
    case = make_case("functional", batch=3, seq=6, capacity=None, first_prompt=True, prompt_lengths=[2, 5, 1],
                     rotary="interleaved", dtype=torch.float16)
    run_and_check(case)


@pytest.mark.parametrize("op", ["functional", "inplace"])
def test_seqlens_k_shapes(op):
    """seqlens_k as [B], [B, 1] and (B == 1) a scalar give bit-identical results."""
    for batch in (1, 2):
        case = make_case(op, batch=batch, seq=2, capacity=8, rotary="half")
        shapes = [case.seqlens_k, case.seqlens_k.reshape(batch, 1)]
        if batch == 1:
            shapes.append(case.seqlens_k.reshape(()))
        results = []
        for sl in shapes:
            c = case.clone()
            c.seqlens_k = sl
            out = c.run()
            results.append((out if op == "inplace" else out[0], c.cache_key if op == "inplace" else out[1]))
        ref_out, _, _ = case.clone().reference()
        assert_output_close(results[0][0], ref_out, case)
        for out, cache in results[1:]:
            assert bits_equal(out, results[0][0]) and bits_equal(cache, results[0][1])


def test_position_ids_without_rotary_are_ignored():
    """Positions only steer RoPE (as in ORT): without do_rotary, even out-of-range position_ids
    change nothing."""
    case = make_case("inplace", batch=2, seq=3, capacity=8, window=2)
    plain = case.clone()
    with_pos = case.clone()
    with_pos.position_ids = torch.tensor([[-5, 10**9, 3], [7, 7, 7]], dtype=torch.int64)
    a, b = plain.run(), with_pos.run()
    assert bits_equal(a, b) and bits_equal(plain.cache_key, with_pos.cache_key)
    ref_out, _, _ = case.reference()
    assert_output_close(a, ref_out, case)


def test_position_ids_match_implicit_positions():
    """position_ids equal to the implicit positions (past_b + s) give the same result as none."""
    case = make_case("inplace", batch=3, seq=4, capacity=12, rotary="half")
    explicit = case.clone()
    explicit.position_ids = torch.stack([torch.arange(4) + p for p in case.pasts]).to(torch.int64)
    implicit = case.clone()
    assert bits_equal(explicit.run(), implicit.run())
    assert bits_equal(explicit.cache_key, implicit.cache_key)


def test_rotary_changes_result_and_positions_matter():
    """Guards the tests themselves: RoPE with shifted positions must give a different cache,
    so a backend that ignored positions could not pass the parity tests."""
    case = make_case("functional", batch=2, seq=3, capacity=6, rotary="half", position_ids="offset",
                     max_positions=40)
    assert int(case.position_ids.max()) < 39
    shifted = case.clone()
    shifted.position_ids = case.position_ids + 1
    _, k1, _ = case.run()
    _, k2, _ = shifted.run()
    assert not bits_equal(k1, k2)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("scenario", ["decode", "prefill", "window"])
def test_half_precision_no_worse_than_sdpa(dtype, scenario):
    """SPEC §5: ‖out − ref‖/‖ref‖ within the dtype bound and no worse than
    F.scaled_dot_product_attention on the same (rotated, rounded) inputs by more than 1.5x."""
    dt = DTYPES[dtype]
    B, Hq, Hkv, D = 2, 8, 2, 64
    if scenario == "decode":
        case = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=300,
                         past_lengths=[250, 280], dtype=dt, rotary="half")
    else:
        case = make_case("inplace", batch=B, seq=48, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=64,
                         past_lengths=[0, 10], dtype=dt, rotary="half", window=17 if scenario == "window" else -1)
    before = case.clone()
    ref_out, ref_k, ref_v = before.reference()
    out = case.run()
    err = assert_output_close(out, ref_out, case)
    # SDPA on the same data: caches after the call (rotated keys, rounded), rotated rounded q.
    geometry = before.geometry()
    q, _, _ = reference_rotated_qkv(before.query, before.key, before.value, before.seqlens_k, geometry,
                                    before.cos_cache, before.sin_cache, None, num_heads=Hq, kv_num_heads=Hkv,
                                    do_rotary=True, rotary_interleaved=False)
    sdpa_err = 0.0
    for b, g in enumerate(geometry):
        k = case.cache_key[b, :, :g.total].repeat_interleave(Hq // Hkv, dim=0)
        v = case.cache_value[b, :, :g.total].repeat_interleave(Hq // Hkv, dim=0)
        pos = torch.arange(case.seq) + g.query_start
        j = torch.arange(g.total)
        mask = j[None, :] <= pos[:, None]
        if case.attrs["local_window_size"] > 0:
            mask &= j[None, :] > pos[:, None] - case.attrs["local_window_size"]
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask)  # [Hq, S, D] in dt
        o = o.transpose(0, 1).reshape(1, case.seq, Hq * D)
        sdpa_err = max(sdpa_err, output_error(o, ref_out[b:b + 1]))
    record_error("sdpa", dt, sdpa_err)
    assert err <= max(1.5 * sdpa_err, NORM_REL[dt] / 10), f"gqa error {err:.3g} vs SDPA {sdpa_err:.3g}"


@pytest.mark.parametrize("dtype,amplitude", [("fp16", 200.0), ("bf16", 2000.0), ("fp32", 1e4)])
def test_large_logits_do_not_overflow(dtype, amplitude):
    """SPEC §5: huge logits (|q·k| up to ~1e8..1e10) must not overflow the softmax: finite
    output within tolerance (the result is nearly one-hot)."""
    dt = DTYPES[dtype]
    case = make_case("inplace", batch=2, seq=5, capacity=12, head_dim=32, dtype=dt, q_amplitude=amplitude)
    case.key.mul_(amplitude / 10)
    run_and_check(case)


def test_long_rows_split_keys_single_row():
    """B = Hkv = 1 with ~2000 keys: the CPU backend splits the key range and merges by
    log-sum-exp; it must equal the reference (window crossing the split boundary too)."""
    for window, sink in ((-1, False), (700, True)):
        case = make_case("inplace", batch=1, seq=1, num_heads=4, kv_num_heads=1, head_dim=64, capacity=2100,
                         past_lengths=[2050], window=window, sink=sink, smooth=True)
        run_and_check(case)
    case = make_case("functional", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=32, capacity=1600,
                     past_lengths=[1555], rotary="half", dtype=torch.bfloat16)
    run_and_check(case)


def test_long_prefill_many_query_tiles():
    """A prefill longer than the backend's query tile (32) with a past and a window."""
    case = make_case("inplace", batch=2, seq=70, num_heads=4, kv_num_heads=2, head_dim=32, capacity=100,
                     past_lengths=[20, 3], window=40, rotary="half", dtype=torch.float16)
    run_and_check(case)
    case = make_case("functional", batch=2, seq=70, num_heads=8, kv_num_heads=1, head_dim=24, capacity=None,
                     first_prompt=True, prompt_lengths=[70, 33], sink=True)
    run_and_check(case)


def test_results_are_deterministic():
    case = make_case("functional", batch=2, seq=9, capacity=10, rotary="half", window=4, dtype=torch.bfloat16)
    a = case.clone().run()
    b = case.clone().run()
    for x, y in zip(a, b):
        assert bits_equal(x, y)


def test_thread_count_does_not_change_results():
    """The CPU backend divides work by the thread count; the result must not depend on it
    beyond fp32 rounding of the split merge (checked against the reference at both counts)."""
    case = make_case("inplace", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=32, capacity=1500,
                     past_lengths=[1400])
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            run_and_check(case.clone())
    finally:
        torch.set_num_threads(old)


def test_fused_cache_fill_covers_every_present_row():
    """With one query tile a head, each attention task fills the present rows of its own key
    split just before it reads them (gqa_cpu.cpp, run_typed). Together the tasks must write all
    of it: the copied past (its unused rows are NaN and must not be copied), the new row and the
    zero tail up to the capacity. At 1, 2 and 4 threads (2 to 4 key splits), with a window that
    starts inside a split, and with enough heads for one split each and S > 1."""
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            for window in (-1, 700):
                case = make_case("functional", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=32,
                                 capacity=2400, past_lengths=[2300], extra_total=37, window=window,
                                 rotary="half", layout=window > 0)
                run_and_check(case)
            case = make_case("functional", batch=4, seq=3, num_heads=8, kv_num_heads=4, head_dim=16, capacity=60,
                             past_lengths=[5, 40, 0, 57], extra_total=3, rotary="interleaved", dtype=torch.bfloat16)
            run_and_check(case)
    finally:
        torch.set_num_threads(old)


# The set this process runs with (gqa_torch/__init__.py reads GQA_CPU_KERNELS), restored after
# the tests below pin others.
PINNED_CPU_KERNELS = os.environ.get("GQA_CPU_KERNELS") or "auto"


@pytest.mark.parametrize("kernel_set", ["baseline", "avx2", "avx512"])
def test_cpu_kernel_sets_match_the_reference(kernel_set):
    """Each instruction set of the CPU backend's inner loops (csrc/cpu/lane_kernels.cpp: 4, 8 and
    16 lanes) against the float64 reference: decode, whose tasks of one or two row blocks take
    the dot products, and prefills, whose tasks of four row blocks or more score against a
    transposed key tile; head sizes that no lane count divides (17, 40, 72), 128 with a key split
    and 256; every feature. A set this CPU lacks is skipped, saying so."""
    gqa_torch._C._set_cpu_kernels(kernel_set)
    try:
        if gqa_torch._C._cpu_kernels() != kernel_set:
            pytest.skip(f"this CPU (or build) has no {kernel_set} kernels; auto runs {gqa_torch._C._cpu_kernels()}")
        cases = [
            make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=72, capacity=300,
                      past_lengths=[250, 97], rotary="half", softcap=2.0, q_amplitude=2.0, sink=True,
                      dtype=torch.bfloat16),
            make_case("inplace", batch=1, seq=1, num_heads=4, kv_num_heads=1, head_dim=128, capacity=2100,
                      past_lengths=[2050], window=700, smooth=True),
            make_case("functional", batch=1, seq=40, num_heads=4, kv_num_heads=1, head_dim=40, capacity=None,
                      first_prompt=True, prompt_lengths=[40], window=9, smooth=True),
            make_case("inplace", batch=1, seq=70, num_heads=8, kv_num_heads=2, head_dim=17, capacity=200,
                      past_lengths=[60], rotary="interleaved", rotary_dim=16, softcap=1.0, dtype=torch.float16),
            make_case("functional", batch=1, seq=33, num_heads=2, kv_num_heads=1, head_dim=256, capacity=40,
                      past_lengths=[5], sink=True, scale=0.1),
            # fp16 decode: the x86 sets' in-register widening, with D % 8 and D % 16 tails.
            make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=36, capacity=300,
                      past_lengths=[250, 97], rotary="half", window=100, dtype=torch.float16),
            make_case("functional", batch=1, seq=1, num_heads=4, kv_num_heads=1, head_dim=128, capacity=2100,
                      past_lengths=[2050], softcap=3.0, sink=True, dtype=torch.float16),
        ]
        for case in cases:
            run_and_check(case)
    finally:
        gqa_torch._C._set_cpu_kernels(PINNED_CPU_KERNELS)


@pytest.mark.parametrize("kernel_set", ["baseline", "avx2", "avx512"])
def test_cpu_fp16_decode_reads_every_fp16_value_exactly(kernel_set):
    """fp16 cache rows widened in registers (vcvtph2ps in the x86 sets, the scalar conversion in
    the head size's tail) give every fp16 value exactly: subnormals, the smallest normal, the
    largest finite values. A one-hot query on one key makes the output that key's V row, so any
    element converted wrongly shows; head size 40 has a tail of 8 past 16 lanes, which gets the
    special values too. (-0 comes out +0, as the sum that starts at +0 makes it.)"""
    gqa_torch._C._set_cpu_kernels(kernel_set)
    try:
        if gqa_torch._C._cpu_kernels() != kernel_set:
            pytest.skip(f"this CPU (or build) has no {kernel_set} kernels; auto runs {gqa_torch._C._cpu_kernels()}")
        D, length = 40, 130
        specials = torch.tensor([2.0 ** -24, -(2.0 ** -24), 1023 * 2.0 ** -24, 2.0 ** -14, 65504.0, -65504.0,
                                 -0.0, 0.0], dtype=torch.float16)
        value_cache = torch.randn(1, 1, length + 1, D).half()
        key_cache = torch.randn(1, 1, length + 1, D).half() * 0.01  # scores near 0 except the chosen key
        picked = 77
        value_cache[0, 0, picked] = specials[torch.randint(0, len(specials), (D,))]
        value_cache[0, 0, picked, :len(specials)] = specials  # each special value in the vector part
        value_cache[0, 0, picked, -len(specials):] = specials  # and in the tail
        key_cache[0, 0, picked] = 0
        key_cache[0, 0, picked, 3] = 60000.0  # with q's 1 there, the score dominates everything else
        query = torch.zeros(1, 1, D, dtype=torch.float16)
        query[0, 0, 3] = 1.0
        out = gqa_torch.group_query_attention_(
            query, key_cache[:, :, length:length + 1].transpose(1, 2).reshape(1, 1, D), torch.zeros(1, 1, D).half(),
            key_cache, value_cache, torch.tensor([length], dtype=torch.int32), num_heads=1, kv_num_heads=1,
            scale=1.0)
        expected = value_cache[0, 0, picked]
        assert torch.equal(out[0, 0], expected), (out[0, 0] - expected).abs().max()
    finally:
        gqa_torch._C._set_cpu_kernels(PINNED_CPU_KERNELS)


def test_cpu_kernel_switch_names_what_it_expects():
    """Auto runs the widest set the CPU has, and a bad name is refused with the accepted ones."""
    assert gqa_torch._C._cpu_kernels() in ("baseline", "avx2", "avx512")
    with pytest.raises(ValueError, match=r'gqa: CPU kernels: expected one of auto, baseline, avx2, avx512, got "sse"'):
        gqa_torch._C._set_cpu_kernels("sse")
    gqa_torch._C._set_cpu_kernels("baseline")
    try:
        assert gqa_torch._C._cpu_kernels() == "baseline"
    finally:
        gqa_torch._C._set_cpu_kernels(PINNED_CPU_KERNELS)


def test_reference_self_checks():
    """The reference itself, on cases whose answer is known without it: one visible key gives
    that key's V exactly; uniform scores give the mean of V; the sink/smooth extra logits only
    shrink the weights."""
    B, S, H, D = 1, 1, 1, 4
    q = torch.randn(B, S, H * D)
    k = torch.randn(B, S, H * D)
    v = torch.randn(B, S, H * D)
    out, pk, pv = reference_gqa(q, k, v, None, None, torch.tensor([0], dtype=torch.int32), 1, num_heads=1,
                                kv_num_heads=1)
    assert torch.allclose(out, v.double())
    # Uniform scores (q = 0 direction): mean of V over the visible keys, window 2 -> last two.
    past_v = torch.randn(1, 1, 3, D)
    past_k = torch.randn(1, 1, 3, D)
    qz = torch.zeros(1, 1, D)
    out, _, _ = reference_gqa(qz, k, v, past_k, past_v, torch.tensor([3], dtype=torch.int32), 4, num_heads=1,
                              kv_num_heads=1, local_window_size=2)
    expected = (past_v[0, 0, 2].double() + v[0, 0].double()) / 2
    assert torch.allclose(out[0, 0], expected)
    out_sink, _, _ = reference_gqa(qz, k, v, past_k, past_v, torch.tensor([3], dtype=torch.int32), 4, num_heads=1,
                                   kv_num_heads=1, local_window_size=2, smooth_softmax=True)
    # exp(0)=1 per key, plus one extra 1 in the denominator: weights 1/3 each.
    assert torch.allclose(out_sink[0, 0], (past_v[0, 0, 2].double() + v[0, 0].double()) / 3)


def test_inplace_cache_exactly_full():
    """C == S with no past: every cache row is written; and a decode that fills the last row."""
    run_and_check(make_case("inplace", batch=2, seq=5, capacity=5, past_lengths=[0, 0], rotary="half"))
    run_and_check(make_case("inplace", batch=2, seq=1, capacity=9, past_lengths=[8, 3], window=4,
                            dtype=torch.bfloat16))


def test_past_present_means_no_first_prompt_mode():
    """With past tensors of P > 0 rows, S == total_sequence_length is an ordinary call (no
    padding mode): rows start at past_b = total_b - S = 0 and C = max(P, S)."""
    case = make_case("functional", batch=2, seq=3, capacity=4, past_lengths=[0, 0], rotary="interleaved")
    assert case.total_sequence_length == 3 and not case.first_prompt
    run_and_check(case)


def test_first_prompt_with_empty_past_tensors():
    """past_key/past_value of P == 0 rows behave as absent (first prompt, padding rows 0)."""
    case = make_case("functional", batch=3, seq=6, capacity=None, first_prompt=True, empty_past=True,
                     prompt_lengths=[6, 2, 4], sink=True, layout=1)
    assert case.cache_key is not None and case.cache_key.shape[1] == 0
    run_and_check(case)


# ---- the checks themselves can fail ---------------------------------------------------------------

def test_checks_detect_wrong_results():
    """Every comparison helper used above rejects a wrong answer: a changed output element, a
    NaN, nonzero padding, one flipped cache bit, a rotated row off by more than the allowance,
    and a write to a guard region."""
    from conftest import assert_cache_matches, ulp_distance
    case = make_case("inplace", batch=2, seq=3, capacity=8, rotary="half", strided=True)
    before = case.clone()
    ref_out, ref_k, ref_v = before.reference()
    out = case.run()
    assert_output_close(out, ref_out, case)
    bad = out.clone()
    bad[1, 2, 5] += 1e-3 * float(ref_out.abs().max())
    with pytest.raises(AssertionError, match="output error"):
        assert_output_close(bad, ref_out, case)
    bad = out.clone()
    bad[0, 0, 0] = math.nan
    with pytest.raises(AssertionError, match="non-finite"):
        assert_output_close(bad, ref_out, case)
    # Caches: one bit.
    k = case.cache_key.clone()
    bits_view = k.view(torch.int32)
    bits_view[1, 0, case.pasts[1], 3] ^= 1
    with pytest.raises(AssertionError, match="key cache"):
        check_caches(before, k, case.cache_value, ref_k, ref_v)
    # ... which 1 ulp of rotary allowance accepts in a rotated row, but not in a value row.
    check_caches(before, k, case.cache_value, ref_k, ref_v, rotary_ulps=1)
    v = case.cache_value.clone()
    v.view(torch.int32)[1, 0, case.pasts[1], 3] ^= 1
    with pytest.raises(AssertionError, match="value cache"):
        check_caches(before, case.cache_key, v, ref_k, ref_v, rotary_ulps=1)
    # NaN canaries compare by bits: a NaN replaced by a number is a difference.
    untouched = case.cache_key.clone()
    untouched[0, 0, -1, 0] = 0.0
    with pytest.raises(AssertionError):
        assert_cache_matches(untouched, ref_k)
    assert int(ulp_distance(torch.tensor([1.0]), torch.tensor([math.nan]))[0]) > 1000
    # Padding rows must be exact zeros.
    fp = make_case("functional", batch=2, seq=4, capacity=None, first_prompt=True, prompt_lengths=[4, 2])
    f_ref, _, _ = fp.clone().reference()
    f_out, _, _ = fp.run()
    assert_output_close(f_out, f_ref, fp)
    f_bad = f_out.clone()
    f_bad[1, 3, 0] = 1e-30
    with pytest.raises(AssertionError, match="padding"):
        assert_output_close(f_bad, f_ref, fp)
    # Half-precision norm-wise check sees one wrong batch row in a batch.
    h = make_case("inplace", batch=4, seq=2, capacity=6, dtype=torch.float16)
    h_ref, _, _ = h.clone().reference()
    h_out = h.run()
    assert_output_close(h_out, h_ref, h)
    h_bad = h_out.clone()
    h_bad[3] = h_bad[3] * 1.01
    with pytest.raises(AssertionError, match="output error"):
        assert_output_close(h_bad, h_ref, h)


def test_guard_region_check_detects_writes():
    """run_and_check's guard-region check fails when the base buffer outside the view changes."""
    case = make_case("inplace", batch=1, seq=1, capacity=4, strided=True)
    original_run = case.run

    def run_and_scribble():
        out = original_run()
        case.cache_base[0][0, 0, 0, 0] = 123.0  # outside the view (the view starts at row 3)
        return out

    case.run = run_and_scribble
    with pytest.raises(AssertionError, match="guard region"):
        run_and_check(case)
