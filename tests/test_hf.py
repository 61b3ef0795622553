"""Hugging Face transformers integration (gqa_torch.hf), on tiny randomly initialised models.

Every family that enable() patches (SUPPORTED_ATTENTION_CLASSES) is built from a config, with
the features that matter switched on and small enough to bind (sliding windows of 4-5 tokens,
Gemma2's softcap 2.0, Qwen2's biases and sliding layers, Qwen3's q/k norms, gpt-oss's sinks; the
comments in FAMILIES say the rest). The reference is the same model on HF's eager attention.
Batches are left-padded, as generate() wants them. A spy on the operator checks that the route
under test really ran (no silent fallback).
"""
from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gqa_torch  # noqa: E402
import gqa_torch.hf as ghf  # noqa: E402
from gqa_torch.hf import GQACache  # noqa: E402

needs_cuda = pytest.mark.skipif(not gqa_torch.cuda_kernels_available(),
                                reason="needs the CUDA kernels and a CUDA device")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict()),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=4, attn_logit_softcapping=2.0,
                                                         query_pre_attn_scalar=24, final_logit_softcapping=30.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=4, num_local_experts=4,
                                                           num_experts_per_tok=2)),
    # Sliding layers that carry the window attribute, full layers that do not (Qwen2-MoE's own rule).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, qkv_bias=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        use_sliding_window=True, sliding_window=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    # Local and global RoPE bases (one table a layer type), per-head q/k norms, sliding layers.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # One packed QKV Linear, partial RoPE (Phi-4-mini's factor), one window for every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=4, partial_rotary_factor=0.5)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.2, embedding_multiplier=2.0,
                                                            residual_multiplier=0.5, logits_scaling=2.0)),
    # q/k RMSNorm over the whole projection.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # A layer without RoPE between two with it, and sliding layers.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Biases, LayerNorm, one window for every layer.
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=4)),
    # Per-head q/k norms; sliding layers with RoPE around a full layer without it.
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Interleaved RoPE on the sliding layers only; LayerNorm, logit scale.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Partial interleaved RoPE (half the head), QKV biases.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(attention_bias=True)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Whole-projection q/k norms and sliding layers.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "granite_moe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        attention_multiplier=0.2, num_local_experts=4, num_experts_per_tok=2)),
    # Per-head q/k norms, partial RoPE, MoE after a dense layer.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        use_qk_norm=True)),
    # A quarter of the head rotated, LayerNorm.
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(use_qkv_bias=True)),
    # Phi-2: MHA with biases, partial RoPE, per-head LayerNorms on q/k, output projection "dense".
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4, partial_rotary_factor=0.5, qk_layernorm=True)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict()),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                                         attention_bias=True)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        attention_multiplier=0.2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(partial_rotary_factor=0.5)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1, use_bias=True)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                      moe_intermediate_size=32, first_k_dense_replace=1)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(partial_rotary_factor=0.5, attention_bias=True)),
    # OLMo and OLMoE clamp q, k and v (clip_qkv: small, so that it bites).
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.3)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.3)),
    # Command-R: interleaved RoPE, a LayerNorm per head with its own weights.
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(use_qk_norm=True, logit_scale=0.5)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_bias=True)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict()),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict()),
    # Interleaved RoPE over the whole head.
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict()),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict()),
    # Sinks, alternating sliding layers, QKV biases, YaRN RoPE (its attention scaling) and MoE.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=64, rope_theta=150000.0))),
}


def build(family: str, **overrides):
    config_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, config_name):  # families newer than this transformers
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # gpt-oss: sinks large enough to move the softmax (its init gives about 0.2)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 2.0)
    return model


