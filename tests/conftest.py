"""Shared test machinery: seeding, poisoning, the case factory, comparison helpers, and a
session hook that fails a run in which no test passed.

Test modules import helpers from here directly (``from conftest import make_case``); pytest
puts this directory on sys.path (rootdir-relative "prepend" import mode, no __init__.py).
"""
from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch

import gqa_torch
from reference import is_first_prompt, output_error, reference_gqa, reference_gqa_, reference_row_geometry, to_bnsh  # noqa: F401  (output_error: re-exported for the tests)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# SPEC §5: fp32 max relative error; fp16/bf16 norm-wise relative error.
FP32_MAX_REL = 1e-5
NORM_REL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}

requires_cuda = pytest.mark.skipif(
    not gqa_torch.cuda_kernels_available(),
    reason="no CUDA device/CUDA build (or a GPU this build has no code for): GPU test skipped"
)

# Worst errors seen, per (suite, dtype); printed at the end of the run (pytest_terminal_summary).
ERROR_RECORD: Dict[tuple, float] = defaultdict(float)


def record_error(suite: str, dtype, value: float) -> None:
    key = (suite, DTYPE_NAMES.get(dtype, str(dtype)))
    ERROR_RECORD[key] = max(ERROR_RECORD[key], float(value))


# ---- seeding ---------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _seed(request):
    """Each test gets its own deterministic seed (derived from its node id), so a failure
    reproduces alone, and tests do not share random streams."""
    seed = abs(hash_str(request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    yield


# ---- the CUDA test files' fixtures (test_cuda*.py) -------------------------------------------------

@pytest.fixture
def clean_error_word():
    """The CUDA test files take it for every test (their pytestmark): each test starts and ends
    with a clear device error word and the asynchronous default."""
    gqa_torch.set_synchronous_errors(False)
    gqa_torch.clear_errors()
    torch.cuda.synchronize()
    yield
    gqa_torch.set_synchronous_errors(False)
    gqa_torch.clear_errors()
    torch.cuda.synchronize()


@pytest.fixture(params=["auto", "kernel", "arrival"])
def decode_merge(request):
    """Runs the test with each way of merging the tensor-core decode kernel's splits: "auto"
    (up to 16 splits inside the launch, by the last split to finish; else the merge kernel),
    "kernel" (the merge kernel) and "arrival" (the last split CTA to finish, at every split
    count)."""
    gqa_torch._C._set_decode_merge(request.param)
    yield request.param
    gqa_torch._C._set_decode_merge("auto")


def _flushes_subnormals() -> bool:
    """Whether float32 arithmetic on this thread flushes subnormals to zero (FTZ/DAZ on)."""
    import numpy as np
    return float(np.float32(1e-40) * np.float32(1.0)) == 0.0


@pytest.fixture(autouse=True)
def _keep_subnormals():
    """torch 2.4's Inductor turns on flush-to-zero (FTZ/DAZ) in the thread that loads CPU code it
    compiled, so for everything the process does after it (torch 2.11 leaves it off; README,
    Known issues). A test that compiles on the CPU would then change how every later test's
    float32 subnormals behave, the op's and the reference's: the mode it found is put back."""
    flushing = _flushes_subnormals()
    yield
    if not flushing and _flushes_subnormals():
        torch.set_flush_denormal(False)
        assert not _flushes_subnormals(), "torch.set_flush_denormal(False) did not turn flushing off"


def hash_str(text: str) -> int:
    h = 1469598103934665603
    for ch in text.encode():
        h = ((h ^ ch) * 1099511628211) % (2**64)
    return h


# ---- poisoning -------------------------------------------------------------------------------

def poison(t: torch.Tensor, value: Optional[float] = None) -> torch.Tensor:
    """Fills t in place with a canary (NaN for floats, a large sentinel for ints) and returns it.
    Elements an operator should have written but did not then stand out; elements it should
    not have read turn its output into NaN."""
    if t.is_floating_point():
        t.fill_(math.nan if value is None else value)
    else:
        t.fill_(-0x5A5A5A5A if value is None else int(value))
    return t


def poison_allocator(shapes: Sequence[Sequence[int]], dtype: torch.dtype, device="cpu", rounds: int = 2) -> None:
    """Best effort for outputs the operator allocates itself: allocate NaN-filled blocks of the
    sizes it will ask for and free them, so a reused block that the operator fails to write
    shows NaN instead of zeros."""
    keep = []
    for _ in range(rounds):
        for shape in shapes:
            keep.append(poison(torch.empty(tuple(shape), dtype=dtype, device=device)))
    del keep


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (so NaN canaries compare equal to themselves)."""
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(int_type)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in units in the last place of a's dtype (NaN vs number: huge)."""
    assert a.dtype == b.dtype

    def ordered(x):
        i = bits(x).long()
        width = x.element_size() * 8
        sign = 1 << (width - 1)
        i = i & ((1 << width) - 1)
        return torch.where(i >= sign, sign - i, i)  # monotonic integer image of the float order

    dist = (ordered(a) - ordered(b)).abs()
    nan = torch.isnan(a) ^ torch.isnan(b)
    return torch.where(nan, torch.full_like(dist, 2**40), dist)


# ---- the case factory --------------------------------------------------------------------------

@dataclass
class Case:
    """Inputs and attributes of one call of either operator, plus what the factory knows about
    the rows (for messages and for the checks)."""
    op: str                                  # "functional" or "inplace"
    query: torch.Tensor
    key: Optional[torch.Tensor]
    value: Optional[torch.Tensor]
    cache_key: Optional[torch.Tensor]        # functional: past_key (or None); in-place: key_cache
    cache_value: Optional[torch.Tensor]
    seqlens_k: torch.Tensor
    total_sequence_length: Optional[int]     # functional only
    cos_cache: Optional[torch.Tensor] = None
    sin_cache: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    head_sink: Optional[torch.Tensor] = None
    attrs: Dict[str, Any] = field(default_factory=dict)
    # bookkeeping
    totals: List[int] = field(default_factory=list)
    pasts: List[int] = field(default_factory=list)
    first_prompt: bool = False
    cache_base: Optional[tuple] = None       # in-place: (key_base, value_base) when the caches are views
    desc: str = ""

    @property
    def dtype(self):
        return self.query.dtype

    @property
    def batch(self):
        return self.query.shape[0]

    @property
    def seq(self):
        return self.query.shape[1]

    @property
    def head_dim(self):
        heads = self.attrs["num_heads"] + (0 if self.key is not None else 2 * self.attrs["kv_num_heads"])
        return self.query.shape[2] // heads

    def tensors(self) -> Dict[str, Optional[torch.Tensor]]:
        return dict(query=self.query, key=self.key, value=self.value, cache_key=self.cache_key,
                    cache_value=self.cache_value, seqlens_k=self.seqlens_k, cos_cache=self.cos_cache,
                    sin_cache=self.sin_cache, position_ids=self.position_ids, head_sink=self.head_sink)

    def op_args(self) -> tuple:
        if self.op == "functional":
            return (self.query, self.key, self.value, self.cache_key, self.cache_value, self.seqlens_k,
                    self.total_sequence_length, self.cos_cache, self.sin_cache, self.position_ids, self.head_sink)
        return (self.query, self.key, self.value, self.cache_key, self.cache_value, self.seqlens_k,
                self.cos_cache, self.sin_cache, self.position_ids, self.head_sink)

    def run(self):
        """Calls the op through the Python wrapper. Functional: (out, present_k, present_v);
        in-place: out (the caches are modified)."""
        if self.op == "functional":
            return gqa_torch.group_query_attention(*self.op_args(), **self.attrs)
        return gqa_torch.group_query_attention_(*self.op_args(), **self.attrs)

    def reference(self):
        """(out float64, expected key cache, expected value cache), computed on the CPU. The
        case's own tensors are not modified: the expected caches are new tensors."""
        cpu = self.to("cpu")
        args = cpu.op_args()
        if self.op == "functional":
            return reference_gqa(*args, **self.attrs)
        return reference_gqa_(*args, **self.attrs)

    def geometry(self):
        past_capacity = 0 if self.cache_key is None else to_bnsh(self.cache_key, self.attrs["kv_layout"]).shape[2]
        fp = is_first_prompt(self.op == "inplace", past_capacity, self.seq, self.total_sequence_length)
        return reference_row_geometry(self.seqlens_k.cpu(), self.seq, first_prompt=fp)

    def map_tensors(self, fn) -> "Case":
        mapped = {k: (fn(v) if isinstance(v, torch.Tensor) else v) for k, v in self.tensors().items()}
        base = None
        if self.cache_base is not None:
            # Keep the views into their (mapped) bases.
            kb, vb = (fn(t) for t in self.cache_base)
            ck = kb.as_strided(self.cache_key.shape, self.cache_key.stride(),
                               self.cache_key.storage_offset() - self.cache_base[0].storage_offset())
            cv = vb.as_strided(self.cache_value.shape, self.cache_value.stride(),
                               self.cache_value.storage_offset() - self.cache_base[1].storage_offset())
            mapped["cache_key"], mapped["cache_value"], base = ck, cv, (kb, vb)
        return replace(self, **mapped, cache_base=base)

    def clone(self) -> "Case":
        """A deep copy (caches included), keeping the strides of every tensor."""
        def copy(t):
            out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            out.copy_(t)
            return out
        if self.cache_base is not None:
            return self.map_tensors(lambda t: t.clone())
        return self.map_tensors(copy)

    def to(self, device) -> "Case":
        return self.map_tensors(lambda t: t.to(device))

    def __repr__(self):
        return f"Case({self.desc})"


def _random_cos_sin(max_positions: int, half: int, dtype: torch.dtype, device="cpu"):
    # Random angles rather than the usual frequency table: every row and column differs a lot,
    # so an off-by-one position or a swapped pair cannot hide behind slowly varying angles.
    angle = torch.rand(max_positions, half, dtype=torch.float64) * (2 * math.pi)
    return torch.cos(angle).to(dtype).to(device), torch.sin(angle).to(dtype).to(device)


def random_normal(shape, dtype, scale=1.0, device="cpu"):
    """Fresh normal values, never all zeros, in the storage dtype."""
    t = torch.randn(*shape, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    t.add_(torch.sign(t), alpha=0.01)  # keep clear of exact zeros
    return t.to(dtype).to(device)


def make_case(
    op: str = "functional",
    *,
    batch: int = 2,
    seq: int = 1,
    num_heads: int = 4,
    kv_num_heads: int = 2,
    head_dim: int = 16,
    capacity: Optional[int] = 8,
    past_lengths: Optional[Sequence[int]] = None,
    first_prompt: bool = False,
    prompt_lengths: Optional[Sequence[int]] = None,
    empty_past: bool = False,
    extra_total: int = 0,
    layout: int = 0,
    packed: bool = False,
    dtype: torch.dtype = torch.float32,
    rotary: Optional[str] = None,
    rotary_dim: Optional[int] = None,
    position_ids: Optional[str] = None,
    cos_dtype: Optional[torch.dtype] = None,
    max_positions: Optional[int] = None,
    window: int = -1,
    softcap: float = 0.0,
    smooth: bool = False,
    sink: bool = False,
    scale: float = 0.0,
    q_amplitude: float = 1.0,
    strided: bool = False,
    poison_unused: bool = True,
    device="cpu",
    desc: str = "",
) -> Case:
    """Fresh random inputs for one call.

    Rows (``B = batch``, ``S = seq``):
    - functional, ``first_prompt``: no past (None, or P == 0 tensors with ``empty_past``),
      ``total_sequence_length = S``, row totals ``prompt_lengths`` (default: ragged in [1, S],
      the first row full); rows ``s >= total_b`` are padding.
    - functional otherwise: past tensors of ``capacity`` rows (None when ``capacity is None``),
      per-row past lengths ``past_lengths`` (default: ragged in [0, P]), ``total_b = past_b + S``,
      ``total_sequence_length = max(total_b) + extra_total``.
    - in-place: caches of ``capacity`` rows, past lengths ragged in [0, C - S].

    Unused cache rows (past rows >= past_b; in-place rows >= past_b) hold NaN when
    ``poison_unused``: the op must neither copy nor read them. ``strided`` makes the activations
    views with padded batch/token strides and (in-place) the caches views into larger poisoned
    buffers whose outside is a guard region.
    """
    assert op in ("functional", "inplace")
    cos_dtype = cos_dtype or torch.float32
    S, B, D = seq, batch, head_dim
    q_hidden, kv_hidden = num_heads * D, kv_num_heads * D

    # ---- rows
    if op == "functional" and first_prompt:
        assert capacity in (None, 0)
        totals = list(prompt_lengths) if prompt_lengths is not None else [S] + [random.randint(1, S) for _ in range(B - 1)]
        pasts = [0] * B
        total_sequence_length = S
        past_capacity = 0
        cache_capacity = S
    elif op == "functional":
        past_capacity = capacity or 0
        pasts = list(past_lengths) if past_lengths is not None else [random.randint(0, past_capacity) for _ in range(B)]
        totals = [p + S for p in pasts]
        total_sequence_length = max(totals) + extra_total
        cache_capacity = max(past_capacity, total_sequence_length)
        assert not (past_capacity == 0 and total_sequence_length == S), "that is a first prompt: pass first_prompt=True"
    else:
        assert capacity is not None and capacity >= S
        past_capacity = cache_capacity = capacity
        pasts = list(past_lengths) if past_lengths is not None else [random.randint(0, capacity - S) for _ in range(B)]
        totals = [p + S for p in pasts]
        total_sequence_length = None
    assert len(totals) == B
    seqlens_k = torch.tensor([t - 1 for t in totals], dtype=torch.int32)

    # ---- activations
    def activation(hidden, amplitude=1.0):
        t = random_normal((B, S, hidden), dtype, amplitude)
        if not strided:
            return t
        base = poison(torch.empty(B, S + 1, hidden + 8, dtype=dtype))  # padded token and batch strides
        view = base[:, 1:, 3:3 + hidden]
        view.copy_(t)
        return view

    if packed:
        parts = [random_normal((B, S, q_hidden), dtype, q_amplitude), random_normal((B, S, 2 * kv_hidden), dtype)]
        query = torch.cat(parts, dim=2)
        if strided:
            base = poison(torch.empty(B, S + 1, query.shape[2] + 8, dtype=dtype))
            view = base[:, 1:, 3:3 + query.shape[2]]
            view.copy_(query)
            query = view
        key = value = None
    else:
        query = activation(q_hidden, q_amplitude)
        key, value = activation(kv_hidden), activation(kv_hidden)

    # ---- caches
    def cache_tensor(rows):
        shape = (B, kv_num_heads, rows, D) if layout == 0 else (B, rows, kv_num_heads, D)
        if not poison_unused:
            return random_normal(shape, dtype)
        # poison_unused: each batch row's cache rows past its past are poisoned, so that a read
        # of them shows. Values are drawn for the past only (a ragged batch in a large cache
        # would otherwise spend seconds on draws that the poison overwrites).
        t = poison(torch.empty(shape, dtype=dtype))
        for b, past in enumerate(pasts):
            valid = min(past, rows)
            if valid > 0:
                to_bnsh(t, layout)[b, :, :valid] = random_normal((kv_num_heads, valid, D), dtype)
        return t

    cache_key = cache_value = None
    cache_base = None
    if op == "functional" and not first_prompt and capacity is not None:
        cache_key, cache_value = cache_tensor(past_capacity), cache_tensor(past_capacity)
    elif op == "functional" and first_prompt and empty_past:
        cache_key, cache_value = cache_tensor(0), cache_tensor(0)
    elif op == "inplace":
        if strided:
            # Views of [.., capacity + guard, ..] buffers: rows outside the view are a guard region.
            extra = 3
            big_shape = (B, kv_num_heads, capacity + 2 * extra, D) if layout == 0 else (B, capacity + 2 * extra, kv_num_heads, D)
            kb, vb = poison(torch.empty(big_shape, dtype=dtype)), poison(torch.empty(big_shape, dtype=dtype))
            dim = 2 if layout == 0 else 1
            cache_key, cache_value = kb.narrow(dim, extra, capacity), vb.narrow(dim, extra, capacity)
            cache_key.copy_(cache_tensor(capacity))
            cache_value.copy_(cache_tensor(capacity))
            cache_base = (kb, vb)
        else:
            cache_key, cache_value = cache_tensor(capacity), cache_tensor(capacity)

    # ---- RoPE
    cos_cache = sin_cache = pos = None
    if rotary is not None:
        R = rotary_dim or D
        assert R % 2 == 0 and R <= D
        needed = max(max(totals), S) if op == "functional" and first_prompt else max(totals)
        if max_positions is None:
            max_positions = needed + 5
        cos_cache, sin_cache = _random_cos_sin(max_positions, R // 2, cos_dtype)
    if position_ids == "random":
        hi = max_positions if max_positions is not None else cache_capacity + 5
        pos = torch.randint(0, hi, (B, S), dtype=torch.int64)
    elif position_ids == "offset":
        hi = max_positions if max_positions is not None else cache_capacity + 5
        starts = torch.randint(0, hi - S + 1, (B, 1), dtype=torch.int64)
        pos = starts + torch.arange(S, dtype=torch.int64)[None, :]
    elif position_ids is not None:
        raise ValueError(position_ids)

    head_sink = (torch.randn(num_heads, dtype=torch.float32) * 1.5) if sink else None

    attrs = dict(num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=rotary is not None,
                 rotary_interleaved=rotary == "interleaved", local_window_size=window, softcap=softcap,
                 smooth_softmax=smooth, kv_layout=layout)
    case = Case(op=op, query=query, key=key, value=value, cache_key=cache_key, cache_value=cache_value,
                seqlens_k=seqlens_k, total_sequence_length=total_sequence_length, cos_cache=cos_cache,
                sin_cache=sin_cache, position_ids=pos, head_sink=head_sink, attrs=attrs, totals=totals,
                pasts=pasts, first_prompt=(op == "functional" and first_prompt), cache_base=cache_base,
                desc=desc or f"{op} B={B} S={S} Hq={num_heads} Hkv={kv_num_heads} D={D} C={capacity} "
                             f"{DTYPE_NAMES[dtype]} layout={layout} packed={packed} rotary={rotary}")
    if str(device) != "cpu":
        case = case.to(device)
    return case


# ---- comparison helpers -----------------------------------------------------------------------

def call_op(op: str, a: dict):
    """Calls the wrapper of `op` ("functional" or "inplace") with the arguments of a dict of the
    shape the validation and fuzz tests build (tensors by name, attributes under "attrs")."""
    attrs = a["attrs"]
    if op == "functional":
        return gqa_torch.group_query_attention(
            a["query"], a["key"], a["value"], a["cache_key"], a["cache_value"], a["seqlens_k"],
            a["total_sequence_length"], a["cos_cache"], a["sin_cache"], a["position_ids"], a["head_sink"], **attrs)
    return gqa_torch.group_query_attention_(
        a["query"], a["key"], a["value"], a["cache_key"], a["cache_value"], a["seqlens_k"], a["cos_cache"],
        a["sin_cache"], a["position_ids"], a["head_sink"], **attrs)


def assert_output_close(out: torch.Tensor, ref: torch.Tensor, case: Optional[Case] = None, suite: str = "parity",
                        tolerance: Optional[float] = None) -> float:
    """SPEC §5 tolerances; also: no NaN/inf anywhere, and first-prompt padding rows exactly 0."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == (case.dtype if case is not None else out.dtype)
    assert torch.isfinite(out).all(), f"non-finite output values ({int((~torch.isfinite(out)).sum())} elements)"
    if case is not None:
        for b, g in enumerate(case.geometry()):
            if g.valid_queries < case.seq:
                pad = out[b, g.valid_queries:]
                assert bool((pad == 0).all()), f"row {b}: padding query rows {g.valid_queries}.. must be exactly 0"
    tol = tolerance if tolerance is not None else (FP32_MAX_REL if out.dtype == torch.float32 else NORM_REL[out.dtype])
    err = output_error(out, ref)
    assert err <= tol, f"output error {err:.3g} > {tol:.3g}"
    record_error(suite, out.dtype, err)  # only passing comparisons feed the summary
    return err


def assert_cache_matches(actual: torch.Tensor, expected: torch.Tensor, *, rotated_rows=None, rotary_ulps: int = 0,
                         name: str = "cache") -> None:
    """Byte-identical, except that rows listed in rotated_rows ([(b, lo, hi)] in cache-row
    coordinates, i.e. rotated new K rows) may differ by rotary_ulps units in the last place
    (CUDA contracts RoPE into FMAs). The expected tensor is the reference's: past rows copied,
    new rows written, untouched rows as before (NaN canaries included), zeros after total."""
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype
    a, e = actual.detach().cpu(), expected.cpu()
    if rotary_ulps == 0 or not rotated_rows:
        if not bits_equal(a, e):
            diff = (bits(a) != bits(e))
            idx = diff.nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {int(diff.sum())} elements differ from the reference, first at {idx}")
        return
    return _assert_cache_with_ulps(a, e, rotated_rows, rotary_ulps, name)


def _assert_cache_with_ulps(a, e, rotated_rows, rotary_ulps, name):
    """a, e in BNSH. Rotated rows may differ by rotary_ulps units in the last place, measured
    either element-wise or against the largest magnitude of that head row (a contracted
    x0*cos - x1*sin can cancel, so a tiny result may be many of its own ulps off while being
    within rounding of its inputs). Only the elements whose bits differ are measured (elsewhere
    the distance is 0): a whole-cache pass in int64 and float64 took most of a GPU test's time."""
    differ = (bits(a) != bits(e)).nonzero()  # [n, 4] (b, h, s, d), in row-major order
    if differ.numel() == 0:
        return
    at = tuple(differ.t())
    av, ev = a[at], e[at]
    allowed = torch.zeros(len(differ), dtype=torch.bool)
    for b, lo, hi in rotated_rows:
        allowed |= (differ[:, 0] == b) & (differ[:, 2] >= lo) & (differ[:, 2] < hi)
    dist = ulp_distance(av, ev)
    eps = torch.finfo(e.dtype).eps
    row_scale = e[differ[:, 0], differ[:, 1], differ[:, 2]].double().abs().amax(dim=-1)  # each one's head row
    close = (av.double() - ev.double()).abs() <= rotary_ulps * eps * row_scale
    strict_bad = (dist != 0) & ~allowed
    loose_bad = (dist > rotary_ulps) & ~close & allowed
    assert not bool(strict_bad.any()), (f"{name}: {int(strict_bad.sum())} non-rotated elements differ, first at "
                                        f"{differ[strict_bad][:5].tolist()}")
    assert not bool(loose_bad.any()), (f"{name}: {int(loose_bad.sum())} rotated elements differ by more than "
                                       f"{rotary_ulps} ulp, first at {differ[loose_bad][:5].tolist()}")


def check_caches(case_before: Case, k_actual, v_actual, k_expected, v_expected, rotary_ulps: int = 0) -> None:
    """Caches vs the reference: V and non-rotated K byte-identical; rotated K rows within
    rotary_ulps (0 on CPU)."""
    layout = case_before.attrs["kv_layout"]
    rotated = None
    if case_before.attrs["do_rotary"]:
        rotated = [(b, g.past, g.past + case_before.seq) for b, g in enumerate(case_before.geometry())]
    assert_cache_matches(to_bnsh(k_actual.cpu(), layout), to_bnsh(k_expected, layout), rotated_rows=rotated,
                         rotary_ulps=rotary_ulps, name="key cache")
    assert_cache_matches(to_bnsh(v_actual.cpu(), layout), to_bnsh(v_expected, layout), name="value cache")


def run_and_check(case: Case, *, rotary_ulps: int = 0, suite: str = "parity", check_guard: bool = True,
                  reference=None):
    """Runs the op on `case` (its own device), compares output and caches with the reference,
    and returns the output error. The in-place caches and guard regions are checked too.
    `reference`: the (out, key cache, value cache) of case.reference() when the caller has it."""
    before = case.clone()
    ref_out, ref_k, ref_v = reference if reference is not None else before.reference()
    if case.op == "functional":
        c = max((0 if case.cache_key is None else to_bnsh(case.cache_key, case.attrs["kv_layout"]).shape[2]),
                case.total_sequence_length)
        H = case.attrs["kv_num_heads"]
        shape = (case.batch, H, c, case.head_dim)
        poison_allocator([ref_out.shape, shape, shape], case.dtype, device=case.query.device)
        out, present_k, present_v = case.run()
        check_caches(before, present_k, present_v, ref_k, ref_v, rotary_ulps)
        # Inputs are read-only for the functional op.
        for name, t in before.tensors().items():
            if t is not None:
                assert bits_equal(getattr(case, name).cpu(), t.cpu()), f"functional op modified its input {name}"
    else:
        poison_allocator([ref_out.shape], case.dtype, device=case.query.device)
        out = case.run()
        check_caches(before, case.cache_key, case.cache_value, ref_k, ref_v, rotary_ulps)
        if check_guard and case.cache_base is not None:
            # The guard region around the view: everything of the base outside the view.
            for base_now, base_before, view_now in ((case.cache_base[0], before.cache_base[0], case.cache_key),
                                                    (case.cache_base[1], before.cache_base[1], case.cache_value)):
                mask = torch.ones(base_now.shape, dtype=torch.bool)
                mask_view = mask.as_strided(view_now.shape, view_now.stride(),
                                            view_now.storage_offset() - base_now.storage_offset())
                mask_view.fill_(False)
                assert torch.equal(bits(base_now.cpu())[mask], bits(base_before.cpu())[mask]), "guard region written"
    return assert_output_close(out, ref_out, case, suite=suite)


# ---- CPU-side results computed once per input ------------------------------------------------
# The GPU route tests run each prefill kernel on the same inputs (their fixture seeds from the
# test id without the route); the float64 reference and the CPU backend's result of one input
# are then computed once and kept here, keyed by a digest of the inputs themselves.

_MEMO: "OrderedDict[bytes, tuple]" = OrderedDict()
_MEMO_LIMIT_BYTES = 8 << 30
_memo_bytes = 0


def case_fingerprint(case: Case) -> bytes:
    """A digest of what a call's results depend on: the op, its attributes, and each tensor's
    dtype, shape, strides and values (not where a view sits in its base: the guard regions
    around viewed caches are checked on the case itself, never taken from a memo)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(repr((case.op, sorted(case.attrs.items()), case.total_sequence_length)).encode())
    for name, t in case.tensors().items():
        if t is None:
            h.update(f"{name}:none;".encode())
            continue
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.stride()};".encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())  # (its buffer, not a copy)
    return h.digest()


def memoized(kind: str, case, compute) -> tuple:
    """compute() (a tuple of tensors) once per `kind` and input (a Case, or its
    case_fingerprint); later calls with the same input get clones of the kept tensors, so
    callers may modify what they get."""
    global _memo_bytes
    key = kind.encode() + b":" + (case if isinstance(case, bytes) else case_fingerprint(case))
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return tuple(t.clone() for t in _MEMO[key])
    result = tuple(compute())
    kept = tuple(t.detach().clone() for t in result)
    _MEMO[key] = kept
    _memo_bytes += sum(t.numel() * t.element_size() for t in kept)
    while _memo_bytes > _MEMO_LIMIT_BYTES and len(_MEMO) > 1:
        _, old = _MEMO.popitem(last=False)
        _memo_bytes -= sum(t.numel() * t.element_size() for t in old)
    return result


# ---- session hooks ---------------------------------------------------------------------------

_PASSED = 0


def pytest_runtest_logreport(report):
    global _PASSED
    if report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        _PASSED += 1


def pytest_sessionfinish(session, exitstatus):
    """A run in which nothing passed (everything skipped, deselected or missing) is a failure:
    skips never count as passes."""
    if session.config.option.collectonly:
        return
    if _PASSED == 0 and exitstatus in (0, 5):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.option.collectonly:
        return
    if _PASSED == 0:
        terminalreporter.write_line("gqa tests: ZERO tests passed -> the run fails (skips are not passes)", red=True)
    if ERROR_RECORD:
        terminalreporter.section("gqa: worst output errors vs the float64 reference")
        for (suite, dtype), err in sorted(ERROR_RECORD.items()):
            metric = "max|d|/max|ref|" if dtype == "fp32" else "||d||/||ref||"
            terminalreporter.write_line(f"  {suite:<14} {dtype:<5} {metric:<16} {err:.3e}")
    import sys
    ort = sys.modules.get("test_ort")
    if ort is not None and getattr(ort, "ORT_RECORD", None):
        rec = ort.ORT_RECORD
        terminalreporter.section("gqa: onnxruntime parity")
        terminalreporter.write_line(f"  configurations compared: {len(rec)}")
        for key in ("out_abs", "out_rel", "present_abs", "ref_rel"):
            terminalreporter.write_line(f"  max {key}: {max(r[key] for r in rec):.3e}")
