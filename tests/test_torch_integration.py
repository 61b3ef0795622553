"""torch integration (DESIGN "Registration"): opcheck on both operators, fake/meta shapes, the
in-place op inside torch.compile(fullgraph=True) decode loops compared with eager, torch.export
of both (the in-place writes as buffer mutations) and an AOTInductor package of a decode step.

Compilation is slow on a 2-core CI machine, so there are few compile tests; the inductor one
compiles once and then runs several steps (no recompiles allowed).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import gqa_torch
from conftest import bits_equal, make_case
from reference import reference_gqa_

OPCHECK_FUNCTIONAL = [
    dict(batch=2, seq=3, capacity=6, rotary="half", sink=True),
    dict(batch=2, seq=1, capacity=8, packed=True, rotary="interleaved", position_ids="random", layout=1),
    dict(batch=3, seq=5, capacity=None, first_prompt=True, window=2, dtype=torch.float16, smooth=True),
    dict(batch=1, seq=2, capacity=4, dtype=torch.bfloat16, softcap=2.0, scale=0.3, rotary="half", rotary_dim=8,
         strided=True),
]
OPCHECK_INPLACE = [
    dict(batch=2, seq=1, capacity=8, packed=True, rotary="half", sink=True),
    dict(batch=2, seq=4, capacity=9, layout=1, dtype=torch.bfloat16, rotary="interleaved", window=3),
    dict(batch=1, seq=1, capacity=5, dtype=torch.float16, position_ids="offset", rotary="half", strided=True),
]


def _case(op, cfg):
    return make_case(op, poison_unused=False, **cfg)  # opcheck compares runs; keep NaN canaries out


@pytest.mark.parametrize("cfg", OPCHECK_FUNCTIONAL, ids=range(len(OPCHECK_FUNCTIONAL)))
def test_opcheck_functional(cfg):
    case = _case("functional", cfg)
    torch.library.opcheck(torch.ops.gqa.group_query_attention.default, case.op_args(), case.attrs)


@pytest.mark.parametrize("cfg", OPCHECK_INPLACE, ids=range(len(OPCHECK_INPLACE)))
def test_opcheck_inplace(cfg):
    case = _case("inplace", cfg)
    torch.library.opcheck(torch.ops.gqa.group_query_attention_.default, case.op_args(), case.attrs)


def test_inplace_schema_declares_mutation_and_returns_no_alias():
    schema = torch.ops.gqa.group_query_attention_.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["key_cache", "value_cache"]
    assert all(r.alias_info is None for r in schema.returns)
    functional = torch.ops.gqa.group_query_attention.default._schema
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in functional.arguments)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("packed", [False, True])
def test_fake_shapes_match_real(layout, packed):
    """The fake impls give the shapes, dtypes and strides-free layouts of the real op:
    C = max(P, total_sequence_length) for the functional presents, in the cache layout."""
    case = make_case("functional", batch=2, seq=2, capacity=5, past_lengths=[5, 1], layout=layout, packed=packed,
                     dtype=torch.float16, extra_total=3, poison_unused=False)
    real = case.clone().run()
    mode = FakeTensorMode()
    with mode:
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in case.op_args()]
        fake = torch.ops.gqa.group_query_attention.default(*fake_args, **case.attrs)
    for r, f in zip(real, fake):
        assert tuple(r.shape) == tuple(f.shape) and r.dtype == f.dtype
    assert real[1].shape[2 if layout == 0 else 1] == max(5, case.total_sequence_length) == 10

    inplace = make_case("inplace", batch=2, seq=3, capacity=7, layout=layout, packed=packed, poison_unused=False)
    real_out = inplace.clone().run()
    with mode:
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inplace.op_args()]
        fake_out = torch.ops.gqa.group_query_attention_.default(*fake_args, **inplace.attrs)
    assert tuple(fake_out.shape) == tuple(real_out.shape) and fake_out.dtype == real_out.dtype


def test_meta_tensors():
    case = make_case("functional", batch=2, seq=3, capacity=4, layout=1, poison_unused=False)
    meta = case.to("meta")
    out, pk, pv = torch.ops.gqa.group_query_attention.default(*meta.op_args(), **case.attrs)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 3, 64)
    assert tuple(pk.shape) == (2, max(4, case.total_sequence_length), 2, 16) and pk.device.type == "meta"


# ---- torch.compile --------------------------------------------------------------------------------

B, HQ, HKV, D, C = 2, 4, 2, 16, 24


def _decode_step(x, w, key_cache, value_cache, seqlens_k, cos, sin, sink):
    """One layer's decode step: projections, the in-place op, a residual."""
    qkv = x @ w  # [B, 1, (Hq + 2 Hkv) D], packed
    out = gqa_torch.group_query_attention_(qkv, None, None, key_cache, value_cache, seqlens_k, cos, sin, None, sink,
                                           num_heads=HQ, kv_num_heads=HKV, do_rotary=True, local_window_size=9)
    return x + 0.5 * out


