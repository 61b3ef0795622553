"""The fuzz cases of tests/test_fuzz.py: the case description (:class:`Spec`), the independent
oracle of SPEC §3/§4 (:func:`expected_flags`), the host mutations, the hypothesis strategy that
draws cases (:func:`specs`), and the tensors built from a case: canary-filled buffers with guard
regions around the caches, and their copies on the device. Nothing here calls the operator;
tests/fuzz_check.py does. Imported only after hypothesis is known to be present."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from hypothesis import strategies as st

from reference import to_bnsh

INT32_MAX = 2**31 - 1
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Quiet NaNs with a recognisable payload (so a canary read becomes NaN, and a canary copied
# somewhere shows up as this exact bit pattern).
CANARY = {torch.float32: 0x7FC5A5A5, torch.float16: 0x7E5A, torch.bfloat16: 0x7FDA}


# ---- the case description -------------------------------------------------------------------------

@dataclass
class Spec:
    """Everything about one call; tensors are built from it deterministically (``seed``)."""
    op: str                       # "functional" or "inplace"
    B: int
    S: int
    Hkv: int
    G: int
    D: int
    dtype: str
    layout: int
    packed: bool
    seqlens: List[int]            # seqlens_k values (int32 range)
    past_fill: List[int]          # cache rows [0, past_fill[b]) hold real data (the rest NaN)
    P: Optional[int] = None       # functional: past capacity (None = past absent)
    C: int = 0                    # in-place: cache capacity
    tsl: Optional[int] = None     # functional: total_sequence_length
    seqlens_form: str = "1d"      # "1d" [B], "2d" [B, 1], "0d" (B == 1)
    rotary: Optional[str] = None  # None, "half", "interleaved"
    R: int = 0
    cos_dtype: str = "fp32"
    max_positions: int = 0
    position_ids: Optional[List[List[int]]] = None
    window: int = -1
    softcap: float = 0.0
    smooth: bool = False
    sink: bool = False
    scale: float = 0.0
    amplitude: float = 1.0       # query scale (large: huge logits, nearly one-hot softmax)
    sink_scale: float = 1.5
    threads: int = 0              # intra-op threads for the op (0: the process default); changes the CPU split
    strided: bool = False         # activations are views into canary buffers
    pads: Tuple[int, int, int] = (0, 0, 0)    # cache stride padding: (in row, per head/row block, per batch)
    guards: Tuple[int, int, int] = (1, 1, 1)  # canary elements before / between / after the caches
    host: Optional[str] = None    # a host-checkable mutation, or None
    seed: int = 0
    device: str = "cpu"           # where the op runs (tensors are built on the CPU, then copied)

    @property
    def Hq(self):
        return self.Hkv * self.G


# ---- the independent oracle (SPEC §3/§4) -----------------------------------------------------------

def is_first_prompt(spec: Spec) -> bool:
    """Functional op only: no past tokens (past absent, or P == 0) and S == total_sequence_length."""
    return spec.op == "functional" and not spec.P and spec.S == spec.tsl


def capacity(spec: Spec) -> int:
    return max(spec.P or 0, spec.tsl) if spec.op == "functional" else spec.C


def row_flags(spec: Spec, seqlen: int) -> int:
    """The SPEC §4 bits one row breaks, with exact integers (so seqlens_k + 1 may pass int32)."""
    total, cap = seqlen + 1, capacity(spec)
    flags = 0
    if total > INT32_MAX:
        flags |= 1
    if is_first_prompt(spec):
        # Tokens at 0..S-1, rows s >= total_b are padding; a row needs at least one token
        # (flag 2, as for a negative past) and at most C = S.
        if total < 1:
            flags |= 2
        if total > cap:
            flags |= 16
        return flags
    past = total - spec.S  # Sk == S: the past length and the query start are the same number
    if past < 0:
        flags |= 2 | 4
    if spec.op == "functional" and past > (spec.P or 0):
        flags |= 8
    if total > cap:
        flags |= 16
    return flags


def row_past(spec: Spec, seqlen: int) -> int:
    return 0 if is_first_prompt(spec) else seqlen + 1 - spec.S


def rope_positions(spec: Spec, b: int) -> List[int]:
    if spec.position_ids is not None:
        return list(spec.position_ids[b])
    return [row_past(spec, spec.seqlens[b]) + s for s in range(spec.S)]


def expected_flags(spec: Spec) -> int:
    """OR over rows; rotary positions (all S new tokens, first-prompt padding included, since
    every new key is rotated into the cache) only for rows whose bounds hold."""
    flags = 0
    for b, seqlen in enumerate(spec.seqlens):
        f = row_flags(spec, seqlen)
        flags |= f
        if f == 0 and spec.rotary is not None:
            if any(not (0 <= p < spec.max_positions) for p in rope_positions(spec, b)):
                flags |= 32
    return flags


# ---- host mutations: (name, applies(spec), exception, argument named in the message) ---------------

def cache_names(spec):
    return ("past_key", "past_value") if spec.op == "functional" else ("key_cache", "value_cache")


HOST_MUTATIONS = {
    "seqlens_int64": (lambda s: True, TypeError, r"seqlens_k"),
    "seqlens_float": (lambda s: True, TypeError, r"seqlens_k"),
    "seqlens_shape": (lambda s: True, ValueError, r"seqlens_k"),
    "seqlens_strided": (lambda s: s.B > 1, ValueError, r"seqlens_k"),
    "position_ids_int32": (lambda s: True, TypeError, r"position_ids"),
    "position_ids_shape": (lambda s: True, ValueError, r"position_ids"),
    "cos_too_wide": (lambda s: s.rotary is not None, ValueError, r"cos_cache"),
    "sin_shape": (lambda s: s.rotary is not None, ValueError, r"sin_cache"),
    "cos_dtype": (lambda s: s.rotary is not None, TypeError, r"cos_cache"),
    "sin_missing": (lambda s: s.rotary is not None, ValueError, r"cos_cache/sin_cache"),
    "window_zero": (lambda s: True, ValueError, r"local_window_size"),
    "window_negative": (lambda s: True, ValueError, r"local_window_size"),
    "softcap_negative": (lambda s: True, ValueError, r"softcap"),
    "softcap_nan": (lambda s: True, ValueError, r"softcap"),
    "scale_inf": (lambda s: True, ValueError, r"scale"),
    # Finite doubles that float32 (the attributes' working type, as in ORT) cannot hold.
    "scale_float32_overflow": (lambda s: True, ValueError, r"scale"),
    "softcap_float32_overflow": (lambda s: True, ValueError, r"softcap"),
    "softcap_float32_underflow": (lambda s: True, ValueError, r"softcap"),
    "kv_layout": (lambda s: True, ValueError, r"kv_layout"),
    "head_sink_shape": (lambda s: True, ValueError, r"head_sink"),
    "head_sink_dtype": (lambda s: True, TypeError, r"head_sink"),
    "num_heads_not_multiple": (lambda s: s.Hkv > 1, ValueError, r"num_heads"),
    "value_missing": (lambda s: not s.packed, ValueError, r"key/value"),
    "key_seq": (lambda s: not s.packed, ValueError, r"key"),
    "query_float64": (lambda s: True, TypeError, r"query"),
    "query_hidden": (lambda s: True, ValueError, r"query"),
    "cache_dtype": (lambda s: s.op == "inplace" or s.P is not None, TypeError, "{key}"),
    "cache_head_dim": (lambda s: s.op == "inplace" or s.P is not None, ValueError, "{key}"),
    "cache_value_strides": (lambda s: s.op == "inplace" or s.P is not None, ValueError, "{value}"),
    "past_value_missing": (lambda s: s.op == "functional" and s.P is not None, ValueError, r"past_key/past_value"),
    "capacity_zero": (lambda s: s.op == "inplace", ValueError, r"key_cache"),
    "tsl_negative": (lambda s: s.op == "functional", ValueError, r"total_sequence_length"),
    "tsl_overflow": (lambda s: s.op == "functional", ValueError, r"total_sequence_length"),
}


# ---- strategies -------------------------------------------------------------------------------------

def _bad_seqlen(draw, kind: str, spec_like: dict) -> int:
    S, cap = spec_like["S"], spec_like["cap"]
    if kind == "overflow":
        return INT32_MAX
    if kind == "negative":  # total < S (first prompt: total < 1)
        hi = -1 if spec_like["first"] else S - 2
        return draw(st.one_of(st.integers(-(2**31), hi), st.integers(max(-(2**31), hi - 2), hi)))
    if kind == "over_capacity":  # total just past the capacity
        return cap + draw(st.integers(0, 2))
    if kind == "huge":
        return draw(st.integers(cap, INT32_MAX - 1))
    if kind == "past_over":  # functional: past_b just past P (total = past + S)
        return spec_like["P"] + draw(st.integers(1, 3)) + S - 1
    raise AssertionError(kind)


@st.composite
def specs(draw, op: str, device: str = "cpu") -> Spec:
    B = draw(st.integers(1, 4))
    S = draw(st.integers(1, 9))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    if draw(st.integers(0, 4)) == 0:
        D = draw(st.integers(0, 19)) * 2 + 1  # odd head size
    else:
        D = draw(st.integers(1, 20)) * 2
    if device != "cpu" and draw(st.integers(0, 2)) == 0:
        D = draw(st.sampled_from([64, 80, 96, 128, 256]))  # the tensor-core decode sizes
    dtype = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    regime = draw(st.sampled_from(["small"] * 6 + ["medium"] * 2 + ["long"]))
    if regime == "long":  # > 1024 keys: the CPU backend splits the keys when B*Hkv is small
        B, Hkv = min(B, 2), min(Hkv, 2)

    def extra():
        if regime == "small":
            return draw(st.integers(0, 12))
        if regime == "medium":
            return draw(st.integers(50, 200))
        return draw(st.integers(1025, 2100))

    def draw_past(most):
        if regime == "long":  # near the top, so the rows really are long
            return most - draw(st.integers(0, min(most, 80)))
        return draw(st.integers(0, most))

    make_invalid = draw(st.integers(0, 99)) >= 65  # about a third of the cases break some row
    P = tsl = None
    C = 0
    if op == "inplace":
        C = S + extra()
        mode = "inplace"
        first = False
        pasts = [draw_past(C - S) for _ in range(B)]
        bad_kinds = ["negative", "overflow", "over_capacity", "huge"]
    else:
        mode = draw(st.sampled_from(["past"] * 5 + ["first"] * 3 + ["nopast_long"] + ["tsl_short"]))
        if mode == "first":
            P = draw(st.sampled_from([None, 0]))
            tsl = S
            first = True
            pasts = [0] * B
            bad_kinds = ["negative", "overflow", "over_capacity", "huge"]
        elif mode == "past":
            P = max(1, extra())
            first = False
            pasts = [draw_past(P) for _ in range(B)]
            bad_kinds = ["negative", "overflow", "past_over", "over_capacity", "huge"]
        else:  # no past tokens but total_sequence_length != S (so not a first prompt)
            P = draw(st.sampled_from([None, 0]))
            first = False
            pasts = [0] * B
            bad_kinds = ["negative", "overflow", "past_over"]
    if first:
        totals = [draw(st.integers(1, S)) for _ in range(B)]
        if draw(st.booleans()):
            totals[draw(st.integers(0, B - 1))] = S  # usually at least one full row
    else:
        totals = [p + S for p in pasts]
    if op == "functional" and not first:
        if mode == "past":
            tsl = max(totals) + draw(st.sampled_from([0, 0, 0, 1, 3]))
            if make_invalid and draw(st.booleans()):
                tsl = max(0, max(totals) - draw(st.integers(1, 4)))  # a row exceeds C unless P covers it
        elif mode == "nopast_long":
            tsl = S + draw(st.integers(1, 5))
        else:  # tsl_short: C = tsl < S, so every row's total S exceeds the capacity
            tsl = draw(st.integers(0, S - 1))
    cap = max(P or 0, tsl) if op == "functional" else C
    seqlens = [t - 1 for t in totals]
    if make_invalid:
        ctx = dict(S=S, cap=cap, P=P or 0, first=first)
        bad_rows = draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True))
        for b in bad_rows:
            seqlens[b] = _bad_seqlen(draw, draw(st.sampled_from(bad_kinds)), ctx)

    spec = Spec(op=op, B=B, S=S, Hkv=Hkv, G=G, D=D, dtype=dtype, layout=draw(st.integers(0, 1)),
                packed=draw(st.booleans()), seqlens=seqlens, past_fill=[max(0, p) for p in pasts], P=P, C=C,
                tsl=tsl, seed=draw(st.integers(0, 2**31 - 1)))
    forms = ["1d", "1d", "2d"] + (["0d"] if B == 1 else [])
    spec.seqlens_form = draw(st.sampled_from(forms))

    # ---- RoPE and positions
    if D >= 2 and draw(st.integers(0, 2)) > 0:
        spec.rotary = draw(st.sampled_from(["half", "interleaved"]))
        spec.R = D - D % 2 if draw(st.booleans()) else 2 * draw(st.integers(1, D // 2))
        if dtype != "fp32" and draw(st.booleans()):
            spec.cos_dtype = dtype
        # Rows the valid rows need: past_b + S (first prompt: S, padding keys are rotated too).
        needed = S if first else max(totals)
        if make_invalid and needed > 1 and draw(st.integers(0, 3)) == 0:
            spec.max_positions = draw(st.integers(1, needed - 1))  # implicit positions fall off the table
        else:
            spec.max_positions = needed + draw(st.integers(0, 3))
    pos_mode = draw(st.sampled_from([None, None, "valid", "valid", "bad"] + (["bad"] if make_invalid else [])))
    if pos_mode is not None:
        hi = spec.max_positions if spec.rotary else 2 * cap + 5
        rows = [[draw(st.integers(0, hi - 1)) for _ in range(S)] for _ in range(B)]
        if pos_mode == "bad":  # without rotary, position_ids are ignored: the call stays valid
            b, s = draw(st.integers(0, B - 1)), draw(st.integers(0, S - 1))
            rows[b][s] = draw(st.one_of(st.sampled_from([-1, hi, hi + 1, 2**40, -(2**62)]),
                                        st.integers(-(2**63), -1), st.integers(hi, 2**63 - 1)))
        spec.position_ids = rows

    # ---- attributes
    spec.window = draw(st.sampled_from([-1, -1, -1, 1, 2, 3, 5, 8, 64, INT32_MAX]))
    # Extremes float32 still holds: a subnormal cap (every logit ~ +-1e-40: uniform weights),
    # a cap near FLT_MAX (the identity), a scale that rounds to 0 (uniform weights again).
    spec.softcap = draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 2.0, 30.0, 1e-40, 3e38]))
    spec.smooth = draw(st.booleans())
    spec.sink = draw(st.booleans())
    spec.scale = draw(st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.35, 1.0, -0.3, 1e-50]))
    # Large query amplitudes (huge logits, nearly one-hot softmax) only for fp16/bf16: an fp32
    # q.k accumulated in fp32 is off by ~eps*|q||k|*sqrt(D) in absolute terms, so logits in the
    # hundreds alone cost ~1e-5 of relative output error, the whole fp32 budget of SPEC §5.
    spec.amplitude = draw(st.sampled_from([1.0, 1.0, 1.0, 3.0] + ([30.0] if dtype != "fp32" else [])))
    spec.sink_scale = draw(st.sampled_from([1.5, 1.5, 20.0]))
    spec.threads = draw(st.sampled_from([0, 0, 1, 3, 6]))  # 0: the process default
    spec.strided = draw(st.booleans())
    if draw(st.booleans()):
        spec.pads = (draw(st.integers(0, 3)), draw(st.integers(0, 5)), draw(st.integers(0, 7)))
    spec.guards = (draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 9)))

    # ---- at most one host-checkable mutation
    # (Hypothesis often draws every choice at its simplest value, 0: the rarer branches sit at
    # the top of each range, and the mutation index is rotated by the seed so that its simplest
    # value does not always pick the same mutation.)
    if draw(st.integers(0, 99)) >= 85:
        names = [n for n, (ok, _, _) in HOST_MUTATIONS.items() if ok(spec)]
        spec.host = names[(draw(st.integers(0, len(names) - 1)) + spec.seed) % len(names)]
    spec.device = device
    return spec


# ---- building the tensors ---------------------------------------------------------------------------

def fill_canary(t: torch.Tensor) -> torch.Tensor:
    t.view(INT_VIEW[t.dtype]).fill_(CANARY[t.dtype] if CANARY[t.dtype] < 2**31 else CANARY[t.dtype] - 2**32)
    return t


def _normal(gen, shape, dtype, amplitude=1.0):
    t = torch.randn(*shape, generator=gen, dtype=torch.float32) * amplitude
    return (t + 0.01 * torch.sign(t)).to(dtype)


def cache_geometry(spec: Spec, rows: int):
    """Shape and (padded) strides of one cache of `rows` rows in the spec's layout."""
    pd, ph, pb = spec.pads
    D, H = spec.D, spec.Hkv
    if spec.layout == 0:  # [B, Hkv, rows, D]
        rs = D + pd
        hs = rows * rs + ph
        bs = H * hs + pb
        return (spec.B, H, rows, D), (bs, hs, rs, 1), spec.B * bs
    hs = D + pd           # [B, rows, Hkv, D]
    rs = H * hs + ph
    bs = rows * rs + pb
    return (spec.B, rows, H, D), (bs, rs, hs, 1), spec.B * bs


