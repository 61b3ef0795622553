"""Where the balanced partition's time goes, segment by segment (the decode kernel's `kShares`
path, `Plan::shares`; decode_mma.cuh).

A CTA of the partition serves its share of the batch's keys as segments, one an item its share
meets. In a build with the decode stamps, each segment writes a record of its own (record
c + g s for segment s of CTA c in a grid of g; the entry stamps only in segment 0's). For each
shape this script captures calls back to back on rotating inputs (as bench_decode.py times
them), stamps one call in the middle, and prints by segment index, medians over the CTAs:

- how many CTAs reached that segment, and when it started after the call's first release;
- the gap from the segment before's exit (its stamp after the count and merge) to this start;
- the time to Q staged (Q's round trip and the barrier before the first tile);
- the tiles (64 keys each at head size 128) and the tile loop's rate, tiles/us;
- the time from the last tile to the exit (the combine, the partials or the output, the count,
  and the merge of the CTA that arrives last);

then the CTAs' last exits after the first release. The fifty-third round's numbers are in
csrc/kernels/NOTES.md ("What a segment costs").

    python3 segment_timeline.py --shapes 16x64x8x128x8192 12x64x8x128x8192r256 --pins shares=cut

Diagnostics only, and only in a build with the stamps compiled in:

    GQA_DECODE_TIMELINE=1 python3 setup.py build_ext --inplace
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

from ab_decode import parse_decode_shape, pinned_switches
from common import progress
from decode_timeline import captured_records, start_stamped_run

# The fields of a record (decode_mma.cuh, DecodeTimelineField).
ENTRY_NS, ENTRY, WAITED, CHECKED, Q_READY, LOOP_DONE, EXIT, EXIT_NS, SM_TILES, CTA = range(10)


def median(values):
    return statistics.median(values) if values else float("nan")


def report(label, rows, period_us):
    """Prints the per-segment summary of one call's records (the module docstring's list)."""
    # Every CTA stamps its entry in segment 0's record, so those records are the grid's first
    # ones. (A one-dimensional grid: the partition's.)
    grid = 0
    while grid < len(rows) and rows[grid][ENTRY_NS] != 0:
        grid += 1
    if grid == 0:
        print(f"## {label}: no records (not the tensor-core decode kernel?)")
        return
    entry = rows[:grid]
    # SM cycles to ns, from each segment's exit against its CTA's entry, on both clocks.
    rates = []
    for i, r in enumerate(rows):
        c = i % grid
        if r[EXIT_NS] > entry[c][ENTRY_NS]:
            rates.append((r[EXIT] - entry[c][ENTRY]) / (r[EXIT_NS] - entry[c][ENTRY_NS]))
    ghz = median(rates)

    def ns(c, clock):  # an SM-clock stamp of CTA c on the GPU timer
        return entry[c][ENTRY_NS] + (clock - entry[c][ENTRY]) / ghz

    t0 = min(ns(c, entry[c][WAITED]) for c in range(grid) if entry[c][WAITED])
    segments = {}
    for i, r in enumerate(rows):
        if r[EXIT_NS] != 0:
            segments.setdefault(i // grid, []).append((i % grid, r))
    print(f"## {label}: period in the graph {period_us:.2f} us; grid {grid}; SM clock {ghz:.3f} GHz; "
          f"CTAs by segment index {{{', '.join(f'{k}: {len(v)}' for k, v in sorted(segments.items()))}}}")
    last_exit = {}
    for k, items in sorted(segments.items()):
        start, gap, to_q, tiles, loop_us, rate, tail = [], [], [], [], [], [], []
        for c, r in items:
            begin, q, done = ns(c, r[WAITED]), ns(c, r[Q_READY]), ns(c, r[LOOP_DONE])
            count = r[SM_TILES] & 0xFFFFFFFF
            start.append((begin - t0) / 1e3)
            if k > 0:
                gap.append((begin - rows[c + grid * (k - 1)][EXIT_NS]) / 1e3)
            to_q.append((q - begin) / 1e3)
            tiles.append(count)
            loop_us.append((done - q) / 1e3)
            if done > q:
                rate.append(count / ((done - q) / 1e3))
            tail.append((r[EXIT_NS] - done) / 1e3)
            last_exit[c] = max(last_exit.get(c, 0), r[EXIT_NS])
        gap_text = f"{median(gap):.2f}" if gap else "-"
        print(f"  segment {k}: {len(items)} CTAs, started {median(start):.2f} us after the first release "
              f"({min(start):.2f}-{max(start):.2f}); gap after the segment before {gap_text}; to Q staged "
              f"{median(to_q):.2f}; {median(tiles):g} tiles in {median(loop_us):.2f} us ({median(rate):.3f} tiles/us, "
              f"{min(rate, default=float('nan')):.3f}-{max(rate, default=float('nan')):.3f}); "
              f"last tile to exit {median(tail):.2f}")
    exits = sorted((x - t0) / 1e3 for x in last_exit.values())
    print(f"  CTAs' last exit after the first release (us): {exits[0]:.2f} / {median(exits):.2f} / {exits[-1]:.2f} "
          f"(min / median / max)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16x64x8x128x8192", "12x64x8x128x8192r256"],
                        help="BxHqxHkvxDxL or BxHqxHkvxDxLrLOW (a ragged batch), as ab_decode.py's")
    parser.add_argument("--pins", nargs="*", default=[],
                        help="each shape again with switches pinned (as ab_decode.py's --pins), e.g. shares=cut")
    parser.add_argument("--calls", type=int, default=8, help="calls back to back in the graph")
    args = parser.parse_args()
    shapes = [parse_decode_shape(text) for text in args.shapes]
    start_stamped_run("segment_timeline.py", args.pins)
    for text, (b, hq, hkv, d, length, low) in zip(args.shapes, shapes):
        for pin in [None] + args.pins:
            label = text + (f" ({pin})" if pin else "")
            progress(f"segment timeline: {label}")
            with pinned_switches(pin) if pin else contextlib.nullcontext():
                records, period = captured_records(b, hq, hkv, d, length, args.calls, low)
            rows = records.cpu().tolist()
            report(label, rows, period)


if __name__ == "__main__":
    main()
