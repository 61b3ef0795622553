"""Hugging Face ``transformers`` integration (imported on demand: ``import gqa_torch.hf``).

Two routes, both honouring left-padded batched ``generate()`` (HF's default for decoders):

**Fused route**: :func:`enable` ``(model)``. The attention layers of the Llama, Mistral, Ministral,
Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma, Gemma2, Gemma3, Phi (1, 1.5, 2), Phi3, PhiMoE,
Granite, Granite-MoE, Granite-MoE-Shared, OLMo, OLMo2, OLMo3, OLMoE, SmolLM3, Starcoder2, Exaone4,
Cohere (Command-R), Cohere2, GLM, GLM4, GLM4-MoE, StableLM, Nemotron, Seed-OSS, Apertus, Arcee,
Helium, ERNIE 4.5, ERNIE 4.5 MoE, dots.llm1 and gpt-oss families
(:data:`SUPPORTED_ATTENTION_CLASSES`) are patched so that RoPE, the KV-cache append and attention
run in one ``gqa::group_query_attention_`` call on a :class:`GQACache` (a transformers ``Cache``
holding a static :class:`gqa_torch.KVCache`). ``generate()`` creates that cache by itself. Handled:
sliding windows (one for every layer, alternating or per-layer), Gemma2's
``attn_logit_softcapping``, the layer's own scale (``query_pre_attn_scalar``, Granite's
``attention_multiplier``), q/k norms before RoPE per head (Qwen3, Gemma3; Phi's LayerNorm, Cohere's
with weights a head) or over the whole projection (OLMo2, OLMoE), OLMo's ``clip_qkv``, QKV biases
(Qwen2, gpt-oss), gpt-oss's learned per-head sinks, partial RoPE (Phi, Phi3, StableLM, Nemotron),
interleaved RoPE (Cohere, Cohere2, Helium, ERNIE 4.5; GLM's also partial), one RoPE table a layer
type (Gemma3's local and global bases) and layers without RoPE (SmolLM3, and the full layers of
Exaone4 and Cohere2). The Q, K and V projections are fused into one GEMM (no extra memory: the three
weights become views of the fused one); Phi3's is one already.

Left padding is turned into per-row lengths: each row is *compacted* so its real tokens start
at cache slot 0. In a call with ``S`` new tokens, each row's real tokens (the ones the 2D
``attention_mask`` marks) are moved to the front of the chunk, the operator writes all ``S``
slots at the row's current length, and the row's length grows by its real tokens only; the
padding slots after them are overwritten by the next tokens and are never visible to a real
query (causality). RoPE uses HF's ``position_ids`` (``cumsum(attention_mask) - 1`` in
``generate``), which for a compacted row equal the cache slots. The outputs of padding positions
are meaningless, exactly as in HF.

**Generic route**: ``attn_implementation="gqa"`` (registered in transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` when this module is imported, or by
:func:`register`). Any decoder whose attention calls the interface then runs its attention
through the in-place operator, with HF doing RoPE and owning the cache (dynamic, static or
sliding); the tests run it on every patched family. The mask function hands the attention a
small int8 description of every key slot (empty / past / new / new padding); the attention
gathers each row's valid keys to the front of a scratch copy and calls the operator with per-row
lengths. It is correct for any HF cache, but it copies the visible K/V each call: the fused route
is the fast one.

Layers patched by :func:`enable` fall back to the generic route when they are called with a
cache that is not a :class:`GQACache` (e.g. a plain ``model(input_ids)``, which makes a
``DynamicCache``) or with no cache.

Limits: causal decoders only; no dropout; no packed (padding-free) sequences; the fused route
keeps its RoPE tables and ``GQACache`` on one device, so :func:`enable` leaves a model split
across devices (``device_map``) on the generic route; RoPE must have static frequencies (not
``dynamic``/``longrope``); masks are expected in HF's left-padding form
(padding before the tokens of a row). ``GQACache`` has a fixed batch: beam search works
(``reorder_cache``), batch expansion/selection of a filled cache do not. Assisted decoding
(``assistant_model``, ``prompt_lookup_num_tokens``) works: ``crop`` removes columns that were real
tokens of every row, which is what it rolls back.
"""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from . import build_info
from .cache import KVCache
from .module import RopeTables
from .ops import cuda_kernels_available, group_query_attention_

Tensor = torch.Tensor

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GQACache",
    "SUPPORTED_ATTENTION_CLASSES",
    "disable",
    "enable",
    "gqa_attention_forward",
    "gqa_mask",
    "register",
]

ATTN_IMPLEMENTATION = "gqa"

