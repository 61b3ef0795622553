"""End-to-end generation benchmark: a Llama-3.2-1B-shaped random model, bf16, greedy decoding.

Model: hidden 2048, 16 layers, 32 query / 8 KV heads, head dim 64, MLP 8192, vocab 128256,
Llama-3 RoPE scaling, tied embeddings; random weights built from the config (no download).
For each batch B and prompt length P it prefills P tokens and decodes N new tokens with:

- ``hf``: transformers' StaticCache + SDPA, the decode step under
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (what ``generate()`` does with a
  static cache, minus generate's per-step Python);
- ``gqa_graph``: ``gqa_torch.hf.enable`` (fused RoPE + append + attention, GQACache), the decode
  step captured in one CUDA graph (``gqa_torch.graphs.CUDAGraphStep``), everything else eager;
- ``gqa_compile``: the same gqa step under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` (Inductor fuses the non-attention ops too). ``--no-gqa-compile`` skips it.

All use the same greedy loop (argmax on the device, no host sync until the end) and the same
weights. Each contender runs a warm-up per case (compilation, capture), then timed runs on a
reset cache (the best of ``--repeats``). Reported: prefill ms, decode ms/step, decode tokens/s
(B per step) and end-to-end tokens/s (B * N over prefill + decode), plus how many greedy steps
agree with hf in every row (bf16 and random weights give near-tied logits, so they may part
early; the relative error of the first-token logits is reported too).

Writes benchmarks/results/bench_e2e.{json,md,png}; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import time
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))  # the repository root, for an in-place build of gqa_torch
from common import bar_plot, progress, write_tables  # noqa: E402

import gqa_torch  # noqa: E402


def llama_1b_config(layers: int):
    from transformers import LlamaConfig

    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    kwargs = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                  pad_token_id=None)
    try:
        return LlamaConfig(rope_parameters=rope, **kwargs)
    except TypeError:  # transformers 4.x
        theta = rope.pop("rope_theta")
        return LlamaConfig(rope_theta=theta, rope_scaling=rope, **kwargs)


def build_model(layers: int):
    from transformers import LlamaForCausalLM

    config = llama_1b_config(layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def cuda_time(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


class Contender:
    """One way of running prefill + decode; `prepare` per case, then `run` (warm-up, timed)."""

    name = "?"

    def prepare(self, batch: int, capacity: int) -> None:
        raise NotImplementedError

    # Subclasses set self.model, self.cache (with a reset()) and self.step in prepare().
    def prefill(self, ids):
        return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits

    def reset(self) -> None:
        self.cache.reset()

    def release(self) -> None:
        self.cache = self.step = None

    def run(self, ids, new_tokens: int):
        """Prefill + greedy decode of new_tokens (first token from the prefill); returns
        (tokens [B, N], first-token logits, prefill s, decode s)."""
        from gqa_torch.graphs import greedy_decode

        self.reset()
        logits, t_prefill = cuda_time(lambda: self.prefill(ids))
        first = logits[:, -1:].argmax(-1)
        tokens, t_decode = cuda_time(lambda: greedy_decode(self.step, first, new_tokens))
        return tokens, logits[:, -1].float(), t_prefill, t_decode


class HFStatic(Contender):
    name = "hf"

    def __init__(self, model):
        self.model = model

    def prepare(self, batch, capacity):
        from transformers import StaticCache

        from gqa_torch.graphs import CompiledStep

        self.cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        model, cache = self.model, self.cache

        def step(tokens):
            positions = cache.get_seq_length()
            positions = (positions if isinstance(positions, torch.Tensor) else torch.tensor(positions, device="cuda"))
            positions = positions.to(torch.long).reshape(1, 1).expand(tokens.shape[0], 1)
            return model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True).logits

        self.step = CompiledStep(step)


class GQA(Contender):
    def __init__(self, model, compiled: bool):
        import gqa_torch.hf as ghf

        self.model = ghf.enable(model)
        self.compiled = compiled
        self.name = "gqa_compile" if compiled else "gqa_graph"

    def prepare(self, batch, capacity):
        from gqa_torch.graphs import CompiledStep, CUDAGraphStep
        from gqa_torch.hf import GQACache

        self.cache = GQACache.for_model(self.model, batch, capacity)
        model, cache = self.model, self.cache

        def step(tokens):
            positions = cache.kv.lengths[0][:, None].long()  # compact rows: the slot is the position
            return model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True).logits

        self.step = CompiledStep(step) if self.compiled else CUDAGraphStep(step)


def first_divergence(a, b) -> int:
    """Greedy steps (from the start) on which every row agrees."""
    same = (a == b).all(0)
    bad = (~same).nonzero()
    return int(bad[0]) if bad.numel() else a.shape[1]


def run_case(contenders, batch, prompt, new_tokens, args):
    torch.manual_seed(batch * 100003 + prompt)
    ids = torch.randint(0, 128000, (batch, prompt), device="cuda")
    capacity = prompt + new_tokens
    row = dict(B=batch, prompt=prompt, new=new_tokens)
    results = {}
    for contender in contenders:
        progress(f"  [{contender.name}] B={batch} P={prompt}: warm-up (compile/capture)...")
        try:
            start = time.perf_counter()
            with torch.no_grad():
                contender.prepare(batch, capacity)
                contender.run(ids, new_tokens)
                progress(f"  [{contender.name}]   warm-up took {time.perf_counter() - start:.1f} s; "
                         f"{args.repeats} timed run(s)...")
                runs = [contender.run(ids, new_tokens) for _ in range(args.repeats)]
            tokens, logits = runs[0][0], runs[0][1]
            t_prefill = min(r[2] for r in runs)  # best of the repeats, prefill and decode separately
            t_decode = min(r[3] for r in runs)
            steps = new_tokens - 1
            results[contender.name] = (tokens, logits)
            row[f"{contender.name}_prefill_ms"] = t_prefill * 1e3
            row[f"{contender.name}_step_ms"] = t_decode * 1e3 / max(steps, 1)
            row[f"{contender.name}_decode_tok_s"] = batch * steps / t_decode
            row[f"{contender.name}_e2e_tok_s"] = batch * new_tokens / (t_prefill + t_decode)
            progress(f"  [{contender.name}]   prefill {t_prefill * 1e3:.1f} ms, decode {row[f'{contender.name}_step_ms']:.3f}"
                     f" ms/step = {row[f'{contender.name}_decode_tok_s']:.0f} tok/s, e2e {row[f'{contender.name}_e2e_tok_s']:.0f} tok/s")
        except Exception as exc:  # record and go on: one failing contender must not lose the run
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            progress(f"  [{contender.name}]   FAILED: {message}")
            if args.verbose:
                traceback.print_exc()
            row[f"{contender.name}_error"] = message
            gqa_torch.clear_errors()
        finally:
            contender.release()
            gc.collect()
            torch.cuda.empty_cache()
    if "hf" in results:
        base_tokens, base_logits = results["hf"]
        for name, (tokens, logits) in results.items():
            if name == "hf":
                continue
            row[f"{name}_same_tokens"] = first_divergence(tokens, base_tokens)
            row[f"{name}_logit_rel_err"] = ((logits - base_logits).norm() / base_logits.norm()).item()
            for metric in ("decode_tok_s", "e2e_tok_s"):
                if f"{name}_{metric}" in row and f"hf_{metric}" in row:
                    row[f"{name}_{metric}_speedup"] = row[f"{name}_{metric}"] / row[f"hf_{metric}"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, prompt 512, 32 new tokens, no gqa_compile")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8")
    parser.add_argument("--prompts", type=int, nargs="+", default=None, help="default: 512 8192")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case; the best is reported")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-gqa-compile", action="store_true", help="skip the torch.compile'd gqa step")
    parser.add_argument("--name", default="bench_e2e", help="results file name (under benchmarks/results/)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args()
    if not gqa_torch.cuda_kernels_available():
        raise SystemExit("bench_e2e needs a GPU and a CUDA build of gqa_torch")
    import transformers

    batches = args.batches or [1, 8]
    prompts = args.prompts or ([512] if args.quick else [512, 8192])
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    with_gqa_compile = not (args.no_gqa_compile or args.quick)
    torch.backends.cuda.matmul.allow_tf32 = True

    progress(f"building the Llama-3.2-1B-shaped model ({args.layers} layers, random bf16 weights)...")
    base = build_model(args.layers)
    contenders = []
    if not args.no_hf:
        contenders.append(HFStatic(base))
    gqa_model = copy.deepcopy(base) if not args.no_hf else base
    contenders.append(GQA(gqa_model, compiled=False))
    if with_gqa_compile:
        contenders.append(GQA(gqa_model, compiled=True))

    rows = []
    cases = [(b, p) for p in prompts for b in batches]
    for i, (batch, prompt) in enumerate(cases, 1):
        progress(f"case {i}/{len(cases)}: B={batch}, prompt={prompt}, new={new_tokens}")
        torch._dynamo.reset()  # a fresh compilation per shape; frees the previous graphs
        rows.append(run_case(contenders, batch, prompt, new_tokens, args))
        gqa_torch.check_errors()

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                gqa_torch=gqa_torch.__version__, model=f"Llama-3.2-1B shape, {args.layers} layers, random weights",
                dtype="bf16", new_tokens=new_tokens,
                timing=f"wall clock around prefill and the whole greedy loop (synchronised), best of {args.repeats} "
                       "runs after a warm-up run",
                contenders="hf = StaticCache + SDPA + torch.compile(reduce-overhead, fullgraph); gqa_graph = "
                           "gqa_torch.hf.enable + CUDAGraphStep; gqa_compile = gqa step under the same torch.compile")
    names = [c.name for c in contenders]
    columns = ["B", "prompt"]
    for name in names:
        columns += [f"{name}_prefill_ms", f"{name}_step_ms", f"{name}_decode_tok_s", f"{name}_e2e_tok_s"]
    for name in names:
        if name != "hf" and "hf" in names:
            columns += [f"{name}_decode_tok_s_speedup", f"{name}_same_tokens", f"{name}_logit_rel_err"]
    errors = sorted({k for r in rows for k in r if k.endswith("_error")})
    columns += errors
    text = write_tables(args.name, meta, rows, columns, "End-to-end greedy generation, Llama-3.2-1B shape, bf16")
    labels = [f"B{r['B']} P{r['prompt']}" for r in rows]
    bar_plot(args.name, labels, {name: [r.get(f"{name}_decode_tok_s", math.nan) for r in rows] for name in names},
             "decode tokens/s (higher is better)", f"Greedy decode, Llama-3.2-1B shape, bf16, {meta['device']}")
    print(text)


if __name__ == "__main__":
    main()
