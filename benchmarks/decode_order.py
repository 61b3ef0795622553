"""Does a graph's place in the interleaved round move its decode time? (device only)

bench_decode.py times every column of a row interleaved (common.replay_interleaved). Under the
"alternating" order ours is the first column, so at each turn of direction its graph runs four
replays in a row. This times ours, SDPA flash, SDPA cuDNN and `--copies` more graphs of our very
same call, under each order, and prints each column's median µs a call and its ratio to
cuDNN: copies of one call that read apart measure the order, not the kernel.

    python3 decode_order.py --rows 5 8 11 --copies 5
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend

import gqa_torch  # noqa: F401  (registers the ops)
from bench_decode import DECODE_GRID, DTYPE, sdpa_step
from common import decode_inputs, progress, sets_for_bytes, time_graphs_interleaved, warm_up_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8],
                        help="indices into bench_decode.DECODE_GRID (as ab_decode.py's; default: B64 L32768)")
    parser.add_argument("--copies", type=int, default=5, help="graphs of our call besides 'ours'")
    parser.add_argument("--replays", type=int, default=15)
    args = parser.parse_args()
    warm_up_gpu(3.0)
    for row in args.rows:
        b, hq, hkv, d, length = DECODE_GRID[row]
        n = sets_for_bytes(2 * b * hkv * length * d * 2)
        qs, ks, vs, ours = decode_inputs(b, hq, hkv, d, length, n, DTYPE)
        # ours first, the copies last, as bench_decode.py's pinned columns follow SDPA's.
        steps = {"ours": ours, "flash": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs),
                 "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}
        steps.update({f"ours_{k}": ours for k in range(1, args.copies + 1)})
        for order in ("alternating", "shuffled"):
            times = time_graphs_interleaved(steps, n, args.replays, order)
            cols = " | ".join(f"{name} {t:.1f} ({times['cudnn'] / t:.3f}x)" for name, t in times.items())
            progress(f"row {row} B{b} {hq}/{hkv}/{d} L{length} [{order}] {cols}")
        del qs, ks, vs, ours, steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