#: Attention classes that :func:`enable` patches to the fused route.
SUPPORTED_ATTENTION_CLASSES = (
    "LlamaAttention", "MistralAttention", "MinistralAttention", "MixtralAttention",
    "Qwen2Attention", "Qwen2MoeAttention", "Qwen3Attention", "Qwen3MoeAttention", "GemmaAttention",
    "Gemma2Attention", "Gemma3Attention", "GptOssAttention", "PhiAttention", "Phi3Attention",
    "PhimoeAttention", "GraniteAttention", "GraniteMoeAttention", "GraniteMoeSharedAttention",
    "OlmoAttention", "Olmo2Attention", "Olmo3Attention", "OlmoeAttention", "SmolLM3Attention",
    "Starcoder2Attention", "Exaone4Attention", "CohereAttention", "Cohere2Attention",
    "GlmAttention", "Glm4Attention", "Glm4MoeAttention", "StableLmAttention", "NemotronAttention",
    "SeedOssAttention", "ApertusAttention", "ArceeAttention", "HeliumAttention",
    "Ernie4_5Attention", "Ernie4_5_MoeAttention", "Dots1Attention")

# Attention classes whose RoPE rotates pairs (2i, 2i + 1) instead of (i, i + R/2).
_INTERLEAVED_ROPE_CLASSES = ("Cohere2Attention", "Glm4Attention", "HeliumAttention", "Ernie4_5Attention",
                             "CohereAttention", "GlmAttention", "Ernie4_5_MoeAttention")

# The default of gqa_attention_forward's sliding_window: the layer did not pass one (None, passed,
# means no window).
_NOT_PASSED = object()

# Key-slot states written by gqa_mask and read by the attention functions.
EMPTY, PAST, NEW, NEW_PAD = 0, 1, 2, 3

# transformers 5.24 renamed the cache argument of the model, decoder-layer and attention forwards and of
# generation (``past_key_values`` -> ``cache``; the old name still works there, with a FutureWarning).
# The name in use is read off the signature of the function that takes it, not off the version.
_CACHE_ARG, _OLD_CACHE_ARG = "cache", "past_key_values"


def _cache_arg_name(fn: Callable) -> str:
    """The name under which ``fn`` (an HF forward or ``prepare_inputs_for_generation``) takes the cache."""
    return _CACHE_ARG if _CACHE_ARG in inspect.signature(fn).parameters else _OLD_CACHE_ARG


# ---- the mask function ----------------------------------------------------------------------

def gqa_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
             mask_function: Optional[Callable] = None, attention_mask: Optional[Tensor] = None,
             device=None, **kwargs) -> Tensor:
    """transformers mask function of ``attn_implementation="gqa"``.

    Instead of a dense ``[B, 1, S, K]`` mask it returns an int8 ``[B, 1, 1, K]`` tensor that
    describes the ``K = kv_length`` key slots the attention will get: ``EMPTY`` (padding or not
    yet written), ``PAST`` (a valid earlier token), ``NEW`` (a token of this call) or ``NEW_PAD``
    (a padding token of this call). Causality and windows are the operator's job; the
    ``mask_function`` pattern (causal / sliding) is therefore not materialised. Being 4D, it
    passes through transformers' mask preprocessing untouched. Sync-free (``q_offset`` and
    ``kv_offset`` may be device tensors, as static caches give them).

    Returns ``None`` (all slots valid) when there is no ``attention_mask`` and the slots are
    exactly this call's tokens.
    """
    if attention_mask is None and kv_length == q_length and (
            isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor) or q_offset == kv_offset):
        # The key slots are exactly this call's tokens and none is padding (an empty cache, no
        # cache, or a GQACache without padding): None says "all valid" at no cost.
        return None
    if device is None:
        device = attention_mask.device if attention_mask is not None else "cpu"
    cols = torch.arange(kv_length, device=device)
    if isinstance(kv_offset, Tensor):
        cols = cols + kv_offset.to(device)
    elif kv_offset:
        cols = cols + int(kv_offset)
    if isinstance(q_offset, Tensor):
        q_offset = q_offset.to(device)
    end = q_offset + q_length
    is_new = (cols >= q_offset) & (cols < end)
    if attention_mask is None:
        valid = (cols < end)[None, :].expand(batch_size, kv_length)
    else:
        if attention_mask.dim() != 2:
            raise ValueError(f"gqa mask: expected a 2D attention_mask, got shape {list(attention_mask.shape)}")
        mask = attention_mask.to(device=device, dtype=torch.bool).expand(batch_size, -1)
        width = mask.shape[-1]
        index = cols.clamp(max=width - 1)[None, :].expand(batch_size, kv_length)
        valid = mask.gather(1, index) & (cols < width)[None, :]
    new_state = torch.where(valid, NEW, NEW_PAD)
    old_state = torch.where(valid, PAST, EMPTY)
    state = torch.where(is_new[None, :], new_state, old_state).to(torch.int8)
    return state.view(batch_size, 1, 1, kv_length)


