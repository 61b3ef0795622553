"""Other GPUs than the H100/H200 the kernels are tuned on, imitated or met on an H200.

GPUs with less shared memory a block than sm90's 227 KB, and without its sm90a kernels (TMA,
wgmma): 99 KB on sm86, sm89 and sm120 (RTX 30xx/40xx/50xx, A10, L4, L40S). There the
tensor-core decode kernel's usual cp.async stages fit at head sizes 64 and 80; at 96 and 128
(107-108 KB) the launch takes two warps a CTA (56 KB), and at 256 one (59 KB)
(kernels/decode_cfg.cuh, decode_smem_fit). These tests run those choices on the H200 under a budget
(gqa_torch._C._set_smem_limit), which also leaves the sm90a kernels out: a kernel that asks for
more than the budget throws, so a decode that took a kernel too large would fail here, and the
profiler's kernel names show which one ran.

And a build with no code for the GPU in use (sm80 only, on the H200): its first call must say so.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import gqa_torch
from conftest import DTYPES, make_case, requires_cuda, run_and_check
from cuda_common import cuda_kernel_names_or_skip, decode_loader_codes, shares_forced

pytestmark = [pytest.mark.cuda, requires_cuda]

SM86_BLOCK_BYTES = 99 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm86, sm89 and sm120
SM80_BLOCK_BYTES = 163 * 1024  # ... on sm80 (A100)


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
# each head size: the four-warp cp.async ones (0 as such, 4 in three stages, 5 one tile ahead)
# and the narrow one (9: two warps at 96 and 128, one at 256).
LOADERS_AT_99KB = {64: {0, 4}, 80: {0, 5}, 96: {9}, 128: {9}, 256: {9}}


def _ragged_decode(head_dim, dtype, op, features):
    return make_case(op, batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=700,
                     past_lengths=[650, 5, 301], dtype=DTYPES[dtype], device="cuda", **FEATURES[features])


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("op", ["inplace", "functional"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", list(LOADERS_AT_99KB))
def test_decode_under_a_99kb_budget(head_dim, dtype, op, features, smem_budget):
    """Decode with ragged rows, on the path a 99 KB GPU takes, against the float64 reference
    (outputs poisoned first; caches and guard regions checked)."""
    smem_budget(SM86_BLOCK_BYTES)
    run_and_check(_ragged_decode(head_dim, dtype, op, features), rotary_ulps=1, suite="cuda_small_smem")
    torch.cuda.synchronize()
    gqa_torch.check_errors()


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("op", ["inplace", "functional"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", list(LOADERS_AT_99KB))
def test_decode_under_a_99kb_budget_takes_a_loader_that_fits(head_dim, dtype, op, features, smem_budget):
    """The decode kernel that test_decode_under_a_99kb_budget's call runs, by its loader."""
    smem_budget(SM86_BLOCK_BYTES)
    names = cuda_kernel_names_or_skip(_ragged_decode(head_dim, dtype, op, features).run)
    codes = decode_loader_codes(names, head_dim)
    assert len(codes) == 1 and codes[0] in LOADERS_AT_99KB[head_dim], names


