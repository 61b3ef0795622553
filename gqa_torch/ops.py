"""Typed wrappers over torch.ops.gqa.*, their fake (meta) implementations and error-word access.

The wrappers hold no math: they give Python defaults and docs, and turn the operators'
data-dependent failures into :class:`gqa_torch.GQAError`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _C  # noqa: F401  (importing it registers torch.ops.gqa.*)
from .errors import GQAError, translate

Tensor = torch.Tensor
_ops = torch.ops.gqa


def _call(op, *args, **kwargs):
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    try:
        return op(*args, **kwargs)
    except (RuntimeError, ValueError) as exc:
        gqa_error = translate(exc)
        if gqa_error is None:
            raise
        raise gqa_error from None


def group_query_attention(
    query: Tensor,
    key: Optional[Tensor] = None,
    value: Optional[Tensor] = None,
    past_key: Optional[Tensor] = None,
    past_value: Optional[Tensor] = None,
    seqlens_k: Optional[Tensor] = None,
    total_sequence_length: Optional[int] = None,
    cos_cache: Optional[Tensor] = None,
    sin_cache: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    head_sink: Optional[Tensor] = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float = 0.0,
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    local_window_size: int = -1,
    softcap: float = 0.0,
    smooth_softmax: bool = False,
    kv_layout: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Grouped-query attention with ONNX Runtime ``GroupQueryAttention`` semantics (functional).

    Shapes (``B`` batch, ``S`` new tokens, ``D`` head size, ``Hq``/``Hkv`` = num_heads/kv_num_heads):

    - ``query``: ``[B, S, Hq*D]``; or packed ``[B, S, (Hq + 2*Hkv)*D]`` when ``key`` and
      ``value`` are both ``None``. fp16, bf16 or fp32; the last dim must be contiguous.
    - ``key``, ``value``: ``[B, S, Hkv*D]``, same dtype.
    - ``past_key``, ``past_value``: optional caches of ``P`` rows, ``[B, Hkv, P, D]``
      (``kv_layout=0``, BNSH) or ``[B, P, Hkv, D]`` (``kv_layout=1``, BSNH).
    - ``seqlens_k``: int32 ``[B]`` (or ``[B, 1]``, or a scalar when ``B == 1``): per row, the
      total valid length *minus one* after this call's tokens are appended.
    - ``total_sequence_length``: the largest total length of the batch (a Python int).
    - ``cos_cache``, ``sin_cache``: ``[max_positions, R/2]`` when ``do_rotary``; fp32, or the
      query's dtype when it is fp16/bf16. ``R`` is the rotary dim (even, ``<= D``).
    - ``position_ids``: int64 ``[B, S]``, the RoPE position of each new token.
    - ``head_sink``: fp32 ``[Hq]``, one learned logit per query head added to the softmax
      denominator.

    Attributes: ``scale`` (0 means ``1/sqrt(D)``), ``do_rotary``, ``rotary_interleaved`` (pairs
    ``(2i, 2i+1)`` instead of ``(i, i+R/2)``), ``local_window_size`` (``-1`` off, else each query
    sees ``W`` keys including itself), ``softcap`` (``0`` off, else ``c*tanh(x/c)``),
    ``smooth_softmax`` (adds a logit 0 to the denominator), ``kv_layout``.

    Returns ``(output [B, S, Hq*D], present_key, present_value)``; the presents have
    ``C = max(P, total_sequence_length)`` rows: the past rows, then the new (rotated) K/V at
    ``[total_b - S, total_b)``, then zeros. With no past and ``S == total_sequence_length``
    (first prompt) new tokens sit at ``0..S-1`` and query rows ``s >= total_b`` are padding
    with zero output.

    Raises ``ValueError``/``TypeError`` naming the argument for bad shapes, dtypes or
    attributes, and :class:`GQAError` for bad ``seqlens_k``/``position_ids`` (checked
    synchronously; on CUDA the error word is cleared after raising).
    """
    if seqlens_k is None or total_sequence_length is None:
        raise TypeError("gqa: group_query_attention needs seqlens_k and total_sequence_length")
    return _call(
        _ops.group_query_attention.default,
        query, key, value, past_key, past_value, seqlens_k, int(total_sequence_length),
        cos_cache, sin_cache, position_ids, head_sink,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved, local_window_size=local_window_size,
        softcap=softcap, smooth_softmax=smooth_softmax, kv_layout=kv_layout,
    )