def _slot_state(attention_mask: Optional[Tensor], batch: int, keys: int, queries: int, where: str) -> Tensor:
    """The ``[B, K]`` slot states from :func:`gqa_mask`; ``None`` means all valid, new ones last."""
    if attention_mask is None:
        state = torch.full((batch, keys), PAST, dtype=torch.int8)
        state[:, keys - queries:] = NEW
        return state
    if attention_mask.dtype != torch.int8 or attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"gqa ({where}): expected the mask made by gqa_torch.hf.gqa_mask (int8 [B, 1, 1, K]), got "
            f"{attention_mask.dtype} {list(attention_mask.shape)}. Custom 4D masks are not supported by "
            "attn_implementation='gqa'.")
    if attention_mask.shape[-1] != keys:
        raise ValueError(f"gqa ({where}): the mask describes {attention_mask.shape[-1]} key slots, the keys have {keys}")
    return attention_mask.reshape(attention_mask.shape[0], keys).expand(batch, keys)


def _gather_rows(x: Tensor, order: Tensor) -> Tensor:
    """``x[b, order[b, s], ...]`` for ``x`` ``[B, S, ...]`` and ``order`` ``[B, S]``."""
    index = order.reshape(*order.shape, *([1] * (x.dim() - 2))).expand(*order.shape, *x.shape[2:])
    return x.gather(1, index)


# ---- the generic attention function ----------------------------------------------------------

def gqa_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, sliding_window: Any = _NOT_PASSED,
                          softcap: Optional[float] = None, s_aux: Optional[Tensor] = None,
                          is_causal: Optional[bool] = None, **kwargs) -> Tuple[Tensor, None]:
    """transformers attention function of ``attn_implementation="gqa"`` (the generic route).

    ``query`` ``[B, Hq, S, D]`` (RoPE applied by the model), ``key``/``value`` ``[B, Hkv, K, D]``
    (what the HF cache returned), ``attention_mask`` from :func:`gqa_mask`. Supports
    ``scaling``, ``sliding_window``, ``softcap`` and ``s_aux`` (per-head sinks, as gpt-oss
    passes them). Returns ``(output [B, S, Hq, D], None)``: no attention weights.

    Each row's valid key slots are gathered to the front of a scratch K/V copy and the new
    tokens' real rows to the front of the query chunk; the in-place operator then runs with
    per-row lengths (``seqlens_k = valid past + S - 1``) on the scratch copy, and the output
    rows are put back in place. HF's own cache tensors are never written.
    """
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError("gqa: attn_implementation='gqa' supports causal (decoder) attention only")
    if dropout and module.training:
        raise ValueError("gqa: attention dropout is not supported (attn_implementation='gqa' is for inference)")
    B, Hq, S, D = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    if key.shape[-1] != D or value.shape[-1] != D:
        raise ValueError(f"gqa: query, key and value must share the head size, got {D}, {key.shape[-1]}, {value.shape[-1]}")
    state = _slot_state(attention_mask, B, K, S, "attention").to(query.device)

    valid = (state == PAST) | (state == NEW)
    new_valid = state == NEW
    past = valid.sum(-1) - new_valid.sum(-1)  # valid keys before the real new tokens, per row
    new_start = (state >= NEW).to(torch.int8).argmax(-1)
    chunk_cols = new_start[:, None] + torch.arange(S, device=query.device)[None, :]

    # Scratch K/V: each row's valid slots first, in order.
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    index = order[:, None, :, None].expand(B, Hkv, K, D)
    key_cache, value_cache = key.gather(2, index), value.gather(2, index)

    q = query.transpose(1, 2).reshape(B, S, Hq * D)
    q_order = None
    if S > 1:  # real new tokens first (left padding puts the padding first)
        chunk_state = state.long().gather(1, chunk_cols.clamp(max=K - 1))
        q_order = torch.argsort((chunk_state != NEW).to(torch.int8), dim=-1, stable=True)
        q = _gather_rows(q, q_order)
    # The new rows the operator appends are the ones already in the scratch copy (identity
    # writes); rows past the valid ones belong to padding queries only.
    slots = (past[:, None] + torch.arange(S, device=query.device)[None, :]).clamp(max=K - 1)
    slot_index = slots[:, None, :, None].expand(B, Hkv, S, D)
    k_new = key_cache.gather(2, slot_index).transpose(1, 2).reshape(B, S, Hkv * D)
    v_new = value_cache.gather(2, slot_index).transpose(1, 2).reshape(B, S, Hkv * D)
    seqlens_k = (past + (S - 1)).to(torch.int32)
    sink = None if s_aux is None else s_aux.float().reshape(Hq).contiguous()
    if sliding_window is _NOT_PASSED:  # Qwen2-MoE and PhiMoE window through the mask alone
        window = _layer_window(module, getattr(module, "config", None))
    else:
        window = int(sliding_window) if sliding_window else -1
    out = group_query_attention_(
        q, k_new, v_new, key_cache, value_cache, seqlens_k, None, None, None, sink,
        num_heads=Hq, kv_num_heads=Hkv, scale=float(scaling or 0.0), local_window_size=window,
        softcap=float(softcap or 0.0))
    if q_order is not None:
        out = _gather_rows(out, torch.argsort(q_order, dim=-1))
    return out.view(B, S, Hq, D), None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Registers ``name`` (default ``"gqa"``) with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``; idempotent. Then ``from_pretrained(..., attn_implementation="gqa")``
    or ``model.set_attn_implementation("gqa")`` selects the generic route. Returns ``name``."""
    AttentionInterface.register(name, gqa_attention_forward)
    AttentionMaskInterface.register(name, gqa_mask)
    return name


# ---- the cache of the fused route -------------------------------------------------------------

class _GQACacheLayer(CacheLayerMixin):
    """One layer's view of a :class:`GQACache` for transformers' bookkeeping; written only by the
    fused attention (``update`` is refused)."""

    is_compileable = True
    is_croppable = True  # GQACache.crop, for batches without padding in the removed columns
    is_sliding = False

    def __init__(self, parent: "GQACache", layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        kv = parent.kv
        self.keys, self.values = kv.layer(layer_idx)
        self.is_initialized = True
        self.batch_size, self.num_heads = kv.batch_size, kv.kv_heads
        self.max_cache_len = kv.capacity
        self.dtype, self.device = kv.dtype, kv.device
        self._seen = parent.seen

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to do: the storage is allocated with the GQACache."""
        return None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        """Refused: a GQACache is filled by the fused attention of :func:`enable`."""
        raise NotImplementedError(
            "GQACache is written by the fused gqa attention (gqa_torch.hf.enable); this attention layer is not "
            "patched. Use an HF cache (DynamicCache/StaticCache) with attn_implementation='gqa' for it instead.")

    def get_mask_sizes(self, query_length: int) -> Tuple[int, Tensor]:
        """See :meth:`GQACache.get_mask_sizes`."""
        return query_length, self._seen[self.layer_idx]

    def get_seq_length(self) -> Tensor:
        """See :meth:`GQACache.get_seq_length`."""
        return self._seen[self.layer_idx]

    def get_max_length(self) -> int:
        """The capacity."""
        return self.max_cache_len

    def reset(self) -> None:
        """Nothing: :meth:`GQACache.reset` resets every layer at once."""
        return None