def test_compile_fullgraph_decode_loop_inductor():
    """torch.compile(fullgraph=True) with inductor over a decode step: no graph break (fullgraph
    raises on one), no recompile as seqlens_k changes, outputs and caches equal to eager, and
    both equal to the reference."""
    torch._dynamo.reset()
    case = make_case("inplace", batch=B, seq=1, num_heads=HQ, kv_num_heads=HKV, head_dim=D, capacity=C,
                     past_lengths=[3, 11], rotary="half", sink=True, poison_unused=False)
    w = torch.randn(HQ * D, (HQ + 2 * HKV) * D) / 8
    eager_k, eager_v = case.cache_key.clone(), case.cache_value.clone()
    comp_k, comp_v = case.cache_key.clone(), case.cache_value.clone()
    compiled = torch.compile(_decode_step, fullgraph=True, backend="inductor")
    x = torch.randn(B, 1, HQ * D)
    seqlens = case.seqlens_k.clone()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            ref_k, ref_v = eager_k.clone(), eager_v.clone()
            eager = _decode_step(x, w, eager_k, eager_v, seqlens, case.cos_cache, case.sin_cache, case.head_sink)
            comp = compiled(x, w, comp_k, comp_v, seqlens, case.cos_cache, case.sin_cache, case.head_sink)
            torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
            assert bits_equal(comp_k, eager_k) and bits_equal(comp_v, eager_v), f"caches differ at step {step}"
            # The caches changed exactly where the reference says.
            qkv = x @ w
            r_out, r_k, r_v = reference_gqa_(qkv, None, None, ref_k, ref_v, seqlens, case.cos_cache, case.sin_cache,
                                             None, case.head_sink, num_heads=HQ, kv_num_heads=HKV, do_rotary=True,
                                             local_window_size=9)
            assert bits_equal(eager_k, r_k) and bits_equal(eager_v, r_v)
            torch.testing.assert_close(eager.double(), x.double() + 0.5 * r_out, rtol=1e-5, atol=1e-5)
            x = eager.detach().clone()
            seqlens = seqlens + 1


def test_compile_multilayer_decode_loop_aot_eager():
    """Three layers, each with its own cache, compiled once as a whole decode step (aot_eager:
    functionalization of the mutated caches, without inductor's compile time); five steps equal
    eager, and the graph has no break."""
    torch._dynamo.reset()
    layers = 3
    case = make_case("inplace", batch=B, seq=1, num_heads=HQ, kv_num_heads=HKV, head_dim=D, capacity=C,
                     past_lengths=[0, 6], rotary="interleaved", poison_unused=False)
    weights = [torch.randn(HQ * D, (HQ + 2 * HKV) * D) / 8 for _ in range(layers)]
    caches_e = [(torch.randn_like(case.cache_key), torch.randn_like(case.cache_value)) for _ in range(layers)]
    caches_c = [(k.clone(), v.clone()) for k, v in caches_e]

    def model(x, caches, seqlens):
        for w, (kc, vc) in zip(weights, caches):
            x = _decode_step(x, w, kc, vc, seqlens, case.cos_cache, case.sin_cache, None)
        return x

    explanation = torch._dynamo.explain(model)(torch.randn(B, 1, HQ * D), [(k.clone(), v.clone()) for k, v in caches_e],
                                               case.seqlens_k)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(B, 1, HQ * D)
    seqlens = case.seqlens_k.clone()
    for step in range(5):
        e = model(x, caches_e, seqlens)
        c = compiled(x, caches_c, seqlens)
        assert bits_equal(c, e), f"step {step}: compiled output differs from eager"
        for (ke, ve), (kc, vc) in zip(caches_e, caches_c):
            assert bits_equal(ke, kc) and bits_equal(ve, vc)
        x, seqlens = e, seqlens + 1


