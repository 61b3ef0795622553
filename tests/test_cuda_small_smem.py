"""GPUs with less shared memory a block than an H100 or H200 (227 KB): 99 KB on sm86, sm89 and
sm120 (RTX 30xx/40xx/50xx, A10, L4, L40S), 163 KB on sm80 (A100).

The tensor-core decode kernel's stages need 104-109 KB at head sizes 96, 128 and 256, so there
the launch takes the generic kernel instead (kernels/launch.cu, decode_mma_fits). These tests run
that choice on the H200 under a budget (gqa_torch._C._set_smem_limit): a kernel that asks for
more than the budget throws, so a decode that still took the tensor-core kernel would fail here.
"""
from __future__ import annotations

import pytest
import torch

import gqa_torch
from conftest import DTYPES, make_case, requires_cuda, run_and_check

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


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("op", ["inplace", "functional"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_decode_under_a_99kb_budget_matches_the_reference(head_dim, dtype, op, features, smem_budget):
    """Decode with ragged rows, on the path a 99 KB GPU takes, against the float64 reference
    (outputs poisoned first; caches and guard regions checked)."""
    smem_budget(SM86_BLOCK_BYTES)
    case = make_case(op, batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=700,
                     past_lengths=[650, 5, 301], dtype=DTYPES[dtype], device="cuda", **FEATURES[features])
    run_and_check(case, rotary_ulps=1, suite="cuda_small_smem")
    torch.cuda.synchronize()
    gqa_torch.check_errors()


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
