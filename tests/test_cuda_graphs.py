"""GPU tests of decode under CUDA graphs and streams (50 replays with changing lengths and
positions, two streams at once, a graph beside eager calls on its capture stream, the arrival
counters' lanes), torch.compile(mode="reduce-overhead") over a multi-layer decode loop, and the
sticky device error word (SPEC §4). Skipped, with the reason printed, without CUDA kernels or
a CUDA device.
"""
from __future__ import annotations

import copy
import gc
import os
import random
import time
import warnings

import pytest
import torch

import gqa_torch
from gqa_torch import errors as gerr
from conftest import assert_output_close, bits_equal, check_caches, make_case, requires_cuda, run_and_check
from cuda_common import (ROTARY_ULPS, assert_untouched_except_valid_rows, capture_in_graph,
                         decode_pinned, inplace_step, replay_with_fresh_inputs_and_check)


pytestmark = [pytest.mark.cuda, requires_cuda, pytest.mark.usefixtures("clean_error_word")]


def _assert_each_matches_reference(outs, cases, befores):
    """Each in-place decode output, and its case's caches, against the float64 reference of the
    case's state before the call."""
    for out, case, before in zip(outs, cases, befores):
        ref_out, ref_k, ref_v = before.reference()
        assert_output_close(out, ref_out, before, suite="cuda")
        check_caches(before, case.cache_key, case.cache_value, ref_k, ref_v, rotary_ulps=ROTARY_ULPS)


@pytest.mark.parametrize("merge,max_splits,schedule", [("auto", 0, "auto"), ("arrival", 0, "auto"),
                                                       ("arrival", 5, "auto"), ("arrival", 5, "longest_first"),
                                                       ("kernel", 3, "longest_first")])
def test_cuda_graph_decode_replay_50_steps(merge, max_splits, schedule):
    """A decode step captured once and replayed 50 times while seqlens_k, position_ids and the
    inputs change: every replay is checked against the reference (output and caches). With the
    plan's splits (2 here; auto merges them in the launch, by the last to finish) and with the
    splits merged by the last one to finish, in 2 and in up to 5 splits (the captured arrival
    counters must be zero again after every replay); and with the rows taken longest first,
    which the captured kernel ranks anew from each replay's lengths."""
    with decode_pinned(merge, max_splits, 1 if max_splits else 0, schedule):
        _graph_decode_replay_50_steps()


@pytest.mark.parametrize("merge,schedule", [("auto", "auto"), ("arrival", "auto"), ("arrival", "longest_first")])
def test_cuda_decode_on_two_streams_at_once(merge, schedule):
    """Decode calls in flight on two streams at once, each in 16 splits merged in the launch by
    the last split to finish: every output and cache matches the reference. Each stream has its
    own arrival counters; shared ones would let a split of one call count as another call's
    last and merge partials not yet written."""
    cases = [make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=1500,
                       past_lengths=[1400 - 37 * i, 700 + 53 * i], dtype=torch.bfloat16, device="cuda")
             for i in range(12)]
    befores = [c.clone() for c in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    with decode_pinned(merge, 16, 1, schedule):
        outs = []
        for i, case in enumerate(cases):
            with torch.cuda.stream(streams[i % 2]):
                outs.append(case.run())
        torch.cuda.synchronize()
    gqa_torch.check_errors()
    _assert_each_matches_reference(outs, cases, befores)


def test_cuda_decode_graph_beside_eager_calls_on_its_capture_stream():
    """A decode graph captured on stream s1 (16 splits merged by the last to finish) is replayed
    on stream s2 while eager calls run on s1: the capture took arrival counters of its own, not
    s1's, so neither side counts the other's splits, and every output and cache matches the
    reference. (Each replay appends the same row and reads the same keys, so five replays leave
    what one leaves.)"""
    with decode_pinned("arrival", 16, 1):
        def decode_case(i):
            return make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=1500,
                             past_lengths=[1400 - 41 * i, 700 + 29 * i], dtype=torch.bfloat16, device="cuda",
                             poison_unused=False)

        static = decode_case(0)
        start_k, start_v = static.cache_key.clone(), static.cache_value.clone()

        def step():
            return gqa_torch.group_query_attention_(*static.op_args(), **static.attrs)

        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s1):
            graph_out = step()
        static.cache_key.copy_(start_k)
        static.cache_value.copy_(start_v)
        before_graph = static.clone()
        eager = [decode_case(i) for i in range(1, 11)]
        befores = [c.clone() for c in eager]
        torch.cuda.synchronize()
        outs = []
        for i, case in enumerate(eager):
            if i % 2 == 0:
                with torch.cuda.stream(s2):
                    graph.replay()
            with torch.cuda.stream(s1):
                outs.append(case.run())
        torch.cuda.synchronize()
    gqa_torch.check_errors()
    ref_out, ref_k, ref_v = before_graph.reference()
    assert_output_close(graph_out, ref_out, before_graph, suite="cuda_graph")
    check_caches(before_graph, static.cache_key, static.cache_value, ref_k, ref_v, rotary_ulps=ROTARY_ULPS)
    _assert_each_matches_reference(outs, eager, befores)


