"""A tiny deterministic all-pairs (pairwise) generator with constraints.

Every pair of values of every two factors appears in at least one generated row, in far
fewer rows than the cartesian product. Greedy (AETG-style): each new row is the best of a
batch of seeded random candidates, scored by how many uncovered pairs it covers.
"""
from __future__ import annotations

import itertools
import random
from typing import Callable, Dict, List, Sequence


def pairwise(factors: Dict[str, Sequence], valid: Callable[[dict], bool] = lambda row: True,
             seed: int = 20240601, candidates: int = 60) -> List[dict]:
    names = list(factors)
    rng = random.Random(seed)
    uncovered = set()
    for a, b in itertools.combinations(range(len(names)), 2):
        for va in range(len(factors[names[a]])):
            for vb in range(len(factors[names[b]])):
                probe = {names[a]: factors[names[a]][va], names[b]: factors[names[b]][vb]}
                if _pair_possible(factors, names, probe, valid, rng):
                    uncovered.add((a, va, b, vb))

    def covered_by(idx):
        return {(a, idx[a], b, idx[b]) for a, b in itertools.combinations(range(len(names)), 2)}

    rows = []
    while uncovered:
        best, best_gain = None, -1
        target = next(iter(sorted(uncovered)))
        for attempt in range(candidates * 20):
            idx = [rng.randrange(len(factors[n])) for n in names]
            if attempt < candidates * 20 - 1 and attempt % 2 == 0:  # half the candidates hit the oldest pair
                a, va, b, vb = target
                idx[a], idx[b] = va, vb
            row = {n: factors[n][i] for n, i in zip(names, idx)}
            if not valid(row):
                continue
            gain = len(covered_by(idx) & uncovered)
            if gain > best_gain:
                best, best_gain = idx, gain
            if attempt >= candidates and best_gain > 0:
                break
        if best is None or best_gain <= 0:
            raise RuntimeError(f"pairwise: cannot cover {sorted(uncovered)[:3]}")
        uncovered -= covered_by(best)
        rows.append({n: factors[n][i] for n, i in zip(names, best)})
    return rows


def _pair_possible(factors, names, probe, valid, rng, tries=400):
    for _ in range(tries):
        row = {n: (probe[n] if n in probe else rng.choice(list(factors[n]))) for n in names}
        if valid(row):
            return True
    return False