class GQACache(Cache):
    """A transformers ``Cache`` for the fused route: a static :class:`gqa_torch.KVCache` (one per
    model, every layer) whose rows are compacted (real tokens from slot 0, see the module doc).

    ``get_seq_length()`` counts the columns the model has been fed (padding included), as HF's
    caches do, as a device tensor (like HF's ``StaticCache``, so compiled steps never sync).
    ``generate()`` on an :func:`enable`-d model creates one sized ``batch * beams`` by
    ``max_length - 1``; build one yourself with :meth:`for_model` to reuse it across calls.
    """

    def __init__(self, *, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, max_cache_len: int,
                 dtype: torch.dtype = torch.float32, device=None, kv_layout: int = 0) -> None:
        self.kv = KVCache(num_layers, batch_size, kv_heads, head_dim, max_cache_len, dtype=dtype, device=device,
                          kv_layout=kv_layout)
        self.seen = torch.zeros(num_layers, dtype=torch.int64, device=self.kv.device)
        # Trailing columns that were a real token of every row (what crop may remove), counted at
        # the first layer: every layer is fed the same columns with the same mask.
        self.pad_free_columns = torch.zeros((), dtype=torch.int64, device=self.kv.device)
        if self.kv.device.type == "cuda":
            torch._dynamo.mark_static_address(self.seen)
            torch._dynamo.mark_static_address(self.pad_free_columns)
        super().__init__(layers=[_GQACacheLayer(self, i) for i in range(num_layers)])

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_cache_len: int, *, kv_layout: int = 0,
                  dtype: Optional[torch.dtype] = None, device=None) -> "GQACache":
        """A cache that fits ``model`` (its text config's layers, KV heads, head dim, and the dtype and
        device of its parameters). Grows the model's RoPE tables when ``max_cache_len`` needs it."""
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        param = next(model.parameters())
        cache = cls(num_layers=config.num_hidden_layers, batch_size=batch_size,
                    kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                    max_cache_len=max_cache_len, dtype=dtype or param.dtype, device=device or param.device,
                    kv_layout=kv_layout)
        state = getattr(model, "_gqa_state", None)
        if state is not None:
            for table in state.rope.values():
                table.ensure(max_cache_len)
        return cache

    # Cache API -----------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> Tensor:
        """Columns fed so far to ``layer_idx`` (padding included), as a 0-dim device tensor."""
        return self.seen[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, Tensor]:
        """The mask covers only this call's tokens: ``(query_length, columns seen)``."""
        return query_length, self.seen[layer_idx]

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        """The fixed capacity of every layer."""
        return self.kv.capacity

    def reset(self) -> None:
        """Empties every row (lengths and column counters to 0), in place."""
        self.kv.reset()
        self.seen.zero_()
        self.pad_free_columns.zero_()

    def reset_rows(self, rows) -> None:
        """Empties some rows (see :meth:`gqa_torch.KVCache.reset_rows`). The column counter is shared
        by the batch, so feed restarted rows with explicit ``position_ids``."""
        self.kv.reset_rows(rows)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row ``b`` becomes old row ``beam_idx[b]`` (in place)."""
        self.kv.reorder(beam_idx)

    def crop(self, tokens_to_remove: Union[int, Tensor]) -> None:
        """Drops the last columns fed to every layer (assisted decoding rolls back the draft
        tokens the model rejected). ``tokens_to_remove <= 0`` removes that many columns; a positive
        value is the number of columns to keep (transformers' older convention). An int, or a
        one-element tensor (transformers 5.17 passes one).

        Rows are compacted, so a column is one slot of every row only where no row had padding
        in it; cropping into columns where some row had padding (a left-padded prompt) raises
        ``ValueError``. It reads the small column counters on the host (device syncs), as
        assisted decoding does anyway between its steps."""
        tokens_to_remove = int(tokens_to_remove)
        seen = int(self.seen.max())
        keep = seen + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        remove = seen - keep
        if remove <= 0:
            return
        if keep < 0 or int(self.seen.min()) != seen:
            raise ValueError(f"GQACache.crop: cannot remove {remove} of the {seen} columns fed "
                             f"(layers fed {self.seen.tolist()} columns)")
        pad_free = int(self.pad_free_columns)
        if pad_free < remove:
            raise ValueError(
                f"GQACache.crop: the last {remove} columns are not real tokens of every row (only the last "
                f"{pad_free} are; rows are compacted, so columns that held padding for some row cannot be "
                "removed). Crop batches without padding, as assisted decoding feeds them.")
        self.kv.lengths.sub_(remove)
        self.seen.sub_(remove)
        self.pad_free_columns.sub_(remove)

    def _note_columns(self, columns: int, real_tokens: Union[int, Tensor]) -> None:
        """After the first layer was fed ``columns`` columns, of which each row kept
        ``real_tokens`` (its last ones): how many trailing columns are real for every row."""
        tail = self.pad_free_columns
        if isinstance(real_tokens, int):
            if real_tokens == columns:
                tail.add_(columns)
            else:
                tail.fill_(real_tokens)
            return
        fewest = real_tokens.min().to(tail.dtype)
        tail.copy_(torch.where(fewest == columns, tail + columns, fewest))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported (the batch is fixed): raises ``NotImplementedError``."""
        raise NotImplementedError("GQACache has a fixed batch; allocate it with the expanded batch size")

    def batch_select_indices(self, indices: Tensor) -> None:
        """Not supported (the batch is fixed): raises ``NotImplementedError``."""
        raise NotImplementedError("GQACache has a fixed batch; use reorder_cache or reset_rows")

    def __repr__(self) -> str:
        return f"GQACache({self.kv!r})"


# ---- the fused route ------------------------------------------------------------------------------

def _layer_window(module: nn.Module, config: Any) -> int:
    """The sliding window of an HF attention layer (-1: none), wherever its family keeps it: on
    the layer, in the config for the layer's type, or in the config for every layer."""
    layer_types = getattr(config, "layer_types", None)
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif layer_types is not None:  # Qwen2-MoE sets the attribute on its sliding layers only
        window = config.sliding_window if layer_types[module.layer_idx] == "sliding_attention" else None
    else:  # Mistral, Mixtral, Phi3, PhiMoE, Starcoder2: one window for every layer
        window = getattr(config, "sliding_window", None)
    if getattr(module, "is_sliding", None) is False:  # Exaone4 keeps the window on its full layers too
        window = None
    return int(window) if window else -1


class _FusedAttention:
    """Per-layer constants of a patched HF attention module (plain Python, read at trace time)."""

    def __init__(self, module: nn.Module, config: Any, rope: Optional[RopeTables], original_forward: Callable,
                 fuse_qkv: bool) -> None:
        self.original_forward = original_forward
        self.cache_arg = _cache_arg_name(original_forward)
        self.rope = rope  # None: a layer without RoPE (see _layer_rope)
        self.num_heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = module.head_dim
        self.scale = float(getattr(module, "scaling", 0.0) or 0.0)
        self.window = _layer_window(module, config)
        self.softcap = float(getattr(module, "attn_logit_softcapping", None) or 0.0)
        # Submodules are looked up by name at each call, so that one replaced after enable() (a
        # quantized or adapter-wrapped projection) is the one called. Phi (1, 1.5, 2) names its
        # per-head LayerNorms q/k_layernorm (present when qk_layernorm is set) and its output
        # projection dense; the other families q/k_norm and o_proj.
        norms = ("q_norm", "k_norm") if hasattr(module, "q_norm") else ("q_layernorm", "k_layernorm")
        self.qk_norm = all(getattr(module, name, None) is not None for name in norms)
        self.q_norm_name, self.k_norm_name = norms
        # OLMo2 normalises the whole projection; Qwen3, Gemma3 and Cohere (weights a head) each head.
        self.qk_norm_whole = self.qk_norm and _norm_width(getattr(module, norms[0])) == self.num_heads * self.head_dim
        self.out_proj_name = "o_proj" if hasattr(module, "o_proj") else "dense"
        clip = getattr(config, "clip_qkv", None)
        self.clip_qkv = float(clip) if clip is not None else None
        # gpt-oss: one learned sink logit per query head, read each call (the weights may be reloaded).
        self.has_sink = isinstance(getattr(module, "sinks", None), Tensor)
        self.rotary_interleaved = type(module).__name__ in _INTERLEAVED_ROPE_CLASSES
        self.packed_proj = isinstance(getattr(module, "qkv_proj", None), nn.Linear)  # Phi3: one QKV Linear
        self.fused = not self.packed_proj and fuse_qkv and _fuse_projections(module)

    def project(self, module: nn.Module, hidden_states: Tensor):
        """``(q, k, v)`` ``[B, S, H*D]``; ``k = v = None`` when q is the packed QKV."""
        q, k, v = self._project(module, hidden_states)
        if self.clip_qkv is not None:  # OLMo, OLMoE: after the norms, before RoPE, q, k and v alike
            c = self.clip_qkv
            q = q.clamp(-c, c)
            k, v = (None, None) if k is None else (k.clamp(-c, c), v.clamp(-c, c))
        return q, k, v

    def _project(self, module: nn.Module, hidden_states: Tensor):
        B, S, _ = hidden_states.shape
        Hq, Hkv, D = self.num_heads, self.kv_heads, self.head_dim
        if self.fused or self.packed_proj:
            packed = (module.qkv_proj(hidden_states) if self.packed_proj else
                      torch.nn.functional.linear(hidden_states, module._gqa_qkv_weight, module._gqa_qkv_bias))
            if not self.qk_norm:
                return packed, None, None
            q, k, v = packed.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
        if not self.qk_norm:
            return q, k, v
        q_norm, k_norm = getattr(module, self.q_norm_name), getattr(module, self.k_norm_name)
        if self.qk_norm_whole:
            return q_norm(q), k_norm(k), v
        q = q_norm(q.reshape(B, S, Hq, D)).reshape(B, S, Hq * D)
        k = k_norm(k.reshape(B, S, Hkv, D)).reshape(B, S, Hkv * D)
        return q, k, v


def _norm_width(norm: nn.Module) -> int:
    """The number of features a norm with a 1-D weight normalises (its weight's size); -1 without
    a weight or with a weight of more dimensions (Cohere's ``[heads, head_dim]``, one per head)."""
    weight = getattr(norm, "weight", None)
    return weight.numel() if isinstance(weight, Tensor) and weight.dim() == 1 else -1


def _fuse_projections(module: nn.Module) -> bool:
    """Concatenates q/k/v weights (and biases) into one tensor and turns the three Linear weights
    into views of it, so the fused GEMM costs no extra memory. False when not possible."""
    linears = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    # Exactly nn.Linear with plain float weights: subclasses (bitsandbytes' Linear4bit/8bitLt,
    # fake-quant and hooked layers) keep their own forward, which one GEMM on the concatenated
    # weights would skip; they are called one by one instead.
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    weights = [lin.weight for lin in linears]
    if any(type(w) is not nn.Parameter or not w.is_floating_point() or w.device.type == "meta" for w in weights):
        return False
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return False
    if getattr(module, "_gqa_qkv_weight", None) is not None:
        return True
    with torch.no_grad():
        fused = torch.cat([w.detach() for w in weights], dim=0)
        sizes = [w.shape[0] for w in weights]
        for lin, part in zip(linears, fused.split(sizes, dim=0)):
            lin.weight.data = part
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                              torch.zeros(lin.out_features, dtype=fused.dtype, device=fused.device) for lin in linears])
            for lin, part in zip(linears, bias.split(sizes)):
                if lin.bias is not None:
                    lin.bias.data = part
    module.register_buffer("_gqa_qkv_weight", fused, persistent=False)
    module.register_buffer("_gqa_qkv_bias", bias, persistent=False)
    return True


