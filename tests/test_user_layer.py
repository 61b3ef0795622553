"""The user layer: KVCache, GroupQueryAttention and the CUDA-graph helpers.

The module is checked against a plain float64 PyTorch reference written here (projections,
per-head RMSNorm, RoPE from the same inverse frequencies, causal/windowed softmax with softcap,
smooth softmax and sinks) over a right-padded prefill followed by ragged decode steps.
GPU variants skip cleanly without a CUDA build and device.
"""
from __future__ import annotations

import math

import pytest
import torch

import gqa_torch
from gqa_torch import GroupQueryAttention, KVCache
from gqa_torch.module import rope_inv_freq

needs_cuda = pytest.mark.skipif(not gqa_torch.cuda_kernels_available(),
                                reason="needs the CUDA kernels and a CUDA device")


# ---- KVCache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [0, 1])
def test_kvcache_shapes_and_seqlens(layout):
    cache = KVCache(3, 4, 2, 8, 16, kv_layout=layout)
    k, v = cache.layer(1)
    assert k.shape == ((4, 2, 16, 8) if layout == 0 else (4, 16, 2, 8)) and k.is_contiguous()
    assert cache.lengths.dtype == torch.int32 and cache.lengths.shape == (3, 4)
    seq = cache.seqlens_k(1, 5)
    assert seq.tolist() == [4, 4, 4, 4] and cache.lengths.sum() == 0  # no state change yet
    cache.advance(1, torch.tensor([5, 2, 0, 3]))
    assert cache.lengths_host(1).tolist() == [5, 2, 0, 3] and cache.lengths_host(0).tolist() == [0] * 4
    assert cache.decode(1).tolist() == [5, 2, 0, 3]
    assert cache.lengths_host(1).tolist() == [6, 3, 1, 4]
    assert cache.prefill(2, [3, 1, 2, 0], 3).tolist() == [2, 2, 2, 2]
    assert cache.lengths_host(2).tolist() == [3, 1, 2, 0]


def test_kvcache_capacity_error_before_the_call():
    cache = KVCache(1, 2, 2, 8, 6)
    x = torch.randn(2, 4, (4 + 4) * 8)
    k, v = cache.layer(0)
    gqa_torch.group_query_attention_(x, None, None, k, v, cache.seqlens_k(0, 4), num_heads=4, kv_num_heads=2)
    cache.advance(0, torch.tensor([4, 1]))
    cache.seqlens_k(0, 2)  # 4 + 2 == capacity: fine
    before_k = k.clone()
    with pytest.raises(ValueError, match="capacity"):
        cache.seqlens_k(0, 3)  # longest row 4 + 3 > 6: refused before any op call
    assert torch.equal(k, before_k) and cache.lengths_host(0).tolist() == [4, 1]
    # The bounds are exact after a reset of the long row.
    cache.reset_rows([0])
    cache.seqlens_k(0, 5)
    with pytest.raises(ValueError):
        cache.seqlens_k(0, 6)


def test_kvcache_bound_is_sync_free_and_conservative():
    # A CUDA-like cache keeps a host bound; simulate with a CPU cache by reading the private
    # bound: it must never be below the true maximum.
    cache = KVCache(2, 3, 1, 4, 32)
    cache.seqlens_k(0, 8)
    cache.advance(0, torch.tensor([8, 3, 5]))  # tensor advance: bound += 8 (this call's S)
    assert cache._bounds[0] == 8 >= int(cache.lengths[0].max())
    cache.advance(0, torch.tensor([1, 1, 1]), max_tokens=1)
    assert cache._bounds[0] == 9 and int(cache.lengths[0].max()) == 9
    cache.lengths[0].zero_()
    cache.refresh_bounds()
    assert cache._bounds == [0, 0]


def test_kvcache_reset_reset_rows_and_reorder():
    L, B, H, C, D = 2, 4, 2, 6, 3
    cache = KVCache(L, B, H, D, C)
    cache.key.copy_(torch.randn_like(cache.key))
    cache.value.copy_(torch.randn_like(cache.value))
    cache.lengths.copy_(torch.randint(0, C, (L, B), dtype=torch.int32))
    key0, value0, len0 = cache.key.clone(), cache.value.clone(), cache.lengths.clone()
    data_ptr = cache.key.data_ptr()

    order = [2, 2, 0, 3]
    cache.reorder(order)
    assert torch.equal(cache.key, key0[:, order]) and torch.equal(cache.value, value0[:, order])
    assert torch.equal(cache.lengths, len0[:, order]) and cache.key.data_ptr() == data_ptr

    cache.reset_rows(torch.tensor([False, True, False, True]))
    assert cache.lengths[:, 1].eq(0).all() and cache.lengths[:, 3].eq(0).all()
    assert torch.equal(cache.lengths[:, 0], len0[:, 2]) and torch.equal(cache.lengths[:, 2], len0[:, 0])
    cache.reset_rows(0)
    assert cache.lengths[:, 0].eq(0).all() and torch.equal(cache.lengths[:, 2], len0[:, 0])
    with pytest.raises(IndexError):
        cache.reset_rows([4])
    with pytest.raises(ValueError):
        cache.reorder([0, 1])
    cache.reset()
    assert cache.lengths.eq(0).all() and torch.equal(cache.value, value0[:, order])
    cache.reset(zero_data=True)
    assert cache.value.eq(0).all()