@dataclass
class Built:
    args: dict                       # op arguments (tensors and attributes)
    buffer: Optional[torch.Tensor]   # in-place: the one buffer holding both caches and guards
    cache_view: Optional[tuple]      # (shape, strides, key offset, value offset)
    inputs: dict = field(default_factory=dict)  # name -> tensor whose bytes must never change


def build(spec: Spec) -> Built:
    gen = torch.Generator().manual_seed(spec.seed)
    dt = DTYPES[spec.dtype]
    B, S, D, Hq, Hkv = spec.B, spec.S, spec.D, spec.Hq, spec.Hkv
    inputs = {}

    def activation(hidden, amplitude, name):
        t = _normal(gen, (B, S, hidden), dt, amplitude)
        if not spec.strided:
            inputs[name] = t
            return t
        base = fill_canary(torch.empty(B, S + 2, hidden + 5, dtype=dt))  # canary margins all around
        view = base[:, 1:1 + S, 2:2 + hidden]
        view.copy_(t)
        inputs[name] = base
        return view

    if spec.packed:
        q = _normal(gen, (B, S, Hq * D), dt, spec.amplitude)
        kv = _normal(gen, (B, S, 2 * Hkv * D), dt)
        full = torch.cat([q, kv], dim=2)
        if spec.strided:
            base = fill_canary(torch.empty(B, S + 2, full.shape[2] + 5, dtype=dt))
            query = base[:, 1:1 + S, 2:2 + full.shape[2]]
            query.copy_(full)
            inputs["query"] = base
        else:
            query = inputs["query"] = full
        key = value = None
    else:
        query = activation(Hq * D, spec.amplitude, "query")
        key = activation(Hkv * D, 1.0, "key")
        value = activation(Hkv * D, 1.0, "value")

    def fill_rows(view):
        """Real data in rows [0, past_fill[b]) of each row b; NaN canaries elsewhere."""
        bnsh = to_bnsh(view, spec.layout)
        fill_canary(bnsh)
        for b, n in enumerate(spec.past_fill):
            n = min(n, bnsh.shape[2])
            if n > 0:
                bnsh[b, :, :n] = _normal(gen, (Hkv, n, D), dt)

    buffer = cache_view = None
    cache_key = cache_value = None
    rows = spec.C if spec.op == "inplace" else spec.P
    if rows is not None:
        shape, strides, span = cache_geometry(spec, rows)
        g0, g1, g2 = spec.guards
        key_off, value_off = g0, g0 + span + g1
        buf = fill_canary(torch.empty(value_off + span + g2, dtype=dt))
        cache_key = buf.as_strided(shape, strides, key_off)
        cache_value = buf.as_strided(shape, strides, value_off)
        fill_rows(cache_key)
        fill_rows(cache_value)
        if spec.op == "inplace":
            buffer, cache_view = buf, (shape, strides, key_off, value_off)
        else:
            inputs["past_buffer"] = buf

    seqlens = torch.tensor(spec.seqlens, dtype=torch.int32)
    if spec.seqlens_form == "2d":
        seqlens = seqlens.reshape(B, 1)
    elif spec.seqlens_form == "0d":
        seqlens = seqlens.reshape(())
    inputs["seqlens_k"] = seqlens

    cos = sin = None
    if spec.rotary is not None:
        angle = torch.rand(spec.max_positions, spec.R // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
        cos, sin = torch.cos(angle).to(DTYPES[spec.cos_dtype]), torch.sin(angle).to(DTYPES[spec.cos_dtype])
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
    pos = None
    if spec.position_ids is not None:
        pos = inputs["position_ids"] = torch.tensor(spec.position_ids, dtype=torch.int64)
    sink = None
    if spec.sink:
        sink = inputs["head_sink"] = torch.randn(Hq, generator=gen, dtype=torch.float32) * spec.sink_scale

    args = dict(query=query, key=key, value=value, cache_key=cache_key, cache_value=cache_value,
                seqlens_k=seqlens, cos_cache=cos, sin_cache=sin, position_ids=pos, head_sink=sink,
                attrs=dict(num_heads=Hq, kv_num_heads=Hkv, scale=spec.scale, do_rotary=spec.rotary is not None,
                           rotary_interleaved=spec.rotary == "interleaved", local_window_size=spec.window,
                           softcap=spec.softcap, smooth_softmax=spec.smooth, kv_layout=spec.layout))
    if spec.op == "functional":
        args["total_sequence_length"] = spec.tsl
    return Built(args=args, buffer=buffer, cache_view=cache_view, inputs=inputs)


def apply_host_mutation(spec: Spec, args: dict) -> dict:
    """A copy of args with exactly one host-checkable rule broken (fresh tensors only: the
    original inputs and the cache buffer stay as they are)."""
    a = dict(args)
    a["attrs"] = dict(args["attrs"])
    name, B, S, D = spec.host, spec.B, spec.S, spec.D
    seq = args["seqlens_k"].reshape(-1)
    if name == "seqlens_int64":
        a["seqlens_k"] = seq.long()
    elif name == "seqlens_float":
        a["seqlens_k"] = seq.float()
    elif name == "seqlens_shape":
        a["seqlens_k"] = torch.cat([seq, seq[:1]])
    elif name == "seqlens_strided":
        a["seqlens_k"] = torch.stack([seq, seq], dim=1)[:, 0]
    elif name == "position_ids_int32":
        pos = args["position_ids"] if args["position_ids"] is not None else torch.zeros(B, S, dtype=torch.int64)
        a["position_ids"] = pos.int()
    elif name == "position_ids_shape":
        a["position_ids"] = torch.zeros(B, S + 1, dtype=torch.int64)
    elif name == "cos_too_wide":
        w = D // 2 + 1
        a["cos_cache"] = torch.rand(spec.max_positions, w).to(args["cos_cache"].dtype)
        a["sin_cache"] = torch.rand(spec.max_positions, w).to(args["cos_cache"].dtype)
    elif name == "sin_shape":
        a["sin_cache"] = torch.rand(spec.max_positions + 1, spec.R // 2).to(args["cos_cache"].dtype)
    elif name == "cos_dtype":
        a["cos_cache"], a["sin_cache"] = args["cos_cache"].double(), args["sin_cache"].double()
    elif name == "sin_missing":
        a["sin_cache"] = None
    elif name == "window_zero":
        a["attrs"]["local_window_size"] = 0
    elif name == "window_negative":
        a["attrs"]["local_window_size"] = -2
    elif name == "softcap_negative":
        a["attrs"]["softcap"] = -0.5
    elif name == "softcap_nan":
        a["attrs"]["softcap"] = math.nan
    elif name == "scale_inf":
        a["attrs"]["scale"] = -math.inf
    elif name == "scale_float32_overflow":
        a["attrs"]["scale"] = 1e39 if spec.seed % 2 else -3.5e38
    elif name == "softcap_float32_overflow":
        a["attrs"]["softcap"] = 1e39 if spec.seed % 2 else 3.5e38
    elif name == "softcap_float32_underflow":
        a["attrs"]["softcap"] = 1e-50 if spec.seed % 2 else 7e-46
    elif name == "kv_layout":
        a["attrs"]["kv_layout"] = 2
    elif name == "head_sink_shape":
        a["head_sink"] = torch.zeros(spec.Hq + 1)
    elif name == "head_sink_dtype":
        a["head_sink"] = torch.zeros(spec.Hq, dtype=torch.float64)
    elif name == "num_heads_not_multiple":
        a["attrs"]["num_heads"] = spec.Hq + 1
    elif name == "value_missing":
        a["value"] = None
    elif name == "key_seq":
        a["key"] = torch.zeros(B, S + 1, spec.Hkv * D, dtype=DTYPES[spec.dtype])
    elif name == "query_float64":
        a["query"] = args["query"].double()
    elif name == "query_hidden":
        q = args["query"]
        heads = spec.Hq + (2 * spec.Hkv if spec.packed else 0)
        if heads > 1:  # hidden + 1 is not a multiple of the head count
            a["query"] = torch.zeros(B, S, q.shape[2] + 1, dtype=q.dtype)
        else:
            a["query"] = torch.zeros(B, S * q.shape[2], dtype=q.dtype)  # rank 2
    elif name == "cache_dtype":
        other = torch.float16 if spec.dtype == "fp32" else torch.float32
        a["cache_key"] = args["cache_key"].to(other)
    elif name == "cache_head_dim":
        ck = args["cache_key"]
        shape = list(ck.shape[:3]) + [D + 1]
        a["cache_key"] = torch.zeros(shape, dtype=ck.dtype)
        a["cache_value"] = torch.zeros(shape, dtype=ck.dtype)
    elif name == "cache_value_strides":
        # Same shape, other strides: contiguous when the key cache is padded, else a padded batch stride.
        ck = args["cache_key"]
        strides = list(torch.empty(ck.shape).stride())
        if list(ck.stride()) == strides:
            strides[0] += 1
        a["cache_value"] = torch.empty_strided(ck.shape, strides, dtype=ck.dtype).zero_()
    elif name == "past_value_missing":
        a["cache_value"] = None
    elif name == "capacity_zero":
        ck = args["cache_key"]
        shape = list(ck.shape)
        shape[2 if spec.layout == 0 else 1] = 0
        a["cache_key"] = torch.zeros(shape, dtype=ck.dtype)
        a["cache_value"] = torch.zeros(shape, dtype=ck.dtype)
    elif name == "tsl_negative":
        a["total_sequence_length"] = -1
    elif name == "tsl_overflow":
        a["total_sequence_length"] = 2**31
    else:
        raise AssertionError(name)
    return a



def device_view(t, device: str, storages: dict):
    """The same view (shape, strides, offset) of a copy of t's whole CPU storage on `device`;
    each storage is copied once (``storages`` maps its address to the copy), so views into one
    canary buffer stay views into one buffer and strided or mutated tensors keep their strides.
    Anything that is not a tensor comes back as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    key = t.untyped_storage().data_ptr()
    if key not in storages:
        n = t.untyped_storage().nbytes() // t.element_size()
        flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
        storages[key] = flat.to(device)
    return storages[key].as_strided(t.shape, t.stride(), t.storage_offset())


def to_device(args: dict, device: str, storages: dict) -> dict:
    """A copy of the op arguments with every tensor moved by :func:`device_view`."""
    out = {k: device_view(v, device, storages) for k, v in args.items()}
    out["attrs"] = dict(args["attrs"])
    return out


def violating_rows(spec: Spec) -> List[int]:
    """The rows whose bounds or rotary positions break SPEC §4 (see expected_flags)."""
    rows = []
    for b, seqlen in enumerate(spec.seqlens):
        f = row_flags(spec, seqlen)
        if f == 0 and spec.rotary is not None:
            f = any(not (0 <= p < spec.max_positions) for p in rope_positions(spec, b))
        if f:
            rows.append(b)
    return rows
