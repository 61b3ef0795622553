"""Power, SM clock and speed of our decode call against SDPA cuDNN, each run alone for seconds at a
time (device only).

bench_decode.py interleaves short replays, so a GPU at its power cap sets every column's clock
from the mix. This runs one call's CUDA graph back to back for `--seconds`, sampling
nvidia-smi every 100 ms meanwhile, then the other's, in turn (`--turns` times each), and prints
for each phase the µs a call, the mean board power, the median and lowest SM clock and the
share of samples with the power-cap throttle reason set (common.GpuClockSampler):

    python3 decode_power.py --rows 8 7 --seconds 3 --turns 2
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention import SDPBackend

import gqa_torch  # noqa: F401  (registers the ops)
from bench_decode import DECODE_GRID, DTYPE, sdpa_step
from common import GpuClockSampler, capture_graph, decode_inputs, sets_for_bytes, warm_up_gpu


def replay_for(graph, seconds: float) -> int:
    """Replays `graph` back to back, four at a time, until `seconds` have passed; returns how many."""
    deadline = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < deadline:
        for _ in range(4):
            graph.replay()
        count += 4
        torch.cuda.synchronize()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8], help="indices into bench_decode.DECODE_GRID")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds each phase runs")
    parser.add_argument("--turns", type=int, default=2, help="phases of each call, alternating")
    args = parser.parse_args()
    clocks = GpuClockSampler(interval_ms=100)
    warm_up_gpu(3.0)
    for row in args.rows:
        b, hq, hkv, d, length = DECODE_GRID[row]
        n = sets_for_bytes(2 * b * hkv * length * d * 2)
        qs, ks, vs, ours = decode_inputs(b, hq, hkv, d, length, n, DTYPE)
        steps = {"ours": ours, "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}
        calls = max(n, 8)
        graphs = {name: capture_graph(step, n, calls) for name, step in steps.items()}
        for turn in range(args.turns):
            for name, graph in graphs.items():
                start = time.monotonic()
                replays = replay_for(graph, args.seconds)
                end = time.monotonic()
                # The first and last 0.3 s left out: the clock and power settle to each call.
                state = clocks.window(start + 0.3, end - 0.3)
                us = (end - start) * 1e6 / (replays * calls)
                print(f"row {row} B{b} {hq}/{hkv}/{d} L{length} turn {turn} {name:>5}: {us:9.2f} us a call, "
                      f"{state['mean_W']:6.1f} W, SM {state['median_sm_MHz']:6.0f} MHz (lowest "
                      f"{state['min_sm_MHz']:.0f}), power-capped in {state['power_capped_pct']:3.0f}% of the samples",
                      flush=True)
        del graphs, qs, ks, vs, ours, steps
        torch.cuda.empty_cache()
    clocks.close()


if __name__ == "__main__":
    main()
