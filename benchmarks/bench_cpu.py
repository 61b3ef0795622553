"""CPU benchmark: gqa_torch's CPU backend against PyTorch's SDPA on the CPU and ONNX Runtime's own
com.microsoft::GroupQueryAttention (BENCHMARKS.md's CPU peer), on the same threads.

Columns, ms a call (the fastest of several calls, after one warm-up):
- ours_inplace: the in-place op (append into a static cache, attention over the valid keys);
- ours_functional: the functional op, ORT's contract (past copied into a present of
  max(past, total) rows), its presents recycled by the CPU output cache (gqa_torch.memory) as a
  loop of calls runs it;
- ours_functional_fresh: the same with that cache disabled, every present fresh memory;
- sdpa: F.scaled_dot_product_attention over the same keys (attention alone, no RoPE or append);
- ort: ONNX Runtime's GroupQueryAttention on the same inputs (functional), when onnx and
  onnxruntime are installed (nan otherwise).

Writes benchmarks/results/cpu.{json,md}. Runs anywhere (no GPU needed):
    python3 benchmarks/bench_cpu.py [--threads N] [--quick]
(GQA_CPU_KERNELS=baseline|avx2|avx512 pins the CPU backend's instruction set; the default is the
widest this CPU has.)
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import gqa_torch
from common import cpu_name, fastest_host_call, progress, write_tables

# (label, B, Hq, Hkv, D, past, new tokens, dtype): BENCHMARKS.md's CPU anchors first (fp32,
# 32/8/128: decode over a past of 4,096 at B = 1 and 8, a 512-token prompt), then other head
# sizes, bf16 and fp16.
ROWS = [
    ("decode", 1, 32, 8, 128, 4096, 1, torch.float32),
    ("decode", 8, 32, 8, 128, 4096, 1, torch.float32),
    ("prefill", 1, 32, 8, 128, 0, 512, torch.float32),
    ("prefill", 1, 32, 8, 128, 0, 2048, torch.float32),
    ("prefill", 1, 14, 2, 64, 0, 2048, torch.float32),
    ("prefill", 1, 16, 8, 256, 0, 1024, torch.float32),
    ("decode", 1, 32, 8, 128, 4096, 1, torch.bfloat16),
    ("decode", 8, 32, 8, 128, 4096, 1, torch.bfloat16),
    ("prefill", 1, 32, 8, 128, 0, 512, torch.bfloat16),
    ("decode", 1, 32, 8, 128, 4096, 1, torch.float16),
    ("decode", 8, 32, 8, 128, 4096, 1, torch.float16),
]


def fastest_ms(call, repeats: int) -> float:
    call()  # warm-up (scratch, thread pool)
    return 1e3 * fastest_host_call(call, repeats)[0]


def functional_fresh_ms(functional, repeats: int) -> float:
    limit = gqa_torch.cpu_output_cache_info()["limit_bytes"]
    gqa_torch.set_cpu_output_cache_limit(0)
    try:
        return fastest_ms(functional, repeats)
    finally:
        gqa_torch.set_cpu_output_cache_limit(limit)


def ort_session(hq: int, hkv: int, threads: int, with_past: bool):
    """ONNX Runtime's GroupQueryAttention as a one-node graph, or None without onnx/onnxruntime."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    names = ["query", "key", "value"] + (["past_key", "past_value"] if with_past else ["", ""]) + \
            ["seqlens_k", "total_sequence_length"]
    ints = {"seqlens_k", "total_sequence_length"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n in ints else TensorProto.FLOAT, None)
              for n in names if n]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
               for n in ("output", "present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8  # what opset 17 needs; a newer onnx stamps more than older runtimes read
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def time_row(kind, b, hq, hkv, d, past, new, dtype, threads, repeats):
    total = past + new
    q = torch.randn(b, new, hq * d, dtype=dtype)
    k = torch.randn(b, new, hkv * d, dtype=dtype)
    v = torch.randn(b, new, hkv * d, dtype=dtype)
    seqlens = torch.full((b,), total - 1, dtype=torch.int32)
    cache_k = torch.randn(b, hkv, total, d, dtype=dtype)
    cache_v = torch.randn(b, hkv, total, d, dtype=dtype)
    past_k = cache_k[:, :, :past].contiguous() if past else None
    past_v = cache_v[:, :, :past].contiguous() if past else None

    def inplace():
        gqa_torch.group_query_attention_(q, k, v, cache_k, cache_v, seqlens, num_heads=hq, kv_num_heads=hkv)

    def functional():
        gqa_torch.group_query_attention(q, k, v, past_k, past_v, seqlens, total, num_heads=hq, kv_num_heads=hkv)

    q_heads = q.view(b, new, hq, d).transpose(1, 2)

    def sdpa():
        # The new tokens sit at the end of the keys: the causal mask of a prompt with no past.
        F.scaled_dot_product_attention(q_heads, cache_k, cache_v, enable_gqa=True, is_causal=new > 1)

    row = dict(case=kind, B=b, heads=f"{hq}/{hkv}/{d}", past=past, new=new, dtype=str(dtype).replace("torch.", ""),
               ours_inplace_ms=fastest_ms(inplace, repeats), ours_functional_ms=fastest_ms(functional, repeats),
               ours_functional_fresh_ms=functional_fresh_ms(functional, repeats),
               sdpa_ms=fastest_ms(sdpa, repeats), ort_ms=float("nan"))
    session = ort_session(hq, hkv, threads, past > 0) if dtype == torch.float32 else None
    if session is not None:
        feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(),
                 "seqlens_k": seqlens.numpy(), "total_sequence_length": np.array(total, dtype=np.int32)}
        if past:
            feeds["past_key"], feeds["past_value"] = past_k.numpy(), past_v.numpy()
        row["ort_ms"] = fastest_ms(lambda: session.run(None, feeds), repeats)
    row["sdpa_over_ours"] = row["sdpa_ms"] / row["ours_inplace_ms"]
    row["ort_over_ours"] = row["ort_ms"] / row["ours_functional_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads for all three (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="the three BENCHMARKS.md anchors only, fewer repeats")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    rows = []
    for spec in ROWS[:3] if args.quick else ROWS:
        kind, b, hq, hkv, d, past, new, dtype = spec
        progress(f"{kind} B={b} {hq}/{hkv}/{d} past={past} new={new} {dtype}")
        repeats = 3 if new > 1 or args.quick else 10
        rows.append(time_row(kind, b, hq, hkv, d, past, new, dtype, threads, repeats))
        progress("    " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items() if k.endswith("_ms")))
    meta = dict(cpu=cpu_name(), threads=threads, cpu_kernels=gqa_torch._C._cpu_kernels(), torch=torch.__version__,
                cpu_output_cache_mb=gqa_torch.cpu_output_cache_info()["limit_bytes"] >> 20,
                timing="fastest of several calls, ms")
    cols = ["case", "B", "heads", "past", "new", "dtype", "ours_inplace_ms", "ours_functional_ms",
            "ours_functional_fresh_ms", "sdpa_ms", "ort_ms", "sdpa_over_ours", "ort_over_ours"]
    print(write_tables("cpu", meta, rows, cols, "CPU backend against SDPA and ONNX Runtime"))


if __name__ == "__main__":
    main()