def test_every_supported_class_has_a_family():
    """FAMILIES builds a model of every attention class that enable() patches (so every class
    runs the tests below)."""
    missing = [config for config, _, _ in FAMILIES.values() if not hasattr(transformers, config)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")
    built = {type(m).__name__ for family in FAMILIES for m in build(family).modules()}
    assert set(ghf.SUPPORTED_ATTENTION_CLASSES) <= built, set(ghf.SUPPORTED_ATTENTION_CLASSES) - built


def left_padded(batch_lengths, vocab=128, width=None):
    """input_ids/attention_mask of a left-padded batch with real tokens in [3, vocab)."""
    width = width or max(batch_lengths)
    ids = torch.randint(3, vocab, (len(batch_lengths), width))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(batch_lengths):
        ids[b, :width - n] = 0
        mask[b, width - n:] = 1
    return ids, mask


class Spy:
    """Counts the operator calls of each route while installed."""

    def __init__(self, monkeypatch):
        self.calls = Counter()
        real = ghf.group_query_attention_

        def spy(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_name  # the route's function
            self.calls[{"_fused_forward": "fused", "gqa_attention_forward": "generic"}.get(caller, caller)] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(ghf, "group_query_attention_", spy)


def cache_kw(model, cache, generation=False):
    """The cache as a keyword argument under the name this transformers version takes (read off
    the signature, as gqa_torch.hf does): `cache` from 5.24, `past_key_values` before, where the
    old name still works with a FutureWarning."""
    fn = model.prepare_inputs_for_generation if generation else model.forward
    return {ghf._cache_arg_name(fn): cache}


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                              max_new_tokens=kwargs.pop("max_new_tokens", 8), **kwargs)


# ---- the fused route ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_generate_matches_hf(family, monkeypatch):
    ref = build(family)
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([5, 11, 8])
    expected = generate(ref, ids, mask)
    spy = Spy(monkeypatch)
    got = generate(ours, ids, mask)
    assert spy.calls["fused"] == 3 * 8 and spy.calls["generic"] == 0, spy.calls  # 3 layers x (prefill + 7 steps)
    assert torch.equal(got, expected), f"\n{got[:, ids.shape[1]:]}\n{expected[:, ids.shape[1]:]}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_logits_match_hf(family, monkeypatch):
    """Prefill of a left-padded batch into a GQACache, then two decode steps: logits at every
    real position within fp32 tolerance of HF (eager, DynamicCache)."""
    ref = build(family)
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([9, 4, 7])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = GQACache.for_model(ours, 3, 16)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        got = ours(ids, attention_mask=mask, position_ids=positions, **cache_kw(ours, cache))
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], want.logits[real], rtol=1e-4, atol=1e-4)
        past, tokens = want.past_key_values, want.logits[:, -1:].argmax(-1)
        for _ in range(2):
            mask = torch.cat([mask, torch.ones_like(tokens)], 1)
            positions = positions[:, -1:] + 1
            want = ref(tokens, attention_mask=mask, position_ids=positions, use_cache=True, **cache_kw(ref, past))
            got = ours(tokens, attention_mask=mask, position_ids=positions, **cache_kw(ours, cache))
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
            past, tokens = want.past_key_values, want.logits[:, -1:].argmax(-1)
    assert spy.calls["fused"] == 3 * 3 and spy.calls["generic"] == 0
    assert cache.kv.lengths_host(0).tolist() == [11, 6, 9]  # compacted: real tokens only
    assert int(cache.get_seq_length()) == 11  # columns fed, HF's count


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_window_and_softcap_are_exercised(family):
    """Negative control: with the fused layers' window and softcap switched off, the logits no
    longer match, so the parity tests above really cover those features."""
    ref = build(family)
    ours = ghf.enable(copy.deepcopy(ref))
    for layer in ours.model.layers:
        layer.self_attn._gqa_fused.window = -1
        layer.self_attn._gqa_fused.softcap = 0.0
    ids, mask = left_padded([12, 9])
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask, **cache_kw(ours, GQACache.for_model(ours, 2, 12))).logits
    assert (got - want)[mask.bool()].abs().max() > 1e-2


