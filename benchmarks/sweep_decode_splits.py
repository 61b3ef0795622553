"""Tuning sweep (device only): the decode grid of bench_decode.py timed at several split counts.

For every row, the in-place op (append + attention, bf16, CUDA-graph replays, inputs rotated
beyond L2) is timed with the plan's own choice, then with each forced ``max_splits`` (and the
smallest split lowered so that the forced count is really used), with the loader `--loader`
pins, the merge `--merge` pins and the row order `--schedule` pins (default: auto's choices).
`--ragged` adds the ragged rows of bench_decode.py (rows of lengths uniform in [256,
capacity]), each followed by a batch of equal rows holding the same keys. Prints, per row, the
plan's time, the best forced setting and its time, so the plan's heuristic can be checked
against measurements. Writes benchmarks/results/sweep_decode_splits.{json,md}.
"""
from __future__ import annotations

import argparse

import torch

import gqa_torch
from bench_decode import DECODE_GRID, DTYPE
from common import inplace_decode_step, progress, time_graph, write_tables

SPLITS = [1, 2, 4, 8, 12, 16, 24, 33, 48, 64, 128]
RAGGED_ROWS = [(32, 8192), (8, 32768)]  # B, capacity: bench_decode.ragged_table's rows


def sweep_row(b, hq, hkv, d, length, splits, lengths=None):
    """Times one row; `lengths` (a ragged row): each batch row's valid length in a cache of
    `length` rows."""
    kv_bytes = 2 * b * hkv * length * d * 2
    seqlens = None
    if lengths is not None:
        seqlens = (lengths - 1).to(torch.int32).cuda()
        kv_bytes = 2 * int(lengths.sum()) * hkv * d * 2
    ours, n = inplace_decode_step(b, hq, hkv, d, length, DTYPE, seqlens)

    times = {"plan": time_graph(ours, n)}
    for s in splits:
        if s > 1 and length // s < 16:
            continue
        gqa_torch._C._set_decode_split_override(s, 16)
        try:
            times[s] = time_graph(ours, n)
        finally:
            gqa_torch._C._set_decode_split_override(0, 0)
    return times, kv_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--splits", type=int, nargs="+", default=SPLITS)
    parser.add_argument("--loader", default="auto", help="the decode loader to pin (auto, cp_async, tma, regs_k)")
    parser.add_argument("--merge", default="auto", help="the decode merge to pin (auto, kernel, arrival)")
    parser.add_argument("--rows", type=int, nargs="*", default=None,
                        help="indices into the decode grid (default: all; none with --ragged: the ragged rows only)")
    parser.add_argument("--schedule", default="auto", help="the decode row order to pin (auto, rows, longest_first)")
    parser.add_argument("--ragged", action="store_true", help="also the ragged rows of bench_decode.py")
    args = parser.parse_args()
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    gqa_torch._C._set_decode_loader(args.loader)
    gqa_torch._C._set_decode_merge(args.merge)
    gqa_torch._C._set_decode_schedule(args.schedule)
    rows = []
    grid = [DECODE_GRID[i] for i in args.rows] if args.rows is not None else DECODE_GRID
    grid = [(*row, None) for row in grid]
    if args.ragged:
        for b, capacity in RAGGED_ROWS:  # the lengths bench_decode.ragged_table draws
            lengths = torch.randint(256, capacity + 1, (b,), generator=torch.Generator().manual_seed(b))
            grid.append((b, 32, 8, 128, capacity, lengths))
            # The same bytes in rows of equal length: what the ragged row would take if its
            # work spread evenly.
            grid.append((b, 32, 8, 128, int(lengths.float().mean()), None))
    for b, hq, hkv, d, length, lengths in grid:
        times, kv_bytes = sweep_row(b, hq, hkv, d, length, args.splits, lengths)
        forced = {k: v for k, v in times.items() if k != "plan"}
        best = min(forced, key=forced.get)
        row = dict(B=b, heads=f"{hq}/{hkv}/{d}", L=length if lengths is None else f"ragged, capacity {length}",
                   TBps=kv_bytes / forced[best] / 1e6, plan_us=times["plan"], best_splits=best,
                   best_us=forced[best], gain=times["plan"] / forced[best],
                   all_us=" ".join(f"{k}:{v:.1f}" for k, v in forced.items()))
        progress(f"B={b} {hq}/{hkv}/{d} L={row['L']}: plan {times['plan']:.1f} us; best {best} splits "
                 f"{forced[best]:.1f} us ({row['gain']:.2f}x); {row['all_us']}")
        rows.append(row)
        torch.cuda.empty_cache()
    gqa_torch._C._set_decode_loader("auto")
    gqa_torch._C._set_decode_merge("auto")
    gqa_torch._C._set_decode_schedule("auto")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bf16", loader=args.loader,
                merge=args.merge, schedule=args.schedule,
                timing="median of CUDA-graph replays, inputs rotated beyond L2")
    print(write_tables("sweep_decode_splits", meta, rows,
                       ["B", "heads", "L", "plan_us", "best_splits", "best_us", "TBps", "gain", "all_us"],
                       "Decode split sweep"))


if __name__ == "__main__":
    main()
