"""GPUs with less shared memory a block than an H100 or H200 (227 KB), and without its sm90a
kernels (TMA, wgmma): 99 KB on sm86, sm89 and sm120 (RTX 30xx/40xx/50xx, A10, L4, L40S).

There the tensor-core decode kernel's four cp.async warps fit at head sizes 64 and 80; at 96
and 128 (104-109 KB) the launch takes two warps a CTA (53-57 KB), and at 256 the generic
kernel (kernels/launch.cu, decode_mma_fits). These tests run those choices on the H200 under a
budget (gqa_torch._C._set_smem_limit), which also leaves the sm90a kernels out: a kernel that
asks for more than the budget throws, so a decode that took a kernel too large would fail here,
and the profiler's kernel names show which one ran.
"""
from __future__ import annotations

import re

import pytest
import torch

import gqa_torch
from conftest import DTYPES, make_case, requires_cuda, run_and_check
from test_cuda import _cuda_kernel_names, _decode_loader_codes

pytestmark = [pytest.mark.cuda, requires_cuda]

SM86_BLOCK_BYTES = 99 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm86, sm89 and sm120


@pytest.fixture
def smem_budget():
    """Sets the budget for one test; the device's own again afterwards, whatever happened."""
    gqa_torch.clear_errors()
    yield gqa_torch._C._set_smem_limit
    gqa_torch._C._set_smem_limit(0)
    gqa_torch.clear_errors()
    torch.cuda.synchronize()


FEATURES = {
    "plain": {},
    "rope_softcap_window_sink": dict(rotary="half", softcap=30.0, window=200, sink=True),
}


# The decode kernel's loader codes (DecodeLoader, kernels/decode_cfg.cuh) a 99 KB GPU may run at
# each head size: the four-warp cp.async ones (0 as such, 4 in three stages, 5 one tile ahead),
# two cp.async warps (9); None: the generic kernel.
LOADERS_AT_99KB = {64: {0, 4}, 80: {0, 5}, 96: {9}, 128: {9}, 256: None}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("op", ["inplace", "functional"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", list(LOADERS_AT_99KB))
def test_decode_under_a_99kb_budget(head_dim, dtype, op, features, smem_budget):
    """Decode with ragged rows, on the path a 99 KB GPU takes, against the float64 reference
    (outputs poisoned first; caches and guard regions checked); then the kernel it ran."""
    smem_budget(SM86_BLOCK_BYTES)

    def make():
        return make_case(op, batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=700,
                         past_lengths=[650, 5, 301], dtype=DTYPES[dtype], device="cuda", **FEATURES[features])

    run_and_check(make(), rotary_ulps=1, suite="cuda_small_smem")
    torch.cuda.synchronize()
    gqa_torch.check_errors()
    names = _cuda_kernel_names(make().run)
    if not names:  # (under compute-sanitizer, which keeps CUPTI from starting)
        pytest.skip("torch.profiler recorded no CUDA kernels here (CUPTI unavailable)")
    codes = _decode_loader_codes(names, head_dim)
    if LOADERS_AT_99KB[head_dim] is None:
        assert codes == [] and any("generic_attn_kernel" in n for n in names), names
    else:
        assert len(codes) == 1 and codes[0] in LOADERS_AT_99KB[head_dim], names


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_under_a_99kb_budget(head_dim, dtype, smem_budget):
    """A ragged first prompt and a chunk after a past, on the mma.sync prefill (the kernel every
    GPU but sm90 runs), against the float64 reference."""
    smem_budget(SM86_BLOCK_BYTES)
    for case in (make_case("functional", batch=2, seq=300, num_heads=8, kv_num_heads=2, head_dim=head_dim,
                           capacity=None, first_prompt=True, dtype=DTYPES[dtype], rotary="half", device="cuda"),
                 make_case("inplace", batch=2, seq=70, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=500,
                           past_lengths=[400, 33], dtype=DTYPES[dtype], window=128, device="cuda")):
        run_and_check(case, rotary_ulps=1, suite="cuda_small_smem")
        torch.cuda.synchronize()
        gqa_torch.check_errors()
        names = _cuda_kernel_names(case.clone().run)
        if not names:
            pytest.skip("torch.profiler recorded no CUDA kernels here (CUPTI unavailable)")
        # (mma.sync configurations have four computing warps; the wgmma ones eight or twelve.)
        warps = [int(m.group(1)) for n in names
                 for m in [re.search(r"prefill_mma_kernel<[^,<>]+,\s*[\w:]*Config<\d+,\s*(\d+),", n)
                           or re.search(r"prefill_mma_kernelI\w+?ConfigILi\d+ELi(\d+)E", n)] if m]
        assert warps == [4], names


def test_a_kernel_past_the_budget_says_how_much_it_needs(smem_budget):
    """The generic kernel keeps two rows of head_size floats a warp (4 warps): 51,200 bytes at
    head size 1,600, past a 50,000-byte budget. The error names the kernel and both sizes."""
    smem_budget(50_000)
    case = make_case("functional", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=1600, capacity=8,
                     dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=r"gqa: generic_attn_kernel needs 51200 bytes of shared memory a block, "
                                           r"and this GPU allows 50000 \(a smaller head_size needs less\)"):
        case.run()
    smem_budget(0)
    run_and_check(make_case("functional", batch=1, seq=1, num_heads=2, kv_num_heads=1, head_dim=1600, capacity=8,
                            dtype=torch.float16, device="cuda"), suite="cuda_small_smem")