def test_fused_beam_search_matches_hf():
    ref = build("llama")
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([6, 10])
    expected = generate(ref, ids, mask, num_beams=3, max_new_tokens=6)
    got = generate(ours, ids, mask, num_beams=3, max_new_tokens=6)
    assert torch.equal(got, expected)


def test_fused_plain_forward_falls_back_to_the_generic_route(monkeypatch):
    """model(ids) without a GQACache makes HF's DynamicCache: the patched layers run the generic
    route (HF RoPE + HF cache + our op) and still match."""
    ref = build("qwen3")
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([7, 3])
    spy = Spy(monkeypatch)
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert spy.calls["generic"] == 3 and spy.calls["fused"] == 0
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_fused_qkv_shares_storage_and_disable_restores():
    ref = build("qwen2")
    model = copy.deepcopy(ref)
    params_before = sum(p.numel() for p in model.parameters())
    ghf.enable(model)
    attn = model.model.layers[0].self_attn
    fused = attn._gqa_qkv_weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.q_proj.bias.untyped_storage().data_ptr() == attn._gqa_qkv_bias.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params_before
    assert model.config._attn_implementation == "gqa"
    ghf.disable(model)
    assert model.config._attn_implementation == "eager" and "forward" not in attn.__dict__
    ids, mask = left_padded([5, 5])
    assert torch.equal(generate(model, ids, mask, max_new_tokens=4), generate(ref, ids, mask, max_new_tokens=4))


class _ScaledLinear(torch.nn.Linear):
    """A Linear subclass with a forward of its own, as quantised or hooked projections have."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_projections_with_their_own_forward_are_not_fused(monkeypatch):
    """q/k/v projections that subclass nn.Linear (bitsandbytes, fake quantisation) keep their
    forward: enable() does not concatenate their weights, and the fused route calls each."""
    ref = build("llama")
    for layer in ref.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(layer.self_attn, name)
            new = _ScaledLinear(old.in_features, old.out_features, bias=old.bias is not None)
            new.load_state_dict(old.state_dict())
            setattr(layer.self_attn, name, new)
    ours = ghf.enable(copy.deepcopy(ref))
    assert all(getattr(layer.self_attn, "_gqa_qkv_weight", None) is None for layer in ours.model.layers)
    ids, mask = left_padded([5, 11])
    spy = Spy(monkeypatch)
    assert torch.equal(generate(ours, ids, mask), generate(ref, ids, mask))
    assert spy.calls["fused"] > 0 and spy.calls["generic"] == 0


def test_gqacache_too_small_raises_before_writing():
    model = ghf.enable(build("llama"))
    ids, mask = left_padded([6, 6])
    cache = GQACache.for_model(model, 2, 8)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kw(model, cache))
        keys_before = cache.kv.key.clone()
        with pytest.raises(ValueError, match="capacity"):
            model(ids[:, :3], attention_mask=torch.ones(2, 9, dtype=torch.long), **cache_kw(model, cache))
    assert torch.equal(cache.kv.key, keys_before)
    assert cache.kv.lengths_host(0).tolist() == [6, 6]


def test_gqacache_reset_and_reuse_across_generate_calls():
    ref = build("mistral")
    ours = ghf.enable(copy.deepcopy(ref))
    cache = GQACache.for_model(ours, 2, 32)
    ids, mask = left_padded([4, 9])
    first = generate(ours, ids, mask, **cache_kw(ours, cache, generation=True))
    assert int(cache.get_seq_length()) == ids.shape[1] + 7
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and cache.kv.lengths.eq(0).all()
    assert torch.equal(generate(ours, ids, mask, **cache_kw(ours, cache, generation=True)), first)
    assert torch.equal(first, generate(ref, ids, mask))


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("draft", ["prompt_lookup", "assistant"])
def test_fused_assisted_generation_matches_hf(family, draft, monkeypatch):
    """Assisted decoding verifies a draft in one forward and crops the rejected tokens: the
    GQACache's crop, with room for a draft that reaches past max_length."""
    ref = build(family)
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([9])
    ids[0, 5:9] = ids[0, 0:4]  # a repeated n-gram, so prompt lookup proposes drafts
    expected = generate(ref, ids, mask, max_new_tokens=12)
    if draft == "prompt_lookup":
        kwargs = dict(prompt_lookup_num_tokens=3)
    else:  # a smaller model of its own weights: its drafts are often wrong
        torch.manual_seed(1)
        kwargs = dict(assistant_model=ghf.enable(build(family, num_hidden_layers=1)))
    crops = Counter()
    real_crop = GQACache.crop

    def counting_crop(cache, tokens_to_remove):
        # Counts the crops that remove columns (transformers 5.17 passes a tensor).
        crops[int(tokens_to_remove) < 0] += 1
        return real_crop(cache, tokens_to_remove)

    monkeypatch.setattr(GQACache, "crop", counting_crop)
    spy = Spy(monkeypatch)
    got = generate(ours, ids, mask, max_new_tokens=12, **kwargs)
    assert torch.equal(got, expected)
    assert spy.calls["fused"] > 0 and spy.calls["generic"] == 0, spy.calls
    assert crops[True] > 0, "no draft token was ever rejected: the case does not test crop"


