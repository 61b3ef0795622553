"""``GroupQueryAttention``: an ``nn.Module`` around the fused in-place operator.

One forward is: a fused QKV projection, optional per-head RMSNorm of q and k (Qwen3), then
``gqa::group_query_attention_`` (RoPE + KV-cache append + grouped-query attention in one call),
then the output projection. The RoPE tables are built here (theta, linear or llama3-style
frequency scaling, a partial rotary fraction, half-split or interleaved pairs).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from .cache import KVCache
from .ops import group_query_attention, group_query_attention_

Tensor = torch.Tensor

__all__ = ["GroupQueryAttention", "RopeTables", "hf_rope_parameters", "rope_inv_freq", "rope_tables"]


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, scaling: Optional[Dict[str, Any]] = None) -> Tensor:
    """The inverse frequencies ``theta^(-2i/R)`` (fp32, ``[R/2]``) of a rotary dim ``R``, with an
    optional frequency scaling:

    - ``{"rope_type": "linear", "factor": f}``: every frequency divided by ``f`` (position
      interpolation).
    - ``{"rope_type": "llama3", "factor": f, "low_freq_factor": l, "high_freq_factor": h,
      "original_max_position_embeddings": n}``: long wavelengths (``> n / l``) divided by ``f``,
      short ones (``< n / h``) kept, a linear blend in between (Llama 3.1+).

    ``"type"`` is accepted for ``"rope_type"``; ``None``/``"default"`` means no scaling.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_inv_freq: rotary_dim must be positive and even, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    kind = None if not scaling else (scaling.get("rope_type") or scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        long_wave, short_wave = original / low, original / high
        scaled = torch.where(wavelength > long_wave, inv_freq / factor, inv_freq)
        blend = (original / wavelength - low) / (high - low)
        blended = (1 - blend) * scaled / factor + blend * scaled
        in_between = (wavelength >= short_wave) & (wavelength <= long_wave)
        return torch.where(in_between, blended, scaled)
    raise ValueError(f"rope_inv_freq: unsupported rope scaling {kind!r} (supported: default, linear, llama3; "
                     "pass the inverse frequencies yourself for other schemes)")


_default_inv_freq = rope_inv_freq  # GroupQueryAttention has an argument of the same name


def rope_tables(inv_freq: Tensor, max_positions: int, attention_scaling: float = 1.0,
                device: Union[str, torch.device, None] = None) -> Tuple[Tensor, Tensor]:
    """``(cos, sin)`` fp32 ``[max_positions, R/2]`` for the operator's ``cos_cache``/``sin_cache``:
    angle ``p * inv_freq[i]`` computed in fp32 (as Hugging Face does), times ``attention_scaling``
    (1 except for YaRN-like schemes)."""
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64).float()
    angles = positions[:, None] * inv_freq[None, :]
    return (angles.cos() * attention_scaling).contiguous(), (angles.sin() * attention_scaling).contiguous()


