"""End-to-end generation on the CPU: transformers' ``generate()`` with and without gqa-torch.

Model: the Llama-3.2-1B shape of bench_e2e.py (hidden 2048, 32 query / 8 KV heads, head dim 64,
MLP 8192, vocab 128256), fewer layers (``--layers``, default 4), random weights, fp32 (or
``--dtype bfloat16``: every contender's weights and caches in bf16).
For each prompt length P it runs greedy ``generate()`` of N new tokens, batch 1, with:

- ``hf_dynamic``: transformers' default, SDPA attention and a DynamicCache (what
  ``model.generate(ids)`` does on the CPU);
- ``hf_static``: SDPA with ``cache_implementation="static"`` (no compilation);
- ``gqa``: ``gqa_torch.hf.enable(model)``: RoPE, the cache append and attention in one
  in-place call on a static GQACache.

Timing: the fastest of ``--repeats`` calls of ``generate()`` with 1 new token (the prefill) and
with N (prefill + N - 1 decode steps); decode ms/token = (T_N - T_1) / (N - 1). Every contender
must produce the same greedy tokens as hf_dynamic in fp32, which the table reports (in bf16 the
contenders round differently, so greedy paths may part after some tokens).

Writes benchmarks/results/e2e_cpu.{json,md} (e2e_cpu_bf16 in bf16); progress goes to stderr.
    python3 benchmarks/bench_e2e_cpu.py [--layers 4] [--prompts 512 4096] [--new-tokens 32] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))  # the repository root, for an in-place build of gqa_torch
from bench_e2e import llama_1b_config  # noqa: E402
from common import cpu_name, fastest_host_call, progress, write_tables  # noqa: E402



def build_model(layers: int, gqa: bool, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    config = llama_1b_config(layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights for every contender
    model = LlamaForCausalLM(config).eval().to(dtype)
    if gqa:
        import gqa_torch.hf

        gqa_torch.hf.enable(model)
    return model


def generate(model, ids, new_tokens: int, static: bool):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    if static:
        kwargs.update(cache_implementation="static", disable_compile=True)
    with torch.inference_mode():
        return model.generate(ids, **kwargs)[:, ids.shape[1]:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)

    contenders = [("hf_dynamic", False, False), ("hf_static", False, True), ("gqa", True, False)]
    rows = []
    for name, gqa, static in contenders:
        progress(f"[e2e_cpu] building {name} ({args.layers} layers)")
        model = build_model(args.layers, gqa, dtype)
        for prompt in args.prompts:
            ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(prompt))
            generate(model, ids, 2, static)  # warm-up
            t_first, _ = fastest_host_call(lambda: generate(model, ids, 1, static), args.repeats)
            t_all, tokens = fastest_host_call(lambda: generate(model, ids, args.new_tokens, static), args.repeats)
            decode_ms = 1e3 * (t_all - t_first) / (args.new_tokens - 1)
            rows.append(dict(contender=name, prompt=prompt, new_tokens=args.new_tokens, prefill_ms=round(1e3 * t_first),
                             decode_ms_per_token=decode_ms, total_s=t_all, tokens=tokens[0].tolist()))
            progress(f"[e2e_cpu] {name} P={prompt}: prefill {1e3 * t_first:.0f} ms, decode {decode_ms:.1f} ms/token")
        model = None  # free its weights before the next contender builds its own

    for row in rows:  # greedy agreement and speed against hf_dynamic on the same prompt
        ref = next(r for r in rows if r["contender"] == "hf_dynamic" and r["prompt"] == row["prompt"])
        agree = 0
        while agree < len(row["tokens"]) and row["tokens"][agree] == ref["tokens"][agree]:
            agree += 1
        row["tokens_agreeing"] = f"{agree}/{len(row['tokens'])}"
        row["decode_speedup"] = ref["decode_ms_per_token"] / row["decode_ms_per_token"]
        row["prefill_speedup"] = ref["prefill_ms"] / row["prefill_ms"]
    for row in rows:
        del row["tokens"]

    import transformers

    meta = dict(cpu=cpu_name(), threads=torch.get_num_threads(),
                torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                model=f"Llama-3.2-1B shape, random weights, {args.dtype}, batch 1, greedy")
    cols = ["contender", "prompt", "new_tokens", "prefill_ms", "decode_ms_per_token", "prefill_speedup",
            "decode_speedup", "tokens_agreeing"]
    name = "e2e_cpu" if dtype == torch.float32 else "e2e_cpu_bf16"
    print(write_tables(name, meta, rows, cols, f"End-to-end generate() on the CPU ({args.dtype})"))


if __name__ == "__main__":
    main()