def test_a_layer_type_with_dynamic_rope_keeps_the_whole_model_on_the_generic_route(monkeypatch):
    """Gemma3 with dynamic RoPE on its global layers: those layers cannot be fused (the operator's
    tables are static), and a GQACache needs every layer, so enable() patches none and generate()
    runs the generic route everywhere, matching HF."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "dynamic", "rope_theta": 1000000.0, "factor": 2.0}}
    ref = build("gemma3", rope_parameters=rope)
    ours = ghf.enable(copy.deepcopy(ref))
    assert ours._gqa_state.patched == []
    ids, mask = left_padded([5, 11])
    spy = Spy(monkeypatch)
    assert torch.equal(generate(ours, ids, mask), generate(ref, ids, mask))
    assert spy.calls["generic"] > 0 and spy.calls["fused"] == 0


def test_a_model_split_across_devices_stays_on_the_generic_route():
    """enable() patches no layer when the attention layers' weights sit on several devices (a
    device_map split; here one layer on the meta device), since a GQACache lives on one."""
    model = build("llama")
    model.model.layers[2].self_attn.to("meta")
    ghf.enable(model)
    assert model._gqa_state.patched == []
    assert "gqa_rope" not in model._modules


def test_enable_refuses_a_gpu_the_kernels_cannot_run_on(monkeypatch):
    """enable() checks the devices of the model's parameters before it patches anything, and a
    GPU that this build cannot run (here a T4, imitated: no GPU is needed) is refused with the GPU
    and what to do; the CPU and a GPU the kernels run on are not."""
    model = build("llama")
    seen = []

    def refuse(devices):
        seen.append(devices)
        raise RuntimeError("refused")

    monkeypatch.setattr(ghf, "_check_cuda_devices", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        ghf.enable(model)
    assert seen == [{torch.device("cpu")}] and getattr(model, "_gqa_state", None) is None
    assert model.config._attn_implementation == "eager"
    monkeypatch.undo()

    monkeypatch.setattr(ghf, "cuda_kernels_available", lambda device: device.index != 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    ghf._check_cuda_devices({torch.device("cpu"), torch.device("cuda:0")})
    with pytest.raises(RuntimeError, match=r"gqa_torch\.hf\.enable: the model is on cuda:1 \(Tesla T4, compute "
                                           r"capability 7\.5\), where gqa_torch's CUDA kernels cannot run: they need "
                                           r"8\.0 or newer, and this build was (built for TORCH_CUDA_ARCH_LIST=|built "
                                           r"CPU-only).*Keep the model on the CPU, or rebuild gqa_torch for this GPU"):
        ghf._check_cuda_devices({torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")})
    ghf.enable(model)  # (on the CPU)
    assert model._gqa_state.patched


def test_gqacache_crop_removes_real_columns_only():
    """Cropping the last columns equals never having fed them (the logits of feeding them again
    are unchanged); columns where a left-padded row had padding cannot be cropped."""
    model = ghf.enable(build("qwen3"))
    ids, mask = left_padded([9, 5])
    cache = GQACache.for_model(model, 2, 16)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, **cache_kw(model, cache)).logits
        cache.crop(-3)
        assert cache.kv.lengths_host(0).tolist() == [6, 2] and cache.seen.tolist() == [6, 6, 6]
        again = model(ids[:, -3:], attention_mask=mask, **cache_kw(model, cache)).logits
    torch.testing.assert_close(again, full[:, -3:], rtol=1e-5, atol=1e-5)
    cache.crop(0)  # nothing
    assert cache.kv.lengths_host(0).tolist() == [9, 5]
    with pytest.raises(ValueError, match=r"GQACache.crop: the last 6 columns are not real tokens of every row \(only "
                                         r"the last 5 are"):
        cache.crop(-6)
    assert cache.kv.lengths_host(0).tolist() == [9, 5]  # unchanged by the refused crop
    cache.crop(torch.tensor(-1))  # a one-element tensor, as transformers 5.17 passes
    assert cache.kv.lengths_host(0).tolist() == [8, 4]
    cache.crop(4)  # transformers' older convention: keep 4 columns
    assert cache.kv.lengths_host(0).tolist() == [4, 0] and int(cache.get_seq_length()) == 4


# ---- the generic route (attn_implementation="gqa") ------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_generic_generate_matches_hf(family, monkeypatch):
    ref = build(family)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("gqa")
    ids, mask = left_padded([10, 3, 6])
    expected = generate(ref, ids, mask)
    spy = Spy(monkeypatch)
    got = generate(ours, ids, mask)
    assert spy.calls["generic"] == 3 * 8 and spy.calls["fused"] == 0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_generic_static_cache_matches_hf(family):
    ref = build(family)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("gqa")
    ids, mask = left_padded([8, 5])
    expected = generate(ref, ids, mask, cache_implementation="static")
    assert torch.equal(generate(ours, ids, mask, cache_implementation="static"), expected)
    assert torch.equal(expected, generate(ref, ids, mask))


def test_generic_route_supports_sinks():
    """s_aux (gpt-oss style per-head sinks) reaches the operator as head_sink."""
    q = torch.randn(2, 4, 3, 16)
    k, v = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)

    class Layer(torch.nn.Module):
        is_causal = True

    sinks = torch.randn(4) * 2
    got, _ = ghf.gqa_attention_forward(Layer(), q, k, v, None, s_aux=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    logits = (q @ kk.transpose(-1, -2)) / 4.0
    logits = logits.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([logits, sinks[None, :, None, None].expand(2, 4, 3, 1)], -1).softmax(-1)
    want = (full[..., :3] @ vv).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_generic_route_rejects_foreign_masks():
    class Layer(torch.nn.Module):
        is_causal = True

    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match="gqa_mask"):
        ghf.gqa_attention_forward(Layer(), q, k, k, torch.zeros(1, 1, 2, 2))


def test_gqa_mask_describes_the_slots():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    state = ghf.gqa_mask(2, 2, 7, q_offset=3, kv_offset=0, attention_mask=mask).view(2, 7)
    E, P, N, NP = ghf.EMPTY, ghf.PAST, ghf.NEW, ghf.NEW_PAD
    assert state.tolist() == [[E, E, P, N, N, E, E], [P, P, P, N, N, E, E]]
    state = ghf.gqa_mask(1, 3, 3, q_offset=torch.tensor(0), kv_offset=torch.tensor(0),
                         attention_mask=torch.tensor([[0, 1, 1]])).view(1, 3)
    assert state.tolist() == [[NP, N, N]]
    assert ghf.gqa_mask(2, 4, 4, q_offset=torch.tensor(9), kv_offset=torch.tensor(9)) is None  # GQACache, no padding
    state = ghf.gqa_mask(2, 1, 6, q_offset=torch.tensor(3), kv_offset=0).view(2, 6)  # static cache, no mask
    assert state.tolist() == [[P, P, P, N, E, E]] * 2


# ---- GPU ------------------------------------------------------------------------------------------------

def _cuda_model(family, dtype, attn="eager", **overrides):
    torch.manual_seed(0)
    model = build(family, **overrides)
    model.config._attn_implementation = attn
    return model.to(device="cuda", dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "phi", "cohere2", "gpt_oss"])
def test_gpu_bf16_fused_close_to_hf(family):
    ref = _cuda_model(family, torch.bfloat16, attn="eager")
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([20, 13, 17])
    ids, mask = ids.cuda(), mask.cuda()
    cache = GQACache.for_model(ours, 3, 24)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.float()
        got = ours(ids, attention_mask=mask, **cache_kw(ours, cache)).logits.float()
    real = mask.bool()
    rel = ((got - want)[real].norm() / want[real].norm()).item()
    assert rel < 3e-2, rel


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_gpu_compiled_generate_matches_eager(family):
    """On CUDA, generate() compiles the decode step (reduce-overhead) because GQACache is a
    compileable static cache; fp32 tokens must equal the uncompiled run and HF's own."""
    ref = _cuda_model(family, torch.float32)
    ours = ghf.enable(copy.deepcopy(ref))
    ids, mask = left_padded([9, 4, 12])
    ids, mask = ids.cuda(), mask.cuda()
    eager = generate(ours, ids, mask, max_new_tokens=10, disable_compile=True)
    compiled = generate(ours, ids, mask, max_new_tokens=10)
    gqa_torch.check_errors()
    assert torch.equal(eager, compiled)
    assert torch.equal(eager, generate(ref, ids, mask, max_new_tokens=10))