def _fused_forward(self: nn.Module, hidden_states: Tensor, position_embeddings=None, attention_mask=None,
                   *args, **kwargs):
    """The patched forward of an HF attention layer (bound to the layer by :func:`enable`).

    Takes the original forward's arguments. The cache is its fourth parameter, named
    ``past_key_values`` or ``cache`` depending on the transformers version (see :func:`_cache_arg_name`);
    the old name is also looked up where HF still accepts it as an alias."""
    fused: _FusedAttention = self._gqa_fused
    cache = args[0] if args else kwargs.get(fused.cache_arg, kwargs.get(_OLD_CACHE_ARG))
    if not isinstance(cache, GQACache):
        return fused.original_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    B, S, _ = hidden_states.shape
    q, k, v = fused.project(self, hidden_states)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        position_ids = position_ids.to(device=hidden_states.device, dtype=torch.int64).expand(B, S)
    order = None
    if attention_mask is None:
        new_tokens = S
    else:
        state = _slot_state(attention_mask, B, S, S, "fused attention")
        real = state.to(hidden_states.device) == NEW
        new_tokens = real.sum(-1).to(torch.int32)
        if S > 1:  # left padding: move each row's real tokens to the front of the chunk
            order = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)
            q = _gather_rows(q, order)
            if k is not None:
                k, v = _gather_rows(k, order), _gather_rows(v, order)
            if position_ids is not None:
                position_ids = position_ids.gather(1, order)
    if position_ids is not None:
        position_ids = position_ids.contiguous()
    kv = cache.kv
    layer = self.layer_idx
    seqlens_k = kv.seqlens_k(layer, S)
    key_cache, value_cache = kv.layer(layer)
    rope = fused.rope
    cos, sin = (rope.cos, rope.sin) if rope is not None else (None, None)
    if rope is None:
        position_ids = None  # positions only place RoPE
    sink = self.sinks.float() if fused.has_sink else None  # the operator takes fp32 sinks
    out = group_query_attention_(
        q, k, v, key_cache, value_cache, seqlens_k, cos, sin, position_ids, sink,
        num_heads=fused.num_heads, kv_num_heads=fused.kv_heads, scale=fused.scale, do_rotary=rope is not None,
        rotary_interleaved=fused.rotary_interleaved, local_window_size=fused.window, softcap=fused.softcap,
        kv_layout=kv.kv_layout)
    kv.advance(layer, new_tokens)
    cache.seen[layer].add_(S)
    if layer == 0:
        cache._note_columns(S, new_tokens)
    if order is not None:
        out = _gather_rows(out, torch.argsort(order, dim=-1))
    return getattr(self, fused.out_proj_name)(out), None


