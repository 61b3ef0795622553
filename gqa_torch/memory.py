"""The recycling cache of the CPU operators' large outputs.

A functional call on the CPU returns fresh presents (and, for a long prompt, a large output).
Fresh memory of tens of MB is mapped anew for every call and zeroed by the OS page by page on
first touch, which costs a decode loop more than its attention. Outputs of 8 MB or more are
therefore taken from blocks that earlier outputs freed, kept in a cache bounded by a byte limit
(by default 2 GiB, or an eighth of the machine's memory where that is less;
``GQA_CPU_OUTPUT_CACHE_MB`` in the environment sets it, 0 disables it).
A block unused while 256 large outputs were allocated is freed. CUDA outputs come from
PyTorch's caching allocator as always.
"""
from __future__ import annotations

import os
from typing import Dict

from . import _C

_ENV = "GQA_CPU_OUTPUT_CACHE_MB"


def cpu_output_cache_info() -> Dict[str, int]:
    """The cache's ``limit_bytes``, what it holds now (``cached_bytes``, ``cached_blocks``) and how
    many large CPU outputs it served from a cached block (``hits``) or allocated fresh (``misses``)."""
    return dict(_C._cpu_output_cache_info())


def release_cpu_output_cache() -> None:
    """Frees every block the cache holds, like ``torch.cuda.empty_cache`` does for CUDA. Outputs
    still alive are not touched; their blocks return to the cache when they are freed."""
    _C._release_cpu_output_cache()


def set_cpu_output_cache_limit(limit_bytes: int) -> None:
    """The most the cache may hold, in bytes; 0 disables it and frees what it holds."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"set_cpu_output_cache_limit: expected an int of 0 or more bytes, got {limit_bytes!r}")
    _C._set_cpu_output_cache_limit(limit_bytes)


def _configure_from_environment() -> None:
    text = os.environ.get(_ENV)
    if text is None or text.strip() == "":
        return
    try:
        megabytes = int(text)
    except ValueError:
        megabytes = -1
    if megabytes < 0:
        raise ValueError(f"gqa_torch: {_ENV} must be a whole number of MB, 0 or more (0 disables the cache), "
                         f"got {text!r}")
    set_cpu_output_cache_limit(megabytes << 20)