def _many_ragged_rows(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    lengths = torch.randint(0, 1500, (70,), generator=gen).tolist()
    return make_case("inplace", batch=70, seq=1, num_heads=4, kv_num_heads=2, head_dim=head_dim, capacity=1600,
                     past_lengths=lengths, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_under_a_99kb_budget_more_rows_than_threads(head_dim, smem_budget):
    """70 ragged rows in place: more rows than the narrow kernel's CTA has threads (64 at head
    size 128, 32 at 256), where it keeps the rows in order instead of ranking them."""
    smem_budget(SM86_BLOCK_BYTES)
    run_and_check(_many_ragged_rows(head_dim), suite="cuda_small_smem")
    torch.cuda.synchronize()
    gqa_torch.check_errors()


@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_under_a_99kb_budget_more_rows_than_threads_runs_the_narrow_loader(head_dim, smem_budget):
    """The kernel that the test above checks is the narrow one (loader code 9)."""
    smem_budget(SM86_BLOCK_BYTES)
    names = cuda_kernel_names_or_skip(_many_ragged_rows(head_dim).run)
    assert decode_loader_codes(names, head_dim) == [9], names


def _bytes_allocated_by(call):
    """The most memory PyTorch's caching allocator handed out during call() beyond what was held
    before it: the op's output and its workspace."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("budget", [SM80_BLOCK_BYTES, SM86_BLOCK_BYTES])
@pytest.mark.parametrize("head_dim,batch,num_heads,capacity", [(128, 9, 16, 8192), (64, 12, 32, 4096)])
def test_decode_without_tma_loaders_takes_16_splits_in_the_partition_bands(head_dim, batch, num_heads, capacity,
                                                                           budget, smem_budget):
    """Shapes inside the balanced partition's bands (72 items at head size 128, 96 at 64), where
    its kernel cannot run (it is built on the TMA loaders alone): the call plans 16 splits an
    item. Its workspace holds as many splits' partial outputs as the partition forced on (which
    the launch runs as the same 16 splits), at least 12 splits' more than a pinned grid of 4;
    and both calls match the reference (ragged rows)."""
    smem_budget(budget)

    def case():
        return make_case("inplace", batch=batch, seq=1, num_heads=num_heads, kv_num_heads=8, head_dim=head_dim,
                         capacity=capacity, dtype=torch.bfloat16, device="cuda")

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = gqa_torch._C._decode_plan(batch, num_heads, 8, capacity, sms, head_dim=head_dim, tma_kernels=False)
    assert plan["shares"] == 0 and plan["max_splits"] == 16, plan
    auto_bytes = _bytes_allocated_by(case().run)
    with shares_forced():
        forced_bytes = _bytes_allocated_by(case().run)
        run_and_check(case(), suite="cuda_small_smem")
    run_and_check(case(), suite="cuda_small_smem")
    assert auto_bytes == forced_bytes, (auto_bytes, forced_bytes)
    # A pinned grid of 4 splits asks for 12 splits' partial outputs fewer (batch x num_heads x
    # head_dim floats a split): the measure tells the split counts apart.
    gqa_torch._C._set_decode_split_override(4, 0)
    try:
        pinned_bytes = _bytes_allocated_by(case().run)
    finally:
        gqa_torch._C._set_decode_split_override(0, 0)
    assert auto_bytes - pinned_bytes >= 12 * batch * num_heads * head_dim * 4, (auto_bytes, pinned_bytes)
    torch.cuda.synchronize()
    gqa_torch.check_errors()


def _prefill_cases(head_dim, dtype):
    """A ragged first prompt with RoPE, and a windowed chunk after a past."""
    return (make_case("functional", batch=2, seq=300, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=None,
                      first_prompt=True, dtype=DTYPES[dtype], rotary="half", device="cuda"),
            make_case("inplace", batch=2, seq=70, num_heads=8, kv_num_heads=2, head_dim=head_dim, capacity=500,
                      past_lengths=[400, 33], dtype=DTYPES[dtype], window=128, device="cuda"))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_under_a_99kb_budget(head_dim, dtype, smem_budget):
    """A ragged first prompt and a chunk after a past, on the mma.sync prefill (the kernel every
    GPU but sm90 runs), against the float64 reference."""
    smem_budget(SM86_BLOCK_BYTES)
    for case in _prefill_cases(head_dim, dtype):
        run_and_check(case, rotary_ulps=1, suite="cuda_small_smem")
        torch.cuda.synchronize()
        gqa_torch.check_errors()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_under_a_99kb_budget_runs_the_mma_sync_kernel(head_dim, dtype, smem_budget):
    """The prefill kernel those cases run is an mma.sync configuration: four computing warps
    (the wgmma ones have eight or twelve)."""
    smem_budget(SM86_BLOCK_BYTES)
    for case in _prefill_cases(head_dim, dtype):
        names = cuda_kernel_names_or_skip(case.run)
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM80_ONLY = os.path.join(ROOT, ".variants", "sm80_only.so.xz")


def test_a_build_without_code_for_this_gpu_says_how_to_rebuild(tmp_path):
    """An extension built for sm80 alone, imported on an sm90 GPU: cuda_kernels_available() says
    False, the first CUDA call raises with the GPU's name, its compute capability and the
    TORCH_CUDA_ARCH_LIST to rebuild with (not CUDA's bare "no kernel image is available"), and
    the CPU backend still runs."""
    if not os.path.exists(SM80_ONLY):
        pytest.skip("needs .variants/sm80_only.so.xz: `bash scripts/pack_arch_build.sh 8.0 sm80_only` on the build "
                    "machine, carried to this one")
    major, minor = torch.cuda.get_device_capability()
    if major == 8:
        pytest.skip("sm80 code runs on this GPU")
    package = tmp_path / "gqa_torch"
    shutil.copytree(os.path.join(ROOT, "gqa_torch"), package,
                    ignore=shutil.ignore_patterns("_C.*.so", "_build_info.py", "__pycache__"))
    so_name = os.path.basename(gqa_torch._C.__file__)
    subprocess.run(f"xz -dc {SM80_ONLY} > {package / so_name}", shell=True, check=True)
    shutil.copy(SM80_ONLY.replace(".so.xz", ".build_info.py"), package / "_build_info.py")
    script = """
import torch, gqa_torch
assert gqa_torch.build_info()["cuda_archs"] == "8.0", gqa_torch.build_info()
assert not gqa_torch.cuda_kernels_available() and gqa_torch._C._cuda_device_support(0) == 2
assert gqa_torch.build_info()["cuda_kernels_available"] is False
gqa_torch.check_errors()  # (nothing ran there: no word to read, no error)
def call(device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4 * 64, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(1, 1, 2 * 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
    kc, vc = (torch.zeros(1, 2, 16, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([5], dtype=torch.int32, device=device)
    return gqa_torch.group_query_attention_(q, k, v, kc, vc, seqlens, num_heads=4, kv_num_heads=2)
call("cpu")
call("cuda")
"""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    arch = "9.0a" if (major, minor) == (9, 0) else f"{major}.{minor}"
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr[-3000:])
    expected = (f"gqa: this build of gqa_torch has no CUDA code for cuda:0 ({torch.cuda.get_device_name()}, compute "
                f"capability {major}.{minor}); gqa_torch.build_info()['cuda_archs'] lists the architectures it was "
                f"built for. Rebuild it for this GPU: on a machine with the GPU the build targets it by default, or set "
                f'TORCH_CUDA_ARCH_LIST="{arch}" (README, Install).')
    assert expected in result.stderr, result.stderr[-3000:]
