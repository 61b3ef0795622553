"""Decode benchmark (BENCHMARKS.md): gqa_torch against SDPA flash, SDPA cuDNN and FlexAttention.

Three tables, all measured in one run, bf16, CUDA-graph replays, inputs rotated beyond L2:
1. decode: one new token per row, all rows full (our op = RoPE-free append + attention);
2. ragged: rows of different valid lengths in one static cache (SDPA reads the capacity);
3. step: the whole decode step (RoPE + append + attention) against the HF StaticCache step
   (RoPE + index_copy_ + masked SDPA over the capacity).
Writes benchmarks/results/decode*.{json,md,png}.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gqa_torch
from common import (HBM_DATASHEET_TBS, GpuClockSampler, bar_plot, decode_inputs, measure_hbm_read_tbs, progress, ragged_lengths,
                    sets_for_bytes, time_graph, time_graphs_interleaved, warm_up_gpu, write_tables)

DECODE_GRID = [  # B, Hq, Hkv, D, L
    (1, 32, 8, 128, 1024), (1, 32, 8, 128, 8192), (1, 32, 8, 128, 32768),
    (8, 32, 8, 128, 1024), (8, 32, 8, 128, 8192), (8, 32, 8, 128, 32768),
    (64, 32, 8, 128, 1024), (64, 32, 8, 128, 8192), (64, 32, 8, 128, 32768),
    (1, 14, 2, 64, 1024), (1, 14, 2, 64, 32768), (16, 64, 8, 128, 8192),
]
STEP_GRID = [(1, 4096, 1000), (8, 4096, 1000), (8, 32768, 4000), (32, 8192, 8000)]  # B, capacity, length
DTYPE = torch.bfloat16
# The decode kernel's loaders timed beside the default ("ours"), one column each.
LOADER_COLUMNS = ["cp_async", "tma", "regs_k"]
MERGE_COLUMNS = ["kernel", "arrival"]
# The decode kernel's row orders pinned (auto takes the rows longest first where the plan says so,
# and a batch of equal rows in fewer splits where it says so; keep_splits: in the plan's own;
# one_wave: a ragged batch in the plan's one wave where auto takes two).
SCHEDULE_COLUMNS = ["rows", "longest_first", "keep_splits", "one_wave"]
# The decode kernel with every feature compiled in (auto takes the build without RoPE, softcap,
# windows, sinks and smooth softmax for these calls, which use none of them).
FEATURE_COLUMNS = ["general"]
# The first K/V tiles issued after the error word and the row checks (auto: before them).
EARLY_COLUMNS = ["off"]
# The L2 prefetch before the PDL wait off and on (auto: on where the caches hold <= 8 MB of K/V).
L2_COLUMNS = ["off", "on"]
# How much L2 fetches around each TMA copy of K and V, pinned (the maps' promotion; auto: 128
# bytes). The cp.async copies and regs_k's K loads always ask for 128.
FETCH_COLUMNS = ["sectors", "128B", "256B"]


def pinned(step, switch, value):
    """`step` with one of the decode kernel's switches set to `value` while it is enqueued."""
    def run(i):
        switch(value)
        try:
            step(i)
        finally:
            switch("auto")

    return run


def latency_bound(b, hq, hkv, d, length):
    return (b == 1 and length <= 8192) or (hq, hkv, d) == (14, 2, 64)


def sdpa_step(backend, qs, ks, vs, mask=None):
    """One SDPA call on input set i, pinned to `backend`."""
    def step(i):
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], attn_mask=mask, enable_gqa=True)

    return step


