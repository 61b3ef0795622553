"""The prefill kernels' division by a launch-invariant divisor (csrc/core/fast_div.h: a
multiply-high, an add and a shift), checked on the host against Python's integer division. The
kernels divide packed rows by the group size and work items by their schedule's counts with it,
so a wrong quotient would misplace whole rows; the GPU parity tests cover the device side."""
from __future__ import annotations

import random

import pytest

from gqa_torch import _C

INT32_MAX = 2**31 - 1


def _numerators(d: int, rng: random.Random) -> list[int]:
    """Every numerator near a multiple of d where a rounding error would show, the ends of the
    range, and random ones."""
    ns = {0, 1, 2, INT32_MAX, INT32_MAX - 1, INT32_MAX - d, INT32_MAX // d * d, INT32_MAX // d * d - 1}
    for k in (1, 2, 3, 7, 1000, INT32_MAX // d // 2, INT32_MAX // d):
        for delta in (-1, 0, 1):
            ns.add(k * d + delta)
    ns.update(rng.randrange(0, INT32_MAX + 1) for _ in range(200))
    return sorted(n for n in ns if 0 <= n <= INT32_MAX)


DIVISORS = (list(range(1, 130)) + [2**k + e for k in range(7, 31) for e in (-1, 0, 1)] +
            [INT32_MAX, INT32_MAX - 1, 641, 6700417, 1_000_003, 12_345_678])


@pytest.mark.parametrize("chunk", range(4))
def test_fast_divide_matches_integer_division(chunk):
    rng = random.Random(chunk)
    for d in DIVISORS[chunk::4]:
        ns = _numerators(d, rng)
        got = _C._fast_divide(ns, d)
        want = [n // d for n in ns]
        bad = [(n, g, w) for n, g, w in zip(ns, got, want) if g != w]
        assert not bad, f"divisor {d}: (n, got, want) {bad[:5]}"


def test_fast_divide_every_small_numerator():
    """Exhaustive over the numerators the group-size division meets in small cases."""
    for d in range(1, 65):
        ns = list(range(0, 70_000))
        assert _C._fast_divide(ns, d) == [n // d for n in ns], f"divisor {d}"


def test_fast_divide_rejects_what_it_does_not_cover():
    with pytest.raises(ValueError, match="divisor must be positive"):
        _C._fast_divide([1], 0)
    with pytest.raises(ValueError, match="numerators must be non-negative"):
        _C._fast_divide([-1], 3)
