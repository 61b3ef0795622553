"""Where a prefill kernel's time goes, block by block: the per-block timeline of the
warp-specialised kernels (`_C._set_prefill_timeline`).

Thread 0 of each computing warpgroup stamps every query block it computes with the SM clock at
entry (after the block's set-up checks), with Q staged, after the first tile (the pipelined
order only), after the tile loop and at exit (output stored). This script runs one in-place
causal call per shape with the stamps on and reports:

- t: the SM cycles per key tile in the loop, and c: the loop's fixed cost per block, from a
  least-squares fit of the loop's cycles against the block's key tiles (in the pipelined
  order from the first tile's end, over the other tiles; the first tile, S and softmax with
  no P V to overlap, is reported on its own);
- the Q wait (entry to Q staged), the epilogue (loop done to exit) and the gap between a
  warpgroup's blocks (its previous exit to this entry: the walk and the block's set-up), in
  cycles and in tiles' worth (÷ t);
- the per-block overhead c + Q wait + epilogue + gap, in tiles, against the mean key tiles a
  block: the share of the kernel that the block edges cost;
- how evenly the CTAs are loaded (max / mean of each CTA's span from its first entry to its
  last exit) and how far apart the computing warpgroups of a block enter and leave it.

    python3 block_timeline.py --shapes 2x4096x128 1x16384x128 --route auto wgmma_ws_kv_pipe3

Diagnostics only: one call per shape, after a warm-up call without the stamps.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import gqa_torch
from common import parse_shape

HQ, HKV = 32, 8
FIELDS = ("entry", "q_ready", "first_done", "loop_done", "exit", "global_ns", "sm_tiles", "cta_work")
WARPGROUPS_PER_RECORD = 4  # the kernel's records are work * 4 + computing warpgroup


def run_stamped(b: int, length: int, d: int, route: str, dtype: torch.dtype):
    """The records of one stamped in-place causal call, and each one's computing warpgroup
    (records with no stamp removed)."""
    q = torch.randn(b, length, HQ * d, device="cuda", dtype=dtype)
    k = torch.randn(b, length, HKV * d, device="cuda", dtype=dtype)
    v = torch.randn(b, length, HKV * d, device="cuda", dtype=dtype)
    caches = [torch.empty(b, HKV, length, d, device="cuda", dtype=dtype) for _ in range(2)]
    seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
    # Every warp-specialised config has at least 64 query rows a block.
    blocks = b * HKV * math.ceil(length * (HQ // HKV) / 64)
    records = torch.zeros(blocks * WARPGROUPS_PER_RECORD, len(FIELDS), dtype=torch.int64, device="cuda")

    def call():
        gqa_torch.group_query_attention_(q, k, v, caches[0], caches[1], seqlens, num_heads=HQ, kv_num_heads=HKV)

    gqa_torch._C._set_prefill_route(route)
    try:
        call()  # warm-up: the TMA maps, the opt-ins, the clocks
        torch.cuda.synchronize()
        gqa_torch._C._set_prefill_timeline(records)
        try:
            call()
            torch.cuda.synchronize()
        finally:
            gqa_torch._C._set_prefill_timeline(None)
    finally:
        gqa_torch._C._set_prefill_route("auto")
    gqa_torch.check_errors()
    return records.cpu()


def computing_records(rows: torch.Tensor):
    """The computing warpgroups' records (those with an exit stamp) and each one's warpgroup."""
    stamped = rows[:, FIELDS.index("exit")] != 0
    warpgroup = torch.arange(rows.shape[0]) % WARPGROUPS_PER_RECORD
    return rows[stamped], warpgroup[stamped]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def analyse(rows: torch.Tensor, warpgroup: torch.Tensor) -> dict:
    """The summary of one shape's records (see the module docstring). Clock values stay int64
    until they are differences: only differences within one SM mean anything."""
    field = {name: rows[:, i] for i, name in enumerate(FIELDS)}
    entry, q_ready, first_done, loop_done, exit_ = (
        field[n] for n in ("entry", "q_ready", "first_done", "loop_done", "exit"))
    tiles = (field["sm_tiles"] & 0xFFFFFFFF).double()
    cta, work = field["cta_work"] >> 32, field["cta_work"] & 0xFFFFFFFF
    q_wait = (q_ready - entry).double()
    epilogue = (exit_ - loop_done).double()
    # The pipelined order stamps its first tile (S and softmax with no P V to overlap): then the
    # loop is fitted from there, over the remaining tiles.
    pipelined = bool((first_done != 0).all())
    if pipelined:
        first = (first_done - q_ready).double()
        loop, loop_tiles = (loop_done - first_done).double(), tiles - 1
    else:
        first = torch.full_like(tiles, float("nan"))
        loop, loop_tiles = (loop_done - q_ready).double(), tiles
    # loop = t * tiles + c, least squares.
    design = torch.stack([loop_tiles, torch.ones_like(loop_tiles)], 1)
    t, c = torch.linalg.lstsq(design, loop.unsqueeze(1)).solution.squeeze(1).tolist()

    gaps, spans = [], []
    for one in cta.unique().tolist():
        in_cta = cta == one
        spans.append(float(exit_[in_cta].max() - entry[in_cta].min()))
        for wg in warpgroup[in_cta].unique().tolist():
            sel = in_cta & (warpgroup == wg)
            order = torch.argsort(entry[sel])
            gaps.extend((entry[sel][order][1:] - exit_[sel][order][:-1]).double().tolist())
    # How far apart the computing warpgroups of one block enter and leave it.
    works, inverse = work.unique(return_inverse=True)
    spread = {}
    for name, stamp in (("entry", entry), ("exit", exit_)):
        high = torch.full((works.numel(),), torch.iinfo(torch.int64).min).scatter_reduce(0, inverse, stamp, "amax")
        low = torch.full((works.numel(),), torch.iinfo(torch.int64).max).scatter_reduce(0, inverse, stamp, "amin")
        spread[name] = float((high - low).double().mean())
    # Cycles a block costs beyond t per key tile: the Q wait, the first tile's excess over a
    # steady one (pipelined), the loop's fixed part, the epilogue and the gap to the next block.
    first_excess = float(first.mean()) - t if pipelined else 0.0
    overhead = float(q_wait.mean()) + first_excess + c + float(epilogue.mean()) + mean(gaps)
    return {
        "blocks": int(works.numel()),
        "warpgroups": int(warpgroup.max()) + 1,
        "mean_tiles": float(tiles.mean()),
        "t_cycles_per_tile": t,
        "c_loop_fixed_cycles": c,
        "q_wait_cycles": float(q_wait.mean()),
        "first_tile_cycles": float(first.mean()),
        "epilogue_cycles": float(epilogue.mean()),
        "gap_cycles": mean(gaps),
        "overhead_tiles": overhead / t if t > 0 else float("nan"),
        "overhead_share": overhead / (overhead + t * float(tiles.mean())) if t > 0 else float("nan"),
        "cta_span_max_over_mean": max(spans) / mean(spans),
        "warpgroup_entry_spread_cycles": spread["entry"],
        "warpgroup_exit_spread_cycles": spread["exit"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8x1024x128", "2x4096x128", "1x16384x128"],
                        help="B x L x D, causal, 32/8 heads")
    parser.add_argument("--route", nargs="+", default=["auto"], help="prefill route names (_C._set_prefill_route)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--json", help="also write the summaries to this file")
    parser.add_argument("--raw", help="also save every shape's records (torch.save) to this file")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"device: {torch.cuda.get_device_name()}, {args.dtype}, causal, {HQ}/{HKV} heads")
    summaries, raw = {}, {}
    for shape in args.shapes:
        b, length, d = parse_shape(shape)
        for route in args.route:
            rows = run_stamped(b, length, d, route, dtype)
            raw[f"{shape} {route}"] = rows
            summary = analyse(*computing_records(rows))
            if not summaries:  # the table's header: analyse()'s keys, in its order
                print("| shape | route | " + " | ".join(summary) + " |")
                print("|---" * (len(summary) + 2) + "|")
            summaries[f"{shape} {route}"] = summary
            cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in summary.values()]
            print(f"| {shape} | {route} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "fields": FIELDS, "runs": summaries}, f, indent=1)
    if args.raw:
        torch.save({"fields": FIELDS, "records": raw}, args.raw)


if __name__ == "__main__":
    main()
