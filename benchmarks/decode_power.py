"""Power, SM clock and speed of our decode call against SDPA cuDNN, each run alone for seconds at a
time (device only).

bench_decode.py interleaves short replays, so a GPU at its power cap sets every column's clock
from the mix. This runs one call's CUDA graph back to back for `--seconds`, sampling
nvidia-smi every 100 ms meanwhile, then the other's, in turn (`--turns` times each), and prints
for each phase the µs a call, the mean board power, the median SM clock and the share of
samples with the power-cap throttle reason set:

    python3 decode_power.py --rows 8 7 --seconds 3 --turns 2
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from torch.nn.attention import SDPBackend

import gqa_torch  # noqa: F401  (registers the ops)
from bench_decode import DECODE_GRID, DTYPE, sdpa_step
from common import capture_graph, decode_inputs, sets_for_bytes, warm_up_gpu

# nvidia-smi's clocks_throttle_reasons.active bit for the software power cap.
POWER_CAP_BIT = 0x4


def sample_while(run, seconds: float) -> tuple:
    """(seconds the work took, the replays `run(deadline)` made, nvidia-smi's samples as
    [(watts, SM MHz, throttle reasons)]) of `run`, sampled every 100 ms while it runs."""
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active",
         "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's first sample lands before the work starts otherwise
    start = time.perf_counter()
    replays = run(start + seconds)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except (ValueError, IndexError):
            continue
    # Drop the samples taken before the work began (the 0.3 s above) and as it ended.
    return elapsed, replays, samples[3:-2] if len(samples) > 8 else samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8], help="indices into bench_decode.DECODE_GRID")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds each phase runs")
    parser.add_argument("--turns", type=int, default=2, help="phases of each call, alternating")
    args = parser.parse_args()
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
                def run(deadline, graph=graph):
                    count = 0
                    while time.perf_counter() < deadline:
                        for _ in range(4):
                            graph.replay()
                        count += 4
                        torch.cuda.synchronize()
                    return count
                elapsed, replays, samples = sample_while(run, args.seconds)
                us = elapsed * 1e6 / (replays * calls)
                watts = statistics.mean(s[0] for s in samples) if samples else float("nan")
                mhz = statistics.median(s[1] for s in samples) if samples else float("nan")
                capped = sum(1 for s in samples if s[2] & POWER_CAP_BIT) / max(len(samples), 1)
                print(f"row {row} B{b} {hq}/{hkv}/{d} L{length} turn {turn} {name:>5}: {us:9.2f} us a call, "
                      f"{watts:6.1f} W, SM {mhz:6.0f} MHz, power-capped in {100 * capped:3.0f}% of "
                      f"{len(samples)} samples", flush=True)


if __name__ == "__main__":
    main()
