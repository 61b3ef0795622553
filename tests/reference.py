"""A float64 reference of both gqa operators, written from SPEC §3 and nothing else.

It is slow and plain on purpose: one batch row at a time, dense masks, no online softmax,
no tiling. It is the judge of the CPU backend and of the CUDA kernels.

Rounding model (so that fp16/bf16 comparisons are fair, SPEC §5 "the same rounded inputs"):

- RoPE is computed in float32 arithmetic and rounded once to the storage dtype (SPEC §3:
  "fp16/bf16 compute in fp32 and round once"). The rotated *key* is what the cache stores, so
  the reference stores exactly that rounded value; the rotated *query* is rounded the same way
  before attention (the implementations write q back in the storage dtype).
- Everything after that (scores, softcap, softmax, the weighted sum of V) is float64.

Entry points:

- ``reference_gqa(...)``: the functional op. Returns ``(output, present_key, present_value)``:
  output float64 ``[B, S, Hq*D]``; presents in the storage dtype, layout ``kv_layout``,
  ``C = max(P, total_sequence_length)`` rows.
- ``reference_gqa_(...)``: the in-place op. Returns ``(output, key_cache, value_cache)``:
  new cache tensors (the inputs are not modified) holding what the caches must hold after the
  call.
- ``reference_row_geometry(...)``: per-row ``(total, past, query_start, valid_queries)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor


# ---- geometry (SPEC §3) -------------------------------------------------------------------

@dataclass
class RowGeometry:
    total: int          # total_b = seqlens_k[b] + 1: valid keys after this call
    past: int           # past_b: where this call's new K/V rows start
    query_start: int    # qstart_b: the position of query token 0
    valid_queries: int  # query rows that attend; the rest (first-prompt padding) output 0


def is_first_prompt(inplace: bool, past_capacity: int, seq: int, total_sequence_length: Optional[int]) -> bool:
    """Functional op only: no past tokens (past absent or P == 0) and S == total_sequence_length."""
    return (not inplace) and past_capacity == 0 and seq == total_sequence_length


def reference_row_geometry(seqlens_k: Tensor, seq: int, *, first_prompt: bool) -> List[RowGeometry]:
    rows = []
    for seqlen in seqlens_k.reshape(-1).tolist():
        total = int(seqlen) + 1
        if first_prompt:
            # New tokens at 0..S-1; query rows s >= total_b are right padding.
            rows.append(RowGeometry(total=total, past=0, query_start=0, valid_queries=min(seq, total)))
        else:
            rows.append(RowGeometry(total=total, past=total - seq, query_start=total - seq, valid_queries=seq))
    return rows


# ---- layouts ---------------------------------------------------------------------------------

def to_bnsh(cache: Tensor, kv_layout: int) -> Tensor:
    """[B, Hkv, C, D] view of a cache in either layout."""
    return cache if kv_layout == 0 else cache.transpose(1, 2)


def from_bnsh(cache_bnsh: Tensor, kv_layout: int) -> Tensor:
    """A contiguous tensor in the requested layout from a [B, Hkv, C, D] tensor."""
    return (cache_bnsh if kv_layout == 0 else cache_bnsh.transpose(1, 2)).contiguous()


def split_qkv(query: Tensor, key: Optional[Tensor], value: Optional[Tensor], num_heads: int,
              kv_num_heads: int) -> Tuple[Tensor, Tensor, Tensor, int]:
    """q [B, S, Hq, D], k and v [B, S, Hkv, D] from separate or packed inputs; and D."""
    batch, seq, hidden = query.shape
    if key is None:
        head_dim = hidden // (num_heads + 2 * kv_num_heads)
        q_width, kv_width = num_heads * head_dim, kv_num_heads * head_dim
        q = query[..., :q_width]
        k = query[..., q_width:q_width + kv_width]
        v = query[..., q_width + kv_width:q_width + 2 * kv_width]
    else:
        head_dim = hidden // num_heads
        q, k, v = query, key, value
    return (q.reshape(batch, seq, num_heads, head_dim), k.reshape(batch, seq, kv_num_heads, head_dim),
            v.reshape(batch, seq, kv_num_heads, head_dim), head_dim)


# ---- RoPE ------------------------------------------------------------------------------------

def rope(x: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor, interleaved: bool) -> Tensor:
    """Rotates the first R = 2*cos.shape[1] dims of x [..., D] (one position per leading row).

    x is [N, H, D] and positions [N]. Computed in float32 and rounded once to x.dtype.
    Pairs are (i, i + R/2) (half split) or (2i, 2i + 1) (interleaved).
    """
    half = cos_cache.shape[1]
    rotary_dim = 2 * half
    cos = cos_cache.float()[positions][:, None, :]  # [N, 1, R/2]
    sin = sin_cache.float()[positions][:, None, :]
    xf = x.float().clone()
    if interleaved:
        x0, x1 = xf[..., 0:rotary_dim:2].clone(), xf[..., 1:rotary_dim:2].clone()
    else:
        x0, x1 = xf[..., :half].clone(), xf[..., half:rotary_dim].clone()
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    if interleaved:
        xf[..., 0:rotary_dim:2] = y0
        xf[..., 1:rotary_dim:2] = y1
    else:
        xf[..., :half] = y0
        xf[..., half:rotary_dim] = y1
    return xf.to(x.dtype)  # dims >= R pass through unchanged (exactly: fp16/bf16 -> fp32 -> back)


# ---- attention -------------------------------------------------------------------------------

def attend_row(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, total: int, *, scale: float,
               local_window_size: int, softcap: float, smooth_softmax: bool,
               head_sink: Optional[Tensor]) -> Tensor:
    """One batch row. q [S', Hq, D] (float64) at absolute `positions` [S']; k, v [Hkv, C, D].

    Query token at position p sees key j iff j <= p, j < total and (W > 0 ⇒ j > p - W).
    Returns [S', Hq, D] float64.
    """
    num_heads, kv_heads = q.shape[1], k.shape[0]
    group = num_heads // kv_heads
    keys = torch.arange(total)
    k = k[:, :total].double()  # [Hkv, total, D]: query head h reads kv head h // G
    v = v[:, :total].double()
    # The query heads grouped by kv head ([S', Hkv, G, D]), so K and V are not repeated G times.
    q_grouped = q.reshape(q.shape[0], kv_heads, group, q.shape[2])
    scores = scale * torch.einsum("skgd,kjd->kgsj", q_grouped, k).reshape(num_heads, q.shape[0], total)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = keys[None, :] <= positions[:, None]
    if local_window_size > 0:
        visible &= keys[None, :] > positions[:, None] - local_window_size
    scores = scores.masked_fill(~visible[None], -math.inf)
    # Extra logits with no value vector: smooth softmax's 0 and the head sink.
    extra = [torch.zeros(num_heads, q.shape[0], 1, dtype=torch.float64)] if smooth_softmax else []
    if head_sink is not None:
        extra.append(head_sink.double()[:, None, None].expand(num_heads, q.shape[0], 1))
    logits = torch.cat([scores] + extra, dim=-1)
    top = logits.max(dim=-1, keepdim=True).values
    weights = torch.exp(logits - top)
    probs = weights / weights.sum(dim=-1, keepdim=True)
    probs = probs[..., :total].reshape(kv_heads, group, q.shape[0], total)
    return torch.einsum("kgsj,kjd->skgd", probs, v).reshape(q.shape[0], num_heads, v.shape[2])


# ---- the operators ---------------------------------------------------------------------------

def _run(query, key, value, cache_key_bnsh, cache_value_bnsh, seqlens_k, geometry, cos_cache, sin_cache,
         position_ids, head_sink, *, num_heads, kv_num_heads, scale, do_rotary, rotary_interleaved,
         local_window_size, softcap, smooth_softmax) -> Tensor:
    """Writes the new rows into cache_*_bnsh [B, Hkv, C, D] (storage dtype, modified in place)
    and returns the float64 output [B, S, Hq*D]."""
    q, k, v, head_dim = split_qkv(query, key, value, num_heads, kv_num_heads)
    batch, seq = q.shape[0], q.shape[1]
    scale = scale if scale != 0.0 else 1.0 / math.sqrt(head_dim)
    output = torch.zeros(batch, seq, num_heads, head_dim, dtype=torch.float64)
    for b, g in enumerate(geometry):
        # Positions of this call's tokens: for attention, and for RoPE unless position_ids.
        token_positions = torch.arange(seq) + g.query_start
        rope_positions = position_ids[b].long() if position_ids is not None else torch.arange(seq) + g.past
        q_b, k_b = q[b], k[b]
        if do_rotary:
            q_b = rope(q_b, rope_positions, cos_cache, sin_cache, rotary_interleaved)
            k_b = rope(k_b, rope_positions, cos_cache, sin_cache, rotary_interleaved)
        # Cache: rows [past_b, past_b + S) get the new K (rotated, rounded) and V.
        cache_key_bnsh[b, :, g.past:g.past + seq] = k_b.transpose(0, 1).to(cache_key_bnsh.dtype)
        cache_value_bnsh[b, :, g.past:g.past + seq] = v[b].transpose(0, 1).to(cache_value_bnsh.dtype)
        n = g.valid_queries
        output[b, :n] = attend_row(
            q_b[:n].double(), cache_key_bnsh[b], cache_value_bnsh[b], token_positions[:n], g.total,
            scale=scale, local_window_size=local_window_size, softcap=softcap,
            smooth_softmax=smooth_softmax, head_sink=head_sink)
        # Rows [n, S) are first-prompt padding: output stays exactly 0.
    return output.reshape(batch, seq, num_heads * head_dim)


def _check_geometry(geometry: List[RowGeometry], *, seq: int, capacity: int, past_capacity: Optional[int],
                    first_prompt: bool) -> None:
    for b, g in enumerate(geometry):
        assert g.total >= 1 and g.past >= 0 and g.query_start >= 0, f"reference: bad seqlens_k in row {b}: {g}"
        assert g.total <= capacity or first_prompt, f"reference: row {b} total {g.total} > capacity {capacity}"
        if past_capacity is not None and not first_prompt:
            assert g.past <= past_capacity, f"reference: row {b} past {g.past} > past capacity {past_capacity}"
        if first_prompt:
            assert seq <= capacity


def reference_gqa(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                  cos_cache=None, sin_cache=None, position_ids=None, head_sink=None, *, num_heads,
                  kv_num_heads, scale=0.0, do_rotary=False, rotary_interleaved=False, local_window_size=-1,
                  softcap=0.0, smooth_softmax=False, kv_layout=0):
    """The functional op: (output float64, present_key, present_value) in the storage dtype."""
    q, _, _, head_dim = split_qkv(query, key, value, num_heads, kv_num_heads)
    batch, seq = q.shape[0], q.shape[1]
    past_capacity = 0 if past_key is None else to_bnsh(past_key, kv_layout).shape[2]
    capacity = max(past_capacity, int(total_sequence_length))
    first_prompt = is_first_prompt(False, past_capacity, seq, total_sequence_length)
    geometry = reference_row_geometry(seqlens_k, seq, first_prompt=first_prompt)
    _check_geometry(geometry, seq=seq, capacity=capacity, past_capacity=past_capacity, first_prompt=first_prompt)

    # present: past rows [0, past_b) copied, everything else zero until the new rows land.
    present_key = torch.zeros(batch, kv_num_heads, capacity, head_dim, dtype=query.dtype)
    present_value = torch.zeros_like(present_key)
    for b, g in enumerate(geometry):
        if g.past > 0:
            present_key[b, :, :g.past] = to_bnsh(past_key, kv_layout)[b, :, :g.past]
            present_value[b, :, :g.past] = to_bnsh(past_value, kv_layout)[b, :, :g.past]
    output = _run(query, key, value, present_key, present_value, seqlens_k, geometry, cos_cache, sin_cache,
                  position_ids, head_sink, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
                  do_rotary=do_rotary, rotary_interleaved=rotary_interleaved, local_window_size=local_window_size,
                  softcap=softcap, smooth_softmax=smooth_softmax)
    return output, from_bnsh(present_key, kv_layout), from_bnsh(present_value, kv_layout)


def reference_gqa_(query, key, value, key_cache, value_cache, seqlens_k, cos_cache=None, sin_cache=None,
                   position_ids=None, head_sink=None, *, num_heads, kv_num_heads, scale=0.0, do_rotary=False,
                   rotary_interleaved=False, local_window_size=-1, softcap=0.0, smooth_softmax=False,
                   kv_layout=0):
    """The in-place op: (output float64, expected key_cache, expected value_cache).

    The caches passed in are not modified; copies are returned in which only the new rows
    [past_b, past_b + S) of every row b differ from the input.
    """
    seq = query.shape[1]
    new_key = to_bnsh(key_cache, kv_layout).clone()
    new_value = to_bnsh(value_cache, kv_layout).clone()
    geometry = reference_row_geometry(seqlens_k, seq, first_prompt=False)
    _check_geometry(geometry, seq=seq, capacity=new_key.shape[2], past_capacity=None, first_prompt=False)
    output = _run(query, key, value, new_key, new_value, seqlens_k, geometry, cos_cache, sin_cache,
                  position_ids, head_sink, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
                  do_rotary=do_rotary, rotary_interleaved=rotary_interleaved, local_window_size=local_window_size,
                  softcap=softcap, smooth_softmax=smooth_softmax)
    return output, from_bnsh(new_key, kv_layout), from_bnsh(new_value, kv_layout)


def reference_rotated_qkv(query, key, value, seqlens_k, geometry, cos_cache, sin_cache, position_ids, *,
                          num_heads, kv_num_heads, do_rotary, rotary_interleaved):
    """q, k (after RoPE, rounded) and v, [B, S, H, D] in the storage dtype, for comparisons
    with other attention implementations (F.scaled_dot_product_attention)."""
    q, k, v, _ = split_qkv(query, key, value, num_heads, kv_num_heads)
    if not do_rotary:
        return q, k, v
    qs, ks = [], []
    for b, g in enumerate(geometry):
        pos = position_ids[b].long() if position_ids is not None else torch.arange(q.shape[1]) + g.past
        qs.append(rope(q[b], pos, cos_cache, sin_cache, rotary_interleaved))
        ks.append(rope(k[b], pos, cos_cache, sin_cache, rotary_interleaved))
    return torch.stack(qs), torch.stack(ks), v


def output_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """fp32: max |out - ref| / max |ref| (per batch row, worst row). fp16/bf16: ‖out - ref‖ /
    ‖ref‖ (per batch row, worst row). Per row, so one bad row of a big batch still shows."""
    out64, ref64 = out.detach().double().cpu(), ref.double().cpu()
    worst = 0.0
    for b in range(ref64.shape[0]):
        o, r = out64[b], ref64[b]
        if out.dtype == torch.float32:
            err = (o - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
        else:
            err = (o - r).norm().item() / max(r.norm().item(), 1e-30)
        if math.isnan(err):
            return math.inf
        worst = max(worst, err)
    return worst