class RopeTables(nn.Module):
    """fp32 cos/sin tables ``[max_positions, R/2]`` for the operator, as non-persistent buffers.

    They stay fp32 when the owning model is cast to fp16/bf16 (the operator accepts fp32 tables
    with a half-precision query and rounds once), and :meth:`ensure` grows them on demand.
    """

    def __init__(self, inv_freq: Tensor, max_positions: int, attention_scaling: float = 1.0,
                 device: Union[str, torch.device, None] = None) -> None:
        super().__init__()
        inv_freq = inv_freq.detach().to(torch.float32).reshape(-1)
        self.attention_scaling = float(attention_scaling)
        self.max_positions = int(max_positions)
        self._inv_freq_master = inv_freq.cpu()  # not a buffer: casts of the model never touch it
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        cos, sin = rope_tables(self.inv_freq, self.max_positions, self.attention_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def rotary_dim(self) -> int:
        """``R``: twice the number of frequencies."""
        return 2 * self.inv_freq.numel()

    def ensure(self, max_positions: int) -> None:
        """Grows the tables to at least ``max_positions`` rows (host-side; call it outside of
        graphs and compiled regions, e.g. when a cache is created)."""
        if max_positions > self.max_positions:
            self.max_positions = int(max_positions)
            self._rebuild()

    def _rebuild(self) -> None:
        device = self.cos.device
        self.inv_freq = self._inv_freq_master.to(device)
        self.cos, self.sin = rope_tables(self.inv_freq, self.max_positions, self.attention_scaling, device=device)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if self.cos.dtype != torch.float32 or self.inv_freq.dtype != torch.float32:
            self._rebuild()  # a cast to fp16/bf16 must not round the RoPE tables
        return self

    def extra_repr(self) -> str:
        """The table's shape facts, for ``print(model)``."""
        return f"rotary_dim={self.rotary_dim}, max_positions={self.max_positions}, attention_scaling={self.attention_scaling}"


class _HeadRMSNorm(nn.Module):
    """RMSNorm over the head dim (Qwen3's q_norm/k_norm): fp32 statistics, weight in the input dtype."""

    def __init__(self, head_dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalises the last dim of ``x``."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GroupQueryAttention(nn.Module):
    """Grouped-query self-attention on the fused in-place operator.

    Args:
        hidden_size: model width.
        num_heads, num_kv_heads: query heads ``Hq`` and KV heads ``Hkv`` (``Hq % Hkv == 0``).
        head_dim: ``D`` (default ``hidden_size // num_heads``).
        qkv_bias, out_bias: biases of the fused QKV projection and of the output projection.
        qk_norm, qk_norm_eps: per-head RMSNorm of q and k before RoPE (Qwen3).
        do_rotary: apply RoPE inside the operator.
        rope_theta, rope_scaling: see :func:`rope_inv_freq`.
        partial_rotary_factor: the fraction of ``D`` that rotates (``R = D * factor``, even).
        rotary_interleaved: pairs ``(2i, 2i+1)`` instead of ``(i, i + R/2)``.
        max_position_embeddings: rows of the cos/sin tables (largest position + 1).
        rope_inv_freq, rope_attention_scaling: explicit inverse frequencies ``[R/2]`` and cos/sin
            scale, for schemes not covered by ``rope_scaling`` (e.g. YaRN from Hugging Face).
        local_window_size: ``-1`` (off) or ``W``: each query sees ``W`` keys including itself.
        softcap: ``0`` (off) or ``c``: logits ``c * tanh(x / c)``.
        smooth_softmax: adds a logit 0 to each softmax denominator.
        head_sink: learn one sink logit per query head (gpt-oss); an fp32 parameter ``[Hq]``.
        scale: logit scale; ``0`` means ``1/sqrt(D)``.

    The cos/sin tables (``self.rope``, a :class:`RopeTables`) stay fp32 when the module is cast
    to fp16/bf16.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: Optional[int] = None,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        do_rotary: bool = True,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[Dict[str, Any]] = None,
        partial_rotary_factor: float = 1.0,
        rotary_interleaved: bool = False,
        max_position_embeddings: int = 4096,
        rope_inv_freq: Optional[Tensor] = None,
        rope_attention_scaling: float = 1.0,
        local_window_size: int = -1,
        softcap: float = 0.0,
        smooth_softmax: bool = False,
        head_sink: bool = False,
        scale: float = 0.0,
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"GroupQueryAttention: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = head_dim or hidden_size // num_heads
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.local_window_size = int(local_window_size) if local_window_size and local_window_size > 0 else -1
        self.softcap, self.smooth_softmax, self.scale = float(softcap or 0.0), bool(smooth_softmax), float(scale or 0.0)
        self.do_rotary, self.rotary_interleaved = bool(do_rotary), bool(rotary_interleaved)
        factory = {"device": device, "dtype": dtype}
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias, **factory)
        self.q_norm = _HeadRMSNorm(head_dim, qk_norm_eps, **factory) if qk_norm else None
        self.k_norm = _HeadRMSNorm(head_dim, qk_norm_eps, **factory) if qk_norm else None
        self.head_sink = nn.Parameter(torch.zeros(num_heads, device=device, dtype=torch.float32)) if head_sink else None

        if rope_inv_freq is None:
            rotary_dim = int(head_dim * partial_rotary_factor)
            rotary_dim -= rotary_dim % 2
            rope_inv_freq = _default_inv_freq(rotary_dim, rope_theta, rope_scaling)
        if 2 * rope_inv_freq.numel() > head_dim:
            raise ValueError(f"GroupQueryAttention: rotary dim {2 * rope_inv_freq.numel()} exceeds head_dim {head_dim}")
        self.rope = RopeTables(rope_inv_freq, max_position_embeddings, rope_attention_scaling, device=device)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if self.head_sink is not None and self.head_sink.dtype != torch.float32:
            self.head_sink.data = self.head_sink.data.float()  # the operator takes fp32 sinks
        return self

    def extra_repr(self) -> str:
        """Heads, head size and the attention attributes that are on, for ``print(model)``."""
        parts = [f"heads={self.num_heads}", f"kv_heads={self.num_kv_heads}", f"head_dim={self.head_dim}",
                 f"rotary_dim={self.rope.rotary_dim if self.do_rotary else 0}"]
        if self.rotary_interleaved:
            parts.append("interleaved")
        if self.local_window_size > 0:
            parts.append(f"window={self.local_window_size}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.smooth_softmax:
            parts.append("smooth_softmax")
        if self.scale:
            parts.append(f"scale={self.scale}")
        return ", ".join(parts)

    def new_cache(self, num_layers: int, batch_size: int, capacity: int, kv_layout: int = 0) -> KVCache:
        """A :class:`KVCache` that fits this module (its KV heads, head dim, dtype and device)."""
        weight = self.qkv_proj.weight
        return KVCache(num_layers, batch_size, self.num_kv_heads, self.head_dim, capacity,
                       dtype=weight.dtype, device=weight.device, kv_layout=kv_layout)

    def _attributes(self) -> Dict[str, Any]:
        return dict(num_heads=self.num_heads, kv_num_heads=self.num_kv_heads, scale=self.scale,
                    do_rotary=self.do_rotary, rotary_interleaved=self.rotary_interleaved,
                    local_window_size=self.local_window_size, softcap=self.softcap,
                    smooth_softmax=self.smooth_softmax)

    def _project(self, hidden_states: Tensor):
        packed = self.qkv_proj(hidden_states)
        if self.q_norm is None:
            return packed, None, None
        B, S, _ = packed.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = packed.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = self.q_norm(q.reshape(B, S, Hq, D)).reshape(B, S, Hq * D)
        k = self.k_norm(k.reshape(B, S, Hkv, D)).reshape(B, S, Hkv * D)
        return q, k, v

    def forward(
        self,
        hidden_states: Tensor,
        cache: Optional[KVCache] = None,
        layer_idx: int = 0,
        *,
        position_ids: Optional[Tensor] = None,
        valid_lengths: Optional[Union[Tensor, int]] = None,
    ) -> Tensor:
        """Attention over ``hidden_states`` ``[B, S, hidden]``; returns ``[B, S, hidden]``.

        With a ``cache``, the ``S`` new tokens of every row are appended at the row's current
        length in layer ``layer_idx`` and attend to everything before them (decode, chunked or
        batched prefill). ``valid_lengths`` (int or int tensor ``[B]``, default ``S``) is how many
        of them each row keeps: pass the prompt lengths of a right-padded prefill. Without a
        cache the call is a plain causal self-attention over the ``S`` tokens.

        ``position_ids`` (int64 ``[B, S]``) overrides the RoPE positions; by default a token's
        position is its slot in the cache. The call reads no device value on the host except the
        capacity check described in :mod:`gqa_torch.cache` (skipped while compiling/capturing).
        """
        q, k, v = self._project(hidden_states)
        B, S, _ = hidden_states.shape
        cos, sin = (self.rope.cos, self.rope.sin) if self.do_rotary else (None, None)
        if position_ids is not None:
            position_ids = position_ids.to(torch.int64).expand(B, S).contiguous()
        sink = None if self.head_sink is None else self.head_sink.float()
        if cache is None:
            seqlens = torch.full((B,), S - 1, dtype=torch.int32, device=hidden_states.device)
            out, _, _ = group_query_attention(q, k, v, None, None, seqlens, S, cos, sin, position_ids, sink,
                                              **self._attributes())
        else:
            self._check_cache(cache, B)
            seqlens = cache.seqlens_k(layer_idx, S)
            key_cache, value_cache = cache.layer(layer_idx)
            out = group_query_attention_(q, k, v, key_cache, value_cache, seqlens, cos, sin, position_ids, sink,
                                         kv_layout=cache.kv_layout, **self._attributes())
            cache.advance(layer_idx, S if valid_lengths is None else valid_lengths)
        return self.o_proj(out)

    def _check_cache(self, cache: KVCache, batch: int) -> None:
        if (cache.kv_heads, cache.head_dim, cache.batch_size) != (self.num_kv_heads, self.head_dim, batch):
            raise ValueError(
                f"GroupQueryAttention: the cache has kv_heads={cache.kv_heads}, head_dim={cache.head_dim}, "
                f"batch={cache.batch_size}; this call needs kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"batch={batch}")

    # ---- Hugging Face ----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, attn_layer: nn.Module, config: Any, layer_idx: Optional[int] = None,
                max_position_embeddings: Optional[int] = None) -> "GroupQueryAttention":
        """Builds the module from a Hugging Face Llama-style attention layer (``q_proj``,
        ``k_proj``, ``v_proj``, ``o_proj``; Llama, Mistral, Qwen2, Qwen3, Gemma2 and kin) and its
        model ``config``, copying the weights (fused into one QKV projection).

        Taken over: biases, the layer's ``scaling`` (Gemma2's ``query_pre_attn_scalar``), the
        sliding window of the layer (``layer.sliding_window``, or ``config.sliding_window`` for
        Mistral-style models that slide everywhere), ``attn_logit_softcapping``, Qwen3's
        ``q_norm``/``k_norm``, and RoPE from ``config`` (theta, partial rotary factor, and any
        static scaling through transformers' own ``ROPE_INIT_FUNCTIONS``). Dynamic RoPE
        (``dynamic``, ``longrope``) is refused: its frequencies depend on the sequence length.
        """
        layer_idx = getattr(attn_layer, "layer_idx", 0) if layer_idx is None else layer_idx
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(attn_layer, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
        projections = [attn_layer.q_proj, attn_layer.k_proj, attn_layer.v_proj]
        weight = attn_layer.q_proj.weight
        qkv_bias = any(p.bias is not None for p in projections)
        out_bias = attn_layer.o_proj.bias is not None
        if getattr(attn_layer, "is_causal", True) is False:
            raise ValueError("GroupQueryAttention.from_hf: bidirectional attention layers are not supported")
        if hasattr(attn_layer, "sliding_window"):
            window = attn_layer.sliding_window
        else:
            window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        inv_freq, attention_scaling = hf_rope_parameters(config, head_dim)
        qk_norm = getattr(attn_layer, "q_norm", None) is not None and getattr(attn_layer, "k_norm", None) is not None
        eps = 1e-6
        if qk_norm:
            eps = getattr(attn_layer.q_norm, "variance_epsilon", getattr(attn_layer.q_norm, "eps", eps))
        module = cls(
            config.hidden_size, heads, kv_heads, head_dim,
            qkv_bias=qkv_bias, out_bias=out_bias, qk_norm=qk_norm, qk_norm_eps=eps,
            max_position_embeddings=max_position_embeddings or getattr(config, "max_position_embeddings", 4096),
            rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling,
            local_window_size=window if window else -1,
            softcap=getattr(attn_layer, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None) or 0.0,
            scale=float(getattr(attn_layer, "scaling", 0.0) or 0.0),
            device=weight.device, dtype=weight.dtype,
        )
        with torch.no_grad():
            module.qkv_proj.weight.copy_(torch.cat([p.weight for p in projections], dim=0))
            if qkv_bias:
                module.qkv_proj.bias.copy_(torch.cat([
                    p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=weight.dtype, device=weight.device)
                    for p in projections]))
            module.o_proj.weight.copy_(attn_layer.o_proj.weight)
            if out_bias:
                module.o_proj.bias.copy_(attn_layer.o_proj.bias)
            if qk_norm:
                module.q_norm.weight.copy_(attn_layer.q_norm.weight)
                module.k_norm.weight.copy_(attn_layer.k_norm.weight)
        return module


def hf_rope_parameters(config: Any, head_dim: int) -> Tuple[Tensor, float]:
    """``(inv_freq fp32 [R/2], attention_scaling)`` of a Hugging Face config, for transformers 4.4x
    (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``). Static schemes only."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict) or (params and not any(k in params for k in ("rope_theta", "rope_type"))):
        params = {}  # per-layer-type dicts (e.g. Gemma3) are not handled here
    merged = {**scaling, **params} if isinstance(scaling, dict) else dict(params)
    kind = merged.get("rope_type") or merged.get("type") or "default"
    theta = merged.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = merged.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = int(head_dim * factor)
    rotary_dim -= rotary_dim % 2
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"gqa_torch: RoPE type {kind!r} depends on the sequence length; it is not supported by the fused op")
    if kind == "default":
        return rope_inv_freq(rotary_dim, theta), 1.0
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:  # transformers missing: our own formulas for what they cover
        return rope_inv_freq(rotary_dim, theta, merged), 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float().cpu(), float(attention_scaling)