class _EnableState:
    def __init__(self, rope: nn.ModuleDict, patched, attn_before: str, prepare_cache_before) -> None:
        self.rope = rope
        self.patched = patched
        self.attn_before = attn_before
        self.prepare_cache_before = prepare_cache_before


# The rope types whose frequencies change with the sequence: the operator's tables are static.
_DYNAMIC_ROPE = ("dynamic", "longrope")
_ONE_ROPE = "default"  # the key of a model's only RoPE table


def _rope_tables(model: nn.Module, rows: int) -> nn.ModuleDict:
    """The operator's fp32 cos/sin tables for the model's rotary embedding: one (key "default"),
    or one a layer type where the rotary module keeps frequencies a type (Gemma3: local and global
    bases). Dynamic and LongRoPE frequencies are left out (their layers stay on HF's attention)."""
    tables = nn.ModuleDict()
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, Tensor) and hasattr(module, "attention_scaling"):
            sources = {_ONE_ROPE: (inv_freq, module.attention_scaling, getattr(module, "rope_type", "default"))}
        elif isinstance(getattr(module, "rope_type", None), dict) and getattr(module, "layer_types", None):
            sources = {t: (getattr(module, f"{t}_inv_freq"), getattr(module, f"{t}_attention_scaling"),
                           module.rope_type[t]) for t in module.layer_types if t in module.rope_type}
        else:
            continue
        for key, (freq, scaling, rope_type) in sources.items():
            if rope_type not in _DYNAMIC_ROPE:
                tables[key] = RopeTables(freq.detach().float().cpu(), rows, float(scaling), device=freq.device)
        return tables
    return tables


