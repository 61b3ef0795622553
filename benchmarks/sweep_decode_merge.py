#!/usr/bin/env python3
"""How the decode kernel's splits are best merged (device only): µs a call with the merge
kernel and with the in-launch merge (the last split to finish), at the plan's split count and
at 8 and 4 splits, on the rows where the two differ most. Prints one line a row; CUDA-graph
timing, inputs rotated beyond L2, as bench_decode.py.

    python3 benchmarks/sweep_decode_merge.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_torch  # noqa: E402
from common import inplace_decode_step, progress, time_graph, warm_up_gpu  # noqa: E402

ROWS = [(1, 32, 8, 128, 1024), (1, 32, 8, 128, 8192), (1, 32, 8, 128, 32768), (1, 14, 2, 64, 1024),
        (8, 32, 8, 128, 1024), (8, 32, 8, 128, 32768)]  # B, Hq, Hkv, D, L
SPLITS = [0, 8, 4]  # 0: the plan's
MERGES = ["kernel", "arrival"]


def sweep_row(b: int, hq: int, hkv: int, d: int, length: int) -> str:
    step, n = inplace_decode_step(b, hq, hkv, d, length, torch.bfloat16)

    cells = []
    try:
        for splits in SPLITS:
            gqa_torch._C._set_decode_split_override(splits, 0)
            for merge in MERGES:
                gqa_torch._C._set_decode_merge(merge)
                cells.append(f"{splits or 'plan'} splits, {merge} {time_graph(step, n):.2f}")
    finally:
        gqa_torch._C._set_decode_split_override(0, 0)
        gqa_torch._C._set_decode_merge("auto")
    return f"B{b} {hq}/{hkv}/{d} L{length}: " + " | ".join(cells)


def main() -> None:
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    warm_up_gpu()
    for row in ROWS:
        progress(sweep_row(*row))


if __name__ == "__main__":
    main()
