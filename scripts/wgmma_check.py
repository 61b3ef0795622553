#!/usr/bin/env python3
"""Diagnoses the wgmma prefill routes (device only) against the mma.sync kernel.

For a few plain causal prefills (bf16 and fp16, D = 64, 128 and 256), runs the in-place op
with each wgmma route (plain, warp-specialised with TMA or cp.async, persistent, three
computing warpgroups, split K/V barriers in the plain and the pipelined order, 80-key tiles at
D = 256) and with the
mma.sync kernel on the same inputs and prints the largest difference, then, when they differ, where:
the error averaged per block of 8 output columns and per 8 query rows of a 64-row warpgroup
tile. A wrong descriptor or fragment layout shows up as a pattern (whole column blocks, every
other 8 rows, one warpgroup), not as noise.

    python3 scripts/wgmma_check.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_torch  # noqa: E402


def run(q, k, v, capacity, route):
    b, s, _ = q.shape
    d = k.shape[-1] // 1
    kc = torch.zeros(b, 1, capacity, d, device="cuda", dtype=q.dtype)
    vc = torch.zeros_like(kc)
    seqlens = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
    gqa_torch._C._set_prefill_route(route)
    try:
        out = gqa_torch.group_query_attention_(q, k, v, kc, vc, seqlens, num_heads=q.shape[-1] // d,
                                               kv_num_heads=1)
        torch.cuda.synchronize()
        gqa_torch.check_errors()
    finally:
        gqa_torch._C._set_prefill_route("auto")
    return out


def explain(diff, s, g, d):
    """Where the error sits: per 8 rows of a 64-row warpgroup tile and per 8-column block (a
    wrong descriptor or fragment layout shows as a pattern, not as noise)."""
    rows = diff.view(s * g, d)  # virtual rows r = token * G + head
    n = (rows.shape[0] // 64) * 64
    if n:
        tile = rows[:n].view(-1, 64, d).mean(0)  # [64 rows of a warpgroup tile][D]
        per_block = tile.view(8, 8, d // 8, 8).mean((1, 3))  # [row group][column block]
        print("    mean error per (8 rows of the 64-row tile) x (8-column block):")
        for i, line in enumerate(per_block.tolist()):
            print(f"      rows {8 * i:2d}-{8 * i + 7:2d}: " + " ".join(f"{x:5.2f}" for x in line))


def main() -> int:
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for s, g in ((64, 2), (130, 1), (300, 4)):
                q = torch.randn(1, s, g * d, device="cuda", dtype=dtype)
                k = torch.randn(1, s, d, device="cuda", dtype=dtype)
                v = torch.randn(1, s, d, device="cuda", dtype=dtype)
                ref = run(q, k, v, s + 8, "mma").float()
                for route in ("wgmma", "wgmma_ws", "wgmma_ws_cpasync", "wgmma_ws_persistent", "wgmma_ws3",
                              "wgmma_ws_kv", "wgmma_ws_kv_pipe", "wgmma_ws_bn80", "wgmma_ws_kv_pipe_pp",
                              "wgmma_ws_kv_pipe3"):
                    out = run(q, k, v, s + 8, route).float()
                    diff = (out - ref).abs()
                    rel = (diff.max() / ref.abs().max()).item()
                    worst = max(worst, rel)
                    print(f"{str(dtype):15s} D={d:3d} S={s:3d} G={g}: max |{route} - mma.sync| / max |ref| = {rel:.3g}"
                          f"{'  (NaN present)' if torch.isnan(out).any() else ''}")
                    if rel > 1e-2:
                        explain(diff, s, g, d)
    print(f"worst {worst:.3g}: {'OK' if worst < 1e-2 else 'MISMATCH'}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
