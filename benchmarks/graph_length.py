#!/usr/bin/env python3
"""How a decode call's measured time depends on the number of calls in the timed CUDA graph
(device only): ours, SDPA cuDNN and SDPA flash on bench_decode.py's grid.

bench_decode.py times a graph of max(input sets, 8) calls a replay (13 at B1 L8192, 8 where one
set exceeds the L2 budget) and divides the replay's time by them, so each call carries a share
of what the replay itself costs: the graph's launch and, for ours, the first call's missing PDL
overlap with the kernel before. This script captures graphs of several lengths for each row,
replays them interleaved (common.replay_interleaved), and fits

    T(replay) = a + b * calls

by least squares: b is the steady per-call time, a the replay's own cost. It prints the
per-call time at each length, b and a for each backend, and the ratio best SDPA / ours at the
shortest length, the longest, and by slope:

    python3 benchmarks/graph_length.py --rows 1 9 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gqa_torch  # noqa: E402
from bench_decode import DECODE_GRID, DTYPE, sdpa_step  # noqa: E402
from common import capture_graph, decode_inputs, replay_interleaved, sets_for_bytes, warm_up_gpu  # noqa: E402


def call_counts(kv_bytes: int) -> list:
    """Graph lengths beside bench_decode.py's own: long ones where a call is short."""
    if kv_bytes < 100e6:
        return [64, 128, 256]
    return [32, 64] if kv_bytes < 1e9 else [16]


def fit_line(xs: list, ys: list) -> tuple:
    """(slope, intercept) of the least-squares line through (xs, ys)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def run_row(b, hq, hkv, d, length, replays):
    kv_bytes = 2 * b * hkv * length * d * 2
    n = sets_for_bytes(kv_bytes)
    qs, ks, vs, ours = decode_inputs(b, hq, hkv, d, length, n, DTYPE)
    steps = {"ours": ours, "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs),
             "flash": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs)}
    counts = sorted(set([max(n, 8)] + call_counts(kv_bytes)))  # bench_decode.py's length first
    graphs = {(name, c): capture_graph(step, n, c) for name, step in steps.items() for c in counts}
    times = replay_interleaved(graphs, replays)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"B{b} {hq}/{hkv}/{d} L{length} (n={n}): us a call with {counts} calls a replay")
    slopes = {}
    for name in steps:
        slope, cost = fit_line(counts, [med[(name, c)] for c in counts])
        slopes[name] = slope
        print(f"  {name:6s} " + "  ".join(f"{med[(name, c)] / c:8.3f}" for c in counts) +
              f"   slope {slope:8.3f}  replay cost {cost:7.2f}")
    short, long_ = counts[0], counts[-1]
    best = min(slopes["cudnn"], slopes["flash"])
    print(f"  cudnn / ours at {short} calls: {med[('cudnn', short)] / med[('ours', short)]:.4f}; "
          f"at {long_}: {med[('cudnn', long_)] / med[('ours', long_)]:.4f}; "
          f"best SDPA / ours by slope: {best / slopes['ours']:.4f}", flush=True)
    del graphs, qs, ks, vs, ours, steps
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=list(range(len(DECODE_GRID))),
                        help="indices into bench_decode.py's grid (default: all)")
    parser.add_argument("--replays", type=int, default=12, help="timed replays of each graph")
    args = parser.parse_args()
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    warm_up_gpu()
    for i in args.rows:
        run_row(*DECODE_GRID[i], args.replays)


if __name__ == "__main__":
    main()