def time_flex(qs, ks, vs):
    """µs a call of FlexAttention compiled for this shape, or nan where it does not compile or
    cannot be captured in a CUDA graph."""
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        # A fresh compile for each shape: past dynamo's recompile limit (eight shapes) the compiled
        # function falls back to flex's eager path, which a CUDA graph cannot capture (B = 16 read
        # nan that way until the thirty-fourth round).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)

        def step(i):
            flex(qs[i], ks[i], vs[i], enable_gqa=True)

        return time_graph(step, len(qs))
    except Exception as exc:
        progress(f"    flex: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
        return float("nan")


def decode_table(args):
    rows = []
    flex_seconds = 0.0  # FlexAttention's compiles and timing so far (bounded by --flex-budget)
    for b, hq, hkv, d, length in DECODE_GRID:
        kv_bytes = 2 * b * hkv * length * d * 2
        n = sets_for_bytes(kv_bytes)
        progress(f"decode B={b} {hq}/{hkv}/{d} L={length}: {kv_bytes / 1e6:.0f} MB K/V, {n} input sets")
        qs, ks, vs, ours = decode_inputs(b, hq, hkv, d, length, n, DTYPE)
        # Every column interleaved (common.time_graphs_interleaved), so that their ratios do not
        # carry the clocks' drift over the run: ours (auto), SDPA flash and cuDNN, and ours with
        # each of the decode kernel's loaders and merges pinned (a switch is read when the call
        # is enqueued, so each graph keeps the one set at its capture).
        steps = {"ours": ours, "flash": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs),
                 "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}
        for switch, values, prefix in ((gqa_torch._C._set_decode_loader, LOADER_COLUMNS, ""),
                                       (gqa_torch._C._set_decode_merge, MERGE_COLUMNS, "merge_"),
                                       (gqa_torch._C._set_decode_schedule, SCHEDULE_COLUMNS, "schedule_"),
                                       (gqa_torch._C._set_decode_features, FEATURE_COLUMNS, "features_"),
                                       (gqa_torch._C._set_decode_early_tiles, EARLY_COLUMNS, "early_"),
                                       (gqa_torch._C._set_decode_l2_prefetch, L2_COLUMNS, "l2_"),
                                       (gqa_torch._C._set_decode_l2_fetch, FETCH_COLUMNS, "fetch_")):
            for value in values:
                steps[prefix + value] = pinned(ours, switch, value)
        timing_began = time.monotonic()
        times = time_graphs_interleaved(steps, n)
        clocks = args.clocks.window(timing_began, time.monotonic())
        t_ours, t_flash, t_cudnn = times.pop("ours"), times.pop("flash"), times.pop("cudnn")
        t_loader = times
        t_flex = float("nan")
        if args.flex and flex_seconds < args.flex_budget:
            start = time.monotonic()
            t_flex = time_flex(qs, ks, vs)
            flex_seconds += time.monotonic() - start
        elif args.flex:
            progress(f"    flex: skipped (--flex-budget {args.flex_budget:.0f} s spent)")
        best = min(t for t in (t_flash, t_cudnn) if t == t)
        row = dict(B=b, heads=f"{hq}/{hkv}/{d}", L=length, kv_MB=kv_bytes / 1e6, ours_us=t_ours, **{f"{k}_us": t for k, t in t_loader.items()},
                   sdpa_flash_us=t_flash, sdpa_cudnn_us=t_cudnn, flex_us=t_flex,
                   speedup_vs_best=best / t_ours, TBps=kv_bytes / t_ours / 1e6,
                   pct_of_4_8TBps=100 * kv_bytes / t_ours / 1e6 / HBM_DATASHEET_TBS,
                   target=("1.3x" if latency_bound(b, hq, hkv, d, length) else
                           ("90% HBM" if kv_bytes >= 1e9 else "1.0x")), **clocks)
        row["meets_target"] = (row["speedup_vs_best"] >= (1.3 if row["target"] == "1.3x" else 1.0)
                               and (row["pct_of_4_8TBps"] >= 90 or row["target"] != "90% HBM"))
        others = ", ".join(f"{k} {t:.1f}" for k, t in t_loader.items())
        progress(f"    ours {t_ours:.1f} us ({others}) | flash {t_flash:.1f} | "
                 f"cudnn {t_cudnn:.1f} | flex {t_flex:.1f} | {row['speedup_vs_best']:.2f}x best SDPA, "
                 f"{row['TBps']:.2f} TB/s | SM clock down to {clocks['min_sm_MHz']:.0f} MHz, "
                 f"power-capped {clocks['power_capped_pct']:.0f}% of the time")
        rows.append(row)
        del qs, ks, vs, ours, steps
        torch.cuda.empty_cache()
    return rows


def ragged_table():
    rows = []
    hq, hkv, d = 32, 8, 128
    for b, capacity, low in [(32, 8192, 256), (8, 32768, 256), (8, 8192, 256)]:
        lengths = ragged_lengths(b, capacity, low)
        valid_bytes = 2 * int(lengths.sum()) * hkv * d * 2
        cap_bytes = 2 * b * hkv * capacity * d * 2
        n = sets_for_bytes(cap_bytes)
        progress(f"ragged B={b} capacity={capacity} mean={lengths.float().mean():.0f}: {n} input sets")
        ks = [torch.randn(b, hkv, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        vs = [torch.randn(b, hkv, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        qs = [torch.randn(b, hq, 1, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        q_bsh = [q.transpose(1, 2).reshape(b, 1, hq * d) for q in qs]
        new_k = torch.randn(b, 1, hkv * d, device="cuda", dtype=DTYPE)
        new_v = torch.randn(b, 1, hkv * d, device="cuda", dtype=DTYPE)
        seqlens = (lengths - 1).to(torch.int32).cuda()
        mask = (torch.arange(capacity)[None, :] < lengths[:, None]).cuda()[:, None, None, :]

        def ours(i):
            gqa_torch.group_query_attention_(q_bsh[i], new_k, new_v, ks[i], vs[i], seqlens,
                                             num_heads=hq, kv_num_heads=hkv)

        steps = {"ours": ours,
                 "cudnn_mask": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs, mask),
                 "eff_mask": sdpa_step(SDPBackend.EFFICIENT_ATTENTION, qs, ks, vs, mask),
                 "flash_full": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs)}
        for value in SCHEDULE_COLUMNS:
            steps["schedule_" + value] = pinned(ours, gqa_torch._C._set_decode_schedule, value)
        for value in FETCH_COLUMNS:
            steps["fetch_" + value] = pinned(ours, gqa_torch._C._set_decode_l2_fetch, value)
        head = time_graphs_interleaved(steps, n)
        t_ours, t_cudnn_mask, t_eff_mask, t_flash_full = (head["ours"], head["cudnn_mask"], head["eff_mask"],
                                                          head["flash_full"])
        t_schedules = {k: v for k, v in head.items() if k.startswith(("schedule_", "fetch_"))}
        masked = min(t for t in (t_cudnn_mask, t_eff_mask, t_flash_full) if t == t)
        row = dict(B=b, capacity=capacity, mean_len=float(lengths.float().mean()), valid_MB=valid_bytes / 1e6,
                   ours_us=t_ours, **{f"{k}_us": t for k, t in t_schedules.items()},
                   sdpa_cudnn_mask_us=t_cudnn_mask, sdpa_efficient_mask_us=t_eff_mask,
                   sdpa_flash_full_capacity_us=t_flash_full, speedup_vs_best=masked / t_ours,
                   capacity_over_mean=capacity / float(lengths.float().mean()),
                   floor_us=valid_bytes / (HBM_DATASHEET_TBS * 1e6),
                   pct_of_4_8TBps=100 * valid_bytes / t_ours / 1e6 / HBM_DATASHEET_TBS)
        others = ", ".join(f"{k} {t:.1f}" for k, t in t_schedules.items())
        progress(f"    ours {t_ours:.1f} us ({others}) | cudnn+mask {t_cudnn_mask:.1f} | flash full {t_flash_full:.1f} | "
                 f"{row['speedup_vs_best']:.2f}x (capacity/mean {row['capacity_over_mean']:.2f})")
        rows.append(row)
        del ks, vs, qs, q_bsh
        torch.cuda.empty_cache()
    return rows


def rope_half(x, cos, sin):
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).to(x.dtype)


def step_table():
    rows = []
    hq, hkv, d = 32, 8, 128
    for b, capacity, length in STEP_GRID:
        cap_bytes = 2 * b * hkv * capacity * d * 2
        n = sets_for_bytes(cap_bytes)
        progress(f"step B={b} capacity={capacity} length={length}: {n} input sets")
        cos_table = torch.randn(capacity, d // 2, device="cuda").cos()
        sin_table = torch.randn(capacity, d // 2, device="cuda").sin()
        ks = [torch.randn(b, hkv, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        vs = [torch.randn(b, hkv, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        qkv = [torch.randn(b, 1, (hq + 2 * hkv) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
        seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
        position = torch.full((b, 1), length - 1, dtype=torch.int64, device="cuda")
        cache_position = torch.tensor([length - 1], device="cuda")
        mask = (torch.arange(capacity, device="cuda") < length)[None, None, None, :].expand(b, 1, 1, capacity)

        def ours(i):
            gqa_torch.group_query_attention_(qkv[i], None, None, ks[i], vs[i], seqlens, cos_table, sin_table,
                                             num_heads=hq, kv_num_heads=hkv, do_rotary=True)

        def hf_step(i):
            q, k, v = qkv[i].split([hq * d, hkv * d, hkv * d], -1)
            q = q.view(b, 1, hq, d).transpose(1, 2)
            k = k.view(b, 1, hkv, d).transpose(1, 2)
            v = v.view(b, 1, hkv, d).transpose(1, 2)
            cos, sin = cos_table[position][:, None], sin_table[position][:, None]
            q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
            ks[i].index_copy_(2, cache_position, k)
            vs[i].index_copy_(2, cache_position, v)
            F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask, enable_gqa=True)

        head = time_graphs_interleaved({"ours": ours, "hf": hf_step}, n)
        t_ours, t_hf = head["ours"], head["hf"]
        row = dict(B=b, capacity=capacity, length=length, ours_us=t_ours, hf_step_us=t_hf, speedup=t_hf / t_ours)
        progress(f"    ours {t_ours:.1f} us | HF step {t_hf:.1f} us | {row['speedup']:.2f}x")
        rows.append(row)
        del ks, vs, qkv
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True,
                        help="time FlexAttention too (the default; it compiles each shape first; --no-flex skips it)")
    parser.add_argument("--flex-budget", type=float, default=240.0,
                        help="seconds of FlexAttention compiles and timing, after which the later rows skip it "
                             "(nan), so that the run fits a device call")
    parser.add_argument("--only", choices=["decode", "ragged", "step"], nargs="+", default=None,
                        help="the tables to time (default: all three)")
    args = parser.parse_args()
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    # The GPU's state while each decode row was timed (nan without nvidia-smi): the table shows
    # mean_W, min_sm_MHz and power_capped_pct, the JSON the median clock too.
    args.clocks = GpuClockSampler()
    warm_up_gpu()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bf16",
                timing="median of CUDA-graph replays, inputs rotated beyond L2")
    progress("measuring HBM read bandwidth (x.sum over 4 GiB)")
    meta["measured_read_TBps"] = round(measure_hbm_read_tbs(), 3)
    progress(f"  {meta['measured_read_TBps']} TB/s")
    out = []
    if args.only is None or "decode" in args.only:
        rows = decode_table(args)
        cols = ["B", "heads", "L", "kv_MB", "ours_us", *[f"{k}_us" for k in LOADER_COLUMNS], *[f"merge_{k}_us" for k in MERGE_COLUMNS],
                *[f"schedule_{k}_us" for k in SCHEDULE_COLUMNS], *[f"features_{k}_us" for k in FEATURE_COLUMNS],
                *[f"early_{k}_us" for k in EARLY_COLUMNS], *[f"l2_{k}_us" for k in L2_COLUMNS],
                *[f"fetch_{k}_us" for k in FETCH_COLUMNS], "sdpa_flash_us", "sdpa_cudnn_us", "flex_us",
                "speedup_vs_best", "TBps", "pct_of_4_8TBps", "target", "meets_target", "mean_W",
                "min_sm_MHz", "power_capped_pct"]
        out.append(write_tables("decode", meta, rows, cols, "Decode attention (append + attention), bf16"))
        bar_plot("decode", [f"B{r['B']} {r['heads']} L{r['L']}" for r in rows],
                 {"gqa_torch": [r["ours_us"] for r in rows], "SDPA flash": [r["sdpa_flash_us"] for r in rows],
                  "SDPA cuDNN": [r["sdpa_cudnn_us"] for r in rows]}, "µs, log scale (lower is better)",
                 "Decode, bf16, H200", log_scale=True)
    if args.only is None or "ragged" in args.only:
        rows = ragged_table()
        cols = ["B", "capacity", "mean_len", "valid_MB", "ours_us", *[f"schedule_{k}_us" for k in SCHEDULE_COLUMNS],
                *[f"fetch_{k}_us" for k in FETCH_COLUMNS],
                "sdpa_cudnn_mask_us", "sdpa_efficient_mask_us",
                "sdpa_flash_full_capacity_us", "speedup_vs_best", "capacity_over_mean", "floor_us", "pct_of_4_8TBps"]
        out.append(write_tables("decode_ragged", meta, rows, cols, "Ragged decode"))
    if args.only is None or "step" in args.only:
        rows = step_table()
        cols = ["B", "capacity", "length", "ours_us", "hf_step_us", "speedup"]
        out.append(write_tables("decode_step", meta, rows, cols, "Full decode step vs HF StaticCache step"))
    args.clocks.close()
    print("\n".join(out))


if __name__ == "__main__":
    main()