def _under_compute_sanitizer():
    """True when compute-sanitizer runs this process: it sets NV_SANITIZER_INJECTION_* variables
    for the library it injects (seen with compute-sanitizer 13.0 on the H200)."""
    return any(k.startswith("NV_SANITIZER_INJECTION") for k in os.environ)


def _settled_lanes_held(timeout_s=10.0):
    """The lanes of arrival counters held on this device, once the count has stopped changing
    (a destroyed graph's lane comes back from a CUDA thread, some time after the graph goes), or
    the last count seen after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last, steady = None, 0
    while True:
        gc.collect()
        torch.cuda.synchronize()
        held = gqa_torch._C._arrival_lanes_held(torch.cuda.current_device())
        steady = steady + 1 if held == last else 0
        last = held
        if steady >= 5 or time.monotonic() > deadline:
            return held
        time.sleep(0.02)


def test_cuda_graph_lanes_come_back_with_their_graphs():
    """Each CUDA graph that captures a decode call holds a lane of arrival counters of its own
    (graphs replayed on two streams at once must not share counters), and destroying the graph
    gives the lane back. Five live graphs hold five more lanes and give all five back. Then 300
    captures in turn, each destroyed before the next (there are 256 lanes), leave the count
    where it started, and every 50th replay matches the reference. (Each capture used to keep its
    lane for good: past the 256th, decode calls merged their splits in the slower merge kernel.)
    The captures take no warm-up on side streams, whose eager calls would hold lanes of their
    own."""
    with decode_pinned("arrival", 16, 1):
        static = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=600,
                           past_lengths=[500, 300], dtype=torch.bfloat16, device="cuda", poison_unused=False)
        inplace_step(static)  # (the error word and this stream's lane exist before the count)
        start = _settled_lanes_held()
        graphs = []
        for _ in range(5):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                inplace_step(static)
            graphs.append(graph)
        assert _settled_lanes_held() == start + 5
        del graphs, graph
        held = _settled_lanes_held()
        if held != start and _under_compute_sanitizer():
            pytest.skip(f"under compute-sanitizer the destroyed graphs' user objects were not released "
                        f"({held - start} of 5 lanes still held): the lanes cannot come back here")
        assert held == start
        for i in range(300):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = inplace_step(static)
            if i % 50 == 49:
                replay_with_fresh_inputs_and_check(graph, static, out, [100 + i, 17 + i])
            else:
                graph.replay()
            del graph, out
        assert _settled_lanes_held() == start


def _lane_warnings(capture, capfd):
    """The "every lane is held" warnings given while `capture()` runs. A TORCH_WARN in a custom
    op reaches C++'s warning handler, which writes it to stderr (seen with torch 2.11), not
    Python's warnings; both are read."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = capture()
    said = [str(w.message) for w in caught] + capfd.readouterr().err.splitlines()
    return result, [text for text in said if "lanes of decode arrival counters" in text]


