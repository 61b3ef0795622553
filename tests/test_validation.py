"""Bad input (SPEC §4): every host-side rule of csrc/torch/params_builder.cpp raises at once with
a message naming the argument and the expectation; every data-dependent rule raises
gqa_torch.GQAError on CPU with the right flags, before anything is written.

Each host-side test starts from a valid call (checked valid by test_base_calls_are_valid) and
breaks exactly one thing. For the in-place op every rejected call must leave the caches byte
for byte as they were.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import bits_equal, make_case
from conftest import call_op as call

B, S, HQ, HKV, D, P, C, ROWS = 2, 3, 4, 2, 8, 6, 10, 16


def base(op: str, layout: int = 0, dtype=torch.float32) -> dict:
    """A valid call as a dict of arguments: rows with totals 6 and 8 (pasts 3 and 5)."""
    def rnd(*shape, dt=dtype):
        return torch.randn(*shape).to(dt)

    cap = P if op == "functional" else C
    cache_shape = (B, HKV, cap, D) if layout == 0 else (B, cap, HKV, D)
    args = dict(query=rnd(B, S, HQ * D), key=rnd(B, S, HKV * D), value=rnd(B, S, HKV * D),
                cache_key=rnd(*cache_shape), cache_value=rnd(*cache_shape),
                seqlens_k=torch.tensor([5, 7], dtype=torch.int32),
                cos_cache=torch.rand(ROWS, D // 2), sin_cache=torch.rand(ROWS, D // 2),
                position_ids=torch.tensor([[3, 4, 5], [5, 6, 7]], dtype=torch.int64),
                head_sink=torch.randn(HQ),
                attrs=dict(num_heads=HQ, kv_num_heads=HKV, do_rotary=True, kv_layout=layout))
    if op == "functional":
        args["total_sequence_length"] = 8
    return args


def expect_error(op: str, args: dict, exc, pattern: str):
    """Calls and checks the exception type and message; the caches must be unchanged."""
    snapshot = {k: v.clone() for k, v in (("k", args["cache_key"]), ("v", args["cache_value"]))
                if isinstance(v, torch.Tensor) and v.numel() < 10**6 and v.stride().count(0) == 0}
    with pytest.raises(exc, match=pattern) as info:
        call(op, args)
    for name, before in snapshot.items():
        now = args["cache_key" if name == "k" else "cache_value"]
        assert bits_equal(now, before), f"a rejected call modified the {name} cache"
    assert not isinstance(info.value, gqa_torch.GQAError), "host-side rules are not GQAErrors"
    return info.value


def with_attrs(args: dict, **attrs) -> dict:
    out = dict(args)
    out["attrs"] = dict(args["attrs"], **attrs)
    return out


def replace(args: dict, **tensors) -> dict:
    out = dict(args)
    out.update(tensors)
    return out


OPS = ["functional", "inplace"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", [0, 1])
def test_base_calls_are_valid(op, layout):
    """The starting points of every test below run cleanly (so each error has one cause)."""
    args = base(op, layout)
    out = call(op, args)
    out = out[0] if op == "functional" else out
    assert out.shape == (B, S, HQ * D) and torch.isfinite(out).all()


# ---- attributes ---------------------------------------------------------------------------------

ATTRIBUTE_CASES = [
    (dict(num_heads=0), r"gqa: num_heads: expected a positive head count, got 0"),
    (dict(num_heads=-4), r"gqa: num_heads: expected a positive head count, got -4"),
    (dict(kv_num_heads=0), r"gqa: kv_num_heads: expected a positive head count, got 0"),
    (dict(kv_num_heads=-2), r"gqa: kv_num_heads: expected a positive head count, got -2"),
    (dict(num_heads=3), r"gqa: num_heads: expected a multiple of kv_num_heads \(2\), got 3"),
    (dict(local_window_size=0), r"gqa: local_window_size: expected -1 \(off\) or a positive window, got 0"),
    (dict(local_window_size=-2), r"gqa: local_window_size: expected -1 \(off\) or a positive window, got -2"),
    (dict(local_window_size=2**31), r"gqa: local_window_size = 2147483648 overflows 32-bit indexing; expected at most 2147483647"),
    (dict(softcap=-1.0), r"gqa: softcap: expected a finite value >= 0 \(0 = off\), got -1"),
    (dict(softcap=math.inf), r"gqa: softcap: expected a finite value >= 0 \(0 = off\), got inf"),
    (dict(softcap=math.nan), r"gqa: softcap: expected a finite value >= 0 \(0 = off\), got nan"),
    (dict(scale=math.inf), r"gqa: scale: expected a finite value \(0 = 1/sqrt\(head_size\)\), got inf"),
    (dict(scale=math.nan), r"gqa: scale: expected a finite value \(0 = 1/sqrt\(head_size\)\), got nan"),
    (dict(kv_layout=2), r"gqa: kv_layout: expected 0 \(BNSH\) or 1 \(BSNH\), got 2"),
    (dict(kv_layout=-1), r"gqa: kv_layout: expected 0 \(BNSH\) or 1 \(BSNH\), got -1"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("attrs,pattern", ATTRIBUTE_CASES, ids=[re.sub(r"\W", "", str(a)) for a, _ in ATTRIBUTE_CASES])
def test_attribute_rules(op, attrs, pattern):
    expect_error(op, with_attrs(base(op), **attrs), ValueError, pattern)


# ---- query / key / value -------------------------------------------------------------------------

def _q(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


QKV_CASES = [
    ("query_float64", lambda a: replace(a, query=a["query"].double()), TypeError,
     r"gqa: query: expected dtype float32, float16 or bfloat16, got Double"),
    ("query_int", lambda a: replace(a, query=torch.ones(B, S, HQ * D, dtype=torch.int32)), TypeError,
     r"gqa: query: expected dtype float32, float16 or bfloat16, got Int"),
    ("query_2d", lambda a: replace(a, query=_q(B, S * HQ * D)), ValueError,
     r"gqa: query: expected a 3-D tensor \[batch, sequence, hidden\], got shape \[2, 96\]"),
    ("query_4d", lambda a: replace(a, query=_q(B, S, HQ, D)), ValueError,
     r"gqa: query: expected a 3-D tensor \[batch, sequence, hidden\], got shape \[2, 3, 4, 8\]"),
    ("query_hidden_strided", lambda a: replace(a, query=_q(B, S, 2 * HQ * D)[..., ::2]), ValueError,
     r"gqa: query: expected the hidden dimension to be contiguous \(stride 1\), got strides \[192, 64, 2\]"),
    ("key_without_value", lambda a: replace(a, value=None), ValueError,
     r"gqa: key/value: expected both present or both absent \(packed QKV\), got key present and value absent"),
    ("value_without_key", lambda a: replace(a, key=None), ValueError,
     r"gqa: key/value: expected both present or both absent \(packed QKV\), got key absent and value present"),
    ("hidden_not_multiple", lambda a: replace(a, query=_q(B, S, 33)), ValueError,
     r"gqa: query: expected hidden size num_heads\*head_size = \(4\)\*head_size, got 33 \(shape \[2, 3, 33\]\)"),
    ("packed_hidden_not_multiple", lambda a: replace(a, query=_q(B, S, 65), key=None, value=None), ValueError,
     r"gqa: query: expected hidden size \(num_heads \+ 2\*kv_num_heads\)\*head_size = \(8\)\*head_size, got 65"),
    ("hidden_zero", lambda a: replace(a, query=_q(B, S, 0)), ValueError,
     r"gqa: query: expected hidden size num_heads\*head_size = \(4\)\*head_size, got 0"),
    ("batch_zero", lambda a: replace(a, query=_q(0, S, HQ * D), key=_q(0, S, HKV * D), value=_q(0, S, HKV * D)),
     ValueError, r"gqa: query: expected batch >= 1, got shape \[0, 3, 32\]"),
    ("seq_zero", lambda a: replace(a, query=_q(B, 0, HQ * D), key=_q(B, 0, HKV * D), value=_q(B, 0, HKV * D)),
     ValueError, r"gqa: query: expected sequence length >= 1, got shape \[2, 0, 32\]"),
    ("key_dtype", lambda a: replace(a, key=a["key"].half()), TypeError,
     r"gqa: key: expected dtype Float \(the dtype of query\), got Half"),
    ("value_dtype", lambda a: replace(a, value=a["value"].bfloat16()), TypeError,
     r"gqa: value: expected dtype Float \(the dtype of query\), got BFloat16"),
    ("key_2d", lambda a: replace(a, key=_q(B, S * HKV * D)), ValueError,
     r"gqa: key: expected a 3-D tensor \[batch, sequence, hidden\], got shape \[2, 48\]"),
    ("value_hidden_strided", lambda a: replace(a, value=_q(B, S, 2 * HKV * D)[..., 1::2]), ValueError,
     r"gqa: value: expected the hidden dimension to be contiguous \(stride 1\)"),
    ("key_seq_mismatch", lambda a: replace(a, key=_q(B, S + 1, HKV * D)), ValueError,
     r"gqa: key: expected shape \[2, 3, 16\] \(\[batch, sequence_length of query, kv_num_heads\*head_size\]\), got \[2, 4, 16\]"),
    ("key_batch_mismatch", lambda a: replace(a, key=_q(1, S, HKV * D)), ValueError,
     r"gqa: key: expected shape \[2, 3, 16\].*got \[1, 3, 16\]"),
    ("value_hidden_mismatch", lambda a: replace(a, value=_q(B, S, HKV * D + 8)), ValueError,
     r"gqa: value: expected shape \[2, 3, 16\].*got \[2, 3, 24\]"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,mutate,exc,pattern", QKV_CASES, ids=[c[0] for c in QKV_CASES])
def test_query_key_value_rules(op, name, mutate, exc, pattern):
    expect_error(op, mutate(base(op)), exc, pattern)


def test_int32_overflow_rules():
    """Sizes past int32 indexing are refused before any data is touched (expanded views, so no
    memory is allocated)."""
    big = 2**31
    a = base("functional")
    q = torch.randn(1, 1, HQ * D).expand(big, 1, HQ * D)
    kv = torch.randn(1, 1, HKV * D).expand(big, 1, HKV * D)
    expect_error("functional", replace(a, query=q, key=kv, value=kv), ValueError,
                 r"gqa: batch = 2147483648 overflows 32-bit indexing; expected at most 2147483647")
    q = torch.randn(1, 1, (HQ + 2 * HKV) * D).expand(1, big, (HQ + 2 * HKV) * D)
    expect_error("functional", replace(a, query=q, key=None, value=None, cache_key=None, cache_value=None),
                 ValueError, r"gqa: sequence length = 2147483648 overflows 32-bit indexing")
    q = torch.randn(1, 1, HQ * D).expand(2**16, 2**13, HQ * D)
    kv = torch.randn(1, 1, HKV * D).expand(2**16, 2**13, HKV * D)
    expect_error("functional", replace(a, query=q, key=kv, value=kv), ValueError,
                 r"gqa: batch\*num_heads\*sequence_length = 2147483648 overflows 32-bit indexing")
    for op, what in (("functional", "past capacity"), ("inplace", "cache capacity")):
        a = base(op)
        cache = torch.randn(B, HKV, 1, D).expand(B, HKV, big, D)
        expect_error(op, replace(a, cache_key=cache, cache_value=cache), ValueError,
                     rf"gqa: {what} = 2147483648 overflows 32-bit indexing")
    expect_error("functional", dict(base("functional"), total_sequence_length=big), ValueError,
                 r"gqa: total_sequence_length = 2147483648 overflows 32-bit indexing")


# ---- caches ---------------------------------------------------------------------------------------

def _cache_name(op, which):
    return {"functional": ("past_key", "past_value"), "inplace": ("key_cache", "value_cache")}[op][which]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", [0, 1])
def test_cache_rules(op, layout):
    k, v = _cache_name(op, 0), _cache_name(op, 1)
    lay = "BNSH \\[batch, kv_num_heads, capacity, head_size\\]" if layout == 0 else \
        "BSNH \\[batch, capacity, kv_num_heads, head_size\\]"
    a = base(op, layout)
    cap = a["cache_key"].shape[2 if layout == 0 else 1]
    expect_error(op, replace(a, cache_key=a["cache_key"].half()), TypeError,
                 rf"gqa: {k}: expected dtype Float \(the dtype of query\), got Half")
    expect_error(op, replace(a, cache_value=a["cache_value"].double()), TypeError,
                 rf"gqa: {v}: expected dtype Float \(the dtype of query\), got Double")
    expect_error(op, replace(a, cache_key=a["cache_key"][0]), ValueError,
                 rf"gqa: {k}: expected a 4-D {lay} tensor, got shape")
    expect_error(op, replace(a, cache_value=a["cache_value"].unsqueeze(0)), ValueError,
                 rf"gqa: {v}: expected a 4-D {lay} tensor, got shape")
    wrong_batch = a["cache_key"][:1].clone()
    expect_error(op, replace(a, cache_key=wrong_batch), ValueError,
                 rf"gqa: {k}: expected {lay} with batch=2, kv_num_heads=2, head_size=8, got shape \[1, ")
    if layout == 0:
        wrong_heads, wrong_dim = torch.randn(B, HKV + 1, cap, D), torch.randn(B, HKV, cap, D + 2)
    else:
        wrong_heads, wrong_dim = torch.randn(B, cap, HKV + 1, D), torch.randn(B, cap, HKV, D + 2)
    expect_error(op, replace(a, cache_key=wrong_heads, cache_value=wrong_heads.clone()), ValueError,
                 rf"gqa: {k}: expected {lay} with batch=2, kv_num_heads=2, head_size=8, got shape")
    expect_error(op, replace(a, cache_key=wrong_dim, cache_value=wrong_dim.clone()), ValueError,
                 rf"gqa: {k}: expected {lay} with batch=2, kv_num_heads=2, head_size=8")
    # The other layout's tensor is caught (capacity != kv heads here).
    other = a["cache_key"].transpose(1, 2).contiguous()
    expect_error(op, replace(a, cache_key=other, cache_value=other.clone()), ValueError,
                 rf"gqa: {k}: expected {lay} with batch=2, kv_num_heads=2, head_size=8, got shape")
    strided = torch.randn(*a["cache_key"].shape[:3], 2 * D)[..., ::2]
    expect_error(op, replace(a, cache_key=strided, cache_value=strided.clone()), ValueError,
                 rf"gqa: {k}: expected the head_size dimension to be contiguous \(stride 1\), got strides")
    bigger = torch.cat([a["cache_value"], a["cache_value"]], dim=2 if layout == 0 else 1)
    expect_error(op, replace(a, cache_value=bigger), ValueError,
                 rf"gqa: {v}: expected the shape of {k} \[.*\], got \[.*\]")
    # Same shape, other strides: a view into a larger capacity buffer.
    dim = 2 if layout == 0 else 1
    view = torch.randn(*[(s * 2 if i == dim else s) for i, s in enumerate(a["cache_value"].shape)]).narrow(dim, 0, cap)
    expect_error(op, replace(a, cache_value=view), ValueError,
                 rf"gqa: {v}: expected the strides of {k} \[.*\], got \[.*\]")


def test_past_both_or_neither():
    a = base("functional")
    expect_error("functional", replace(a, cache_value=None), ValueError,
                 r"gqa: past_key/past_value: expected both present or both absent, got past_key present and past_value absent")
    expect_error("functional", replace(a, cache_key=None), ValueError,
                 r"gqa: past_key/past_value: expected both present or both absent, got past_key absent and past_value present")


def test_inplace_cache_capacity_at_least_one():
    a = base("inplace")
    empty = torch.randn(B, HKV, 0, D)
    expect_error("inplace", replace(a, cache_key=empty, cache_value=empty.clone()), ValueError,
                 r"gqa: key_cache: expected a capacity >= 1, got shape \[2, 2, 0, 8\]")


def test_inplace_cache_required():
    """The schema makes the caches mandatory: None is refused (by the dispatcher) before any
    work; the message is torch's own."""
    a = base("inplace")
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        call("inplace", replace(a, cache_key=None, cache_value=None))


