"""Prefill benchmark (BENCHMARKS.md): gqa_torch against SDPA flash, SDPA cuDNN and FlexAttention.

Causal GQA prefill, bf16, Hq/Hkv = 32/8, timed with CUDA-graph replays over rotated inputs.
- attention: our in-place op on a fresh cache (it also appends K/V) against SDPA on
  [B, H, L, D] tensors; TFLOP/s count half of 4·B·Hq·L²·D, and % of a bf16 GEMM measured now;
- whole op: packed QKV + RoPE + append + attention in one call, against RoPE + cache write +
  SDPA cuDNN;
- ragged: batched chunked prefill on top of ragged pasts, against SDPA with a padding mask.
Writes benchmarks/results/prefill*.{json,md,png}.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gqa_torch
from common import bar_plot, progress, sdpa_views, sets_for_bytes, time_graph, time_graphs_interleaved, warm_up_gpu, write_tables

# The prefill kernels timed side by side (gqa_torch._C._set_prefill_route); "ours" is the default.
ROUTES = ("mma", "wgmma", "wgmma_ws", "wgmma_ws_cpasync", "wgmma_ws_persistent", "wgmma_ws3", "wgmma_ws_kv",
          "wgmma_ws_kv_pipe", "wgmma_ws_bn80", "wgmma_ws_kv_pipe_pp", "wgmma_ws_kv_pipe3")
GRID = [(8, 1024, 128), (2, 4096, 128), (1, 16384, 128), (2, 4096, 64), (2, 4096, 256)]  # B, L, D
HQ, HKV = 32, 8
DTYPE = torch.bfloat16


def gemm_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    out = torch.empty(8192, 8192, device="cuda", dtype=DTYPE)
    us = time_graph(lambda _: torch.matmul(a, b, out=out), 1, calls_per_replay=10, replays=5)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def causal_flops(b, length, d, hq=HQ):
    return 4 * b * hq * length * length * d / 2


def sdpa_step(backend, qs, ks, vs, causal=True, mask=None):
    """One SDPA call on input set i, pinned to `backend`."""
    def step(i):
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], attn_mask=mask, is_causal=causal and mask is None,
                                           enable_gqa=True)

    return step


def sdpa_time(backend, qs, ks, vs, causal=True, mask=None):
    step = sdpa_step(backend, qs, ks, vs, causal, mask)
    try:
        return time_graph(step, len(qs))
    except Exception as exc:
        progress(f"    {backend.name}: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
        return float("nan")


def flex_time(qs, ks, vs):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        length = qs[0].shape[2]
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, length, length, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        return time_graph(lambda i: flex(qs[i], ks[i], vs[i], block_mask=mask, enable_gqa=True), len(qs))
    except Exception as exc:
        progress(f"    flex: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
        return float("nan")


def rope_half(x, cos, sin):
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).to(x.dtype)


def attention_rows(args, ceiling):
    rows = []
    for b, length, d in GRID:
        per_set = b * length * (HQ + 2 * HKV) * d * 2 * 2
        n = sets_for_bytes(per_set, cap=8)
        progress(f"prefill B={b} L={length} D={d}: {n} input sets")
        qkv = [torch.randn(b, length, (HQ + 2 * HKV) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
        caches = [(torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE),
                   torch.empty(b, HKV, length, d, device="cuda", dtype=DTYPE)) for _ in range(n)]
        seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
        cos = torch.rand(length, d // 2, device="cuda")
        sin = torch.rand(length, d // 2, device="cuda")

        def ours(i):
            q, k, v = qkv[i].split([HQ * d, HKV * d, HKV * d], -1)
            gqa_torch.group_query_attention_(q, k, v, caches[i][0], caches[i][1], seqlens,
                                             num_heads=HQ, kv_num_heads=HKV)

        def ours_whole(i):
            gqa_torch.group_query_attention_(qkv[i], None, None, caches[i][0], caches[i][1], seqlens, cos, sin,
                                             num_heads=HQ, kv_num_heads=HKV, do_rotary=True)

        def ours_prep_append(i):  # the same call with prep appending the new rows (set at capture)
            gqa_torch._C._set_prefill_append("prep")
            try:
                ours(i)
            finally:
                gqa_torch._C._set_prefill_append("auto")

        qs, ks, vs = sdpa_views(qkv, b, length, d, HQ, HKV)
        # The headline columns (ours, with prep's append, SDPA flash and cuDNN) interleaved, so
        # that their ratios do not carry the clocks' drift over the run.
        head = time_graphs_interleaved({"ours": ours, "prep_append": ours_prep_append,
                                        "flash": sdpa_step(SDPBackend.FLASH_ATTENTION, qs, ks, vs),
                                        "cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION, qs, ks, vs)}, n)
        t_ours, t_prep_append, t_flash, t_cudnn = head["ours"], head["prep_append"], head["flash"], head["cudnn"]
        t_whole = time_graph(ours_whole, n)
        # Each kernel pinned (ROUTES), next to the default route ("ours").
        t_route = {}
        for route in ROUTES:
            if route == "wgmma" and d > 128:  # the plain wgmma kernel: head sizes up to 128
                t_route[route] = float("nan")
                continue
            if route == "wgmma_ws_bn80" and d <= 128:  # its own kernel at 256 only (else route 5's)
                t_route[route] = float("nan")
                continue
            gqa_torch._C._set_prefill_route(route)
            try:
                t_route[route] = time_graph(ours, n)
            finally:
                gqa_torch._C._set_prefill_route("auto")
        t_flex = flex_time(qs, ks, vs) if args.flex else float("nan")
        positions = torch.arange(length, device="cuda")

        def unfused_whole(i):
            q = rope_half(qs[i], cos[positions], sin[positions])
            k = rope_half(ks[i], cos[positions], sin[positions])
            caches[i][0].copy_(k)
            caches[i][1].copy_(vs[i])
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(q, caches[i][0], caches[i][1], is_causal=True, enable_gqa=True)

        try:
            t_unfused = time_graph(unfused_whole, n)
        except Exception as exc:
            progress(f"    unfused cuDNN step unavailable: {exc}")
            t_unfused = float("nan")
        flops = causal_flops(b, length, d)
        tf = lambda t: flops / (t * 1e-6) / 1e12  # noqa: E731
        row = dict(B=b, L=length, D=d, ours_us=t_ours, ours_TFLOPs=tf(t_ours), prep_append_us=t_prep_append,
                   **{f"{route}_TFLOPs": tf(t_route[route]) for route in ROUTES},
                   flash_TFLOPs=tf(t_flash),
                   cudnn_TFLOPs=tf(t_cudnn), flex_TFLOPs=tf(t_flex), vs_flash=t_flash / t_ours,
                   vs_cudnn=t_cudnn / t_ours, pct_of_gemm=100 * tf(t_ours) / ceiling,
                   whole_op_us=t_whole, rope_write_cudnn_us=t_unfused, whole_vs_unfused=t_unfused / t_whole)
        routes = ", ".join(f"{route} {row[route + '_TFLOPs']:.0f}" for route in ROUTES)
        progress(f"    ours {row['ours_TFLOPs']:.0f} TFLOP/s, {t_ours:.0f} us ({t_prep_append:.0f} us with prep's append; {routes}) | flash {row['flash_TFLOPs']:.0f} | cudnn "
                 f"{row['cudnn_TFLOPs']:.0f} | flex {row['flex_TFLOPs']:.0f} | whole {t_whole:.0f} us vs "
                 f"RoPE+write+cuDNN {t_unfused:.0f} us")
        rows.append(row)
        del qkv, caches, qs, ks, vs
        torch.cuda.empty_cache()
    return rows


def ragged_row():
    b, chunk, capacity, d = 4, 2048, 8192, 128
    pasts = torch.tensor([0, 1500, 3000, 6000])
    totals = pasts + chunk
    progress(f"ragged chunked prefill B={b} chunk={chunk} pasts={pasts.tolist()}")
    n = 2
    qkv = [torch.randn(b, chunk, (HQ + 2 * HKV) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
    kc = [torch.randn(b, HKV, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
    vc = [torch.randn(b, HKV, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
    seqlens = (totals - 1).to(torch.int32).cuda()

    def ours(i):
        gqa_torch.group_query_attention_(qkv[i], None, None, kc[i], vc[i], seqlens, num_heads=HQ, kv_num_heads=HKV)

    t_ours = time_graph(ours, n)
    qpos = pasts[:, None] + torch.arange(chunk)[None]
    keys = torch.arange(capacity)
    mask = ((keys[None, None, :] <= qpos[:, :, None]) & (keys[None, None, :] < totals[:, None, None]))
    mask = mask[:, None].cuda()
    qs = [x[..., :HQ * d].view(b, chunk, HQ, d).transpose(1, 2) for x in qkv]
    t_cudnn = sdpa_time(SDPBackend.CUDNN_ATTENTION, qs, kc, vc, causal=False, mask=mask)
    t_eff = sdpa_time(SDPBackend.EFFICIENT_ATTENTION, qs, kc, vc, causal=False, mask=mask)
    flops = sum(4 * HQ * d * (chunk * int(p) + chunk * (chunk + 1) / 2) for p in pasts)
    best = min(t for t in (t_cudnn, t_eff) if t == t) if (t_cudnn == t_cudnn or t_eff == t_eff) else float("nan")
    row = dict(B=b, chunk=chunk, pasts=str(pasts.tolist()), ours_us=t_ours, ours_TFLOPs=flops / t_ours / 1e6,
               sdpa_cudnn_mask_us=t_cudnn, sdpa_efficient_mask_us=t_eff, speedup_vs_best=best / t_ours)
    progress(f"    ours {t_ours:.0f} us | cudnn+mask {t_cudnn:.0f} | efficient+mask {t_eff:.0f}")
    return [row]


def short_chunk_rows():
    """A short chunk on a long cache (speculative verification widths, small chunks): few query
    blocks, so the plan splits the key range. Against SDPA with the equivalent mask."""
    d, capacity = 128, 8192
    rows = []
    for b, chunk in ((1, 8), (1, 64), (4, 16)):
        past = capacity - chunk
        progress(f"short chunk B={b} S={chunk} past={past}")
        n = 4
        qkv = [torch.randn(b, chunk, (HQ + 2 * HKV) * d, device="cuda", dtype=DTYPE) for _ in range(n)]
        kc = [torch.randn(b, HKV, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        vc = [torch.randn(b, HKV, capacity, d, device="cuda", dtype=DTYPE) for _ in range(n)]
        seqlens = torch.full((b,), capacity - 1, dtype=torch.int32, device="cuda")

        def ours(i):
            gqa_torch.group_query_attention_(qkv[i], None, None, kc[i], vc[i], seqlens, num_heads=HQ,
                                             kv_num_heads=HKV)

        t_ours = time_graph(ours, n)
        qpos = past + torch.arange(chunk)
        mask = (torch.arange(capacity)[None, :] <= qpos[:, None])[None, None].cuda()
        qs = [x[..., :HQ * d].view(b, chunk, HQ, d).transpose(1, 2) for x in qkv]
        t_cudnn = sdpa_time(SDPBackend.CUDNN_ATTENTION, qs, kc, vc, causal=False, mask=mask)
        t_eff = sdpa_time(SDPBackend.EFFICIENT_ATTENTION, qs, kc, vc, causal=False, mask=mask)
        best = min((t for t in (t_cudnn, t_eff) if t == t), default=float("nan"))
        rows.append(dict(B=b, S=chunk, past=past, ours_us=t_ours, sdpa_cudnn_mask_us=t_cudnn,
                         sdpa_efficient_mask_us=t_eff, speedup_vs_best=best / t_ours))
        progress(f"    ours {t_ours:.1f} us | cudnn+mask {t_cudnn:.1f} | efficient+mask {t_eff:.1f}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True,
                        help="time FlexAttention too (the default; it compiles each shape first; --no-flex skips it)")
    args = parser.parse_args()
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    torch.manual_seed(0)
    warm_up_gpu()
    progress("measuring the bf16 GEMM ceiling (8192^3)")
    ceiling = gemm_tflops()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bf16", heads="32/8",
                gemm_TFLOPs=round(ceiling, 1), timing="median of CUDA-graph replays, inputs rotated beyond L2")
    progress(f"  {ceiling:.0f} TFLOP/s")
    rows = attention_rows(args, ceiling)
    cols = ["B", "L", "D", "ours_us", "ours_TFLOPs", "prep_append_us", *[f"{route}_TFLOPs" for route in ROUTES],
            "flash_TFLOPs",
            "cudnn_TFLOPs", "flex_TFLOPs", "vs_flash", "vs_cudnn", "pct_of_gemm", "whole_op_us", "rope_write_cudnn_us", "whole_vs_unfused"]
    text = write_tables("prefill", meta, rows, cols, "Causal prefill, bf16, 32/8 heads")
    bar_plot("prefill", [f"B{r['B']} L{r['L']} D{r['D']}" for r in rows],
             {"gqa_torch": [r["ours_TFLOPs"] for r in rows], "SDPA flash": [r["flash_TFLOPs"] for r in rows],
              "SDPA cuDNN": [r["cudnn_TFLOPs"] for r in rows]}, "TFLOP/s (higher is better)", "Prefill, H200")
    ragged = ragged_row()
    text += write_tables("prefill_ragged", meta, ragged,
                         ["B", "chunk", "pasts", "ours_us", "ours_TFLOPs", "sdpa_cudnn_mask_us",
                          "sdpa_efficient_mask_us", "speedup_vs_best"], "Ragged batched chunked prefill")
    short = short_chunk_rows()
    text += write_tables("prefill_short_chunk", meta, short,
                         ["B", "S", "past", "ours_us", "sdpa_cudnn_mask_us", "sdpa_efficient_mask_us",
                          "speedup_vs_best"], "A short chunk on a long cache (split key range)")
    print(text)


if __name__ == "__main__":
    main()
