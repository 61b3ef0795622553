"""Decode on the path of a GPU with 99 KB of shared memory a block, imitated on an H100/H200.

sm86, sm89 and sm120 GPUs (RTX 30xx/40xx/50xx, A10, L4, L40S) cannot hold the tensor-core decode
kernel's usual cp.async stages at head sizes 96, 128 and 256, so they take fewer warps a CTA:
two at 96 and 128, one at 256 (kernels/decode_cfg.cuh, decode_smem_fit). Under a shared-memory
budget (gqa_torch._C._set_smem_limit, which also leaves the sm90a kernels out) an H100 or H200
runs those kernels; this times them, interleaved in one process, against the sm90 path, the
generic kernel (a 50,000-byte budget, which no tensor-core configuration fits) and SDPA cuDNN.
An H100's bandwidth is not an RTX's: read the ratios between columns, not the times, as what the
narrow kernel buys over the generic one.

    python3 small_smem.py                       # the default shapes
    python3 small_smem.py --shapes 8x32x8x128x8192 1x32x8x256x8192
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend

import gqa_torch
from ab_decode import parse_decode_shape
from bench_decode import DTYPE, sdpa_step
from common import decode_inputs, progress, sets_for_bytes, time_graphs_interleaved, warm_up_gpu

SM86_BLOCK_BYTES = 99 * 1024
GENERIC_ONLY_BYTES = 50_000  # below every tensor-core decode configuration (two warps at 96: 57 KB)

DEFAULT_SHAPES = ["1x32x8x128x8192", "8x32x8x128x8192", "8x32x8x128x32768", "32x32x8x128x4096",
                  "8x32x32x96x4096", "1x32x8x256x8192"]


def under_budget(step, budget: int):
    """`step` with the budget set around each call: the kernels chosen while a graph captures it
    are the ones its replays run."""
    def call(i: int) -> None:
        gqa_torch._C._set_smem_limit(budget)
        try:
            step(i)
        finally:
            gqa_torch._C._set_smem_limit(0)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="BxHQxHKVxDxL")
    parser.add_argument("--replays", type=int, default=15)
    args = parser.parse_args()
    warm_up_gpu(3.0)
    print("| B | Hq/Hkv/D | L | sm90 path µs | 99 KB path µs | generic µs | SDPA cuDNN µs "
          "| generic / 99 KB path | 99 KB path / sm90 path |")
    print("|---|---|---|---|---|---|---|---|---|")
    for text in args.shapes:
        b, hq, hkv, d, length, low = parse_decode_shape(text)
        if low is not None:
            raise SystemExit(f"--shapes: equal rows only here, got {text}")
        n = sets_for_bytes(2 * b * hkv * length * d * 2)
        qs, ks, vs, ours = decode_inputs(b, hq, hkv, d, length, n, DTYPE)
        steps = {"sm90": ours, "sm86": under_budget(ours, SM86_BLOCK_BYTES),
                 "generic": under_budget(ours, GENERIC_ONLY_BYTES),
                 "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}
        t = time_graphs_interleaved(steps, n, args.replays)
        progress(f"B{b} {hq}/{hkv}/{d} L{length}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
        print(f"| {b} | {hq}/{hkv}/{d} | {length} | {t['sm90']:.1f} | {t['sm86']:.1f} | {t['generic']:.1f} | "
              f"{t['cudnn']:.1f} | {t['generic'] / t['sm86']:.2f} | {t['sm86'] / t['sm90']:.2f} |", flush=True)
        del qs, ks, vs, ours, steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