def test_total_sequence_length_rules():
    a = base("functional")
    expect_error("functional", dict(a, total_sequence_length=-1), ValueError,
                 r"gqa: total_sequence_length: expected a value >= 0, got -1")
    with pytest.raises(TypeError, match="needs seqlens_k and total_sequence_length"):
        gqa_torch.group_query_attention(a["query"], a["key"], a["value"], None, None, a["seqlens_k"], None,
                                        num_heads=HQ, kv_num_heads=HKV)
    with pytest.raises(TypeError, match="needs seqlens_k and total_sequence_length"):
        gqa_torch.group_query_attention(a["query"], a["key"], a["value"], None, None, None, 8,
                                        num_heads=HQ, kv_num_heads=HKV)


# ---- seqlens_k ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_seqlens_rules(op):
    a = base(op)
    expect_error(op, replace(a, seqlens_k=a["seqlens_k"].long()), TypeError,
                 r"gqa: seqlens_k: expected dtype int32, got Long")
    expect_error(op, replace(a, seqlens_k=a["seqlens_k"].float()), TypeError,
                 r"gqa: seqlens_k: expected dtype int32, got Float")
    expect_error(op, replace(a, seqlens_k=torch.tensor([5, 7, 7], dtype=torch.int32)), ValueError,
                 r"gqa: seqlens_k: expected shape \[2\] or \[2, 1\], got \[3\]")
    expect_error(op, replace(a, seqlens_k=torch.tensor([[5, 7]], dtype=torch.int32)), ValueError,
                 r"gqa: seqlens_k: expected shape \[2\] or \[2, 1\], got \[1, 2\]")
    expect_error(op, replace(a, seqlens_k=torch.tensor(5, dtype=torch.int32)), ValueError,
                 r"gqa: seqlens_k: expected shape \[2\] or \[2, 1\], got \[\]")
    strided = torch.tensor([5, 0, 7, 0], dtype=torch.int32)[::2]
    expect_error(op, replace(a, seqlens_k=strided), ValueError,
                 r"gqa: seqlens_k: expected a contiguous tensor, got strides \[2\]")


