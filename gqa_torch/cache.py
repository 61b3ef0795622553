"""A static, preallocated KV cache for the in-place operator ``gqa::group_query_attention_``.

One :class:`KVCache` holds every layer of a model: two tensors of fixed capacity (keys and
values), and the valid length of each batch row per layer, kept *on the cache's device* as an
int32 tensor. Nothing here reads a device value on the host unless you ask for it
(:meth:`KVCache.lengths_host`, :meth:`KVCache.refresh_bounds`), so a decode step that uses it
can be captured in a CUDA graph or compiled with ``torch.compile(fullgraph=True)``.

How one call of the operator uses it (``S`` new tokens per row)::

    seqlens_k = cache.seqlens_k(layer, S)          # int32 [B]: lengths + S - 1 (capacity checked)
    key_cache, value_cache = cache.layer(layer)
    out = gqa_torch.group_query_attention_(qkv, None, None, key_cache, value_cache, seqlens_k, ...)
    cache.advance(layer, S)                        # or the per-row prompt lengths (right padding)

Capacity. The operator writes the ``S`` new rows of row ``b`` at ``[len_b, len_b + S)``; that
must stay within ``capacity``. It is never wrapped or truncated:

- *Host path* (eager, not compiling, not capturing): :meth:`KVCache.seqlens_k` raises a
  ``ValueError`` before the operator is called. For a CPU cache the check is exact. For a CUDA
  cache it uses a host-side upper bound of the row lengths that is kept without any device
  sync (exact for uniform lengths, conservative otherwise).
- *Device / capture path* (inside a CUDA graph or ``torch.compile``): no host check can run.
  The operator checks on the device: the violating row writes nothing, its output is NaN and the
  sticky error word gets flag 16 (``total length exceeds the cache capacity``);
  :func:`gqa_torch.check_errors` raises :class:`gqa_torch.GQAError` at your loop's sync point.
  After compiled or replayed steps the host bound is stale (it did not see them); call
  :meth:`KVCache.refresh_bounds` (one sync) before relying on the host check again.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor
Rows = Union[Tensor, Sequence[int], int]

__all__ = ["KVCache"]

_LAYOUTS = {0: 0, 1: 1, "bnsh": 0, "bsnh": 1, "BNSH": 0, "BSNH": 1}


def _tracing() -> bool:
    """True while torch.compile traces or a CUDA graph captures: no host reads, no host state."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class KVCache:
    """Per-layer key/value caches of fixed capacity, with per-row valid lengths on the device.

    Args:
        num_layers: how many attention layers share this cache (each has its own K/V and lengths).
        batch_size: rows ``B``.
        kv_heads: KV heads ``Hkv`` per layer.
        head_dim: head size ``D``.
        capacity: rows ``C`` of every cache; a row never holds more than ``C`` tokens.
        dtype: fp16, bf16 or fp32 (the operator's query dtype).
        device: where the caches and the lengths live.
        kv_layout: ``0``/``"bnsh"`` for ``[B, Hkv, C, D]`` (default) or ``1``/``"bsnh"`` for
            ``[B, C, Hkv, D]``; passed to the operator as ``kv_layout``.

    Attributes:
        key, value: ``[num_layers, B, Hkv, C, D]`` (BNSH) or ``[num_layers, B, C, Hkv, D]``.
        lengths: int32 ``[num_layers, B]`` on ``device``: the valid tokens of each row.

    On CUDA the tensors are marked as static addresses for ``torch.compile``'s CUDA graphs;
    every method that changes state does so in place, so the addresses never change.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device, None] = None,
        kv_layout: Union[int, str] = 0,
    ) -> None:
        if kv_layout not in _LAYOUTS:
            raise ValueError(f"KVCache: kv_layout must be 0/'bnsh' or 1/'bsnh', got {kv_layout!r}")
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("capacity", capacity)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache: {name} must be a positive int, got {value!r}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"KVCache: dtype must be float16, bfloat16 or float32, got {dtype}")
        self.kv_layout = _LAYOUTS[kv_layout]
        self.num_layers, self.batch_size, self.kv_heads = num_layers, batch_size, kv_heads
        self.head_dim, self.capacity = head_dim, capacity
        if self.kv_layout == 0:
            shape = (num_layers, batch_size, kv_heads, capacity, head_dim)
        else:
            shape = (num_layers, batch_size, capacity, kv_heads, head_dim)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros((num_layers, batch_size), dtype=torch.int32, device=device)
        # Host-side upper bound of max(lengths[layer]); None when unknown. Never read on device.
        self._bounds: List[Optional[int]] = [0] * num_layers
        self._pending: List[int] = [0] * num_layers
        if device.type == "cuda":
            for tensor in (self.key, self.value, self.lengths):
                torch._dynamo.mark_static_address(tensor)

    # ---- shape facts ----------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the K/V caches."""
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        """The device of the caches and of the lengths."""
        return self.key.device

    def __repr__(self) -> str:
        layout = "BNSH" if self.kv_layout == 0 else "BSNH"
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, capacity={self.capacity}, {layout}, {self.dtype}, {self.device})")

    def layer(self, layer_idx: int) -> Tuple[Tensor, Tensor]:
        """``(key_cache, value_cache)`` of one layer: contiguous views, written in place by the op."""
        return self.key[layer_idx], self.value[layer_idx]

    # ---- lengths ---------------------------------------------------------------------------

    def lengths_host(self, layer_idx: Optional[int] = None) -> Tensor:
        """The valid lengths copied to the host (a device sync): ``[num_layers, B]``, or ``[B]``
        for one layer. Never called by the decode path itself."""
        lengths = self.lengths if layer_idx is None else self.lengths[layer_idx]
        return lengths.to("cpu")

    def refresh_bounds(self) -> None:
        """Re-reads the lengths (one device sync) to make the host capacity check exact again,
        e.g. after steps that ran inside a CUDA graph or a compiled function."""
        maxima = self.lengths.max(dim=1).values.tolist()
        self._bounds = [int(m) for m in maxima]

    def seqlens_k(self, layer_idx: int, num_new_tokens: int) -> Tensor:
        """The operator's ``seqlens_k`` for a call that appends ``num_new_tokens`` slots to every
        row of ``layer_idx`` at the row's current length: int32 ``[B]`` = ``lengths + S - 1``.

        Covers decode (``S = 1``), chunked prefill, and right-padded prefill (all rows write
        ``S`` slots; :meth:`advance` then keeps only each row's real tokens). It does not change
        the lengths; call :meth:`advance` after the operator ran.

        On the host path (see the module docstring) it raises ``ValueError`` when a row would
        exceed the capacity; inside a graph or a compiled function the operator's device check
        flags it instead.
        """
        S = int(num_new_tokens)
        if S <= 0:
            raise ValueError(f"KVCache.seqlens_k: num_new_tokens must be positive, got {S}")
        if not _tracing():
            self._check_capacity(layer_idx, S)
            self._pending[layer_idx] = S
        return self.lengths[layer_idx] + (S - 1)

    def advance(self, layer_idx: int, num_tokens: Union[int, Tensor], max_tokens: Optional[int] = None) -> None:
        """Adds ``num_tokens`` (an int, or an int tensor ``[B]`` on the device, e.g. the prompt
        lengths of a right-padded batch) to the valid lengths of ``layer_idx``, in place.

        ``max_tokens`` is a host-known upper bound of a tensor ``num_tokens`` that keeps the host
        capacity check tight; by default the ``S`` of the preceding :meth:`seqlens_k` call is
        used (a row never keeps more tokens than the call wrote)."""
        lengths = self.lengths[layer_idx]
        if isinstance(num_tokens, Tensor):
            lengths.add_(num_tokens.to(device=lengths.device, dtype=lengths.dtype))
            step = max_tokens if max_tokens is not None else self._pending[layer_idx] if not _tracing() else None
        else:
            lengths.add_(int(num_tokens))
            step = int(num_tokens)
        if not _tracing():
            bound = self._bounds[layer_idx]
            self._bounds[layer_idx] = None if bound is None or step is None else bound + int(step)

    def prefill(self, layer_idx: int, prompt_lengths: Union[Tensor, Sequence[int]], seq_len: int) -> Tensor:
        """Right-padded prefill in one call: returns ``seqlens_k`` for ``seq_len`` new slots per
        row and advances each row by its prompt length (``prompt_lengths``: ``[B]``, each
        ``<= seq_len``). The padding slots are overwritten by the next appended tokens.

        It advances the lengths *before* you call the operator (handy in a step function); if
        that call fails, :meth:`reset` the rows."""
        seqlens = self.seqlens_k(layer_idx, seq_len)
        if not isinstance(prompt_lengths, Tensor):
            values = [int(v) for v in prompt_lengths]
            if any(v < 0 or v > seq_len for v in values):
                raise ValueError(f"KVCache.prefill: prompt lengths must be in [0, {seq_len}], got {values}")
            prompt_lengths = torch.tensor(values, dtype=torch.int32, device=self.device)
            self.advance(layer_idx, prompt_lengths, max_tokens=max(values, default=0))
        else:
            self.advance(layer_idx, prompt_lengths)
        return seqlens

    def decode(self, layer_idx: int) -> Tensor:
        """Decode in one call: ``seqlens_k`` for one new token per row, and the lengths advanced
        by one (before the operator runs; see :meth:`prefill`)."""
        seqlens = self.seqlens_k(layer_idx, 1)
        self.advance(layer_idx, 1)
        return seqlens

    def _check_capacity(self, layer_idx: int, num_new_tokens: int) -> None:
        if self.device.type == "cpu":
            current = int(self.lengths[layer_idx].max())  # a host tensor: no sync to pay for
        else:
            current = self._bounds[layer_idx]
            if current is None:
                return  # unknown after an untracked update; the device check stays
        if current + num_new_tokens > self.capacity:
            kind = "holds" if self.device.type == "cpu" else "may hold up to"
            raise ValueError(
                f"KVCache capacity exceeded: layer {layer_idx} {kind} {current} tokens in its longest row and "
                f"this call appends {num_new_tokens}, but the capacity is {self.capacity}. Allocate a larger "
                f"KVCache, or reset()/reset_rows() finished rows.")

    # ---- state changes ---------------------------------------------------------------------

    def reset(self, zero_data: bool = False) -> None:
        """Empties every row of every layer (lengths to 0). The K/V data is left in place unless
        ``zero_data``: rows past a row's length are never read, and later appends overwrite them."""
        self.lengths.zero_()
        if zero_data:
            self.key.zero_()
            self.value.zero_()
        self._bounds = [0] * self.num_layers

    def reset_rows(self, rows: Rows) -> None:
        """Empties the given batch rows in every layer (continuous batching: a finished row is
        reused for a new request). ``rows``: an int, a list of ints, an int tensor of indices, or
        a bool tensor ``[B]``. In place and sync-free for tensors on the cache's device."""
        if isinstance(rows, Tensor) and rows.dtype == torch.bool:
            if rows.shape != (self.batch_size,):
                raise ValueError(f"KVCache.reset_rows: a bool mask must have shape [{self.batch_size}], got {list(rows.shape)}")
            self.lengths.masked_fill_(rows.to(self.device)[None, :], 0)
            return
        index = self._index(rows, "reset_rows")
        self.lengths.index_fill_(1, index, 0)
        # The host bounds stay valid upper bounds.

    def reorder(self, batch_indices: Rows) -> None:
        """Reorders the batch in place, row ``b`` becoming old row ``batch_indices[b]`` (beam
        search). ``batch_indices``: ``B`` indices, repeats allowed. Keys, values and lengths of
        every layer move together; one layer at a time, so the temporary memory is one layer's."""
        index = self._index(batch_indices, "reorder")
        if index.numel() != self.batch_size:
            raise ValueError(f"KVCache.reorder: expected {self.batch_size} indices, got {index.numel()}")
        for layer_idx in range(self.num_layers):
            for tensor in (self.key[layer_idx], self.value[layer_idx]):
                tensor.copy_(tensor.index_select(0, index))
        self.lengths.copy_(self.lengths.index_select(1, index))

    def _index(self, rows: Rows, what: str) -> Tensor:
        if isinstance(rows, Tensor):
            index = rows.to(device=self.device, dtype=torch.long).reshape(-1)
        else:
            values = [rows] if isinstance(rows, int) else [int(r) for r in rows]
            bad = [r for r in values if not -self.batch_size <= r < self.batch_size]
            if bad:
                raise IndexError(f"KVCache.{what}: row indices {bad} out of range for batch {self.batch_size}")
            index = torch.tensor([r % self.batch_size for r in values], dtype=torch.long, device=self.device)
        return index