def test_kvcache_rejects_bad_arguments():
    with pytest.raises(ValueError):
        KVCache(1, 1, 1, 8, 0)
    with pytest.raises(ValueError):
        KVCache(1, 1, 1, 8, 4, kv_layout=2)
    with pytest.raises(TypeError):
        KVCache(1, 1, 1, 8, 4, dtype=torch.int32)
    with pytest.raises(ValueError):
        KVCache(1, 2, 1, 8, 4).seqlens_k(0, 0)


# ---- a plain float64 reference of the module -----------------------------------------------------

def _rms(x, weight, eps):
    return weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope64(x, positions, inv_freq, interleaved):
    """x [N, H, D] float64 at positions [N]; rotates the first R = 2 * len(inv_freq) dims."""
    half = inv_freq.numel()
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    y = x.clone()
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return y


class Reference:
    """The module's math in float64, one row at a time, with its own per-row K/V lists."""

    def __init__(self, module: GroupQueryAttention, batch: int):
        self.m = module
        self.keys = [[] for _ in range(batch)]
        self.values = [[] for _ in range(batch)]

    def step(self, x, keep):
        """x [B, S, hidden]; keep[b] = tokens row b keeps (its first ones). Returns [B, S, hidden]
        float64 with zeros at the dropped positions."""
        m = self.m
        Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        G = Hq // Hkv
        W = m.qkv_proj.weight.double()
        bias = m.qkv_proj.bias.double() if m.qkv_proj.bias is not None else None
        out = torch.zeros(x.shape[0], x.shape[1], Hq * D, dtype=torch.float64)
        inv_freq = m.rope.inv_freq.cpu()
        scale = m.scale or 1 / math.sqrt(D)
        for b in range(x.shape[0]):
            n = keep[b]
            packed = x[b, :n].double() @ W.T + (bias if bias is not None else 0)
            q, k, v = packed.split([Hq * D, Hkv * D, Hkv * D], -1)
            q, k, v = q.view(n, Hq, D), k.view(n, Hkv, D), v.view(n, Hkv, D)
            if m.q_norm is not None:
                q, k = _rms(q, m.q_norm.weight, m.q_norm.eps), _rms(k, m.k_norm.weight, m.k_norm.eps)
            start = len(self.keys[b])
            pos = torch.arange(start, start + n)
            if m.do_rotary:
                q, k = _rope64(q, pos, inv_freq, m.rotary_interleaved), _rope64(k, pos, inv_freq, m.rotary_interleaved)
            self.keys[b] += list(k)
            self.values[b] += list(v)
            K, V = torch.stack(self.keys[b]), torch.stack(self.values[b])  # [T, Hkv, D]
            T = K.shape[0]
            for s in range(n):
                p = start + s
                j = torch.arange(T)
                visible = j <= p
                if m.local_window_size > 0:
                    visible &= j > p - m.local_window_size
                for h in range(Hq):
                    logits = scale * (K[:, h // G] @ q[s, h])
                    if m.softcap:
                        logits = m.softcap * torch.tanh(logits / m.softcap)
                    logits = logits[visible]
                    extra = []
                    if m.smooth_softmax:
                        extra.append(0.0)
                    if m.head_sink is not None:
                        extra.append(float(m.head_sink[h].detach()))
                    top = max([logits.max().item()] + extra)
                    weights = torch.exp(logits - top)
                    denom = weights.sum() + sum(math.exp(e - top) for e in extra)
                    out[b, s, h * D:(h + 1) * D] = (weights / denom) @ V[visible][:, h // G]
        y = out @ m.o_proj.weight.double().T
        if m.o_proj.bias is not None:
            y = y + m.o_proj.bias.double()
        for b in range(x.shape[0]):
            y[b, keep[b]:] = 0
        return y


FEATURES = {
    "plain": dict(),
    "bias_qknorm_partial": dict(qkv_bias=True, out_bias=True, qk_norm=True, partial_rotary_factor=0.5),
    "interleaved_window_softcap": dict(rotary_interleaved=True, local_window_size=3, softcap=4.0),
    "sink_smooth_scale_llama3": dict(head_sink=True, smooth_softmax=True, scale=0.2, rope_theta=500000.0,
                                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0, original_max_position_embeddings=16)),
    "linear_scaling_mqa": dict(rope_scaling=dict(type="linear", factor=4.0), kv_heads=1),
}


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_module_matches_reference(feature, layout):
    opts = dict(FEATURES[feature])
    kv_heads = opts.pop("kv_heads", 2)
    hidden, heads, B, S = 48, 4, 3, 7
    module = GroupQueryAttention(hidden, heads, kv_heads, 16, max_position_embeddings=64, **opts)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    cache = module.new_cache(1, B, 16, kv_layout=layout)
    ref = Reference(module, B)
    prompt = [7, 3, 5]
    x = torch.randn(B, S, hidden)
    got = module(x, cache, 0, valid_lengths=torch.tensor(prompt))
    want = ref.step(x, prompt)
    assert cache.lengths_host(0).tolist() == prompt
    for b in range(B):
        torch.testing.assert_close(got[b, :prompt[b]].double(), want[b, :prompt[b]], rtol=1e-4, atol=1e-4)
    for step in range(4):  # ragged decode: rows at different lengths
        x = torch.randn(B, 1, hidden)
        got = module(x, cache, 0)
        want = ref.step(x, [1] * B)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
    assert cache.lengths_host(0).tolist() == [p + 4 for p in prompt]
    # Two new tokens at once (chunked prefill continuation), ragged rows.
    x = torch.randn(B, 2, hidden)
    torch.testing.assert_close(module(x, cache, 0).double(), ref.step(x, [2] * B), rtol=1e-4, atol=1e-4)


def test_module_without_cache_is_causal_self_attention():
    module = GroupQueryAttention(32, 4, 2, local_window_size=2, softcap=3.0)
    x = torch.randn(2, 6, 32)
    ref = Reference(module, 2)
    torch.testing.assert_close(module(x).double(), ref.step(x, [6, 6]), rtol=1e-4, atol=1e-4)


def test_module_feature_switches_change_the_result():
    """The attributes reach the operator: switching one changes the output."""
    base = GroupQueryAttention(32, 4, 2)
    x = torch.randn(1, 6, 32)
    y = base(x)
    for attr, value in [("local_window_size", 2), ("softcap", 0.5), ("smooth_softmax", True),
                        ("rotary_interleaved", True), ("scale", 0.05)]:
        other = GroupQueryAttention(32, 4, 2)
        other.load_state_dict(base.state_dict())
        setattr(other, attr, value)
        assert not torch.allclose(other(x), y, atol=1e-5), attr


def test_module_keeps_fp32_rope_tables_under_casts():
    m = GroupQueryAttention(32, 4, 2, head_sink=True)
    cos = m.rope.cos.clone()
    m = m.to(torch.bfloat16)
    assert m.rope.cos.dtype == torch.float32 and torch.equal(m.rope.cos, cos)
    assert m.head_sink.dtype == torch.float32 and m.qkv_proj.weight.dtype == torch.bfloat16


def test_module_rejects_a_mismatched_cache():
    m = GroupQueryAttention(32, 4, 2)
    with pytest.raises(ValueError, match="kv_heads"):
        m(torch.randn(2, 1, 32), KVCache(1, 2, 1, 8, 4), 0)


def test_llama3_inverse_frequencies_match_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig
    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=dict(rope_theta=500000.0, **scaling))
    theirs, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(64, 500000.0, scaling)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(64, 500000.0))  # the scaling does something


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_from_hf_matches_the_hf_attention_layer(family):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.3)
    if family == "qwen3":
        config = transformers.Qwen3Config(attention_bias=True, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Gemma2Config(sliding_window=3, attn_logit_softcapping=1.5, query_pre_attn_scalar=20,
                                           **common)
        model = transformers.Gemma2ForCausalLM(config)
    model.config._attn_implementation = "eager"
    layer = model.model.layers[0].self_attn  # sliding in Gemma2 (layer 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # non-trivial norm weights and biases
    ours = GroupQueryAttention.from_hf(layer, config)
    if family == "gemma2":
        assert ours.local_window_size == 3 and ours.softcap == 1.5 and ours.scale == pytest.approx(20 ** -0.5)
    else:
        assert ours.q_norm is not None and ours.qkv_proj.bias is not None
    B, S = 2, 6
    x = torch.randn(B, S, 64)
    positions = torch.arange(S)[None].expand(B, S)
    cos, sin = model.model.rotary_emb(x, positions)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = j <= i
    if family == "gemma2":
        allowed &= j > i - 3
    mask = torch.zeros(S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None].expand(B, 1, S, S)
    with torch.no_grad():
        want, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
        got = ours(x)
        cache = ours.new_cache(1, B, 8)
        got_cached = torch.cat([ours(x[:, :4], cache, 0), ours(x[:, 4:5], cache, 0), ours(x[:, 5:], cache, 0)], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_cached, want, rtol=1e-4, atol=1e-5)


# ---- GPU: capacity on the device path, CUDA graphs, torch.compile --------------------------------

class TinyModel(torch.nn.Module):
    """Embedding -> [GroupQueryAttention + MLP] x L -> logits, for the graph/compile tests."""

    def __init__(self, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.attn = torch.nn.ModuleList(GroupQueryAttention(hidden, heads, kv_heads, local_window_size=-1)
                                        for _ in range(layers))
        self.mlp = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                                           torch.nn.Linear(2 * hidden, hidden)) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens, cache):
        x = self.embed(tokens)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norm(x), cache, i)
            x = x + mlp(self.norm(x))
        return x @ self.embed.weight.T