def test_seqlens_shape_message_mentions_scalar_when_batch_is_one():
    a = base("inplace")
    a = replace(a, query=a["query"][:1], key=a["key"][:1], value=a["value"][:1], cache_key=a["cache_key"][:1],
                cache_value=a["cache_value"][:1], position_ids=a["position_ids"][:1],
                seqlens_k=torch.tensor([5, 5], dtype=torch.int32))
    expect_error("inplace", a, ValueError, r"gqa: seqlens_k: expected shape \[1\] or \[1, 1\] or a scalar, got \[2\]")


# ---- rotary, position_ids, head_sink -------------------------------------------------------------

ROTARY_CASES = [
    ("no_cos_sin", lambda a: replace(a, cos_cache=None, sin_cache=None), ValueError,
     r"gqa: cos_cache/sin_cache: expected both when do_rotary=True, got cos_cache absent and sin_cache absent"),
    ("no_sin", lambda a: replace(a, sin_cache=None), ValueError,
     r"gqa: cos_cache/sin_cache: expected both when do_rotary=True, got cos_cache present and sin_cache absent"),
    ("no_cos", lambda a: replace(a, cos_cache=None), ValueError,
     r"got cos_cache absent and sin_cache present"),
    ("cos_1d", lambda a: replace(a, cos_cache=torch.rand(ROWS), sin_cache=torch.rand(ROWS)), ValueError,
     r"gqa: cos_cache: expected a 2-D tensor \[max_positions, rotary_dim/2\], got shape \[16\]"),
    ("cos_3d", lambda a: replace(a, cos_cache=torch.rand(1, ROWS, 4), sin_cache=torch.rand(1, ROWS, 4)), ValueError,
     r"gqa: cos_cache: expected a 2-D tensor \[max_positions, rotary_dim/2\], got shape \[1, 16, 4\]"),
    ("sin_shape", lambda a: replace(a, sin_cache=torch.rand(ROWS, 2)), ValueError,
     r"gqa: sin_cache: expected the shape of cos_cache \[16, 4\], got \[16, 2\]"),
    ("sin_rows", lambda a: replace(a, sin_cache=torch.rand(ROWS + 1, 4)), ValueError,
     r"gqa: sin_cache: expected the shape of cos_cache \[16, 4\], got \[17, 4\]"),
    ("sin_dtype", lambda a: replace(a, sin_cache=a["sin_cache"].half()), TypeError,
     r"gqa: sin_cache: expected the dtype of cos_cache Float, got Half"),
    ("cos_half_for_fp32_query", lambda a: replace(a, cos_cache=a["cos_cache"].half(), sin_cache=a["sin_cache"].half()),
     TypeError, r"gqa: cos_cache: expected dtype float32, got Half"),
    ("cos_double", lambda a: replace(a, cos_cache=a["cos_cache"].double(), sin_cache=a["sin_cache"].double()),
     TypeError, r"gqa: cos_cache: expected dtype float32, got Double"),
    ("cos_strided", lambda a: replace(a, cos_cache=torch.rand(ROWS, 8)[:, ::2], sin_cache=torch.rand(ROWS, 8)[:, ::2]),
     ValueError, r"gqa: cos_cache/sin_cache: expected contiguous tensors, got strides \[8, 2\] and \[8, 2\]"),
    ("sin_strided", lambda a: replace(a, sin_cache=torch.rand(4, ROWS).t()), ValueError,
     r"gqa: cos_cache/sin_cache: expected contiguous tensors, got strides \[4, 1\] and \[1, 16\]"),
    ("cos_width_zero", lambda a: replace(a, cos_cache=torch.rand(ROWS, 0), sin_cache=torch.rand(ROWS, 0)), ValueError,
     r"gqa: cos_cache: expected width rotary_dim/2 with 2 <= rotary_dim <= head_size \(8\), got width 0 \(shape \[16, 0\]\)"),
    ("cos_too_wide", lambda a: replace(a, cos_cache=torch.rand(ROWS, 5), sin_cache=torch.rand(ROWS, 5)), ValueError,
     r"gqa: cos_cache: expected width rotary_dim/2 with 2 <= rotary_dim <= head_size \(8\), got width 5 \(shape \[16, 5\]\)"),
    ("cos_no_rows", lambda a: replace(a, cos_cache=torch.rand(0, 4), sin_cache=torch.rand(0, 4)), ValueError,
     r"gqa: cos_cache: expected at least one position row, got shape \[0, 4\]"),
    ("position_ids_int32", lambda a: replace(a, position_ids=a["position_ids"].int()), TypeError,
     r"gqa: position_ids: expected dtype int64, got Int"),
    ("position_ids_shape", lambda a: replace(a, position_ids=a["position_ids"][:, :2].contiguous()), ValueError,
     r"gqa: position_ids: expected shape \[2, 3\] \(\[batch, sequence_length\]\), got \[2, 2\]"),
    ("position_ids_1d", lambda a: replace(a, position_ids=a["position_ids"].reshape(-1)), ValueError,
     r"gqa: position_ids: expected shape \[2, 3\] \(\[batch, sequence_length\]\), got \[6\]"),
    ("position_ids_strided", lambda a: replace(a, position_ids=a["position_ids"].repeat(1, 2)[:, ::2]), ValueError,
     r"gqa: position_ids: expected a contiguous tensor, got strides \[6, 2\]"),
    ("head_sink_half", lambda a: replace(a, head_sink=a["head_sink"].half()), TypeError,
     r"gqa: head_sink: expected dtype float32, got Half"),
    ("head_sink_shape", lambda a: replace(a, head_sink=torch.randn(HQ - 1)), ValueError,
     r"gqa: head_sink: expected shape \[4\] \(\[num_heads\]\), got \[3\]"),
    ("head_sink_2d", lambda a: replace(a, head_sink=torch.randn(1, HQ)), ValueError,
     r"gqa: head_sink: expected shape \[4\] \(\[num_heads\]\), got \[1, 4\]"),
    ("head_sink_strided", lambda a: replace(a, head_sink=torch.randn(2 * HQ)[::2]), ValueError,
     r"gqa: head_sink: expected a contiguous tensor"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,mutate,exc,pattern", ROTARY_CASES, ids=[c[0] for c in ROTARY_CASES])
def test_rotary_position_sink_rules(op, name, mutate, exc, pattern):
    expect_error(op, mutate(base(op)), exc, pattern)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_query_cos_dtype_rules(dtype):
    """Half-precision queries accept fp32 cos/sin or cos/sin of the query's own dtype, nothing else."""
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    a = base("inplace", dtype=dtype)
    a["head_sink"] = a["head_sink"].float()
    for ok in (torch.float32, dtype):
        call("inplace", replace(a, cos_cache=a["cos_cache"].to(ok), sin_cache=a["sin_cache"].to(ok)))
    name = "Half" if dtype == torch.float16 else "BFloat16"
    other_name = "BFloat16" if dtype == torch.float16 else "Half"
    expect_error("inplace", replace(a, cos_cache=a["cos_cache"].to(other), sin_cache=a["sin_cache"].to(other)),
                 TypeError, rf"gqa: cos_cache: expected dtype float32 or {name}, got {other_name}")
    expect_error("inplace", replace(a, head_sink=a["head_sink"].to(dtype)), TypeError,
                 rf"gqa: head_sink: expected dtype float32, got {name}")


def test_cos_rules_only_apply_with_rotary():
    """Without do_rotary the cos/sin inputs are not used; position_ids are still shape-checked."""
    a = with_attrs(base("inplace"), do_rotary=False)
    call("inplace", replace(a, cos_cache=torch.rand(3), sin_cache=None))
    expect_error("inplace", replace(a, position_ids=a["position_ids"].int()), TypeError,
                 r"gqa: position_ids: expected dtype int64, got Int")


# ---- data-dependent rules (CPU: GQAError, raised before any write) ---------------------------------

def gqa_case(op, *, seq=S, capacity=None, totals=None, first_prompt=False, rotary=False, max_positions=None,
             layout=0):
    """A valid case (make_case) that tests then break through seqlens_k/position_ids."""
    kwargs = dict(batch=2, seq=seq, num_heads=HQ, kv_num_heads=HKV, head_dim=D, layout=layout,
                  rotary="half" if rotary else None, max_positions=max_positions, poison_unused=False)
    if first_prompt:
        return make_case("functional", capacity=None, first_prompt=True, prompt_lengths=totals, **kwargs)
    return make_case(op, capacity=capacity, past_lengths=[t - seq for t in totals], **kwargs)


def expect_gqa_error(case, flags: int, pattern: str):
    before = case.clone()
    with pytest.raises(gqa_torch.GQAError, match=pattern) as info:
        case.run()
    err = info.value
    assert err.flags == flags, f"flags {err.flags} != expected {flags} ({err})"
    assert err.violations == gerr.decode_flags(flags)
    assert str(err).endswith(f"(flags={flags})")
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    assert "[gqa-error-flags" not in str(err) and "Exception raised from" not in str(err)
    for name, t in before.tensors().items():
        if t is not None:
            assert bits_equal(getattr(case, name), t), f"rejected call modified {name}"
    return err


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("layout", [0, 1])
def test_flag_total_overflow(layout):
    case = gqa_case("inplace", capacity=C, totals=[6, 8], layout=layout)
    case.seqlens_k[1] = INT32_MAX
    expect_gqa_error(case, gerr.TOTAL_OVERFLOW | gerr.CAPACITY,
                     r"gqa: seqlens_k\[1\] = 2147483647, so seqlens_k \+ 1 = 2147483648 does not fit in int32 "
                     r"\(error flag 1, 16: seqlens_k \+ 1 overflows int32; total length \(seqlens_k \+ 1\) exceeds the cache capacity\)")
    case = gqa_case("functional", capacity=P, totals=[6, 8], layout=layout)
    case.seqlens_k[0] = INT32_MAX
    expect_gqa_error(case, gerr.TOTAL_OVERFLOW | gerr.PAST_CAPACITY | gerr.CAPACITY,
                     r"gqa: seqlens_k\[0\] = 2147483647, so seqlens_k \+ 1 = 2147483648 does not fit in int32 \(error flag 1, 8, 16: ")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seqlen", [1, -1, -5, -2**31])
def test_flag_past_and_query_start_negative(op, seqlen):
    """total_b < S: the new tokens would start before position 0 (flags 2 and 4: with S == Sk
    the past length and the query start are the same number)."""
    case = gqa_case(op, capacity=P if op == "functional" else C, totals=[6, 8])
    case.seqlens_k[0] = seqlen
    total = seqlen + 1
    expect_gqa_error(case, gerr.PAST_NEGATIVE | gerr.QUERY_NEGATIVE,
                     rf"gqa: seqlens_k\[0\] = {seqlen} gives total length {total}, which is less than the 3 new tokens "
                     r"of this call \(error flag 2, 4: past length \(seqlens_k \+ 1 - new tokens\) is negative; "
                     r"query start \(seqlens_k \+ 1 - query tokens\) is negative\)")


def test_flag_first_prompt_empty_row():
    case = gqa_case("functional", seq=5, totals=[5, 3], first_prompt=True)
    case.seqlens_k[1] = -1
    expect_gqa_error(case, gerr.PAST_NEGATIVE,
                     r"gqa: seqlens_k\[1\] = -1 gives total length 0, but a row holds at least 1 token "
                     r"\(error flag 2: past length \(seqlens_k \+ 1 - new tokens\) is negative\)")


def test_flag_first_prompt_row_longer_than_prompt():
    """First prompt: C = S, so total_b > S exceeds the present capacity."""
    case = gqa_case("functional", seq=5, totals=[5, 3], first_prompt=True)
    case.seqlens_k[0] = 5
    expect_gqa_error(case, gerr.CAPACITY,
                     r"gqa: seqlens_k\[0\] = 5 gives total length 6, which exceeds the cache capacity 5 \(error flag 16: ")


@pytest.mark.parametrize("layout", [0, 1])
def test_flag_past_capacity(layout):
    case = gqa_case("functional", capacity=P, totals=[6, 8], layout=layout)
    case.total_sequence_length = 12  # C = 12, so only the past bound is broken
    case.seqlens_k[1] = 10
    expect_gqa_error(case, gerr.PAST_CAPACITY,
                     r"gqa: seqlens_k\[1\] = 10 gives past length 8 \(total length minus the 3 new tokens\), which "
                     r"exceeds the past_key/past_value capacity 6 \(error flag 8: past length exceeds the "
                     r"past_key/past_value capacity\)")


@pytest.mark.parametrize("op", OPS)
def test_flag_capacity(op):
    if op == "inplace":
        case = gqa_case(op, capacity=C, totals=[6, 8])
        case.seqlens_k[0] = C
        bound, total = C, C + 1
    else:
        case = gqa_case(op, capacity=P, totals=[6, 8])  # C = max(6, 8) = 8
        case.seqlens_k[0] = 8  # total 9 > 8, past 6 <= 6
        bound, total = 8, 9
    expect_gqa_error(case, gerr.CAPACITY,
                     rf"gqa: seqlens_k\[0\] = {total - 1} gives total length {total}, which exceeds the cache capacity "
                     rf"{bound} \(error flag 16: total length \(seqlens_k \+ 1\) exceeds the cache capacity\)")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [16, 17, -1, 2**40])
def test_flag_position_ids_out_of_range(op, bad):
    case = gqa_case(op, capacity=P if op == "functional" else C, totals=[6, 8], rotary=True, max_positions=ROWS)
    case.position_ids = torch.tensor([[1, 2, 3], [4, 5, bad]], dtype=torch.int64)
    expect_gqa_error(case, gerr.POSITION,
                     rf"gqa: position_ids\[1, 2\] = {bad} is outside the cos_cache/sin_cache rows \[0, 16\) "
                     r"\(error flag 32: a rotary position is outside the cos_cache/sin_cache rows\)")


@pytest.mark.parametrize("op", OPS)
def test_flag_implicit_position_out_of_range(op):
    """Without position_ids, new token s sits at past_b + s; the cos/sin table must cover it."""
    case = gqa_case(op, capacity=P if op == "functional" else C, totals=[6, 8], rotary=True, max_positions=7)
    expect_gqa_error(case, gerr.POSITION,
                     r"gqa: seqlens_k\[1\] = 7 gives rotary position 7 of row 1 \(token 2\), which is outside the "
                     r"cos_cache/sin_cache rows \[0, 7\) \(error flag 32: ")


def test_flag_position_first_prompt_padding_is_rotated_too():
    """First-prompt padding keys are written to the present (rotated), so their positions
    0..S-1 must be in the table even when every row is shorter."""
    case = gqa_case("functional", seq=5, totals=[3, 2], first_prompt=True, rotary=True, max_positions=4)
    expect_gqa_error(case, gerr.POSITION, r"rotary position 4 of row 0 \(token 4\), which is outside the "
                                          r"cos_cache/sin_cache rows \[0, 4\)")


def test_flags_or_over_rows():
    """Several bad rows: the flags are the OR of every row's violations; the message names the
    first bad row."""
    case = gqa_case("inplace", capacity=C, totals=[6, 8])
    case.seqlens_k[0] = C + 3        # 16
    case.seqlens_k[1] = 0            # 2 | 4
    expect_gqa_error(case, gerr.CAPACITY | gerr.PAST_NEGATIVE | gerr.QUERY_NEGATIVE,
                     r"gqa: seqlens_k\[0\] = 13 gives total length 14, which exceeds the cache capacity 10")


@pytest.mark.parametrize("order", ["position_first", "seqlens_first"])
def test_flags_or_over_rows_position_and_seqlens(order):
    """SPEC §4: the flags name every violated bound (the CUDA kernels OR each row's bits into
    the word). A batch with one row whose position is out of range and another whose total
    exceeds the capacity must report both 16 and 32, whichever row comes first."""
    case = gqa_case("inplace", capacity=C, totals=[6, 8], rotary=True, max_positions=ROWS)
    case.position_ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    bad_pos_row = 0 if order == "position_first" else 1
    case.position_ids[bad_pos_row, 0] = 99
    case.seqlens_k[1 - bad_pos_row] = C  # total C + 1
    err = None
    with pytest.raises(gqa_torch.GQAError) as info:
        case.run()
    err = info.value
    assert err.flags == gerr.POSITION | gerr.CAPACITY, (
        f"GQAError.flags = {err.flags}, expected 48 (position 32 | capacity 16); message: {err}")


def test_check_happens_before_any_write_for_later_bad_rows():
    """Row 0 valid, row 1 bad: the CPU backend must not have written row 0's new K/V."""
    case = gqa_case("inplace", capacity=C, totals=[6, 8], rotary=True, max_positions=ROWS)
    case.position_ids = torch.tensor([[1, 2, 3], [4, 5, 40]], dtype=torch.int64)
    expect_gqa_error(case, gerr.POSITION, r"position_ids\[1, 2\] = 40")


# ---- GQAError decoding helpers ----------------------------------------------------------------------

def test_flag_constants_and_messages_match_the_extension():
    assert [gerr.TOTAL_OVERFLOW, gerr.PAST_NEGATIVE, gerr.QUERY_NEGATIVE, gerr.PAST_CAPACITY, gerr.CAPACITY,
            gerr.POSITION] == [1, 2, 4, 8, 16, 32]
    assert list(gqa_torch._C.error_flag_messages()) == gerr.FLAG_MESSAGES
    assert len(set(gerr.FLAG_MESSAGES)) == 6


def test_decode_flags():
    assert gqa_torch.decode_flags(0) == []
    assert gqa_torch.decode_flags(1) == ["seqlens_k + 1 overflows int32"]
    assert gqa_torch.decode_flags(32 | 1) == [gerr.FLAG_MESSAGES[0], gerr.FLAG_MESSAGES[5]]
    assert gqa_torch.decode_flags(63) == gerr.FLAG_MESSAGES
    assert gqa_torch.decode_flags(64) == ["unknown flags 0x40"]
    assert gqa_torch.decode_flags(64 | 8) == [gerr.FLAG_MESSAGES[3], "unknown flags 0x40"]


def test_gqa_error_object():
    e = gqa_torch.GQAError(6)
    assert e.flags == 6 and e.violations == gerr.FLAG_MESSAGES[1:3]
    assert str(e) == "gqa: " + "; ".join(gerr.FLAG_MESSAGES[1:3]) + " (flags=6)"
    assert isinstance(e, ValueError) and isinstance(e, RuntimeError)
    e = gqa_torch.GQAError(16, "gqa: row 3 is too long")
    assert str(e) == "gqa: row 3 is too long (flags=16)" and e.violations == [gerr.FLAG_MESSAGES[4]]


def test_translate():
    exc = RuntimeError("[gqa-error-flags=40] gqa: something broke\nException raised from foo at bar.cpp:1")
    g = gerr.translate(exc)
    assert isinstance(g, gqa_torch.GQAError) and g.flags == 40
    assert str(g) == "gqa: something broke (flags=40)"
    assert gerr.translate(ValueError("gqa: query: expected ...")) is None
    assert gerr.translate(RuntimeError("")) is None


def test_untagged_errors_pass_through_unchanged():
    """Host-side errors keep their Python type (ValueError/TypeError), not GQAError."""
    a = base("inplace")
    err = expect_error("inplace", with_attrs(a, kv_layout=5), ValueError, "kv_layout")
    assert type(err) is ValueError
    err = expect_error("inplace", replace(a, seqlens_k=a["seqlens_k"].long()), TypeError, "seqlens_k")
    assert type(err) is TypeError


def test_error_word_api_without_cuda():
    """On a machine without the CUDA kernels the error-word helpers are harmless no-ops, and
    the synchronous switch round-trips."""
    if gqa_torch.cuda_kernels_available():
        pytest.skip("CUDA present: covered by test_cuda.py")
    assert gqa_torch.check_errors() is None
    assert gqa_torch.clear_errors() is None
    old = gqa_torch.synchronous_errors()
    try:
        gqa_torch.set_synchronous_errors(True)
        assert gqa_torch.synchronous_errors() is True
        gqa_torch.set_synchronous_errors(False)
        assert gqa_torch.synchronous_errors() is False
    finally:
        gqa_torch.set_synchronous_errors(old)
    if not gqa_torch._C.built_with_cuda():  # a CUDA build on a GPU-less machine fails in the driver instead
        with pytest.raises(RuntimeError, match="error word exists only in a CUDA build"):
            gqa_torch._C.error_word(0)


def test_tuning_switches_name_what_they_expect():
    """The private switches that tests and benchmarks use refuse bad values with a message that
    names the switch and the accepted values."""
    with pytest.raises(ValueError, match=r'gqa: prefill route: expected .*auto.*mma.*wgmma.*, got "nope"'):
        gqa_torch._C._set_prefill_route("nope")
    with pytest.raises(ValueError, match=r'expected one of .*wgmma_ws_kv_pipe, wgmma_ws_bn80, wgmma_ws_kv_pipe_pp, wgmma_ws_kv_pipe3, x_head_groups, x_group_rounds, x_plain_pp, x_one_step, x_narrow_o, x_q_first, x_static_walk, got ""'):
        gqa_torch._C._set_prefill_route("")
    gqa_torch._C._set_prefill_route("wgmma_ws_bn80")
    gqa_torch._C._set_prefill_route("auto")
    # (switch, its name in the message, its values, a refused value, a value other than auto)
    named_switches = [
        (gqa_torch._C._set_decode_loader, "decode loader", (
            "auto, cp_async, tma, regs_k, tma_four_warps, cp_async_shallow, cp_async_one_ahead, tma_one_ahead, "
            "tma_shallow, tma_wide"), "nope",
         "tma"),
        (gqa_torch._C._set_decode_merge, "decode merge", "auto, kernel, arrival", "cluster", "kernel"),
        (gqa_torch._C._set_decode_schedule, "decode schedule",
         "auto, rows, longest_first, keep_splits, two_per_sm, one_wave", "even", "keep_splits"),
        (gqa_torch._C._set_decode_features, "decode features", "auto, general", "plain", "general"),
        (gqa_torch._C._set_decode_early_tiles, "decode early tiles", "auto, off", "late", "off"),
        (gqa_torch._C._set_decode_l2_prefetch, "decode L2 prefetch", "auto, off, on", "evict_last", "on"),
        (gqa_torch._C._set_decode_l2_fetch, "decode L2 fetch", "auto, sectors, 128B, 256B", "64B", "128B"),
        (gqa_torch._C._set_prefill_append, "prefill append", "auto, prep", "kernel", "prep"),
        (gqa_torch._C._set_prefill_q_loader, "prefill Q loader", "auto, cp_async", "tma", "cp_async"),
    ]
    for switch, name, values, refused, accepted in named_switches:
        with pytest.raises(ValueError, match=f'gqa: {name}: expected one of {values}, got "{refused}"'):
            switch(refused)
        switch(accepted)
        switch("auto")
    with pytest.raises(ValueError, match=r"gqa: max_splits: expected 0\.\.128, got 129"):
        gqa_torch._C._set_decode_split_override(129, 0)
    with pytest.raises(ValueError, match=r"gqa: min_split_keys: expected 0\.\.1048576, got -1"):
        gqa_torch._C._set_decode_split_override(0, -1)
    gqa_torch._C._set_decode_split_override(0, 0)  # back to the plan's own choice
    grids = "auto, items, two_per_sm, cut, force"
    with pytest.raises(ValueError, match=f'gqa: decode share grid: expected one of {grids}, got "sms"'):
        gqa_torch._C._set_decode_shares("sms", -1)
    with pytest.raises(ValueError, match=r"gqa: item_keys: expected -1\.\.1048576, got -2"):
        gqa_torch._C._set_decode_shares("auto", -2)
    with pytest.raises(ValueError, match=r"gqa: item_keys: expected -1\.\.1048576, got 1048577"):
        gqa_torch._C._set_decode_shares("items", 1 << 20 | 1)
    gqa_torch._C._set_decode_shares("two_per_sm", 0)
    gqa_torch._C._set_decode_shares("cut", 0)
    gqa_torch._C._set_decode_shares("auto", -1)  # back to the plan's
    with pytest.raises(ValueError, match=r"gqa: shared-memory budget: expected 0\.\.2\^30 bytes, got -1"):
        gqa_torch._C._set_smem_limit(-1)
    with pytest.raises(ValueError, match=r"gqa: shared-memory budget: expected 0\.\.2\^30 bytes, got 1073741825"):
        gqa_torch._C._set_smem_limit((1 << 30) + 1)
    gqa_torch._C._set_smem_limit(0)  # the device's own


def test_cuda_device_support_without_a_gpu():
    """No GPU: cuda_kernels_available() is False, and the device query refuses a device that is
    not there (a CUDA build) or says "no code" (a CPU-only build, which has none for any GPU)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_cuda.py asks about it")
    assert not gqa_torch.cuda_kernels_available()
    if gqa_torch._C.built_with_cuda():
        with pytest.raises(ValueError, match="gqa: device index 0 out of range"):
            gqa_torch._C._cuda_device_support(0)
    else:
        assert gqa_torch._C._cuda_device_support(0) == 2


@pytest.mark.parametrize("kernel,width", [("prefill", 8), ("decode", 16)])
def test_timeline_switches_check_their_buffer(kernel, width):
    """The diagnostic timelines (per prefill block, per decode CTA) take an int64 CUDA tensor
    [n, width] or None; anything else is refused before a pointer is kept (a CPU tensor's
    address would be written by the GPU)."""
    setter = getattr(gqa_torch._C, f"_set_{kernel}_timeline")
    with pytest.raises(ValueError, match=rf"gqa: {kernel} timeline: expected a contiguous int64 CUDA tensor of shape "
                                         rf"\[records, {width}\], got Long \[3, {width}\] on the CPU"):
        setter(torch.zeros(3, width, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"gqa: {kernel} timeline: expected .*, got Long \[3, {width + 1}\] on the CPU"):
        setter(torch.zeros(3, width + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"gqa: {kernel} timeline: expected .*, got Int \[3, {width}\] on the CPU"):
        setter(torch.zeros(3, width, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"gqa: {kernel} timeline: expected .*, got Long \[24\] on the CPU"):
        setter(torch.zeros(24, dtype=torch.int64))
    setter(None)  # off, the default


def test_arrival_lanes_held_refuses_a_device_index_out_of_range():
    """The tests' lane count names a device by index, and a CUDA build refuses one outside
    [0, 64) with a message naming it, before any CUDA call (so this holds on a machine without a
    GPU too). A CPU-only build has no lanes: 0 for every index."""
    if not gqa_torch._C.built_with_cuda():
        assert gqa_torch._C._arrival_lanes_held(0) == 0
        assert gqa_torch._C._arrival_lanes_held(64) == 0
        return
    for bad in (-1, 64, 1 << 40):
        with pytest.raises(ValueError, match=rf"gqa: device index {bad} out of range"):
            gqa_torch._C._arrival_lanes_held(bad)