@needs_cuda
def test_gpu_generic_static_cache_compiled():
    ref = _cuda_model("qwen2", torch.float32)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("gqa")
    ids, mask = left_padded([9, 4])
    ids, mask = ids.cuda(), mask.cuda()
    want = generate(ref, ids, mask, cache_implementation="static", max_new_tokens=8)
    got = generate(ours, ids, mask, cache_implementation="static", max_new_tokens=8)
    assert torch.equal(got, want)


@needs_cuda
@pytest.mark.parametrize("backend", ["graph", "compile"])
def test_gpu_graph_decode_of_an_hf_model(backend):
    """One decode step of the whole HF model (fused route) in a CUDA graph / compiled with
    reduce-overhead + fullgraph, replayed for greedy decoding: same tokens as generate()."""
    from gqa_torch.graphs import CompiledStep, CUDAGraphStep, greedy_decode
    ref = _cuda_model("llama", torch.float32)
    ours = ghf.enable(copy.deepcopy(ref))
    B, P, steps = 2, 7, 10
    ids = torch.randint(3, 128, (B, P), device="cuda")
    expected = generate(ours, ids, torch.ones_like(ids), max_new_tokens=steps, disable_compile=True)[:, P:]
    cache = GQACache.for_model(ours, B, P + steps)
    with torch.no_grad():
        first = ours(ids, **cache_kw(ours, cache)).logits[:, -1:].argmax(-1)

        def step(tokens):
            positions = cache.kv.lengths[0][:, None].long()
            return ours(input_ids=tokens, position_ids=positions, **cache_kw(ours, cache)).logits

        runner = CUDAGraphStep(step) if backend == "graph" else CompiledStep(step)
        got = greedy_decode(runner, first, steps)
    assert torch.equal(got, expected)