def test_cuda_decode_with_every_lane_held_warns_and_merges_in_the_kernel(capfd):
    """With all 256 lanes of arrival counters held (live graphs that each captured a decode
    call), a capture that needs a lane of its own finds none: it warns, naming the lanes and how
    to give them back, and its decode call merges the splits in the merge kernel, whose replay
    matches the reference. A second such capture does not warn again; once a graph is destroyed
    its lane serves the next capture, and the one after it, finding every lane held again, warns
    again. Destroying the graphs gives every lane back, and the next capture takes one again and
    matches too."""
    device = torch.cuda.current_device()

    def capture(pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = inplace_step(static)
        return graph, out

    with decode_pinned("arrival", 16, 1):
        static = make_case("inplace", batch=2, seq=1, num_heads=8, kv_num_heads=2, head_dim=128, capacity=600,
                           past_lengths=[500, 300], dtype=torch.bfloat16, device="cuda", poison_unused=False)
        inplace_step(static)  # (the error word and this stream's lane exist before the count)
        start = _settled_lanes_held()
        assert start < 256
        graphs, pool = [], None
        while gqa_torch._C._arrival_lanes_held(device) < 256 and len(graphs) < 300:
            graphs.append(capture(pool)[0])
            pool = graphs[-1].pool()
        assert _settled_lanes_held() == 256

        (laneless, laneless_out), said = _lane_warnings(lambda: capture(pool), capfd)
        assert len(said) == 1, said
        assert "all 256 lanes" in said[0] and "Destroying CUDA graphs" in said[0], said
        assert _settled_lanes_held() == 256
        replay_with_fresh_inputs_and_check(laneless, static, laneless_out, [431, 250])
        (second, second_out), said = _lane_warnings(lambda: capture(pool), capfd)
        assert said == []
        replay_with_fresh_inputs_and_check(second, static, second_out, [98, 577])

        del graphs[0]
        held = _settled_lanes_held()
        if held == 256 and _under_compute_sanitizer():
            pytest.skip("under compute-sanitizer a destroyed graph's user object was not released: its lane "
                        "cannot come back here")
        assert held == 255
        (taker, _), said = _lane_warnings(lambda: capture(pool), capfd)
        assert said == [] and _settled_lanes_held() == 256
        (third, _), said = _lane_warnings(lambda: capture(pool), capfd)
        assert len(said) == 1, said

        del graphs, laneless, laneless_out, second, second_out, taker, third
        assert _settled_lanes_held() == start
        graph, out = capture(None)
        assert _settled_lanes_held() == start + 1
        replay_with_fresh_inputs_and_check(graph, static, out, [377, 512])


def _graph_decode_replay_50_steps():
    B, Hq, Hkv, D, C = 3, 8, 2, 64, 96
    rng = random.Random(5)
    case = make_case("inplace", batch=B, seq=1, num_heads=Hq, kv_num_heads=Hkv, head_dim=D, capacity=C,
                     past_lengths=[5, 10, 20], rotary="half", position_ids="random", max_positions=200, sink=True,
                     window=40, device="cuda", poison_unused=False)
    static = case.clone()
    start_k, start_v = static.cache_key.clone(), static.cache_value.clone()

    graph, static_out = capture_in_graph(lambda: inplace_step(static), warmups=2)
    static.cache_key.copy_(start_k)
    static.cache_value.copy_(start_v)
    torch.cuda.synchronize()

    for _ in range(50):
        static.position_ids.copy_(torch.randint(0, 200, (B, 1), dtype=torch.int64))
        replay_with_fresh_inputs_and_check(graph, static, static_out, [rng.randint(0, C - 1) for _ in range(B)])


def test_cuda_graph_replay_with_bad_row_sets_flags():
    """A bad seqlens_k during a replay sets the word; check_errors() after the replay raises
    with the flags, and the bad row's output is NaN."""
    case = make_case("inplace", batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=64, capacity=32,
                     past_lengths=[3, 4], device="cuda", poison_unused=False)

    def check_errors_refused():
        with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
            gqa_torch.check_errors()

    graph, out = capture_in_graph(case.run, during_capture=check_errors_refused)
    case.seqlens_k.copy_(torch.tensor([5, 40], dtype=torch.int32, device="cuda"))  # row 1: total 41 > 32
    k_before = case.cache_key.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    assert bits_equal(case.cache_key[1], k_before[1])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == gerr.CAPACITY
    gqa_torch.check_errors()  # cleared


def _captured_decode_loop(case, steps, poison_at=None, bad_row=1, resume_after=2):
    """Runs a decode loop of `steps` graph replays of one captured in-place call (fresh copies of
    the case's caches, the same per-step inputs from a fixed seed). With `poison_at`, that step's
    seqlens_k of `bad_row` is past the capacity; `resume_after` more steps then run while the
    word is still set, the word is checked (its GQAError returned) and cleared, and the loop
    repeats the poisoned step and goes on with valid inputs. Returns per executed step the
    output and both caches (clones), and the GQAError (or None)."""
    static = case.clone()
    C = static.cache_key.shape[2]
    gen = torch.Generator().manual_seed(11)
    inputs = [tuple(torch.randn(t.shape, generator=gen).to(t.dtype) for t in (static.query, static.key, static.value))
              for _ in range(steps)]
    pasts = static.seqlens_k.cpu()  # the case's past lengths (S = 1: seqlens_k = past)

    def load(t, poisoned=False):
        for dst, src in zip((static.query, static.key, static.value), inputs[t]):
            dst.copy_(src)
        seq = pasts + t  # one new token per step: total = past + t + 1
        if poisoned:
            seq[bad_row] = C + 5
        static.seqlens_k.copy_(seq)

    def call():
        return gqa_torch.group_query_attention_(static.query, static.key, static.value, static.cache_key,
                                                static.cache_value, static.seqlens_k, **static.attrs)

    load(0)  # the warm-up call writes exactly what step 0 writes
    graph, out = capture_in_graph(call)

    record, error = [], None

    def replay(t, poisoned=False):
        load(t, poisoned)
        graph.replay()
        torch.cuda.synchronize()
        record.append((t, out.clone(), static.cache_key.clone(), static.cache_value.clone()))

    t = 0
    while t < steps:
        if t == poison_at and error is None:
            replay(t, poisoned=True)
            for later in range(t + 1, min(steps, t + 1 + resume_after)):
                replay(later)  # valid inputs, but the word is still set
            with pytest.raises(gqa_torch.GQAError) as info:
                gqa_torch.check_errors()
            error = info.value
            gqa_torch.check_errors()  # raising cleared it
            continue  # the poisoned step again, now valid
        replay(t)
        gqa_torch.check_errors()
        t += 1
    return record, error


def test_poisoned_step_in_a_captured_decode_loop():
    """SPEC §4 under CUDA graphs: one replay of a captured decode loop gets an out-of-range
    seqlens_k for one row. That replay and the later ones (valid inputs) write nothing and
    output NaN, because the word is sticky; the flags decode to the capacity message; up to
    the poisoned step every output and cache byte equals a clean run's; after the word is
    cleared, the loop repeats the poisoned step and every later step equals the clean run."""
    case = make_case("inplace", batch=3, seq=1, num_heads=8, kv_num_heads=2, head_dim=64, capacity=40,
                     past_lengths=[4, 9, 17], device="cuda", poison_unused=False)
    steps, poison_at, resume_after = 10, 4, 2
    clean, no_error = _captured_decode_loop(case, steps)
    assert no_error is None and [t for t, *_ in clean] == list(range(steps))
    poisoned, error = _captured_decode_loop(case, steps, poison_at=poison_at, resume_after=resume_after)

    assert error.flags == gerr.CAPACITY, error.flags
    assert gerr.FLAG_MESSAGES[4] in str(error), str(error)  # bit 4 is flag 16
    order = [t for t, *_ in poisoned]
    assert order == list(range(poison_at + 1 + resume_after)) + list(range(poison_at, steps)), order

    clean_by_step = {t: rest for t, *rest in clean}
    for t, out, k, v in poisoned[:poison_at]:  # before the poisoned step: identical to the clean run
        c_out, c_k, c_v = clean_by_step[t]
        assert bits_equal(out, c_out) and bits_equal(k, c_k) and bits_equal(v, c_v), f"step {t}"
    _, k_before, v_before = clean_by_step[poison_at - 1]
    for t, out, k, v in poisoned[poison_at:poison_at + 1 + resume_after]:  # poisoned step and the skipped ones
        assert torch.isnan(out).all(), f"step {t}: outputs must be NaN while the word is set"
        assert bits_equal(k, k_before) and bits_equal(v, v_before), f"step {t}: a cache was written"
    for t, out, k, v in poisoned[poison_at + 1 + resume_after:]:  # after clear: the loop runs on correctly
        c_out, c_k, c_v = clean_by_step[t]
        assert torch.isfinite(out).all(), f"step {t} after clear"
        assert bits_equal(out, c_out) and bits_equal(k, c_k) and bits_equal(v, c_v), f"step {t} after clear"


class _Decoder(torch.nn.Module):
    def __init__(self, layers, batch, capacity, hq, hkv, d):
        super().__init__()
        self.hq, self.hkv = hq, hkv
        self.proj = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(hq * d, (hq + 2 * hkv) * d) / d ** 0.5) for _ in range(layers)])
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.randn(batch, hkv, capacity, d))
            self.register_buffer(f"v{i}", torch.randn(batch, hkv, capacity, d))
        self.layers = layers

    def mark_caches_static(self):
        # The caches are mutated in place; as static addresses CUDA graphs may capture that.
        for i in range(self.layers):
            torch._dynamo.mark_static_address(getattr(self, f"k{i}"))
            torch._dynamo.mark_static_address(getattr(self, f"v{i}"))

    def forward(self, x, seqlens_k, cos, sin):
        for i in range(self.layers):
            qkv = x @ self.proj[i]
            out = gqa_torch.group_query_attention_(qkv, None, None, getattr(self, f"k{i}"), getattr(self, f"v{i}"),
                                                   seqlens_k, cos, sin, num_heads=self.hq, kv_num_heads=self.hkv,
                                                   do_rotary=True)
            x = x + out
        return x


