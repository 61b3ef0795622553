"""Decode steps in CUDA graphs (GPU only).

A decode step of a model built on the in-place operator (and :class:`gqa_torch.KVCache`) reads
no device value on the host, so the whole step, every layer, can be recorded once and replayed:

    step = gqa_torch.graphs.CUDAGraphStep(lambda tokens: model_step(tokens, cache))
    for _ in range(n):
        logits = step(tokens)          # eager for the first `warmup` calls, then replays
        tokens.copy_(logits.argmax(-1, keepdim=True))
    step.sync()                        # the loop's sync point: raises GQAError if a step flagged one

or, with the same step function, ``CompiledStep`` (``torch.compile(mode="reduce-overhead",
fullgraph=True)``, whose CUDA graphs come from Inductor). :func:`greedy_decode` is such a loop.

Errors. Inside a graph nothing can raise: a step whose ``seqlens_k``/positions break the
contract (e.g. a row that would pass the cache capacity) makes the operator write nothing for
that row, output NaN and set the sticky device error word, and later replays skip their writes.
:meth:`CUDAGraphStep.sync` (and :func:`greedy_decode` at its sync points) synchronises and calls
:func:`gqa_torch.check_errors`, which raises :class:`gqa_torch.GQAError` and clears the word.

Outputs of a replay live in the graph's static buffers and are overwritten by the next replay:
clone what you keep.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from .ops import check_errors

Tensor = torch.Tensor

__all__ = ["CUDAGraphStep", "CompiledStep", "greedy_decode"]


def _copy_into(static: Sequence[Tensor], inputs: Sequence[Tensor], what: str) -> None:
    if len(inputs) != len(static):
        raise TypeError(f"{what}: expected {len(static)} inputs (as at capture), got {len(inputs)}")
    for i, (dst, src) in enumerate(zip(static, inputs)):
        if src is dst:
            continue
        if not isinstance(src, Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            got = f"{src.dtype} {list(src.shape)}" if isinstance(src, Tensor) else type(src).__name__
            raise ValueError(f"{what}: input {i} must be {dst.dtype} {list(dst.shape)} (as at capture), got {got}")
        dst.copy_(src, non_blocking=True)


class CUDAGraphStep:
    """A step function recorded in one CUDA graph and replayed with static input/output buffers.

    Args:
        step_fn: ``step_fn(*inputs) -> Tensor | tuple of Tensors``. It must be capturable: CUDA
            tensors only, no host reads of device values, the same kernels each call (the
            in-place gqa operator, a :class:`gqa_torch.KVCache` and any model code that follows
            those rules qualify). State it mutates in place (caches, lengths) is state the replays
            mutate too.
        warmup: how many calls run eagerly (on a side stream) before the next call captures.
            They are real steps, not rehearsals, so nothing has to be rolled back.
        pool: a graph memory pool to share with other graphs (``torch.cuda.graph_pool_handle()``).

    Calling it copies the inputs into the static input buffers (skipped for the buffers
    themselves, see :attr:`static_inputs`), replays, and returns the static outputs.
    """

    def __init__(self, step_fn: Callable[..., Any], *, warmup: int = 2, pool: Any = None) -> None:
        if warmup < 1:
            raise ValueError("CUDAGraphStep: warmup must be >= 1 (lazy initialisation must not happen during capture)")
        self.step_fn = step_fn
        self.warmup = int(warmup)
        self.pool = pool
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_inputs: Tuple[Tensor, ...] = ()
        self.static_outputs: Any = None
        self.calls = 0
        self._stream: Optional[torch.cuda.Stream] = None

    @property
    def captured(self) -> bool:
        """Whether the graph has been recorded (after ``warmup`` eager calls)."""
        return self.graph is not None

    def __call__(self, *inputs: Tensor):
        """Runs one step: eagerly while warming up, then capture + replay, then replays."""
        self.calls += 1
        if self.graph is not None:
            _copy_into(self.static_inputs, inputs, "CUDAGraphStep")
            self.graph.replay()
            return self.static_outputs
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor) or x.device.type != "cuda":
                raise ValueError(f"CUDAGraphStep: input {i} must be a CUDA tensor")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=inputs[0].device if inputs else None)
        current = torch.cuda.current_stream()
        if self.calls <= self.warmup:
            # Eager steps on a side stream, as CUDA graph capture wants its warm-up.
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                out = self.step_fn(*inputs)
            current.wait_stream(self._stream)
            return out
        # Capture with static copies of this call's inputs, then replay to run this step.
        self.static_inputs = tuple(x.clone() for x in inputs)
        graph = torch.cuda.CUDAGraph()
        current.synchronize()
        with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
            self.static_outputs = self.step_fn(*self.static_inputs)
        self.graph = graph
        self.graph.replay()
        return self.static_outputs

    def sync(self, check: bool = True) -> None:
        """The loop's natural sync point: waits for the device and, when ``check``, raises
        :class:`gqa_torch.GQAError` if any replay flagged bad lengths/positions."""
        torch.cuda.current_stream().synchronize()
        if check:
            check_errors()

    def reset(self) -> None:
        """Drops the graph (e.g. after the step function's tensors were reallocated)."""
        self.graph = None
        self.static_inputs, self.static_outputs = (), None
        self.calls = 0


class CompiledStep:
    """The same step function under ``torch.compile(mode="reduce-overhead", fullgraph=True)``:
    Inductor fuses the non-attention ops and records CUDA graphs itself.

    ``step_fn`` must be traceable without graph breaks (the gqa operators are, through their
    fake implementations); tensors it mutates in place that are not its inputs (caches) should be
    marked as static addresses (:class:`gqa_torch.KVCache` does that on CUDA). The outputs are
    overwritten by the next call, as with :class:`CUDAGraphStep`.
    """

    def __init__(self, step_fn: Callable[..., Any], *, mode: str = "reduce-overhead", fullgraph: bool = True,
                 dynamic: Optional[bool] = False) -> None:
        self.step_fn = step_fn
        self.compiled = torch.compile(step_fn, mode=mode, fullgraph=fullgraph, dynamic=dynamic)

    def __call__(self, *inputs: Tensor):
        """One step (marks a new CUDA-graph step for Inductor's graph trees first), under
        ``torch.no_grad()``: the operators have no backward, and a graph compiled while the
        model's weights require grad would trace one and fail."""
        mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
        if mark is not None:
            mark()
        with torch.no_grad():
            return self.compiled(*inputs)

    def sync(self, check: bool = True) -> None:
        """As :meth:`CUDAGraphStep.sync`."""
        torch.cuda.current_stream().synchronize()
        if check:
            check_errors()


def greedy_decode(step: Callable[[Tensor], Union[Tensor, Tuple[Tensor, ...]]], first_tokens: Tensor, num_steps: int,
                  *, eos_token_id: Optional[int] = None, check_every: int = 0) -> Tensor:
    """Greedy decoding with a step ``step(tokens [B, 1]) -> logits [B, 1 or S, V]`` (e.g. a
    :class:`CUDAGraphStep` or :class:`CompiledStep`); returns the tokens ``[B, num_steps]``
    (``first_tokens`` followed by ``num_steps - 1`` generated ones), on the device.

    The loop never reads the device except at its sync points: every ``check_every`` steps
    (when > 0, also where ``eos_token_id`` stops the loop early once every row produced it) and
    at the end. Each sync point calls :func:`gqa_torch.check_errors` (CUDA), so a step that
    flagged bad lengths raises :class:`gqa_torch.GQAError` there.
    """
    if first_tokens.dim() == 1:
        first_tokens = first_tokens[:, None]
    batch = first_tokens.shape[0]
    out = torch.empty((batch, num_steps), dtype=first_tokens.dtype, device=first_tokens.device)
    tokens = first_tokens.clone()
    out[:, :1] = tokens
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device) if eos_token_id is not None else None
    cuda = tokens.device.type == "cuda"
    produced = num_steps
    for i in range(1, num_steps):
        result = step(tokens)
        logits = result[0] if isinstance(result, (tuple, list)) else result
        tokens = logits[:, -1].argmax(-1, keepdim=True).to(first_tokens.dtype)
        out[:, i:i + 1] = tokens
        if finished is not None:
            finished |= tokens[:, 0] == eos_token_id
        if check_every and i % check_every == 0:
            if cuda:
                torch.cuda.current_stream().synchronize()
                check_errors(tokens.device)
            if finished is not None and bool(finished.all()):
                produced = i + 1
                break
    if cuda:
        torch.cuda.current_stream().synchronize()
        check_errors(tokens.device)
    return out[:, :produced]
