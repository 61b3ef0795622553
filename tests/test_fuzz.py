"""Property-based fuzzing of both operators (hypothesis): on CPU always, on CUDA when the build
and the machine have it (``test_fuzz_*_cuda``; skipped, with the reason, otherwise).

Every drawn case is one call of ``gqa_torch.group_query_attention`` (functional) or
``gqa_torch.group_query_attention_`` (in place) with random shapes, dtypes, layouts, packed or
separate QKV, strided activations, padded cache strides and every attribute (RoPE half /
interleaved / partial, with or without position_ids, window, softcap, smooth softmax, head
sink, scale), and with random *valid and invalid* seqlens_k, position_ids, capacities and
total_sequence_length. The outcome is predicted independently of the extension:

- a host-checkable problem (one "host mutation" of an otherwise valid call) must raise
  ``ValueError``/``TypeError`` (never ``GQAError``) whose message names the bad argument;
- a data-dependent problem must raise ``gqa_torch.GQAError`` whose ``flags`` are exactly the
  SPEC §4 bits computed here from the row geometry (:func:`expected_flags`);
- otherwise output and caches must match ``tests/reference.py`` (SPEC §5 tolerances for the
  output; caches byte for byte, as the CPU backend rounds RoPE exactly like the reference),
  with a finite output.

Writes are checked at byte level: the in-place caches are views (possibly with padded strides)
into ONE canary-filled buffer with guard regions before, between and after the two caches.
After a valid call every byte outside the rows ``[past_b, past_b + S)`` of each row must be as
before (and those rows must hold the reference's K/V); after a rejected call the whole buffer
is unchanged. Inputs of both ops (activation buffers with canary margins, past buffers, tables,
seqlens_k, ...) must never change. Cache rows that must not be read (``>= past_b``) and every
margin hold NaN canaries, so a stray read shows up as NaN in the output or the presents.

On CUDA the same property holds with the device's own error path (SPEC §4): the functional op
raises ``GQAError`` synchronously; the in-place op returns, its violating rows' outputs are NaN,
nothing in the cache buffer has changed, and ``gqa_torch.check_errors()`` then raises
``GQAError`` with exactly the expected flags (and clears them). A valid call leaves the error
word clear. Odd head sizes are refused on CUDA with a ValueError naming ``query``. Rotated new
K rows may differ from the reference by one unit in the last place (FMA contraction of RoPE);
every other byte must match.

The intra-op thread count of the op is drawn too (the CPU backend splits query tiles and keys
by it), and rows of more than 1024 keys make it split and merge the keys.

Each case runs under a faulthandler watchdog, so a hang fails with a traceback instead of
stalling CI. The run is reproducible (``derandomize=True``, no example database, tensor values
from a drawn seed), and the number of valid / invalid cases is reported in the terminal
summary and checked by :func:`test_fuzz_summary` at the end of the module. The
``test_checker_*`` tests show that the checks catch a misbehaving op.

Findings are kept as named regression tests (``test_regression_*``):

1. scale/softcap that are finite doubles but not finite float32 (1e39) were accepted and
   gave all-NaN outputs (csrc/torch/params_builder.cpp now refuses them, naming the attribute);
2. a positive softcap below float32's smallest subnormal (1e-50) became 0, silently switching
   the cap off (refused likewise);
3. (the checker) fp16 outputs that underflow (a dominant head sink) are judged against the
   storage dtype's own rounding, see :func:`check_output`.
"""
from __future__ import annotations

import faulthandler
import math
import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# Hypothesis caches (constants, failure patches) outside the work tree, unless asked otherwise.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "gqa-hypothesis"))

import gqa_torch  # noqa: E402
from conftest import (FP32_MAX_REL, NORM_REL, bits, output_error, poison_allocator, record_error,  # noqa: E402
                      requires_cuda, ulp_distance)
from conftest import call_op as call  # noqa: E402
from reference import reference_gqa, reference_gqa_, to_bnsh  # noqa: E402

