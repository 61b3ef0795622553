#!/usr/bin/env python3
"""One build's decode speed against SDPA cuDNN, for comparing builds and switch settings
(device only).

Two builds cannot share a process (both register torch.ops.gqa), so an A/B of two builds runs
this script in each in turn, several times (scripts/gpu_check.sh, step "abdecode"). Each run
times our in-place call and SDPA cuDNN interleaved on the chosen rows of bench_decode.py's
grid and any other shapes (CUDA-graph replays, inputs rotated beyond L2, as bench_decode.py),
so that the ratio ours / cuDNN carries no drift of the clocks between runs. `--pins` adds our
call with a switch pinned, interleaved with the rest: `splits=N` (the decode split count,
_set_decode_split_override) or `merge=`, `loader=`, `schedule=`, `l2=`, `features=` (the _set_decode_*
switches; `shares=GRID/KEYS` the balanced partition's grid and item weight, as
`shares=two_per_sm/256`, or `shares=force/KEYS` it wherever its kernel is built;
`schedule=keep_splits` keeps the plan's splits for a batch of equal rows, `l2=on` and
`l2=off` pin the L2 prefetch before the PDL wait, `features=general` the decode kernel with every
feature compiled in); pins joined by `+` (`splits=1+schedule=longest_first`) make one column.
Prints one line a row:

    python3 benchmarks/ab_decode.py --rows 1 9 10 --shapes 8x32x8x256x1024 32x32x8x128x8192r256 \
        --pins merge=kernel splits=4

`--flash` adds SDPA flash as a column of its own (a shape cuDNN or flash cannot run reads nan);
`--models` adds the decode shapes of common models (MODEL_SHAPES):

    python3 benchmarks/ab_decode.py --flash --rows --models
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gqa_torch  # noqa: E402
from bench_decode import DECODE_GRID, DTYPE, sdpa_step  # noqa: E402
from common import decode_inputs, inplace_decode_step, ragged_lengths, time_graphs_interleaved, warm_up_gpu  # noqa: E402


# Decode shapes of common models outside bench_decode's grid (`--models`; the fortieth round's
# sweep), B x Hq x Hkv x D x L at B = 1 and in batches. The heads follow Llama 3.2 1B (32/8/64),
# GPT-2 (12/12/64), Phi-2 (32/32/80), Phi-3 mini (32/32/96), Qwen2 7B (28/4/128), Llama 2 7B
# (32/32/128), Llama 3 70B (64/8/128), Gemma 2 9B (16/8/256) and Gemma 2B (8/4/256).
MODEL_SHAPES = [
    "1x32x8x64x8192", "16x32x8x64x4096", "64x32x8x64x2048", "8x12x12x64x1024",
    "1x32x32x80x2048", "8x32x32x80x2048", "32x32x32x80x2048",
    "1x32x32x96x4096", "8x32x32x96x4096", "32x32x32x96x4096", "1x24x8x96x8192",
    "1x28x4x128x8192", "32x28x4x128x4096", "1x32x32x128x4096", "8x32x32x128x4096",
    "12x64x8x128x16384", "15x64x8x128x8192", "16x64x8x128x16384",
    "1x16x8x256x8192", "8x16x8x256x4096", "32x16x8x256x4096", "1x8x4x256x8192", "16x8x4x256x4096",
    "64x8x4x256x2048", "17x32x8x256x2048", "64x32x8x256x1024",
]


def split_override(value: str) -> None:
    gqa_torch._C._set_decode_split_override(0 if value == "auto" else int(value), 0)


def share_switch(value: str) -> None:
    """`shares=GRID` or `shares=GRID/KEYS`: the balanced partition's grid (auto, items,
    two_per_sm, cut) and item weight in keys (the plan's without /KEYS), where the plan takes it;
    `shares=force` (or `force/KEYS`) takes the plan's grid wherever the partition's kernel is built
    (head sizes 64 and 128), whether or not the plan takes it."""
    grid, _, keys = value.partition("/")
    gqa_torch._C._set_decode_shares(grid, int(keys) if keys else -1)


SWITCHES = {"splits": split_override, "shares": share_switch, "merge": gqa_torch._C._set_decode_merge,
            "loader": gqa_torch._C._set_decode_loader, "schedule": gqa_torch._C._set_decode_schedule,
            "l2": gqa_torch._C._set_decode_l2_prefetch, "features": gqa_torch._C._set_decode_features}


def pin_parts(pin: str) -> list:
    """The (switch name, value) pairs of a pin: "name=value", or several joined by "+"
    ("splits=1+schedule=longest_first"). Refuses a name SWITCHES does not know."""
    parts = []
    for part in pin.split("+"):
        if part.count("=") != 1 or part.split("=")[0] not in SWITCHES:
            raise SystemExit(f"--pins: expected name=value[+name=value...] with names {sorted(SWITCHES)}, got {pin}")
        parts.append(tuple(part.split("=")))
    return parts


@contextlib.contextmanager
def pinned_switches(pin: str):
    """Every switch of `pin` set inside the block, and given back to auto afterwards (a switch is
    read when a call is enqueued, so a graph captured inside keeps the pinned settings)."""
    parts = pin_parts(pin)
    try:
        for name, value in parts:
            SWITCHES[name](value)
        yield
    finally:
        for name, _ in parts:
            SWITCHES[name]("auto")


def parse_decode_shape(text: str) -> tuple:
    """(B, Hq, Hkv, D, L, low) from "BxHqxHkvxDxL" (every row full: low None) or
    "BxHqxHkvxDxLrLOW" (a ragged batch: lengths uniform in [LOW, L]). Refuses anything else."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)x(\d+)(?:r(\d+))?", text.lower())
    if match is None or (match.group(6) is not None and not 1 <= int(match.group(6)) <= int(match.group(5))):
        raise SystemExit(f"--shapes: expected BxHqxHkvxDxL or BxHqxHkvxDxLrLOW with 1 <= LOW <= L, got {text}")
    dims = tuple(int(x) for x in match.groups()[:5])
    return dims + (None if match.group(6) is None else int(match.group(6)),)