def _greedy_eager(model, cache, first, steps):
    tokens, out = first, [first]
    for _ in range(steps - 1):
        tokens = model(tokens, cache)[:, -1:].argmax(-1)
        out.append(tokens)
    return torch.cat(out, 1)


@needs_cuda
@pytest.mark.parametrize("backend", ["graph", "compile"])
def test_graph_and_compiled_decode_match_eager(backend):
    from gqa_torch.graphs import CompiledStep, CUDAGraphStep, greedy_decode
    torch.manual_seed(0)
    model = TinyModel().cuda().eval()
    B, P, steps = 3, 5, 12
    prompt = torch.randint(0, 96, (B, P), device="cuda")
    results = []
    for mode in ("eager", backend):
        cache = KVCache(2, B, 2, 16, P + steps, device="cuda")
        with torch.no_grad():
            first = model(prompt, cache)[:, -1:].argmax(-1)
            if mode == "eager":
                results.append(_greedy_eager(model, cache, first, steps))
            else:
                step_cls = CUDAGraphStep if mode == "graph" else CompiledStep
                step = step_cls(lambda t: model(t, cache))
                results.append(greedy_decode(step, first, steps, check_every=4))
        assert cache.lengths_host().eq(P + steps - 1).all()
    assert torch.equal(results[0], results[1])


