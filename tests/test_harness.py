"""The test machinery's own checks (CPU only): the input digest and the memo that lets the GPU
route tests compute the float64 reference and the CPU backend's result once per input."""
from __future__ import annotations

import random

import torch

from conftest import case_fingerprint, make_case, memoized


def _case(seed: int, **kw):
    random.seed(seed)
    torch.manual_seed(seed)
    return make_case("inplace", batch=2, seq=5, num_heads=4, kv_num_heads=2, head_dim=16, capacity=12,
                     rotary="half", strided=True, **kw)


def test_fingerprint_same_inputs_same_digest():
    """The same seed gives the same inputs and digest; a contiguous copy of the strided
    activations gives another (strides are part of the digest: a miss costs only time)."""
    assert case_fingerprint(_case(3)) == case_fingerprint(_case(3))
    assert case_fingerprint(_case(3)) != case_fingerprint(_case(3).clone())


def test_fingerprint_sees_every_input():
    """One element of any input tensor, or one attribute, changes the digest; the guard region
    around a viewed cache (checked on the case itself, never memoized) does not."""
    base = case_fingerprint(_case(3))
    for name in ("query", "key", "value", "cache_key", "cache_value", "cos_cache", "sin_cache", "seqlens_k"):
        case = _case(3)
        t = getattr(case, name)
        first = (0,) * t.dim()
        t[first] = t[first] - 1
        assert case_fingerprint(case) != base, name
    case = _case(3)
    guard = case.cache_base[0]
    guard.view(-1)[-1] = guard.view(-1)[-1] + 1  # past the view's last element: the guard region
    assert case_fingerprint(case) == base
    case = _case(3)
    case.attrs["softcap"] = 5.0
    assert case_fingerprint(case) != base
    assert case_fingerprint(_case(4)) != base


def test_memoized_computes_once_and_hands_out_copies():
    calls = []

    def compute():
        calls.append(1)
        return torch.arange(6.0), torch.ones(2)

    case = _case(5)
    first = memoized("harness", case, compute)
    first[0].zero_()  # the caller's tensors are its own
    second = memoized("harness", _case(5), compute)
    assert len(calls) == 1
    assert torch.equal(second[0], torch.arange(6.0)) and torch.equal(second[1], torch.ones(2))
    memoized("harness", _case(6), compute)  # other inputs: computed again
    memoized("other kind", case, compute)   # another kind of result: computed again
    assert len(calls) == 3
    memoized("harness", case_fingerprint(_case(5)), compute)  # by digest: the kept result
    assert len(calls) == 3