def time_row(b: int, hq: int, hkv: int, d: int, length: int, pins: list, low: "int | None" = None,
             flash: bool = False) -> dict:
    """µs a call on one shape: ours, SDPA cuDNN (over the whole cache, a reference for the clocks
    even where the batch is ragged), SDPA flash if `flash`, and ours with each pin ("name=value").
    A backend that cannot run the shape reads nan."""
    seqlens = None if low is None else (ragged_lengths(b, length, low) - 1).to(torch.int32).cuda()
    ours, n = inplace_decode_step(b, hq, hkv, d, length, DTYPE, seqlens)
    qs, ks, vs, _ = decode_inputs(b, hq, hkv, d, length, n, DTYPE)  # SDPA's own sets
    steps = {"ours": ours, "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}
    if flash:
        steps["flash"] = sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs)
    for pin in pins:
        def step(i, pin=pin):
            with pinned_switches(pin):
                ours(i)

        steps[pin] = step
    return time_graphs_interleaved(steps, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=list(range(len(DECODE_GRID))),
                        help="indices into bench_decode.DECODE_GRID (default: all)")
    parser.add_argument("--shapes", nargs="*", default=[],
                        help="more shapes, each BxHqxHkvxDxL, or BxHqxHkvxDxLrLOW for a ragged batch of lengths "
                             "uniform in [LOW, L] (printed as rows 100, 101, ...)")
    parser.add_argument("--pins", nargs="*", default=[],
                        help="columns of ours with a switch pinned, each name=value (splits, shares, merge, loader, schedule, l2, "
                             "features), or several joined by '+'")
    parser.add_argument("--models", action="store_true",
                        help="add MODEL_SHAPES (common models' decode shapes) after --shapes")
    parser.add_argument("--flash", action="store_true", help="also time SDPA flash (a column of its own)")
    parser.add_argument("--tag", default="", help="a name for this build, printed on every line")
    parser.add_argument("--smem-limit", type=int, default=0,
                        help="time our calls as on a GPU whose block holds at most this many bytes of shared memory "
                             "and that has no sm90a kernels (_C._set_smem_limit): 166912 an A100, 101376 sm86/sm89")
    args = parser.parse_args()
    for pin in args.pins:
        pin_parts(pin)  # (refuses a bad one before any timing)
    shapes = [(i, DECODE_GRID[i] + (None,)) for i in args.rows]
    texts = args.shapes + (MODEL_SHAPES if args.models else [])
    shapes += [(100 + i, parse_decode_shape(text)) for i, text in enumerate(texts)]
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    warm_up_gpu()
    gqa_torch._C._set_smem_limit(args.smem_limit)  # (read as each call is enqueued and captured)
    for index, (b, hq, hkv, d, length, low) in shapes:
        times = time_row(b, hq, hkv, d, length, args.pins, low, args.flash)
        ours, cudnn = times.pop("ours"), times.pop("cudnn")
        flash = f" flash {times.pop('flash'):.2f}" if args.flash else ""
        pins = "".join(f" | {name} {t:.2f}" for name, t in times.items())
        ragged = "" if low is None else f" ragged from {low}"
        print(f"{args.tag} row {index} B{b} {hq}/{hkv}/{d} L{length}{ragged}: ours {ours:.2f} cudnn {cudnn:.2f} "
              f"cudnn/ours {cudnn / ours:.3f}{flash}{pins}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
