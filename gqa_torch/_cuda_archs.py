"""The GPU architectures a build targets (TORCH_CUDA_ARCH_LIST): the default and the checks.

setup.py loads this file by its path (the package is not importable before it is built), so it
imports nothing from gqa_torch, nor torch.
"""
import re
from typing import List, Sequence, Tuple

# The kernels use bf16 mma.sync and cp.async: Ampere (sm80) and newer.
MIN_CAPABILITY = (8, 0)

# Without a GPU to look at, the build targets Hopper with its arch-specific features (wgmma,
# TMA, setmaxnreg), which the fastest prefill and decode kernels need.
DEFAULT_ARCHS = "9.0a"

_ENTRY = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def entries(arch_list: str) -> List[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST value (``;``, ``,`` or spaces between them)."""
    return [e for e in re.split(r"[;,\s]+", arch_list.strip()) if e]


def too_old(arch_list: str) -> List[str]:
    """The numeric entries of ``arch_list`` below MIN_CAPABILITY (named ones are not checked)."""
    old = []
    for entry in entries(arch_list):
        match = _ENTRY.match(entry)
        if match and (int(match.group(1)), int(match.group(2))) < MIN_CAPABILITY:
            old.append(entry)
    return old


def default_archs(gpus: Sequence[Tuple[str, Tuple[int, int]]]) -> Tuple[str, str]:
    """TORCH_CUDA_ARCH_LIST for a build that was given none, and a line that says why.

    ``gpus``: (name, (major, minor)) of each GPU visible to the build. Their architectures, with
    sm90 as 9.0a (its arch-specific kernels); GPUs older than MIN_CAPABILITY are left out. With
    none left, DEFAULT_ARCHS.
    """
    usable = sorted({cap for _, cap in gpus if tuple(cap) >= MIN_CAPABILITY})
    old = sorted({f"{name} ({cap[0]}.{cap[1]})" for name, cap in gpus if tuple(cap) < MIN_CAPABILITY})
    note = ""
    if old:
        note = (f"; left out, older than compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                f"{', '.join(old)} (call the op on CPU tensors there)")
    if not usable:
        reason = "no GPU visible to the build" if not gpus else "no visible GPU the kernels support"
        return DEFAULT_ARCHS, f"{DEFAULT_ARCHS} ({reason}: the default, H100/H200{note})"
    archs = ";".join(f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "") for major, minor in usable)
    names = ", ".join(sorted({name for name, cap in gpus if tuple(cap) >= MIN_CAPABILITY}))
    return archs, f"{archs} (the GPUs visible to the build: {names}{note})"