@torch.no_grad()
def test_compile_reduce_overhead_multilayer_decode():
    """torch.compile(mode="reduce-overhead", fullgraph=True) over a 4-layer decode step, run for
    12 steps with growing ragged seqlens: equal to eager at every step, caches too, and
    inductor captured it in CUDA graphs (no cudagraph skip)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    B, C, Hq, Hkv, D = 2, 64, 8, 2, 64
    eager = _Decoder(4, B, C, Hq, Hkv, D).cuda()
    compiled_model = copy.deepcopy(eager)
    compiled_model.mark_caches_static()
    compiled = torch.compile(compiled_model, mode="reduce-overhead", fullgraph=True)
    angle = torch.rand(128, D // 2, device="cuda") * 6.28
    cos, sin = angle.cos(), angle.sin()
    seqlens = torch.tensor([3, 17], dtype=torch.int32, device="cuda")
    skips_before = counters["inductor"].get("cudagraph_skips", 0)
    x = torch.randn(B, 1, Hq * D, device="cuda")
    for step in range(12):
        torch.compiler.cudagraph_mark_step_begin()
        y_c = compiled(x, seqlens, cos, sin).clone()
        y_e = eager(x, seqlens, cos, sin)
        torch.testing.assert_close(y_c, y_e, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        for i in range(4):
            torch.testing.assert_close(getattr(compiled_model, f"k{i}"), getattr(eager, f"k{i}"), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(getattr(compiled_model, f"v{i}"), getattr(eager, f"v{i}"), rtol=1e-4, atol=1e-4)
        x = y_e / y_e.norm(dim=-1, keepdim=True) * 8
        seqlens = seqlens + 1
    assert counters["inductor"].get("cudagraph_skips", 0) == skips_before, "inductor skipped CUDA graphs"
    gqa_torch.check_errors()


def _bad_inplace_case(bad: str, strided=True, rotary=False):
    """B = 3, row 1 broken by `bad`; caches are views into guarded, poisoned buffers."""
    case = make_case("inplace", batch=3, seq=2, num_heads=4, kv_num_heads=2, head_dim=64, capacity=16,
                     past_lengths=[3, 5, 7], strided=strided, rotary="half" if rotary or bad == "position" else None,
                     position_ids="offset" if bad == "position" else None, max_positions=32, device="cuda",
                     poison_unused=False)
    expected = {
        "overflow": (2**31 - 1, gerr.TOTAL_OVERFLOW | gerr.CAPACITY),
        "negative": (0, gerr.PAST_NEGATIVE | gerr.QUERY_NEGATIVE),
        "capacity": (16, gerr.CAPACITY),
        "position": (None, gerr.POSITION),
    }[bad]
    if bad == "position":
        case.position_ids[1, 1] = 32
    else:
        case.seqlens_k[1] = expected[0]
    return case, expected[1]


@pytest.mark.parametrize("bad", ["overflow", "negative", "capacity", "position"])
def test_error_word_inplace_deferred(bad):
    """In-place, asynchronous default: no exception at the call; the violating row writes
    nothing (guard regions and rows outside the targets byte-identical) and its output is NaN;
    check_errors() raises GQAError with the flags and clears them."""
    case, flags = _bad_inplace_case(bad)
    before = case.clone()
    out = case.run()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all(), "the violating row's output must be NaN"
    assert_untouched_except_valid_rows(before, case, written_rows=[0, 2])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags, f"flags {info.value.flags} != {flags}"
    assert info.value.violations == gerr.decode_flags(flags)
    gqa_torch.check_errors()  # cleared: no second raise
    assert int(gqa_torch._C.error_word(torch.cuda.current_device()).item()) == 0


def test_error_word_is_sticky_until_cleared():
    """After a flagged call, later valid calls skip their writes and output NaN, until
    check_errors() raises and clears; then calls work again and match the reference."""
    case, flags = _bad_inplace_case("capacity")
    case.run()
    good = make_case("inplace", batch=2, seq=1, num_heads=4, kv_num_heads=2, head_dim=64, capacity=16,
                     past_lengths=[1, 2], strided=True, device="cuda", poison_unused=False)
    for _ in range(3):
        before = good.clone()
        out = good.run()
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "calls after a flagged one must be poisoned (NaN)"
        assert_untouched_except_valid_rows(before, good, written_rows=[])
    with pytest.raises(gqa_torch.GQAError) as info:
        gqa_torch.check_errors()
    assert info.value.flags == flags
    run_and_check(good, rotary_ulps=ROTARY_ULPS, suite="cuda")
    gqa_torch.check_errors()


@pytest.mark.parametrize("bad,flags", [("past_capacity", gerr.PAST_CAPACITY), ("negative", 6), ("capacity", 16),
                                       ("position", 32)])
def test_error_word_functional_raises_synchronously(bad, flags):
    """The functional op checks the word after its launch, raises GQAError and clears it."""
    case = make_case("functional", batch=2, seq=2, num_heads=4, kv_num_heads=2, head_dim=64, capacity=6,
                     past_lengths=[2, 4], rotary="half", position_ids="offset", max_positions=16, device="cuda",
                     poison_unused=False)
    if bad == "past_capacity":
        case.total_sequence_length = 12
        case.seqlens_k[1] = 10  # past 9 > 6, total 11 <= 12
    elif bad == "negative":
        case.seqlens_k[0] = 0
    elif bad == "capacity":
        case.seqlens_k[0] = 6  # total 7 > C = 6, past 5 <= 6
    else:
        case.position_ids[0, 0] = -3
    with pytest.raises(gqa_torch.GQAError) as info:
        case.run()
    assert info.value.flags == flags
    assert "wrote nothing" in str(info.value)
    gqa_torch.check_errors()  # already cleared


def test_synchronous_errors_switch_makes_inplace_raise():
    case, flags = _bad_inplace_case("negative")
    gqa_torch.set_synchronous_errors(True)
    assert gqa_torch.synchronous_errors()
    before = case.clone()
    with pytest.raises(gqa_torch.GQAError) as info:
        case.run()
    assert info.value.flags == flags
    assert_untouched_except_valid_rows(before, case, written_rows=[0, 2])
    gqa_torch.check_errors()  # the raising call cleared it
    gqa_torch.set_synchronous_errors(False)
    case, flags = _bad_inplace_case("negative")
    case.run()  # deferred again
    with pytest.raises(gqa_torch.GQAError):
        gqa_torch.check_errors()


def test_check_errors_device_argument():
    gqa_torch.check_errors(torch.device("cuda"))
    gqa_torch.check_errors("cuda:0")
    with pytest.raises(ValueError, match="gqa: check_errors: expected a CUDA device, got cpu"):
        gqa_torch.check_errors("cpu")


def test_cuda_kernels_available_asks_about_the_device():
    """The kernels run on this GPU (its code is in the build); the device argument is checked."""
    assert gqa_torch.cuda_kernels_available() and gqa_torch.cuda_kernels_available("cuda:0")
    assert gqa_torch.cuda_kernels_available(torch.device("cuda"))
    assert gqa_torch._C._cuda_device_support(0) == 0
    with pytest.raises(ValueError, match="gqa: cuda_kernels_available: expected a CUDA device, got cpu"):
        gqa_torch.cuda_kernels_available("cpu")
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"gqa: device index {count} out of range"):
        gqa_torch._C._cuda_device_support(count)