def group_query_attention_(
    query: Tensor,
    key: Optional[Tensor],
    value: Optional[Tensor],
    key_cache: Tensor,
    value_cache: Tensor,
    seqlens_k: Tensor,
    cos_cache: Optional[Tensor] = None,
    sin_cache: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    head_sink: Optional[Tensor] = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float = 0.0,
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    local_window_size: int = -1,
    softcap: float = 0.0,
    smooth_softmax: bool = False,
    kv_layout: int = 0,
) -> Tensor:
    """Grouped-query attention that appends into fixed-capacity caches in place.

    ``key_cache``/``value_cache`` are ``[B, Hkv, C, D]`` (BNSH) or ``[B, C, Hkv, D]`` (BSNH).
    For row ``b``, ``total_b = seqlens_k[b] + 1``; the ``S`` new K (after RoPE) and V rows go
    to ``[total_b - S, total_b)`` and nothing else in the caches is touched. Every other input
    and attribute is as in :func:`group_query_attention`. Returns the output ``[B, S, Hq*D]``.

    It never reads device data on the host, so it can be captured in a CUDA graph or traced by
    ``torch.compile(fullgraph=True)``. On CUDA, bad ``seqlens_k``/``position_ids`` set the
    sticky device error word instead of raising: the violating rows write nothing, outputs are
    NaN, and later calls skip their writes until :func:`check_errors` raises and clears it.
    :func:`set_synchronous_errors` makes every call check at once. On CPU it raises
    :class:`GQAError` before writing anything.
    """
    return _call(
        _ops.group_query_attention_.default,
        query, key, value, key_cache, value_cache, seqlens_k,
        cos_cache, sin_cache, position_ids, head_sink,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved, local_window_size=local_window_size,
        softcap=softcap, smooth_softmax=smooth_softmax, kv_layout=kv_layout,
    )


# ---- error word ---------------------------------------------------------------------------

def _device_index(device, caller: str) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"gqa: {caller}: expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def check_errors(device=None) -> None:
    """Raises :class:`GQAError` if a CUDA call on ``device`` flagged bad ``seqlens_k`` or
    ``position_ids``, then clears the flags. Synchronises with the current stream. Does nothing
    when the build or machine has no CUDA."""
    if not cuda_kernels_available():
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gqa: check_errors() cannot run inside CUDA-graph capture; call it after replay")
    word = _C.error_word(_device_index(device, "check_errors"))
    flags = int(word.item())
    if flags:
        word.zero_()
        raise GQAError(flags)


def clear_errors(device=None) -> None:
    """Clears the error word of ``device`` without raising (stream-ordered; capturable)."""
    if cuda_kernels_available():
        _C.error_word(_device_index(device, "clear_errors")).zero_()


def set_synchronous_errors(enabled: bool) -> None:
    """The debugging switch: when on, every CUDA call (the in-place op too) checks the error
    word right after it runs and raises :class:`GQAError`. Also set by ``GQA_SYNC_ERRORS=1``."""
    _C.set_synchronous_errors(bool(enabled))


def synchronous_errors() -> bool:
    """Whether :func:`set_synchronous_errors` is on."""
    return bool(_C.synchronous_errors())


def cuda_kernels_available(device=None) -> bool:
    """True when this build has the CUDA kernels, a CUDA device is usable now, and the kernels can
    run on ``device`` (default: the current one): compute capability 8.0 or newer, with code for
    it in this build (``build_info()["cuda_archs"]``). Where this is False, CUDA calls raise and
    say why; CPU tensors always work."""
    if not (_C.built_with_cuda() and torch.cuda.is_available()):
        return False
    return _C._cuda_device_support(_device_index(device, "cuda_kernels_available")) == 0


# ---- fake (meta) implementations, for torch.compile and FakeTensor tracing ------------------

def _head_dim(query: Tensor, key: Optional[Tensor], num_heads: int, kv_num_heads: int):
    heads = num_heads if key is not None else num_heads + 2 * kv_num_heads
    torch._check(query.shape[2] % heads == 0, lambda: "gqa: query hidden size must divide by the head count")
    return query.shape[2] // heads


@torch.library.register_fake("gqa::group_query_attention")
def _group_query_attention_fake(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                cos_cache=None, sin_cache=None, position_ids=None, head_sink=None, *,
                                num_heads, kv_num_heads, scale=0.0, do_rotary=False, rotary_interleaved=False,
                                local_window_size=-1, softcap=0.0, smooth_softmax=False, kv_layout=0):
    batch, seq = query.shape[0], query.shape[1]
    head_dim = _head_dim(query, key, num_heads, kv_num_heads)
    past_rows = 0
    if past_key is not None:
        past_rows = past_key.shape[2] if kv_layout == 0 else past_key.shape[1]
    capacity = max(past_rows, total_sequence_length)
    output = query.new_empty((batch, seq, num_heads * head_dim))
    if kv_layout == 0:
        shape = (batch, kv_num_heads, capacity, head_dim)
    else:
        shape = (batch, capacity, kv_num_heads, head_dim)
    return output, query.new_empty(shape), query.new_empty(shape)


@torch.library.register_fake("gqa::group_query_attention_")
def _group_query_attention_inplace_fake(query, key, value, key_cache, value_cache, seqlens_k,
                                        cos_cache=None, sin_cache=None, position_ids=None, head_sink=None, *,
                                        num_heads, kv_num_heads, scale=0.0, do_rotary=False,
                                        rotary_interleaved=False, local_window_size=-1, softcap=0.0,
                                        smooth_softmax=False, kv_layout=0):
    head_dim = _head_dim(query, key, num_heads, kv_num_heads)
    return query.new_empty((query.shape[0], query.shape[1], num_heads * head_dim))