@needs_cuda
def test_capacity_overflow_inside_a_graph_sets_the_error_word():
    from gqa_torch.graphs import CUDAGraphStep
    model = TinyModel().cuda().eval()
    B, P = 2, 4
    cache = KVCache(2, B, 2, 16, P + 3, device="cuda")  # room for 3 decode tokens
    gqa_torch.clear_errors()
    with torch.no_grad():
        model(torch.randint(0, 96, (B, P), device="cuda"), cache)
        step = CUDAGraphStep(lambda t: model(t, cache), warmup=1)
        tokens = torch.zeros(B, 1, dtype=torch.long, device="cuda")
        for _ in range(3):
            logits = step(tokens)
        step.sync()  # all within capacity: no error
        assert torch.isfinite(logits).all()
        step(tokens)  # the 4th token does not fit: flagged on the device, nothing raised yet
        with pytest.raises(gqa_torch.GQAError) as info:
            step.sync()
    assert info.value.flags & 16
    # Eager, the host check refuses it before the call (the bound saw the eager prefill only,
    # so refresh it first).
    cache.refresh_bounds()
    with pytest.raises(ValueError, match="capacity"):
        model(torch.zeros(B, 1, dtype=torch.long, device="cuda"), cache)


@needs_cuda
def test_module_bf16_close_to_fp32_on_gpu():
    torch.manual_seed(0)
    m32 = GroupQueryAttention(128, 8, 2, qk_norm=True, softcap=20.0).cuda()
    m16 = GroupQueryAttention(128, 8, 2, qk_norm=True, softcap=20.0).cuda()
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.bfloat16)
    x = torch.randn(2, 9, 128, device="cuda")
    c32, c16 = m32.new_cache(1, 2, 16), m16.new_cache(1, 2, 16)
    a = torch.cat([m32(x[:, :8], c32, 0), m32(x[:, 8:], c32, 0)], 1)
    b = torch.cat([m16(x[:, :8].bfloat16(), c16, 0), m16(x[:, 8:].bfloat16(), c16, 0)], 1).float()
    assert ((a - b).norm() / a.norm()).item() < 2e-2