def test_compile_functional_op_no_graph_break():
    """The functional op traces too (total_sequence_length is a Python int)."""
    torch._dynamo.reset()
    case = make_case("functional", batch=2, seq=1, capacity=8, rotary="half", poison_unused=False)

    def f(q, k, v, pk, pv, sl):
        return gqa_torch.group_query_attention(q, k, v, pk, pv, sl, case.total_sequence_length, case.cos_cache,
                                               case.sin_cache, **case.attrs)

    args = (case.query, case.key, case.value, case.cache_key, case.cache_value, case.seqlens_k)
    explanation = torch._dynamo.explain(f)(*args)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(*args), f(*args)):
        assert bits_equal(a, b)


class _ExportedStep(torch.nn.Module):
    """A projection and the in-place op on the module's own cache buffers (a decode step)."""

    def __init__(self, batch, capacity, hq, hkv, d):
        super().__init__()
        self.hq, self.hkv = hq, hkv
        self.proj = torch.nn.Linear(hq * d, (hq + 2 * hkv) * d)
        self.register_buffer("key_cache", torch.randn(batch, hkv, capacity, d))
        self.register_buffer("value_cache", torch.randn(batch, hkv, capacity, d))

    def forward(self, x, seqlens_k, cos, sin):
        return torch.ops.gqa.group_query_attention_(self.proj(x), None, None, self.key_cache, self.value_cache,
                                                    seqlens_k, cos, sin, num_heads=self.hq, kv_num_heads=self.hkv,
                                                    do_rotary=True)


def test_torch_export_in_place_step_and_functional_op():
    """torch.export: the in-place op's cache writes become buffer mutations of the exported program
    (after run_decompositions, as AOTInductor takes it), and both ops run from the exported
    module with eager's results, caches included."""
    torch.manual_seed(0)
    B, C, Hq, Hkv, D = 2, 16, 4, 2, 16
    eager = _ExportedStep(B, C, Hq, Hkv, D).eval()
    start = {k: v.clone() for k, v in eager.state_dict().items()}
    x = torch.randn(B, 1, Hq * D)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    angle = torch.rand(32, D // 2) * 6.28
    args = (x, seqlens, angle.cos(), angle.sin())
    with torch.no_grad():
        program = torch.export.export(eager, args).run_decompositions()
        assert set(program.graph_signature.buffers_to_mutate.values()) == {"key_cache", "value_cache"}
        exported = program.module()
        exported.load_state_dict(start)
        got = exported(*args)
        want = eager(*args)  # eager's caches started from `start` too
    assert bits_equal(got, want)
    for name in ("key_cache", "value_cache"):
        assert bits_equal(getattr(exported, name), getattr(eager, name))
        assert not bits_equal(getattr(eager, name), start[name])  # the step wrote the caches

    case = make_case("functional", batch=2, seq=1, capacity=8, rotary="half", poison_unused=False)

    class Functional(torch.nn.Module):
        def forward(self, q, k, v, pk, pv, sl, cos, sin):
            return torch.ops.gqa.group_query_attention(q, k, v, pk, pv, sl, case.total_sequence_length, cos, sin,
                                                       **case.attrs)

    fargs = (case.query, case.key, case.value, case.cache_key, case.cache_value, case.seqlens_k, case.cos_cache,
             case.sin_cache)
    functional = torch.export.export(Functional(), fargs).run_decompositions().module()
    for a, b in zip(functional(*fargs), Functional()(*fargs)):
        assert bits_equal(a, b)


def test_aot_inductor_package_runs_decode_steps(tmp_path):
    """AOTInductor (torch._inductor.aoti_compile_and_package, what a C++ server deploys) compiles
    an exported decode step with the in-place op; the loaded package runs three steps with eager's
    outputs, each step reading the rows the one before appended to the package's own caches."""
    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        pytest.skip(f"torch {torch.__version__} has no torch._inductor.aoti_compile_and_package (torch >= 2.6)")
    torch.manual_seed(0)
    B, C, Hq, Hkv, D = 2, 16, 4, 2, 16
    eager = _ExportedStep(B, C, Hq, Hkv, D).eval()
    start = {k: v.clone() for k, v in eager.state_dict().items()}
    angle = torch.rand(32, D // 2) * 6.28
    cos, sin = angle.cos(), angle.sin()
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    x = torch.randn(B, 1, Hq * D)
    with torch.no_grad():
        program = torch.export.export(eager, (x, seqlens, cos, sin))
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "step.pt2"))
        loaded = torch._inductor.aoti_load_package(package)
        eager.load_state_dict(start)  # export traced with fake tensors; reset anyway
        for step in range(3):
            x = torch.randn(B, 1, Hq * D)
            want = eager(x, seqlens, cos, sin)
            got = loaded(x, seqlens, cos, sin)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
            seqlens = seqlens + 1
