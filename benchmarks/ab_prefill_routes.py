"""Interleaved A/B timing of prefill kernels (routes), to set `auto`'s thresholds.

bench_prefill.py times each route once, one after another, and the H200's clocks drift by
several percent over a run (SDPA cuDNN read 528 and 573 TFLOP/s on the same row in two runs).
Here every route gets its own CUDA graph, and the graphs are replayed in turn, round after
round, so that drift hits every route alike; the table gives each route's median and its
ratio to the first route.

    python3 ab_prefill_routes.py --routes wgmma_ws_persistent wgmma_ws_kv_pipe --shapes 2x4096x128 1x8192x128
    python3 ab_prefill_routes.py --routes wgmma_ws_persistent wgmma_ws_bn80 --shapes 2x4096x256 1x8192x256

A route name may end in "+q_cp_async" (e.g. auto+q_cp_async): that route with its Q tiles
staged by cp.async instead of TMA (_C._set_prefill_q_loader).

With --cudnn, SDPA cuDNN on the same inputs joins the interleaved graphs as the last column, and
the table ends with each route's ratio to it. Two builds are compared that way: run the script
in each (alternating processes: `scripts/gpu_check.sh abbuild`) and set their ours / cuDNN side by side.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gqa_torch
from common import parse_shape, progress, sdpa_views, sets_for_bytes, time_graphs_interleaved, warm_up_gpu

HQ, HKV = 32, 8
DTYPE = torch.bfloat16


def time_routes(b: int, length: int, d: int, routes, rounds: int, cudnn: bool = False):
    """Median µs per call of the in-place causal op for each route, replays interleaved (and of
    SDPA cuDNN on the same q, k, v, under the name "cudnn", with `cudnn`)."""
    per_set = b * length * (HQ + 2 * HKV) * d * 2 * 2
    n = sets_for_bytes(per_set, cap=8)
    qkv = [torch.randn(b, length, (HQ + 2 * HKV) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
    caches = [(torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE),
               torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE)) for _ in range(n)]
    seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")

    def call(i):
        q, k, v = qkv[i].split([HQ * d, HKV * d, HKV * d], -1)
        gqa_torch.group_query_attention_(q, k, v, caches[i][0], caches[i][1], seqlens, num_heads=HQ,
                                         kv_num_heads=HKV)

    def pinned(route):
        """The call with `route` pinned (e.g. auto+q_cp_async: that Q loader); the switches are
        read when a graph is captured."""
        name, _, q_loader = route.partition("+q_")

        def step(i):
            gqa_torch._C._set_prefill_route(name)
            gqa_torch._C._set_prefill_q_loader(q_loader or "auto")
            try:
                call(i)
            finally:
                gqa_torch._C._set_prefill_route("auto")
                gqa_torch._C._set_prefill_q_loader("auto")

        return step

    steps = {route: pinned(route) for route in routes}
    if cudnn:
        qs, ks, vs = sdpa_views(qkv, b, length, d, HQ, HKV)

        def sdpa_cudnn(i):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, enable_gqa=True)

        steps["cudnn"] = sdpa_cudnn
    return time_graphs_interleaved(steps, n, replays=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", nargs="+", default=["auto", "wgmma_ws_persistent", "wgmma_ws_kv_pipe"])
    parser.add_argument("--shapes", nargs="+", default=["8x1024x128", "4x2048x128", "2x4096x128", "1x8192x128",
                                                        "1x16384x128"], help="B x L x D, causal, 32/8 heads")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--cudnn", action="store_true", help="SDPA cuDNN as the last column, and each route / it")
    args = parser.parse_args()
    warm_up_gpu()
    print(f"device: {torch.cuda.get_device_name()}, bf16, causal, {HQ}/{HKV} heads, median of {args.rounds} "
          "interleaved graph replays")
    timed = args.routes + (["cudnn"] if args.cudnn else [])
    ratio_names = [f"{r} / {args.routes[0]}" for r in args.routes[1:]]
    ratio_names += [f"{r} / cudnn" for r in args.routes] if args.cudnn else []
    print("| B | L | D | " + " | ".join(f"{r} TFLOP/s" for r in timed) + " | " + " | ".join(ratio_names) + " |")
    print("|---" * (3 + len(timed) + len(ratio_names)) + "|")
    for shape in args.shapes:
        b, length, d = parse_shape(shape)
        progress(f"B={b} L={length} D={d}")
        us = time_routes(b, length, d, args.routes, args.rounds, args.cudnn)
        flops = 4 * b * HQ * length * length * d / 2
        tflops = [flops / (us[r] * 1e-6) / 1e12 for r in timed]
        ratios = [us[args.routes[0]] / us[r] for r in args.routes[1:]]
        ratios += [us["cudnn"] / us[r] for r in args.routes] if args.cudnn else []
        print(f"| {b} | {length} | {d} | " + " | ".join(f"{t:.0f}" for t in tflops) + " | " +
              " | ".join(f"{x:.3f}" for x in ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