def _layer_rope(module: nn.Module, config: Any, tables: nn.ModuleDict):
    """``(patchable, table)`` of an attention layer: its RoPE table (None for a layer without
    RoPE), and whether the fused route can run it at all."""
    if not getattr(module, "use_rope", True):  # SmolLM3's NoPE layers (use_rope is 0 or 1 there)
        return True, None
    if (type(module).__name__ == "Exaone4Attention" and module.sliding_window is not None
            and not module.is_sliding):  # Exaone4's full layers between sliding ones have no RoPE
        return True, None
    if type(module).__name__ == "Cohere2Attention" and module.sliding_window is None:  # nor Cohere2's
        return True, None
    key = _ONE_ROPE
    if _ONE_ROPE not in tables:
        layer_types = getattr(config, "layer_types", None)
        key = layer_types[module.layer_idx] if layer_types else None
    return key in tables, tables[key] if key in tables else None


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except Exception:  # older transformers or a model that refuses: set the config directly
            pass
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def _check_cuda_devices(devices) -> None:
    """Raises, before anything is patched, if a CUDA device among ``devices`` cannot run the
    kernels (a GPU older than compute capability 8.0, one this build has no code for, or a
    CPU-only build): the model's first forward would raise there anyway, later and further from
    the cause."""
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        if cuda_kernels_available(device):
            continue
        index = torch.cuda.current_device() if device.index is None else device.index
        major, minor = torch.cuda.get_device_capability(index)
        info = build_info()
        built = (f"built for TORCH_CUDA_ARCH_LIST={info.get('cuda_archs')!r}" if info.get("mode") == "CUDA"
                 else "built CPU-only")
        raise RuntimeError(
            f"gqa_torch.hf.enable: the model is on cuda:{index} ({torch.cuda.get_device_name(index)}, compute "
            f"capability {major}.{minor}), where gqa_torch's CUDA kernels cannot run: they need 8.0 or newer, and "
            f"this build was {built}. Keep the model on the CPU, or rebuild gqa_torch for this GPU (README, Install).")


