"""Does the order of interleaved graphs move the ratio of ours to SDPA cuDNN? (causal prefill)

The H200 runs long prefills at its power cap, and a graph that follows a graph which drew less
power runs at higher clocks. This times ours, SDPA flash and SDPA cuDNN, each in its own CUDA
graph, under several orders of a round, and prints ours / cuDNN for each order, with the SM
clock and board power (NVML, when pynvml is installed) sampled as each timed replay starts.
`common.time_graphs_interleaved` takes the last scheme ("self, alternating").

    python3 interleave_order.py 2x4096x128 1x16384x128
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend

import gqa_torch
from bench_prefill import causal_flops, sdpa_step
from common import capture_graph, parse_shape, sdpa_views, sets_for_bytes, warm_up_gpu

HQ, HKV = 32, 8
DTYPE = torch.bfloat16


def nvml_probes():
    """(SM clock in MHz, board power in W) readers, or NaN readers without pynvml."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return (lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
    except Exception:  # no pynvml, or no NVML on this machine
        return (lambda: float("nan")), (lambda: float("nan"))


def steps_for(b: int, length: int, d: int):
    """(input sets, {name: step(i)}) for the in-place op and the two SDPA backends."""
    n = sets_for_bytes(b * length * (HQ + 2 * HKV) * d * 2 * 2, cap=8)
    qkv = [torch.randn(b, length, (HQ + 2 * HKV) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
    caches = [(torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE),
               torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE)) for _ in range(n)]
    seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
    qs, ks, vs = sdpa_views(qkv, b, length, d, HQ, HKV)

    def ours(i):
        q, k, v = qkv[i].split([HQ * d, HKV * d, HKV * d], -1)
        gqa_torch.group_query_attention_(q, k, v, caches[i][0], caches[i][1], seqlens, num_heads=HQ,
                                         kv_num_heads=HKV)

    return n, {"ours": ours, "flash": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs),
               "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}


def time_in_order(graphs, calls, order_of_round, rounds, untimed_before, probes):
    """{name: (median µs per call, median clock, median power)} over `rounds` rounds."""
    clock, power = probes
    samples = {name: [] for name in graphs}
    for round_ in range(rounds):
        for name in order_of_round(round_):
            for _ in range(untimed_before):
                graphs[name].replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            mhz, watts = clock(), power()
            end.synchronize()
            samples[name].append((start.elapsed_time(end) * 1000.0 / calls, mhz, watts))
    return {name: tuple(statistics.median(s[k] for s in rows) for k in range(3))
            for name, rows in samples.items() if rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="BxLxD, e.g. 1x16384x128")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    probes = nvml_probes()
    warm_up_gpu(3.0)
    fixed = lambda *names: (lambda _round: list(names))  # noqa: E731
    alternating = lambda _round: ["ours", "flash", "cudnn"][:: 1 if _round % 2 == 0 else -1]  # noqa: E731
    schemes = [("ours, flash, cudnn", fixed("ours", "flash", "cudnn"), 0),
               ("cudnn, flash, ours", fixed("cudnn", "flash", "ours"), 0),
               ("ours, cudnn", fixed("ours", "cudnn"), 0),
               ("cudnn, ours", fixed("cudnn", "ours"), 0),
               ("self, ours, flash, cudnn", fixed("ours", "flash", "cudnn"), 1),
               ("self, cudnn, flash, ours", fixed("cudnn", "flash", "ours"), 1),
               ("self, alternating", alternating, 1)]
    for shape in args.shapes:
        b, length, d = parse_shape(shape)
        n, steps = steps_for(b, length, d)
        calls = max(n, 8)
        graphs = {name: capture_graph(step, n, calls) for name, step in steps.items()}
        flops = causal_flops(b, length, d, HQ)
        for label, order, untimed_before in schemes:
            res = time_in_order(graphs, calls, order, args.rounds, untimed_before, probes)
            tflops = {name: flops / (r[0] * 1e-6) / 1e12 for name, r in res.items()}
            cols = " | ".join(f"{name} {tflops[name]:.0f} TFLOP/s @{res[name][1]:.0f} MHz {res[name][2]:.0f} W"
                              for name in res)
            print(f"{shape} [{label}] ours/cudnn {tflops['ours'] / tflops['cudnn']:.3f} :: {cols}", flush=True)
        del graphs


if __name__ == "__main__":
    main()
