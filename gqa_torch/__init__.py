"""gqa_torch: fused grouped-query attention for PyTorch.

``torch.ops.gqa.group_query_attention`` (functional, ONNX Runtime parity) and
``torch.ops.gqa.group_query_attention_`` (in-place KV cache, graph-capturable), with CPU,
CUDA and fake implementations. See the README and SPEC for the contract.

The user layer: :class:`KVCache` (a static per-layer cache with per-row lengths on the device),
:class:`GroupQueryAttention` (an ``nn.Module`` on the in-place op), ``gqa_torch.graphs`` (CUDA-graph
decode steps) and ``gqa_torch.hf`` (Hugging Face transformers; imported on demand, so transformers
stays optional).
"""
from __future__ import annotations

import os
from typing import Any, Dict

import torch

from . import _C
from .cache import KVCache
from .errors import FLAG_MESSAGES, GQAError, decode_flags
from .memory import _configure_from_environment as _configure_cpu_output_cache
from .memory import cpu_output_cache_info, release_cpu_output_cache, set_cpu_output_cache_limit
from .ops import (
    check_errors,
    clear_errors,
    cuda_kernels_available,
    group_query_attention,
    group_query_attention_,
    set_synchronous_errors,
    synchronous_errors,
)
from .module import GroupQueryAttention

__all__ = [
    "GQAError",
    "GroupQueryAttention",
    "KVCache",
    "build_info",
    "check_errors",
    "clear_errors",
    "cpu_output_cache_info",
    "cuda_kernels_available",
    "decode_flags",
    "group_query_attention",
    "group_query_attention_",
    "release_cpu_output_cache",
    "set_cpu_output_cache_limit",
    "set_synchronous_errors",
    "synchronous_errors",
]
__version__ = "0.1.0"

if list(_C.error_flag_messages()) != FLAG_MESSAGES:
    raise ImportError("gqa_torch: the extension's error flag table differs from gqa_torch.errors (stale build?)")

if os.environ.get("GQA_SYNC_ERRORS") == "1":
    set_synchronous_errors(True)
# The CPU output cache's limit in MB (gqa_torch.memory); 0 disables it.
_configure_cpu_output_cache()
# The CPU backend's instruction set, pinned for a whole process (tests of the narrower sets):
# "baseline", "avx2" or "avx512"; unset or "auto" picks the widest this CPU has.
if os.environ.get("GQA_CPU_KERNELS"):
    _C._set_cpu_kernels(os.environ["GQA_CPU_KERNELS"])


def build_info() -> Dict[str, Any]:
    """How this extension was built: mode (CUDA or CPU-only, and why), CUDA archs, torch, and
    whether the decode kernel has its diagnostic stamps (GQA_DECODE_TIMELINE=1 at build time)."""
    try:
        from . import _build_info as info
    except ImportError:  # built by something other than setup.py
        return {"mode": "CUDA" if _C.built_with_cuda() else "CPU-only"}
    return {
        "mode": info.MODE,
        "cpu_only_reason": info.CPU_ONLY_REASON,
        "cuda_archs": info.CUDA_ARCHS,
        "built_against_torch": info.TORCH_VERSION,
        "built_against_cuda": info.TORCH_CUDA,
        "running_torch": torch.__version__,
        "cuda_kernels_available": cuda_kernels_available(),
        "decode_timeline": getattr(info, "DECODE_TIMELINE", False),
    }