def enable(model: nn.Module, *, fuse_qkv: bool = True, max_positions: Optional[int] = None) -> nn.Module:
    """Switches a transformers causal LM to gqa-torch, in place; returns the model.

    - Sets ``attn_implementation="gqa"`` (the generic route) for every attention layer.
    - Patches the attention layers of the supported families (:data:`SUPPORTED_ATTENTION_CLASSES`)
      to the fused route (RoPE + cache append + attention in one call) when they get a
      :class:`GQACache`.
    - Makes ``generate()`` allocate a :class:`GQACache` (unless you pass a cache, as ``cache=`` or
      ``past_key_values=`` depending on the transformers version, or ``use_cache=False``). The
      cache is static and marked compileable, so on CUDA ``generate()`` compiles the decode step
      as it does for HF's ``StaticCache`` (``generation_config.disable_compile=True`` turns that off).

    ``fuse_qkv`` fuses the Q/K/V projections into one GEMM (the three weights become views of
    the fused one). ``max_positions`` sizes the RoPE tables (default: the config's
    ``max_position_embeddings``; they grow when a larger cache is made). Undo with :func:`disable`.

    Raises ``RuntimeError``, before changing anything, if the model sits on a GPU that the CUDA
    kernels cannot run on (:func:`gqa_torch.cuda_kernels_available` is False there).
    """
    if getattr(model, "_gqa_state", None) is not None:
        return model
    _check_cuda_devices({p.device for p in model.parameters()})
    register()
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    before = getattr(config, "_attn_implementation", None)
    rows = max_positions or getattr(config, "max_position_embeddings", None) or 4096
    rope = _rope_tables(model, rows)
    patched = []
    layers = [(module, *_layer_rope(module, config, rope)) for module in model.modules()
              if type(module).__name__ in SUPPORTED_ATTENTION_CLASSES
              and getattr(module, "is_causal", True) is not False]
    # All or none: a GQACache can only serve a model whose every attention layer writes it, and
    # it lives on one device (a model split by device_map stays on the generic route).
    devices = {p.device for module, _, _ in layers for p in module.parameters()}
    if len(rope) and layers and all(patchable for _, patchable, _ in layers) and len(devices) == 1:
        model.add_module("gqa_rope", rope)
        for module, _, table in layers:
            original = module.forward
            module._gqa_fused = _FusedAttention(module, config, table, original, fuse_qkv)
            module.forward = types.MethodType(_fused_forward, module)
            patched.append(module)
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    prepare_before = model.__dict__.get("_prepare_cache_for_generation")
    if hasattr(model, "_prepare_cache_for_generation") and patched:
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    model._gqa_state = _EnableState(rope, patched, before, prepare_before)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undoes :func:`enable`: original forwards, the previous ``attn_implementation``, HF's cache
    creation. The fused Q/K/V weight stays shared with the three projections (harmless)."""
    state = getattr(model, "_gqa_state", None)
    if state is None:
        return model
    for module in state.patched:
        del module.forward  # back to the class's forward
        del module._gqa_fused
    if "_prepare_cache_for_generation" in model.__dict__:
        del model._prepare_cache_for_generation
    if state.prepare_cache_before is not None:
        model._prepare_cache_for_generation = state.prepare_cache_before
    if state.attn_before is not None:
        _set_attn_implementation(model, state.attn_before)
    if "gqa_rope" in model._modules:
        del model._modules["gqa_rope"]
    model._gqa_state = None
    return model


def _prepare_cache_for_generation(self, generation_config, model_kwargs: Dict[str, Any], *args, **kwargs):
    """generate()'s cache creation on an enabled model: a GQACache unless the caller brought a cache
    or disabled caching."""
    hf_impl = type(self)._prepare_cache_for_generation
    bound = inspect.signature(hf_impl).bind(self, generation_config, model_kwargs, *args, **kwargs)
    batch_size = bound.arguments.get("batch_size")
    max_cache_length = bound.arguments.get("max_cache_length")
    # generate() keeps the cache in model_kwargs under the name its model inputs take it by
    # (generate() itself already renamed a caller's deprecated past_key_values= to it).
    cache_arg = _cache_arg_name(self.prepare_inputs_for_generation)
    if (model_kwargs.get(cache_arg) is not None or generation_config.use_cache is False
            or batch_size is None or max_cache_length is None):
        return hf_impl(self, generation_config, model_kwargs, *args, **kwargs)
    if getattr(generation_config, "max_cache_len", None):
        max_cache_length = max(max_cache_length, generation_config.max_cache_len)
    if str(getattr(bound.arguments.get("generation_mode"), "value", "")) == "assisted_generation":
        # The verifying forward feeds the pending token and the draft at once; near max_length the
        # draft can reach past it before crop() rolls the rejected part back.
        draft = max(generation_config.prompt_lookup_num_tokens or 0, int(generation_config.num_assistant_tokens or 0))
        max_cache_length += draft + 1
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
    model_kwargs[cache_arg] = GQACache.for_model(self, rows, max_cache_length)


register()