INT32_MAX = 2**31 - 1
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Quiet NaNs with a recognisable payload (so a canary read becomes NaN, and a canary copied
# somewhere shows up as this exact bit pattern).
CANARY = {torch.float32: 0x7FC5A5A5, torch.float16: 0x7E5A, torch.bfloat16: 0x7FDA}
WATCHDOG_S = 120  # one case takes milliseconds; a hang is reported (with stacks) after this

# Examples per hypothesis test: fixed, so CI runs the same cases every time. The two tests take
# ~55-65 s together on 2 cores. GQA_FUZZ_EXAMPLES overrides it for longer local soaks.
FUZZ_EXAMPLES = int(os.environ.get("GQA_FUZZ_EXAMPLES", 4000))
# CUDA (device runs only): each case is a few launches and synchronisations.
FUZZ_EXAMPLES_CUDA = int(os.environ.get("GQA_FUZZ_EXAMPLES_CUDA", 2000))
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)

# ---- counters (reported by the terminal summary and by test_fuzz_summary) ------------------------

STATS_BY_DEVICE = {"cpu": Counter(), "cuda": Counter()}


class _SummaryPlugin:
    """Registered by the module fixture: prints the fuzz counters at the end of the run."""

    def pytest_terminal_summary(self, terminalreporter):
        if not any(STATS_BY_DEVICE.values()):
            return
        terminalreporter.section("gqa: property-based fuzzing (tests/test_fuzz.py)")
        for device, stats in STATS_BY_DEVICE.items():
            if stats:
                terminalreporter.write_line(f"  {device}:")
                for line in summary_lines(stats):
                    terminalreporter.write_line("    " + line)


def summary_lines(stats: Counter) -> List[str]:
    total = stats["valid"] + stats["invalid_data"] + stats["invalid_host"]
    lines = [f"cases: {total} = {stats['valid']} valid + {stats['invalid_data'] + stats['invalid_host']} invalid "
             f"({stats['invalid_data']} GQAError, {stats['invalid_host']} ValueError/TypeError)"]
    for op in ("functional", "inplace"):
        lines.append(f"  {op}: {stats['valid:' + op]} valid, {stats['invalid:' + op]} invalid")
    flags = ", ".join(f"{1 << bit}: {stats[f'flag:{1 << bit}']}" for bit in range(6))
    lines.append(f"  GQAError flag bits seen (cases per bit): {flags}")
    hosts = sorted((k[5:], v) for k, v in stats.items() if k.startswith("host:"))
    lines.append("  host mutations: " + ", ".join(f"{k} {v}" for k, v in hosts))
    feats = ["fp32", "fp16", "bf16", "packed", "rotary", "position_ids", "window", "softcap", "smooth", "sink",
             "first_prompt", "long", "strided"]
    lines.append("  valid cases with: " + ", ".join(f"{f} {stats['feat:' + f]}" for f in feats))
    return lines


@pytest.fixture(scope="module", autouse=True)
def _fuzz_summary_plugin(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("gqa-fuzz-summary"):
        pm.register(_SummaryPlugin(), "gqa-fuzz-summary")
    yield


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

def _cache_names(spec):
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


DEFAULT_THREADS = torch.get_num_threads()


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


def with_threads(threads: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) with `threads` intra-op threads (0: torch's default for this
    process); the CPU backend divides its work (query tiles, key splits) by the thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or DEFAULT_THREADS)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(saved)


