"""Shared timing and reporting for the benchmarks (BENCHMARKS.md method).

Time = CUDA events around CUDA-graph replays of a loop of calls that rotates over enough
input sets to defeat the 60 MB L2; the median over replays, after a warm-up. The CPU
benchmarks time host calls instead (fastest_host_call).
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HBM_DATASHEET_TBS = 4.8


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fastest_host_call(call: Callable[[], Any], repeats: int) -> Tuple[float, Any]:
    """(seconds of the fastest of `repeats` calls, the last call's result), timed on the host:
    for CPU work, where no device queue runs ahead of the clock."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - start)
    return best, result


def parse_shape(text: str):
    """A prefill benchmark's shape argument, "BxLxD", as (B, L, D)."""
    b, length, d = (int(x) for x in text.lower().split("x"))
    return b, length, d


def ragged_lengths(b: int, capacity: int, low: int) -> torch.Tensor:
    """The valid lengths of a ragged decode batch (bench_decode.py's ragged table, ab_decode.py's
    ragged shapes): uniform in [low, capacity], seeded by the batch size, on the CPU."""
    return torch.randint(low, capacity + 1, (b,), generator=torch.Generator().manual_seed(b))


def sets_for_bytes(bytes_per_set: int, target: int = 400 << 20, cap: int = 64) -> int:
    """How many input sets to rotate over so that their bytes exceed `target`."""
    return max(1, min(cap, -(-target // max(1, bytes_per_set))))


def decode_inputs(b: int, hq: int, hkv: int, d: int, length: int, n: int, dtype: torch.dtype,
                  seqlens: "torch.Tensor | None" = None):
    """n input sets of an in-place decode call: queries [B, Hq, 1, D] and K and V caches
    [B, Hkv, L, D] (SDPA's layout), one new key and value, seqlens_k (default: every row full),
    and our in-place call (gqa_torch.group_query_attention_: append + attention) on set i, whose
    queries are the same tensors seen as [B, 1, Hq D]. Returns (qs, ks, vs, call)."""
    import gqa_torch  # (the benchmarks' own modules import it first; kept local for the others)

    ks = [torch.randn(b, hkv, length, d, device="cuda", dtype=dtype) for _ in range(n)]
    vs = [torch.randn(b, hkv, length, d, device="cuda", dtype=dtype) for _ in range(n)]
    qs = [torch.randn(b, hq, 1, d, device="cuda", dtype=dtype) for _ in range(n)]
    new_k = torch.randn(b, 1, hkv * d, device="cuda", dtype=dtype)
    new_v = torch.randn(b, 1, hkv * d, device="cuda", dtype=dtype)
    if seqlens is None:
        seqlens = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
    q_bsh = [q.transpose(1, 2).reshape(b, 1, hq * d) for q in qs]

    def call(i: int) -> None:
        gqa_torch.group_query_attention_(q_bsh[i], new_k, new_v, ks[i], vs[i], seqlens, num_heads=hq, kv_num_heads=hkv)

    return qs, ks, vs, call


def inplace_decode_step(b: int, hq: int, hkv: int, d: int, length: int, dtype: torch.dtype,
                        seqlens: "torch.Tensor | None" = None):
    """One in-place decode call on input set i % n (decode_inputs), for CUDA-graph timing as
    bench_decode.py times it, with n sets enough to exceed L2. Returns (step, n)."""
    n = sets_for_bytes(2 * b * hkv * length * d * 2)
    call = decode_inputs(b, hq, hkv, d, length, n, dtype, seqlens)[3]

    def step(i: int) -> None:
        call(i % n)

    return step, n


def sdpa_views(qkv: list, b: int, length: int, d: int, hq: int, hkv: int):
    """Per input set, q, k and v of a packed [B, L, (Hq + 2 Hkv) D] tensor as [B, H, L, D]
    views (no copy), the layout SDPA takes."""
    split = [x.split([hq * d, hkv * d, hkv * d], -1) for x in qkv]
    qs = [s[0].view(b, length, hq, d).transpose(1, 2) for s in split]
    ks = [s[1].view(b, length, hkv, d).transpose(1, 2) for s in split]
    vs = [s[2].view(b, length, hkv, d).transpose(1, 2) for s in split]
    return qs, ks, vs


def capture_graph(step: Callable[[int], None], n_sets: int, calls: int) -> "torch.cuda.CUDAGraph":
    """`calls` calls of `step(i % n_sets)` in one CUDA graph, after a warm-up on a side stream
    (allocations, autotuning, lazy init); replayed once before it is returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, n_sets) + 2):
            step(i % n_sets)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(step: Callable[[int], None], n_sets: int, calls_per_replay: int = 0, replays: int = 15) -> float:
    """Median µs per call of `step(i)` (i = input set), captured in one CUDA graph."""
    calls = calls_per_replay or max(n_sets, 8)
    graph = capture_graph(step, n_sets, calls)
    for _ in range(2):  # untimed: the clocks and caches settle
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def replay_interleaved(graphs: dict, replays: int = 15, order: str = "shuffled") -> dict:
    """The µs of each timed replay of each CUDA graph in `graphs` (name -> graph), `replays` of
    each, with the graphs replayed in turn, round after round. Timed one after another, the same
    kernel read 497 and 525 TFLOP/s within one run on an H200 (its clocks drift); interleaved,
    the drift hits every graph alike, so that their ratios hold.

    Each timed replay follows an untimed replay of the same graph. A power-capped H200 (about
    690 W on long prefills) clocks a graph higher when it follows a graph that drew less power:
    in a fixed order, with SDPA flash's graph before cuDNN's, ours / cuDNN read 0.94 at B=1
    L=16384 D=128, and 1.16 with ours after flash; alternating the two alone read 1.06 in either
    order (2026-11-30). So no graph keeps one place in the round:
    - "shuffled" (the default): each round in its own random order, seeded by the round. Every
      graph follows every other about equally often.
    - "alternating": the given order, then reversed, round after round (the rule up to stop
      68). The first and last graphs then run four replays in a row at each turn. At B64 L32768
      decode (16 ms a replay) ours, first, read 1% slower than five copies of the same call
      later in the round (1862.5 against 1844.3-1845.9 µs, benchmarks/decode_order.py, stop
      69), and 6% slower than the columns in the middle in stop 68's grid; shuffled, all six
      read 1844.5-1846.1. Rows of 2 ms a replay or less read alike in either order."""
    if order not in ("shuffled", "alternating"):
        raise ValueError(f"replay_interleaved: order must be 'shuffled' or 'alternating', not {order!r}")
    for graph in graphs.values():  # untimed: the clocks and caches settle
        graph.replay()
    times = {name: [] for name in graphs}
    names = list(graphs)
    for round_ in range(replays):
        if order == "shuffled":
            round_order = random.Random(round_).sample(names, len(names))
        else:
            round_order = names if round_ % 2 == 0 else names[::-1]
        for name in round_order:
            graph = graphs[name]
            graph.replay()  # untimed: the clocks settle on this graph's own draw
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0)
    return times


def time_graphs_interleaved(steps: dict, n_sets: int, replays: int = 15, order: str = "shuffled") -> dict:
    """Median µs per call of each `steps[name](i)`, each captured in its own CUDA graph of
    max(n_sets, 8) calls, the graphs replayed interleaved in `order` (replay_interleaved). A step
    that cannot run or be captured reads nan."""
    calls = max(n_sets, 8)
    graphs = {}
    for name, step in steps.items():
        try:
            graphs[name] = capture_graph(step, n_sets, calls)
        except Exception as exc:
            progress(f"    {name}: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
    times = replay_interleaved(graphs, replays, order)
    del graphs
    return {name: statistics.median(times[name]) / calls if name in times else float("nan") for name in steps}


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keeps the GPU busy with bf16 GEMMs for `seconds`, so that the first timed row does not run
    at idle clocks (on an H200 that had idled, the first row read up to 20% slow)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(8):
            torch.matmul(a, a, out=out)
        torch.cuda.synchronize()
    del a, out
    torch.cuda.empty_cache()


class GpuClockSampler:
    """nvidia-smi's power draw, SM clock and throttle reasons, sampled every `interval_ms` in the
    background for the life of the benchmark, so that each table row can say whether the GPU ran
    at its power cap meanwhile (stop 73: an H200 at its 700 W cap ran the SM clock at 1,410-1,965
    MHz through a 16 ms row, and copies of one call read 9% apart). Where nvidia-smi is missing
    or fails, `window` reports nan and the benchmark goes on."""

    POWER_CAP_BIT = 0x4  # clocks_throttle_reasons.active: the software power cap

    def __init__(self, interval_ms: int = 200):
        self.samples: List[Tuple[float, float, float, int]] = []  # (monotonic s, W, SM MHz, reasons)
        self._proc = None
        command = ["nvidia-smi", "--query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active",
                   "--format=csv,noheader,nounits", "-lms", str(interval_ms)]
        try:  # this process's GPU by its UUID (CUDA_VISIBLE_DEVICES renumbers the indices)
            command += ["-i", f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"]
        except (AttributeError, RuntimeError, AssertionError):
            pass  # one line a GPU then; on a machine of one GPU the same
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.5)
            if self._proc.poll() is not None and "-i" in command:  # the UUID not taken: every GPU
                self._proc = subprocess.Popen(command[:-2], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                self.samples.append((time.monotonic(), float(parts[0]), float(parts[1]), int(parts[2], 16)))
            except (ValueError, IndexError):
                continue

    def window(self, start: float, end: float) -> Dict[str, float]:
        """Over the samples taken between monotonic times `start` and `end`: the mean board power
        (W), the lowest and the median SM clock (MHz) and the share of samples (%) with the power
        cap active; nan where there are none."""
        inside = [s for s in list(self.samples) if start <= s[0] <= end]
        if not inside:
            return {"mean_W": float("nan"), "min_sm_MHz": float("nan"), "median_sm_MHz": float("nan"),
                    "power_capped_pct": float("nan")}
        capped = sum(1 for s in inside if s[3] & self.POWER_CAP_BIT)
        return {"mean_W": statistics.mean(s[1] for s in inside), "min_sm_MHz": min(s[2] for s in inside),
                "median_sm_MHz": statistics.median(s[2] for s in inside),
                "power_capped_pct": 100.0 * capped / len(inside)}

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()


def measure_hbm_read_tbs() -> float:
    """Measured read bandwidth of this GPU now: x.sum() over 4 GiB of bf16."""
    x = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)

    def step(_):
        torch.sum(x, dtype=torch.float32)

    us = time_graph(step, 1, calls_per_replay=4, replays=5)
    del x
    torch.cuda.empty_cache()
    return x_bytes_tbs(1 << 32, us)


def x_bytes_tbs(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


def write_tables(name: str, meta: Dict, rows: List[Dict], columns: Sequence[str], title: str) -> str:
    """Writes results/<name>.json and results/<name>.md; returns the Markdown table."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"## {title}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    return text


def bar_plot(name: str, labels: List[str], series: Dict[str, List[float]], ylabel: str, title: str,
             log_scale: bool = False) -> None:
    """results/<name>.png: grouped bars, one group per row (`log_scale`: a logarithmic value axis,
    so that rows three orders of magnitude apart all show). Skipped quietly without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no PNG plot")
        return
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    for i, (key, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [v if v == v else 0 for v in values], width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=110)
    plt.close(fig)
