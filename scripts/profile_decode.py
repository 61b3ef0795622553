#!/usr/bin/env python3
"""Where the time of one call goes, for the rows that miss their targets (device only).

Two views of the same call:

- ``--mode timeline``: 32 calls captured in one CUDA graph and replayed under
  ``torch.profiler``; prints, per kernel name, the mean duration, and the mean idle time on
  the GPU between the end of one kernel and the start of the next (launch latency, PDL waits),
  next to the graph-timed µs per call.
- ``--mode ncu``: a few eager calls, for Nsight Compute to profile (the shell runs
  ``ncu ... python3 scripts/profile_decode.py --mode ncu --row ...``).

Rows: decode (bf16, in-place op, all rows full, Hq/Hkv/D = 32/8/128) and one prefill.

    python3 scripts/profile_decode.py --mode timeline --row b1_l1024
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

import gqa_torch  # noqa: E402
from common import capture_graph, time_graph  # noqa: E402

ROWS = {  # name: (B, L, S[, D[, Hq, Hkv]]): S = 1 decode, else a causal prefill of S tokens on an
    # empty cache; D 128 and 32/8 heads unless given
    "b1_l1024": (1, 1024, 1),
    "b1_l8192": (1, 8192, 1),
    "b8_l8192": (8, 8192, 1),
    "b8_l32768": (8, 32768, 1),
    "b64_l8192": (64, 8192, 1),
    "b64_l32768": (64, 32768, 1),
    "prefill_b8_l1024": (8, 1024, 1024),
    "prefill_b2_l4096": (2, 4096, 4096),
    "prefill_b1_l16384": (1, 16384, 16384),
    "prefill_b2_l4096_d64": (2, 4096, 4096, 64),
    "prefill_b2_l4096_d256": (2, 4096, 4096, 256),
    "d64_b1_l1024": (1, 1024, 1, 64, 14, 2),  # bench_decode.py's 14/2/64 rows
    "d64_b1_l32768": (1, 32768, 1, 64, 14, 2),
    "g8_b16_l8192": (16, 8192, 1, 128, 64, 8),  # its 64/8 row
    "g8_b15_l8192": (15, 8192, 1, 128, 64, 8),  # 120 items on 132 SMs (stop 85's A/B)
}


def row_shape(row: str):
    """(B, L, S, D, Hq, Hkv) of a row, with the defaults filled in."""
    defaults = (128, 32, 8)  # D, Hq, Hkv
    shape = ROWS[row]
    return (*shape, *defaults[len(shape) - 3:])


def make_call(row: str):
    """Returns step(i) over enough input sets to rotate beyond L2, and the set count."""
    b, length, s, D, hq, hkv = row_shape(row)
    kv_bytes = 2 * b * hkv * length * D * 2
    n = max(1, min(32, (400 << 20) // kv_bytes + 1))
    dt = torch.bfloat16
    caches = [(torch.randn(b, hkv, length, D, device="cuda", dtype=dt),
               torch.randn(b, hkv, length, D, device="cuda", dtype=dt)) for _ in range(n)]
    qs = [torch.randn(b, s, hq * D, device="cuda", dtype=dt) for _ in range(n)]
    new_k = torch.randn(b, s, hkv * D, device="cuda", dtype=dt)
    new_v = torch.randn(b, s, hkv * D, device="cuda", dtype=dt)
    seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")

    def step(i: int) -> None:
        gqa_torch.group_query_attention_(qs[i], new_k, new_v, caches[i][0], caches[i][1], seqlens,
                                         num_heads=hq, kv_num_heads=hkv)

    return step, n


def timeline(row: str) -> None:
    step, n = make_call(row)
    per_call = time_graph(step, n)
    calls = 32
    graph = capture_graph(step, n, calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    print(f"{row}: graph-timed {per_call:.2f} us per call; {len(kernels)} kernel events in {calls} calls")
    if not kernels:
        return
    by_name = {}
    for start, end, name in kernels:
        by_name.setdefault(name[:60], []).append(end - start)
    for name, durations in by_name.items():
        print(f"  {name:60s} n={len(durations):3d} mean {statistics.mean(durations):7.2f} us")
    gaps = [kernels[i + 1][0] - kernels[i][1] for i in range(len(kernels) - 1)]
    span = kernels[-1][1] - kernels[0][0]
    print(f"  gaps between kernels: mean {statistics.mean(gaps) if gaps else 0:.2f} us, "
          f"min {min(gaps) if gaps else 0:.2f}; span {span / calls:.2f} us per call")


def eager(row: str) -> None:
    step, n = make_call(row)
    for i in range(6):
        step(i % n)
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["timeline", "ncu"], required=True)
    parser.add_argument("--row", choices=sorted(ROWS), nargs="+", required=True)
    parser.add_argument("--prefill-route", default="auto", help="the prefill kernel (_C._set_prefill_route)")
    args = parser.parse_args()
    if not gqa_torch.cuda_kernels_available():
        print("profile_decode: needs a GPU and a CUDA build", file=sys.stderr)
        return 2
    gqa_torch._C._set_prefill_route(args.prefill_route)
    for row in args.row:
        (timeline if args.mode == "timeline" else eager)(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
