"""Autograd (csrc/torch/ops.cpp): the operators have no backward, and say so.

Without an autograd kernel PyTorch would backprop through them as if their outputs did not
depend on their inputs, with only a warning: silently wrong gradients for anyone who fine-tunes
a model patched by gqa_torch.hf. What must hold: the forward with inputs that require grad
returns exactly what it returns without; backward through any output raises, naming the op;
nothing warns; and the in-place op bumps its caches' version counters like PyTorch's in-place
ops, so a graph that saved a cache before the op wrote it refuses to backprop.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

import gqa_torch
from conftest import bits_equal, make_case

OPS = {"functional": "gqa::group_query_attention", "inplace": "gqa::group_query_attention_"}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gqa_torch.cuda_kernels_available(), reason="needs the CUDA kernels and a CUDA device"))]


def decode(op, device="cpu"):
    return make_case(op, batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=16, capacity=12,
                     past_lengths=[5, 9], rotary="half", poison_unused=False, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("needs_grad", ["query", "key", "value", "sink"])
def test_backward_raises_and_the_forward_is_unchanged(op, needs_grad, device):
    case = decode(op, device) if needs_grad != "sink" else make_case(
        op, batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=16, capacity=12, past_lengths=[5, 9],
        sink=True, poison_unused=False, device=device)
    with torch.no_grad():
        expected = case.clone().run()
    graded = case.clone()
    attr = {"sink": "head_sink"}.get(needs_grad, needs_grad)
    getattr(graded, attr).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "no autograd kernel registered" warning included
        got = graded.run()
        got = got if isinstance(got, tuple) else (got,)
        expected = expected if isinstance(expected, tuple) else (expected,)
        for a, b in zip(got, expected):
            assert bits_equal(a.detach(), b)
        assert got[0].requires_grad
        with pytest.raises(RuntimeError, match=f"derivative for {OPS[op]} is not implemented"):
            got[0].float().sum().backward()


@pytest.mark.parametrize("op", list(OPS))
def test_no_grad_outputs_do_not_require_grad(op):
    case = decode(op)
    case.query.requires_grad_(True)
    with torch.no_grad():
        out = case.run()
    out = out if isinstance(out, tuple) else (out,)
    assert not any(t.requires_grad for t in out)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_bumps_cache_versions(device):
    """In grad mode, under no_grad and under inference mode (normal tensors); an inference
    tensor, which has no counter, is still written outside inference mode."""
    case = decode("inplace", device)
    for context in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        before = (case.cache_key._version, case.cache_value._version)
        with context():
            case.run()
        assert case.cache_key._version > before[0] and case.cache_value._version > before[1], context

    with torch.inference_mode():
        inference = decode("inplace", device)
        inference.run()
    assert inference.cache_key.is_inference()
    before = inference.cache_key.clone()
    inference.seqlens_k = inference.seqlens_k + 1  # a new (normal) tensor: the next slot
    inference.run()
    assert not torch.equal(inference.cache_key, before)


def test_a_graph_that_saved_a_cache_refuses_to_backprop_after_the_op_writes_it():
    case = decode("inplace")
    weight = torch.randn(case.cache_key.shape, requires_grad=True)
    loss = (weight * case.cache_key).sum()  # saves the cache for weight's gradient
    case.run()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_module_with_trainable_weights_refuses_backward():
    """What a fine-tuning user hits: a GroupQueryAttention layer's loss cannot backprop."""
    torch.manual_seed(0)
    layer = gqa_torch.GroupQueryAttention(64, 4, 2)
    assert layer.qkv_proj.weight.requires_grad
    out = layer(torch.randn(2, 3, 64))  # no cache: a prompt attends to itself
    with pytest.raises(RuntimeError, match="derivative for gqa::group_query_attention"):
        out.sum().backward()


@pytest.mark.filterwarnings("ignore:Error detected in torch.*NotImplemented:UserWarning")
def test_compile_with_inputs_that_require_grad_says_why_it_fails():
    """AOTAutograd traces the backward when it compiles a graph whose inputs require grad, so the
    missing backward shows at compile time (as for PyTorch's own custom ops without one); the
    README says to compile inference under torch.no_grad(), where the same graph compiles."""
    case = decode("inplace")
    projection = torch.nn.Linear(case.query.shape[-1], case.query.shape[-1])

    def step_on(graded):
        """A step on fresh caches (the op writes them), cloned outside the compiled code: older
        Dynamo (torch 2.4) does not trace dataclasses.replace, which Case.clone uses."""
        args = list(graded.op_args())

        def step(hidden):
            args[0] = projection(hidden)
            return gqa_torch.group_query_attention_(*args, **graded.attrs)
        return step

    hidden = torch.randn(case.query.shape)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="derivative for gqa::group_query_attention_ is not implemented"):
        torch.compile(step_on(case.clone()), backend="aot_eager", fullgraph=True)(hidden)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(step_on(case.clone()), backend="aot_eager", fullgraph=True)(hidden)
        assert bits_equal(out, step_on(case.clone())(hidden))
    torch._dynamo.reset()


def test_compiled_step_runs_a_model_whose_weights_require_grad():
    """gqa_torch.graphs.CompiledStep runs its step under torch.no_grad(), so a decode step of a
    layer with trainable weights compiles (on the CPU here, with Inductor's default mode)."""
    from gqa_torch.graphs import CompiledStep
    torch.manual_seed(0)
    layer = gqa_torch.GroupQueryAttention(32, 4, 2)
    cache = gqa_torch.KVCache(1, 2, 2, 8, 16)
    reference_cache = gqa_torch.KVCache(1, 2, 2, 8, 16)
    prompt = torch.randn(2, 3, 32)
    with torch.no_grad():
        layer(prompt, cache, 0)
        layer(prompt, reference_cache, 0)
    torch._dynamo.reset()
    step = CompiledStep(lambda x: layer(x, cache, 0), mode="default")
    for _ in range(3):
        x = torch.randn(2, 1, 32)
        got = step(x)
        with torch.no_grad():
            expected = layer(x, reference_cache, 0)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not got.requires_grad
    torch._dynamo.reset()