def watched(fn, *args, **kwargs):
    """Runs fn under a watchdog: a hang dumps every thread's stack and exits (CI fails loudly
    instead of stalling)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        return fn(*args, **kwargs)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- the property ----------------------------------------------------------------------------------

def _assert_same_bytes(now: torch.Tensor, before: torch.Tensor, what: str):
    diff = bits(now) != bits(before)
    if bool(diff.any()):
        idx = diff.nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} elements changed, first (flat) at {idx}")


def _assert_close_bits(now: torch.Tensor, expected: torch.Tensor, loose: Optional[torch.Tensor], what: str):
    """Byte equality, except where ``loose`` (a bool mask, or None) allows one ulp."""
    if loose is None:
        _assert_same_bytes(now, expected, what)
        return
    diff = bits(now) != bits(expected)
    strict = diff & ~loose
    if bool(strict.any()):
        idx = strict.nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: {int(strict.sum())} elements changed, first (flat) at {idx}")
    worst = int(ulp_distance(now[loose], expected[loose]).max()) if bool(loose.any()) else 0
    assert worst <= 1, f"{what}: rotated new K rows differ by {worst} ulp (at most 1 allowed)"


def check_spec(spec: Spec) -> str:
    """Runs one case and checks it; returns "valid", "gqa_error" or "host_error"."""
    on_cpu = spec.device == "cpu"
    built = build(spec)
    cpu_args = built.args
    storages = {}
    args = cpu_args if on_cpu else to_device(cpu_args, spec.device, storages)
    if not on_cpu:  # the inputs and the buffer to watch are the device copies
        built.inputs = {k: device_view(v, spec.device, storages) for k, v in built.inputs.items()}
        built.buffer = device_view(built.buffer, spec.device, storages)
        gqa_torch.check_errors()  # a flag left over by the previous case is a failure of that case
    inputs_before = {k: v.clone() for k, v in built.inputs.items()}
    buffer_before = built.buffer.clone() if built.buffer is not None else None

    def inputs_unchanged():
        for name, before in inputs_before.items():
            _assert_same_bytes(built.inputs[name], before, f"input {name} (with its margins)")

    def buffer_unchanged():
        if built.buffer is not None:
            _assert_same_bytes(built.buffer, buffer_before, "in-place cache buffer after a rejected call")

    kind = f"{spec.device} {spec.op} B={spec.B} S={spec.S} Hkv={spec.Hkv} G={spec.G} D={spec.D} {spec.dtype}"
    odd_on_cuda = not on_cpu and spec.D % 2 == 1
    if spec.host is not None or odd_on_cuda:
        if spec.host is not None:
            _, exc, pattern = HOST_MUTATIONS[spec.host]
            key_name, value_name = _cache_names(spec)
            pattern = pattern.format(key=key_name, value=value_name)
            mutated = apply_host_mutation(spec, cpu_args)
            mutated = mutated if on_cpu else to_device(mutated, spec.device, storages)
        else:  # the CUDA kernels need an even head size (a host rule of the CUDA backend)
            exc, pattern, mutated = ValueError, "query", args
        with pytest.raises((ValueError, TypeError)) as info:
            with_threads(spec.threads, call, spec.op, mutated)
        err = info.value
        rule = spec.host or "odd head size on CUDA"
        assert not isinstance(err, gqa_torch.GQAError), f"host rule {rule} raised a GQAError: {err}"
        assert isinstance(err, exc), f"host rule {rule}: expected {exc.__name__}, got {type(err).__name__}: {err}"
        first = str(err).splitlines()[0]
        assert re.search(rf"gqa: {re.escape(pattern)}\b", first), (
            f"host rule {rule}: message does not name {pattern!r}: {first}")
        inputs_unchanged()
        buffer_unchanged()
        return "host_error"

    flags = expected_flags(spec)
    if flags:
        with pytest.raises(gqa_torch.GQAError) as info:
            out = with_threads(spec.threads, call, spec.op, args)
            if not on_cpu and spec.op == "inplace":
                # Deferred on CUDA (SPEC §4): the violating rows are NaN, then the sync point raises.
                for b in violating_rows(spec):
                    assert bool(torch.isnan(out[b]).all()), f"{kind}: row {b} violates SPEC §4 but its output is not NaN"
                gqa_torch.check_errors()
        err = info.value
        assert err.flags == flags, (f"{kind}: GQAError.flags = {err.flags}, expected {flags} "
                                    f"(seqlens_k={spec.seqlens}); message: {err}")
        inputs_unchanged()
        buffer_unchanged()
        if not on_cpu:
            gqa_torch.check_errors()  # raising cleared the word
        return "gqa_error"

    # ---- valid: reference first (on CPU copies), then the op
    ref_args = tuple(cpu_args[k] for k in ("query", "key", "value", "cache_key", "cache_value", "seqlens_k"))
    tail = (cpu_args["cos_cache"], cpu_args["sin_cache"], cpu_args["position_ids"], cpu_args["head_sink"])
    new_k_loose = not on_cpu and spec.rotary is not None  # rotated K rows: one ulp of FMA contraction allowed
    if spec.op == "functional":
        ref_out, ref_k, ref_v = reference_gqa(*ref_args, cpu_args["total_sequence_length"], *tail, **cpu_args["attrs"])
        shape = (spec.B, spec.Hkv, capacity(spec), spec.D)
        poison_allocator([ref_out.shape, shape, shape], DTYPES[spec.dtype], device=spec.device)
        out, present_k, present_v = with_threads(spec.threads, call, spec.op, args)
        loose_k = None
        if new_k_loose:  # in the present's own layout (BSNH when kv_layout is 1)
            loose_k = torch.zeros(ref_k.shape, dtype=torch.bool)
            for b, seqlen in enumerate(spec.seqlens):
                p = row_past(spec, seqlen)
                to_bnsh(loose_k, spec.layout)[b, :, p:p + spec.S] = True
        for name, actual, expected, loose in (("present_key", present_k, ref_k, loose_k),
                                              ("present_value", present_v, ref_v, None)):
            assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype), name
            _assert_close_bits(actual.cpu(), expected, loose, f"{kind}: {name} vs the reference")
    else:
        ref_out, ref_k, ref_v = reference_gqa_(*ref_args, *tail, **cpu_args["attrs"])
        poison_allocator([ref_out.shape], DTYPES[spec.dtype], device=spec.device)
        out = with_threads(spec.threads, call, spec.op, args)
        # The expected buffer: as before, except rows [past_b, past_b + S) of each row.
        expected = buffer_before.cpu()
        loose = torch.zeros(expected.shape, dtype=torch.bool) if new_k_loose else None
        shape, strides, key_off, value_off = built.cache_view
        for off, ref in ((key_off, ref_k), (value_off, ref_v)):
            dst = to_bnsh(expected.as_strided(shape, strides, off), spec.layout)
            src = to_bnsh(ref, spec.layout)
            for b, seqlen in enumerate(spec.seqlens):
                p = row_past(spec, seqlen)
                dst[b, :, p:p + spec.S] = src[b, :, p:p + spec.S]
                if loose is not None and off == key_off:
                    to_bnsh(loose.as_strided(shape, strides, off), spec.layout)[b, :, p:p + spec.S] = True
        _assert_close_bits(built.buffer.cpu(), expected, loose,
                           f"{kind}: cache buffer (guards, padding, other rows, new rows)")
    if not on_cpu:
        gqa_torch.check_errors()  # a valid call sets no flag
    inputs_unchanged()
    out = out.cpu()
    assert out.shape == (spec.B, spec.S, spec.Hq * spec.D)
    assert not bool(torch.isnan(out).any()), f"{kind}: NaN in a valid output"
    check_output(out, ref_out, kind)
    if is_first_prompt(spec):
        for b, seqlen in enumerate(spec.seqlens):
            assert bool((out[b, seqlen + 1:] == 0).all()), f"row {b}: first-prompt padding output must be 0"
    return "valid"


def check_output(out: torch.Tensor, ref: torch.Tensor, kind: str) -> None:
    """SPEC §5 per batch row: fp32 max|d|/max|ref| <= 1e-5, fp16/bf16 ||d||/||ref|| <= 1e-3 / 4e-3.

    One allowance: a row whose reference the storage dtype itself cannot hold to within half
    the tolerance (its rounding error ``floor`` > tol/2, which needs subnormal outputs, e.g. a
    head sink or smooth softmax's 0 outweighing every key by e^12 in fp16) must be within
    ``floor + tol``: as good as rounding the exact result allows. In the normal range rounding
    alone is at most eps/2 < tol/2, so the allowance never loosens an ordinary row.
    """
    assert torch.isfinite(out).all(), f"{kind}: non-finite output values"
    tol = FP32_MAX_REL if out.dtype == torch.float32 else NORM_REL[out.dtype]
    worst = 0.0
    for b in range(ref.shape[0]):
        err = output_error(out[b:b + 1], ref[b:b + 1])
        floor = output_error(ref[b:b + 1].to(out.dtype), ref[b:b + 1])
        allowed = tol if floor <= tol / 2 else floor + tol
        assert err <= allowed, f"{kind}: row {b}: output error {err:.3g} > {allowed:.3g} (rounding floor {floor:.3g})"
        if floor <= tol / 2:
            worst = max(worst, err)
    record_error("fuzz", out.dtype, worst)


def record(spec: Spec, outcome: str):
    stats = STATS_BY_DEVICE[spec.device]
    if outcome == "valid":
        stats["valid"] += 1
        stats[f"valid:{spec.op}"] += 1
        feats = [spec.dtype] + [name for name, on in (
            ("packed", spec.packed), ("rotary", spec.rotary), ("position_ids", spec.position_ids and spec.rotary),
            ("window", spec.window > 0), ("softcap", spec.softcap > 0), ("smooth", spec.smooth),
            ("sink", spec.sink), ("first_prompt", is_first_prompt(spec)), ("strided", spec.strided),
            ("long", max(r + 1 for r in spec.seqlens) > 1024)) if on]
        for f in feats:
            stats["feat:" + f] += 1
    else:
        stats["invalid_data" if outcome == "gqa_error" else "invalid_host"] += 1
        stats[f"invalid:{spec.op}"] += 1
        if outcome == "host_error":
            stats[f"host:{spec.host or 'odd_head_size_cuda'}"] += 1
        else:
            flags = expected_flags(spec)
            for bit in range(6):
                if flags & (1 << bit):
                    stats[f"flag:{1 << bit}"] += 1


# ---- the fuzz tests ---------------------------------------------------------------------------------

@settings(max_examples=FUZZ_EXAMPLES, **FUZZ_SETTINGS)
@given(spec=specs("functional"))
def test_fuzz_functional(spec):
    # The reference and the bookkeeping run single-threaded (tiny tensors; on a busy 2-core
    # runner every parallel region would wait for a descheduled thread); the op itself runs
    # with the drawn thread count.
    record(spec, with_threads(1, watched, check_spec, spec))


@settings(max_examples=FUZZ_EXAMPLES, **FUZZ_SETTINGS)
@given(spec=specs("inplace"))
def test_fuzz_inplace(spec):
    record(spec, with_threads(1, watched, check_spec, spec))


@requires_cuda
@settings(max_examples=FUZZ_EXAMPLES_CUDA, **FUZZ_SETTINGS)
@given(spec=specs("functional", "cuda"))
def test_fuzz_functional_cuda(spec):
    record(spec, with_threads(1, watched, check_spec, spec))


@requires_cuda
@settings(max_examples=FUZZ_EXAMPLES_CUDA, **FUZZ_SETTINGS)
@given(spec=specs("inplace", "cuda"))
def test_fuzz_inplace_cuda(spec):
    record(spec, with_threads(1, watched, check_spec, spec))


# ---- the oracle itself -------------------------------------------------------------------------------

def _spec(op="inplace", **kw):
    base = dict(op=op, B=1, S=3, Hkv=1, G=2, D=8, dtype="fp32", layout=0, packed=False, seqlens=[5],
                past_fill=[3], C=10)
    base.update(kw)
    return Spec(**base)


def test_oracle_flags_follow_the_spec():
    """The independent oracle on hand-computed rows (so a wrong oracle cannot pass silently)."""
    assert expected_flags(_spec(seqlens=[5])) == 0
    assert expected_flags(_spec(seqlens=[INT32_MAX])) == 1 | 16
    assert expected_flags(_spec(seqlens=[1])) == 2 | 4                    # total 2 < S = 3
    assert expected_flags(_spec(seqlens=[10])) == 16                      # total 11 > C = 10
    f = _spec("functional", P=4, tsl=7, C=0, seqlens=[7])                 # past 5 > P, total 8 > 7
    assert expected_flags(f) == 8 | 16
    assert expected_flags(replace(f, seqlens=[INT32_MAX])) == 1 | 8 | 16
    first = _spec("functional", P=None, tsl=3, C=0, seqlens=[1], past_fill=[0])
    assert is_first_prompt(first) and expected_flags(first) == 0
    assert expected_flags(replace(first, seqlens=[-1])) == 2
    assert expected_flags(replace(first, seqlens=[3])) == 16
    rot = _spec(seqlens=[5], rotary="half", R=8, max_positions=5)          # positions 3, 4, 5
    assert expected_flags(rot) == 32
    assert expected_flags(replace(rot, max_positions=6)) == 0
    assert expected_flags(replace(rot, max_positions=6, position_ids=[[0, 6, 1]])) == 32
    # Positions are not checked for rows whose bounds already fail.
    assert expected_flags(replace(rot, seqlens=[10], max_positions=2)) == 16
    assert expected_flags(replace(rot, B=2, seqlens=[10, 5], past_fill=[0, 0], max_positions=2)) == 16 | 32


# ---- the checker catches misbehaviour -----------------------------------------------------------------

def _valid_spec(**kw) -> Spec:
    """A small valid in-place call (rows of total 5 in a capacity of 6), changed by kw."""
    base = dict(op="inplace", B=1, S=2, Hkv=1, G=2, D=8, dtype="fp32", layout=0, packed=False, seqlens=[4],
                past_fill=[3], C=6, seed=3)
    base.update(kw)
    return Spec(**base)


def _sabotage(kind: str):
    """A stand-in for `call` that misbehaves in one way after (or instead of) the real op."""
    real = call

    def op(op_name, a):
        if kind == "wrong_flags":
            raise gqa_torch.GQAError(16)
        if kind == "host_error_unnamed":
            raise ValueError("gqa: something is wrong")
        if kind == "write_then_op":     # a write, then the real op (which rejects the call)
            a["cache_key"].view(-1)[0] = 0
        result = real(op_name, a)
        if kind == "guard_write":      # one element just past the value cache
            shape, strides = a["cache_value"].shape, a["cache_value"].stride()
            last = sum((n - 1) * st for n, st in zip(shape, strides)) + 1
            a["cache_value"].as_strided((1,), (1,), a["cache_value"].storage_offset() + last).fill_(0)
        elif kind == "other_row_write":  # row 0 of every batch row (a past row: past_b >= 1 below)
            to_bnsh(a["cache_key"], a["attrs"]["kv_layout"])[:, :, 0].fill_(0)
        elif kind == "input_write":
            a["query"].view(-1)[0] += 1
        elif kind == "nan_output":
            out = result[0] if op_name == "functional" else result
            out.view(-1)[-1] = math.nan
        elif kind == "wrong_output":
            out = result[0] if op_name == "functional" else result
            out.mul_(1.001)
        return result

    return op


@pytest.mark.parametrize("kind", ["guard_write", "other_row_write", "input_write", "nan_output", "wrong_output"])
def test_checker_detects_bad_valid_calls(kind, monkeypatch):
    """Self-check: each way an op could misbehave on a valid call fails check_spec."""
    spec = _valid_spec(B=2, seqlens=[4, 5], past_fill=[3, 4], pads=(1, 2, 3), guards=(2, 3, 4))
    assert check_spec(spec) == "valid"
    monkeypatch.setattr(sys.modules[__name__], "call", _sabotage(kind))
    with pytest.raises(AssertionError):
        check_spec(spec)


@pytest.mark.parametrize("kind,spec_kw", [("wrong_flags", dict(seqlens=[0])), ("host_error_unnamed", dict(host="softcap_nan")),
                                          ("write_then_op", dict(seqlens=[0])), ("wrong_flags", dict(seqlens=[4]))])
def test_checker_detects_bad_rejections(kind, spec_kw, monkeypatch):
    """Self-check: wrong flags, an exception that names no argument, a write before a rejection,
    or a GQAError for a valid call all fail check_spec."""
    spec = _valid_spec(**spec_kw)
    check_spec(spec)
    monkeypatch.setattr(sys.modules[__name__], "call", _sabotage(kind))
    with pytest.raises((AssertionError, gqa_torch.GQAError)):
        check_spec(spec)


# ---- regression tests (findings of the fuzzer, kept as explicit examples) ---------------------------

@pytest.mark.parametrize("attrs", [dict(softcap=1e39), dict(softcap=3.5e38), dict(scale=1e39), dict(scale=-1e39)],
                         ids=["softcap_1e39", "softcap_3.5e38", "scale_1e39", "scale_-1e39"])
@pytest.mark.parametrize("op", ["inplace", "functional"])
def test_regression_attribute_beyond_float32_is_rejected(op, attrs):
    """Finding 1 (csrc/torch/params_builder.cpp): scale/softcap were checked to be finite as
    doubles, then narrowed to float, where 1e39 is inf: every logit became inf or NaN and a
    "valid" call returned an all-NaN output. Now a ValueError names the attribute."""
    name = next(iter(attrs))
    spec = _valid_spec(op=op, P=4, tsl=5, C=0) if op == "functional" else _valid_spec()
    built = build(spec)
    args = dict(built.args, attrs=dict(built.args["attrs"], **attrs))
    before = built.buffer.clone() if built.buffer is not None else None
    with pytest.raises(ValueError, match=rf"gqa: {name}: expected .*float32.*got {re.escape(f'{attrs[name]:g}')}"):
        call(op, args)
    if before is not None:
        _assert_same_bytes(built.buffer, before, "cache buffer after a rejected call")


@pytest.mark.parametrize("softcap", [1e-50, 7e-46])
def test_regression_softcap_that_rounds_to_zero_is_rejected(softcap):
    """Finding 2 (csrc/torch/params_builder.cpp): a positive softcap below half the smallest
    float32 subnormal became 0.0f, i.e. the cap was silently switched off (output error 0.95
    against SPEC §3's c*tanh(x/c), which makes every logit ~0). Now a ValueError."""
    built = build(_valid_spec())
    args = dict(built.args, attrs=dict(built.args["attrs"], softcap=softcap))
    with pytest.raises(ValueError, match=r"gqa: softcap: expected 0 \(off\) or a value float32 can hold"):
        call("inplace", args)


@pytest.mark.parametrize("attrs", [dict(softcap=3e38), dict(softcap=1.5e-45), dict(softcap=1e-40),
                                   dict(scale=1e-50), dict(scale=1e36)],
                         ids=["softcap_3e38", "softcap_denorm_min", "softcap_1e-40", "scale_1e-50", "scale_1e36"])
def test_regression_float32_extremes_stay_valid(attrs):
    """The other side of findings 1 and 2: values float32 does hold keep working and match the
    reference (a subnormal cap or a vanishing scale gives uniform weights, a huge cap is the
    identity, a huge scale a one-hot softmax). Not promised: a scale so large that the logits
    themselves pass FLT_MAX (e.g. 3e38 * q.k), which fp32 accumulation (SPEC §5) cannot hold."""
    assert check_spec(_valid_spec(**attrs)) == "valid"


def test_regression_fp16_output_underflow_under_dominant_sink():
    """Finding 3 (the checker, not the operator): a head sink of 29 next to a single key of logit
    ~0 makes the exact output ~1e-12, below fp16's smallest subnormal, so the correctly rounded
    fp16 output is 0 and ||d||/||ref|| = 1. check_output allows exactly the storage dtype's own
    rounding error in that (subnormal-only) situation; this pins the case."""
    spec = Spec(op="inplace", B=1, S=1, Hkv=1, G=1, D=7, dtype="fp16", layout=0, packed=False, seqlens=[0],
                past_fill=[0], C=1, sink=True, sink_scale=20.0, seed=0)
    assert check_spec(spec) == "valid"
    out = call("inplace", build(spec).args)
    assert bool((out == 0).all())


def _mutation_bases() -> List[Spec]:
    """Valid calls to which, between them, every host mutation applies."""
    common = dict(B=2, Hkv=2, seqlens=[4, 3], past_fill=[3, 2], rotary="half", R=4, max_positions=8)
    return [_valid_spec(**common), _valid_spec(op="functional", P=4, tsl=5, C=0, **common)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(HOST_MUTATIONS))
def test_each_host_mutation(name, device):
    """Every host rule once per device, with its exception and the argument it names (the fuzz
    reaches them only at random)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA half of this test needs one")
    applies = HOST_MUTATIONS[name][0]
    base = next(spec for spec in _mutation_bases() if applies(spec))
    assert check_spec(replace(base, host=name, device=device)) == "host_error"


# Findings of the CUDA fuzz (H200, 2026-11-29), each pinned on both devices with its flags.
_LONG = 700  # B * S > 2048 with position_ids: the separate validate_rows kernel runs first
CUDA_FINDINGS = {
    # Finding 4 (csrc/kernels/prep.cu): explicit position_ids of a row whose bounds already
    # failed were flagged too (flag 32 on top of the row's own), unlike CPU and SPEC's oracle.
    "positions_of_a_bad_decode_row": (6, Spec(
        op="inplace", B=1, S=1, Hkv=1, G=1, D=64, dtype="bf16", layout=0, packed=False, seqlens=[-1],
        past_fill=[0], C=4, rotary="half", R=2, max_positions=1, position_ids=[[-1]])),
    "positions_of_a_bad_fp32_decode_row": (6, Spec(
        op="inplace", B=1, S=1, Hkv=1, G=1, D=64, dtype="fp32", layout=0, packed=False, seqlens=[-1],
        past_fill=[0], C=4, rotary="half", R=2, max_positions=1, position_ids=[[-1]])),
    "positions_of_an_overflowing_functional_row": (1 | 16, Spec(
        op="functional", B=1, S=1, Hkv=1, G=1, D=2, dtype="fp32", layout=0, packed=False, seqlens=[INT32_MAX],
        past_fill=[0], tsl=1, rotary="half", R=2, max_positions=1, position_ids=[[-1]])),
    "positions_of_a_bad_row_in_a_long_prefill": (2 | 4, Spec(
        op="inplace", B=3, S=_LONG, Hkv=1, G=1, D=8, dtype="fp32", layout=0, packed=False,
        seqlens=[_LONG - 1, 100, _LONG + 49], past_fill=[0, 0, 50], C=_LONG + 100, rotary="half", R=8,
        max_positions=_LONG + 100,
        position_ids=[list(range(_LONG)), [-1] * _LONG, list(range(50, 50 + _LONG))])),
    # Finding 5 (csrc/kernels/prep.cu): a functional call whose present has capacity 0
    # (total_sequence_length 0, no past) launched no prep kernel, so nothing checked the row:
    # no error, where total 1 > capacity 0 is flag 16.
    "functional_present_of_capacity_zero": (16, Spec(
        op="functional", B=1, S=1, Hkv=1, G=1, D=2, dtype="fp32", layout=0, packed=False, seqlens=[0],
        past_fill=[0], tsl=0)),
    # Finding 6 (this checker): the one-ulp mask of rotated new K rows was built BNSH for a BSNH
    # present; it now takes the present's layout.
    "bsnh_present_with_rotated_keys": (0, Spec(
        op="functional", B=1, S=2, Hkv=3, G=1, D=2, dtype="fp32", layout=1, packed=False, seqlens=[1],
        past_fill=[0], P=1, tsl=2, rotary="half", R=2, max_positions=2)),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(CUDA_FINDINGS))
def test_regression_cuda_fuzz_findings(name, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA half of this regression needs one")
    flags, spec = CUDA_FINDINGS[name]
    spec = replace(spec, device=device)
    assert expected_flags(spec) == flags  # the oracle agrees with the hand-computed flags
    assert check_spec(spec) == ("gqa_error" if flags else "valid")


# ---- summary ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fuzz_summary(device):
    """Runs last in this module: prints the counts, and checks that the fuzz tests really mixed
    valid calls, GQAErrors (every flag bit) and host errors (skipped when they were deselected,
    or, for CUDA, when there is no GPU)."""
    stats = STATS_BY_DEVICE[device]
    total = stats["valid"] + stats["invalid_data"] + stats["invalid_host"]
    if total == 0:
        pytest.skip(f"the {device} fuzz tests did not run in this session")
    for line in summary_lines(stats):
        print(line)
    assert stats["valid"] >= 0.3 * total, dict(stats)
    assert stats["invalid_data"] >= 0.15 * total, dict(stats)
    assert stats["invalid_host"] >= 0.03 * total, dict(stats)
    if total >= 1000:
        for bit in range(6):
            assert stats[f"flag:{1 << bit}"] > 0, f"no case raised flag {1 << bit}"
        # On CPU (8,000 cases) the strategy reaches every host rule; the 4,000 CUDA cases missed
        # capacity_zero, so both devices also run each rule once in test_each_host_mutation.
        ran = {k[5:] for k in stats if k.startswith("host:")}
        assert device != "cpu" or set(HOST_MUTATIONS) <= ran, f"host mutations that never ran: {sorted(set(HOST_MUTATIONS) - ran)}"
