"""Where a decode call's time goes, CTA by CTA: the tensor-core decode kernel's per-CTA stamps
(`_C._set_decode_timeline`, decode_mma.cuh).

Each CTA that computes stamps the GPU timer at entry and exit, and its SM's clock at entry,
after the PDL wait, after the error word and the row checks, with Q staged, after its tile loop
and at exit. For each shape this script captures a CUDA graph of calls back to back on
rotating inputs (as bench_decode.py times them), with the stamps on for one call in the
middle, replays it, and reports:

- the call's period in the graph (replay time / calls) against its span on the GPU timer, from
  the first CTA's release (the end of its PDL wait: the kernel before has finished) to the last
  CTA's exit; their difference is what overlaps the kernel before or after;
- the CTAs' wait before the release (they sit resident under the kernel before), their work
  (release, or entry for later CTAs, to exit), and its parts: the error word and the row
  checks, Q staged, the tiles, and the combine, partials and merge, min / median / max;
- the start: how long after the first release the last CTA of the first wave was released,
  and the tail: from the median CTA exit to the last, and how many SMs sat idle for how long
  at the end (the mean over SMs of the last exit minus the SM's own last exit);
- the GPU timer's resolution seen (the smallest step between distinct stamps);
- the spread of CTAs of equal work: each one's tile rate, alone on its SM or sharing it, in
  the first dispatch wave or a later one, by split index, and where the slowest tenth ran.

    python3 decode_timeline.py --rows 0 4 6 11 --pins schedule=keep_splits splits=1

(`--pins`: the same rows again with a switch pinned, as ab_decode.py pins them.)

Under the balanced partition (`Plan::shares`) a CTA's record here is its first segment's; each
later segment writes a record of its own past the grid's, which segment_timeline.py reports.

Diagnostics only, and only in a build with the stamps compiled in (they cost the smallest calls
even when off, so the default build has none):

    GQA_DECODE_TIMELINE=1 python3 setup.py build_ext --inplace

(`scripts/gpu_check.sh dtimeline` builds such a copy of the tree and runs this script there.)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics

import torch

import gqa_torch
from bench_decode import DECODE_GRID, DTYPE
from common import inplace_decode_step, progress, ragged_lengths, time_graph

FIELDS = ("entry_ns", "entry", "waited", "checked", "q_ready", "loop_done", "exit", "exit_ns", "sm_tiles", "cta")
RECORD_WIDTH = 16  # kDecodeTimelineFields (common.cuh); the fields past FIELDS are unused
MAX_RECORDS = 1 << 16


def captured_records(b, hq, hkv, d, length, calls, low=None):
    """Every record (MAX_RECORDS x RECORD_WIDTH on the GPU, unstamped ones zero) of one call in
    the middle of `calls` back to back in a CUDA graph, and the graph's time per call (µs).
    `low`: a ragged batch of lengths uniform in [low, length] (as ab_decode.py's shapes)."""
    seqlens = None
    if low is not None:
        seqlens = (ragged_lengths(b, length, low) - 1).to(torch.int32).cuda()
    call, n = inplace_decode_step(b, hq, hkv, d, length, DTYPE, seqlens)
    records = torch.zeros(MAX_RECORDS, RECORD_WIDTH, dtype=torch.int64, device="cuda")
    period = time_graph(call, n, calls_per_replay=max(calls, n))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            if i == calls // 2:
                gqa_torch._C._set_decode_timeline(records)
            call(i)
            gqa_torch._C._set_decode_timeline(None)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    del graph, call
    torch.cuda.empty_cache()
    return records, period


def stamped_call(b, hq, hkv, d, length, calls, low=None):
    """Records of the CTAs that computed in one call (captured_records), each with its linear
    block index appended as a last column, on the CPU, and the graph's time per call (µs)."""
    records, period = captured_records(b, hq, hkv, d, length, calls, low)
    exit_ns = FIELDS.index("exit_ns")
    index = torch.arange(MAX_RECORDS, device="cuda", dtype=torch.int64).unsqueeze(1)
    records = torch.cat([records, index], dim=1)
    rec = records[(records[:, 0] != 0) & (records[:, exit_ns] != 0)].cpu()
    return rec, period


def report(shape, rec, period_us, label=""):
    """Prints the summary of one call's records (the module docstring's list)."""
    b, hq, hkv, d, length = shape
    cols = {name: rec[:, i].tolist() for i, name in enumerate(FIELDS)}
    n = len(rec)
    # SM cycles to ns: each CTA's entry-to-exit on both clocks.
    rates = [(x1 - x0) / (n1 - n0) for x0, x1, n0, n1 in zip(cols["entry"], cols["exit"], cols["entry_ns"], cols["exit_ns"])
             if n1 > n0]
    ghz = statistics.median(rates) if rates else float("nan")
    release = [n0 + (w - e) / ghz for n0, e, w in zip(cols["entry_ns"], cols["entry"], cols["waited"])]
    exits = cols["exit_ns"]
    t0 = min(release)
    span_us = (max(exits) - t0) / 1e3
    waits = [(w - e) / ghz / 1e3 for e, w in zip(cols["entry"], cols["waited"])]
    work = [(x - max(r, e)) / 1e3 for r, e, x in zip(release, cols["entry_ns"], exits)]
    loops = [(l - w) / ghz / 1e3 for w, l in zip(cols["waited"], cols["loop_done"])]
    checks = [(c - w) / ghz / 1e3 for w, c in zip(cols["waited"], cols["checked"])]
    q_ready = [(q - c) / ghz / 1e3 for c, q in zip(cols["checked"], cols["q_ready"])]
    tile_loop = [(l - q) / ghz / 1e3 for q, l in zip(cols["q_ready"], cols["loop_done"])]
    after_loop = [(x - l) / ghz / 1e3 for l, x in zip(cols["loop_done"], cols["exit"])]
    sms = [v >> 32 for v in cols["sm_tiles"]]
    tiles = [v & 0xFFFFFFFF for v in cols["sm_tiles"]]
    first_wave = [r for r, e in zip(release, cols["entry_ns"]) if e <= t0]
    last_exit_by_sm = {}
    for sm, x in zip(sms, exits):
        last_exit_by_sm[sm] = max(last_exit_by_sm.get(sm, 0), x)
    idle_end = [(max(exits) - x) / 1e3 for x in last_exit_by_sm.values()]
    stamps = sorted(set(cols["entry_ns"]) | set(exits))
    steps = [y - x for x, y in zip(stamps, stamps[1:]) if y > x]

    def mmm(xs):
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"

    per_sm = {}
    for count in (sum(1 for s in sms if s == sm) for sm in last_exit_by_sm):
        per_sm[count] = per_sm.get(count, 0) + 1
    print(f"## B={b} {hq}/{hkv}/{d} L={length}{label}: {n} CTAs on {len(last_exit_by_sm)} SMs, "
          f"{statistics.mean(tiles):.1f} tiles a CTA (max {max(tiles)}); SMs by their CTA count "
          f"{dict(sorted(per_sm.items()))}")
    print(f"  period in the graph {period_us:.2f} us; span from the first release to the last exit {span_us:.2f} us")
    print(f"  SM clock {ghz:.3f} GHz; GPU timer step >= {min(steps) if steps else 0} ns")
    print(f"  wait before release (us, min/median/max): {mmm(waits)}")
    print(f"  work, release to exit (us): {mmm(work)}; release to loop done (us): {mmm(loops)}")
    print(f"  after the release: error word and row checks {mmm(checks)}; then Q staged {mmm(q_ready)}; "
          f"then the tiles {mmm(tile_loop)}; then the combine, partials and merge {mmm(after_loop)}")
    print(f"  first wave: {len(first_wave)} CTAs released within {(max(first_wave) - t0) / 1e3:.2f} us "
          f"of the first")
    print(f"  tail: median exit to last {(max(exits) - statistics.median(exits)) / 1e3:.2f} us; "
          f"SMs idle at the end {statistics.mean(idle_end):.2f} us on average (max {max(idle_end):.2f})")
    spread(cols, ghz, t0)
    placement(rec[:, -1].tolist(), sms, cols, ghz)


def placement(index, sms, cols, ghz):
    """Where the block dispatcher put the CTAs and what each SM streamed: the SMs that the
    first n (and 2 n) CTAs in linear block order landed on, n the SMs that ran any, and per SM its tiles over the
    time from its first CTA's Q staged to its last CTA's loop end (the SM's own rate)."""
    order = sorted(range(len(index)), key=lambda i: index[i])
    n_sm = len(set(sms))
    for head in (n_sm, 2 * n_sm):
        if len(order) >= head:
            print(f"  the first {head} CTAs in block order sit on {len({sms[i] for i in order[:head]})} SMs")
    tiles = [v & 0xFFFFFFFF for v in cols["sm_tiles"]]
    start = [n0 + (q - e) / ghz for n0, e, q in zip(cols["entry_ns"], cols["entry"], cols["q_ready"])]
    end = [n0 + (l - e) / ghz for n0, e, l in zip(cols["entry_ns"], cols["entry"], cols["loop_done"])]
    per_sm = {}
    for i, sm in enumerate(sms):
        t, a, b, c = per_sm.get(sm, (0, float("inf"), 0.0, 0))
        per_sm[sm] = (t + tiles[i], min(a, start[i]), max(b, end[i]), c + 1)
    rows = sorted(per_sm.values(), key=lambda r: r[2])
    t_first = min(r[1] for r in rows)
    ends = [(r[2] - t_first) / 1e3 for r in rows]
    rates = [r[0] / ((r[2] - r[1]) / 1e3) for r in rows if r[2] > r[1]]
    print(f"  per SM: tiles {min(r[0] for r in rows)}-{max(r[0] for r in rows)}; loop end after the first "
          f"start (us) min/median/max {min(ends):.2f} / {statistics.median(ends):.2f} / {max(ends):.2f}; "
          f"SM tile rate {min(rates):.3f} / {statistics.median(rates):.3f} / {max(rates):.3f}")
    by_count = {}
    for t, a, b, c in rows:
        by_count.setdefault(c, []).append(((b - t_first) / 1e3, t))
    print("  per SM by its CTA count: " + "; ".join(
        f"{c} CTAs: {len(v)} SMs, loop end median {statistics.median(x for x, _ in v):.2f} us, "
        f"tiles median {statistics.median(t for _, t in v)}" for c, v in sorted(by_count.items())))


def spread(cols, ghz, t0):
    """Why CTAs of equal work finish at different times (the many-CTA rows' tails): each CTA's
    tile rate (tiles per µs of its tile loop), split by whether its SM ran another CTA of the
    call through at least half of that loop, by dispatch wave and by split index, and where the
    slowest tenth ran."""
    tiles = [v & 0xFFFFFFFF for v in cols["sm_tiles"]]
    sms = [v >> 32 for v in cols["sm_tiles"]]
    splits = [v & 0xFFFF for v in cols["cta"]]
    # The tile loop on the GPU timer: SM-clock stamps placed by the CTA's own entry on both clocks.
    start = [n0 + (q - e) / ghz for n0, e, q in zip(cols["entry_ns"], cols["entry"], cols["q_ready"])]
    end = [n0 + (l - e) / ghz for n0, e, l in zip(cols["entry_ns"], cols["entry"], cols["loop_done"])]
    rate = [t / ((b - a) / 1e3) if b > a else float("nan") for t, a, b in zip(tiles, start, end)]
    by_sm = {}
    for i, sm in enumerate(sms):
        by_sm.setdefault(sm, []).append(i)

    def shared(i):
        own = end[i] - start[i]
        return any(min(end[i], end[j]) - max(start[i], start[j]) >= own / 2 for j in by_sm[sms[i]] if j != i)

    def med(idx):
        vals = [rate[i] for i in idx if rate[i] == rate[i]]
        return f"{statistics.median(vals):.3f} ({len(vals)})" if vals else "- (0)"

    every = range(len(rate))
    sharing = [shared(i) for i in every]  # (each CTA's SM scanned once)
    alone = [i for i in every if not sharing[i]]
    paired = [i for i in every if sharing[i]]
    first = [i for i in every if cols["entry_ns"][i] <= t0]
    later = [i for i in every if cols["entry_ns"][i] > t0]
    ranked = sorted((i for i in every if rate[i] == rate[i]), key=lambda i: rate[i])
    slow = ranked[: max(1, len(ranked) // 10)]
    sm_rate = sorted((statistics.mean(rate[i] for i in idx), sm) for sm, idx in by_sm.items())
    print(f"  tile rate, tiles/us (min/median/max): {min(rate):.3f} / {statistics.median(rate):.3f} / "
          f"{max(rate):.3f}; median alone on its SM {med(alone)}, sharing it {med(paired)}; "
          f"first wave {med(first)}, later {med(later)}")
    by_split = {}
    for i in every:
        by_split.setdefault(splits[i], []).append(i)
    print("  by split index: " + ", ".join(f"{k}: {med(v)}" for k, v in sorted(by_split.items())[:16]))
    later_set = set(later)
    print(f"  slowest tenth ({len(slow)} CTAs): on {len({sms[i] for i in slow})} SMs, "
          f"{sum(1 for i in slow if sharing[i])} sharing their SM, {sum(1 for i in slow if i in later_set)} of a later "
          f"wave; slowest SMs {[(sm, round(r, 3)) for r, sm in sm_rate[:5]]}, "
          f"fastest {[(sm, round(r, 3)) for r, sm in sm_rate[-5:]]}")


def start_stamped_run(script, pins):
    """The stamps scripts' start (this one and segment_timeline.py): refuses a bad pin and a
    build without the decode stamps before any timing, then seeds torch and prints the device."""
    from ab_decode import pin_parts  # (imports gqa_torch, as this script does)
    for pin in pins:
        pin_parts(pin)  # (refuses a bad one)
    assert gqa_torch.cuda_kernels_available(), "needs a GPU and a CUDA build"
    if not gqa_torch.build_info().get("decode_timeline", False):
        raise SystemExit(f"{script}: this build has no decode stamps; rebuild with "
                         "GQA_DECODE_TIMELINE=1 python3 setup.py build_ext --inplace")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="*", default=[0, 4, 6, 11], help="indices into the decode grid")
    parser.add_argument("--shapes", nargs="*", default=[],
                        help="more shapes, BxHqxHkvxDxL or BxHqxHkvxDxLrLOW (a ragged batch), as ab_decode.py's")
    parser.add_argument("--dump", default=None, help="a directory to write each call's raw records to (.pt)")
    parser.add_argument("--calls", type=int, default=8, help="calls back to back in the graph")
    parser.add_argument("--pins", nargs="*", default=[],
                        help="each row again with switches pinned, name=value or several joined by '+' "
                             "(as ab_decode.py's --pins)")
    args = parser.parse_args()
    from ab_decode import parse_decode_shape, pinned_switches  # (imports gqa_torch, as this script does)
    start_stamped_run("decode_timeline.py", args.pins)
    shapes = [tuple(DECODE_GRID[i]) + (None,) for i in args.rows] + [parse_decode_shape(s) for s in args.shapes]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for *shape, low in shapes:
        shape = tuple(shape)
        for pin in [None] + args.pins:
            label = (f" lengths from {low}" if low else "") + (f" ({pin})" if pin else "")
            progress(f"timeline: B={shape[0]} L={shape[4]}{label}")
            with pinned_switches(pin) if pin else contextlib.nullcontext():
                rec, period = stamped_call(*shape, args.calls, low)
            if len(rec) == 0:
                print(f"## {shape}: no records (not the tensor-core decode kernel?)")
                continue
            report(shape, rec, period, label)
            if args.dump:
                name = "x".join(map(str, shape)) + (f"r{low}" if low else "") + (f"_{pin}" if pin else "")
                torch.save({"fields": FIELDS, "records": rec, "period_us": period},
                           os.path.join(args.dump, re.sub(r"[^A-Za-z0-9_.+-]", "_", name) + ".pt"))


if __name__ == "__main__":
    main()
