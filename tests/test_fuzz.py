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

The cases, the oracle and the tensors built from a case are in ``tests/fuzz_cases.py``; the
property that each case is checked against, and the counters, in ``tests/fuzz_check.py``.

Findings are kept as named regression tests (``test_regression_*``):

1. scale/softcap that are finite doubles but not finite float32 (1e39) were accepted and
   gave all-NaN outputs (csrc/torch/params_builder.cpp now refuses them, naming the attribute);
2. a positive softcap below float32's smallest subnormal (1e-50) became 0, silently switching
   the cap off (refused likewise);
3. (the checker) fp16 outputs that underflow (a dominant head sink) are judged against the
   storage dtype's own rounding, see :func:`check_output`.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import replace
from typing import List

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# Hypothesis caches (constants, failure patches) outside the work tree, unless asked otherwise.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "gqa-hypothesis"))

import gqa_torch  # noqa: E402
import fuzz_check  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from conftest import call_op as call  # noqa: E402
from fuzz_cases import HOST_MUTATIONS, INT32_MAX, Spec, build, expected_flags, is_first_prompt, specs  # noqa: E402
from fuzz_check import (STATS_BY_DEVICE, SummaryPlugin, assert_same_bytes, check_spec, record,  # noqa: E402
                        summary_lines, watched, with_threads)
from reference import to_bnsh  # noqa: E402

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


@pytest.fixture(scope="module", autouse=True)
def _fuzz_summary_plugin(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("gqa-fuzz-summary"):
        pm.register(SummaryPlugin(), "gqa-fuzz-summary")
    yield


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
    monkeypatch.setattr(fuzz_check, "call", _sabotage(kind))
    with pytest.raises(AssertionError):
        check_spec(spec)


@pytest.mark.parametrize("kind,spec_kw", [("wrong_flags", dict(seqlens=[0])), ("host_error_unnamed", dict(host="softcap_nan")),
                                          ("write_then_op", dict(seqlens=[0])), ("wrong_flags", dict(seqlens=[4]))])
def test_checker_detects_bad_rejections(kind, spec_kw, monkeypatch):
    """Self-check: wrong flags, an exception that names no argument, a write before a rejection,
    or a GQAError for a valid call all fail check_spec."""
    spec = _valid_spec(**spec_kw)
    check_spec(spec)
    monkeypatch.setattr(fuzz_check, "call", _sabotage(kind))
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
        assert_same_bytes(built.buffer, before, "cache buffer after a rejected call")


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
