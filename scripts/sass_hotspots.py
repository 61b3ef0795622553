"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

Input: `ncu -i REPORT.ncu-rep --page source --csv --print-source sass > FILE.csv` (the report
taken with `--section SourceCounters`; scripts/profile_gpu.sh writes it with GQA_SASS=1).
Prints the stall reasons over the whole kernel, the share of samples in each twentieth of the
code, and the top sites with the instructions just before them (the stall shows on the
instruction that waits, and its cause is usually a few lines up: the load it consumes, the
barrier it sits behind).

With --stretches it also cuts the code at each instruction that reads the SM clock
(SR_CLOCKLO): the prefill kernels' timeline stamps (`_C._set_prefill_timeline`) are compiled in
and only switched off at run time, so they mark a block's stretches in the SASS (entry, Q
ready, first tile done, loop done, exit), and each stretch gets its share of the samples and its
stall reasons.

    python3 scripts/sass_hotspots.py FILE.csv [--top 8] [--context 6] [--stretches]
"""
from __future__ import annotations

import argparse
import csv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv_file")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--context", type=int, default=6)
    parser.add_argument("--stretches", action="store_true",
                        help="also the samples of each stretch between SM clock reads")
    args = parser.parse_args()

    with open(args.csv_file, newline="") as f:
        rows = list(csv.reader(f))
    # One section per profiled kernel: a line naming the kernel, the header, then one line per
    # SASS instruction.
    starts = [k for k, r in enumerate(rows) if r and r[0] == "Kernel Name"]
    if not starts:
        raise SystemExit(f"{args.csv_file}: no 'Kernel Name' line; is it ncu's --page source --csv output?")
    for begin, end in zip(starts, starts[1:] + [len(rows)]):
        report(rows[begin], rows[begin + 1], rows[begin + 2:end], args.top, args.context, args.stretches)


def report(kernel, header, code, top_n, context, stretches=False):
    source = header.index("Source")
    samples = header.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "(Not Issued)" not in h]

    def value(row, column):
        try:
            return float(row[column] or 0)
        except (ValueError, IndexError):
            return 0.0

    total = sum(value(r, samples) for r in code) or 1.0
    print(" ".join(kernel)[:160])
    print(f"{len(code)} instructions, {total:.0f} samples")
    by_reason = sorted(((sum(value(r, i) for r in code), header[i]) for i in reasons), reverse=True)
    print("stall reasons: " + ", ".join(f"{name[6:]} {100 * n / total:.1f}%" for n, name in by_reason[:8] if n))
    twentieths = [0.0] * 20
    for k, r in enumerate(code):
        twentieths[k * 20 // len(code)] += value(r, samples)
    print("samples by twentieth of the code (%): " + " ".join(f"{100 * x / total:.0f}" for x in twentieths))
    top = sorted(range(len(code)), key=lambda k: -value(code[k], samples))[:top_n]
    for k in top:
        row = code[k]
        why = ", ".join(f"{header[i][6:]} {value(row, i):.0f}" for i in reasons if value(row, i))
        print(f"\n{100 * value(row, samples) / total:5.1f}%  {row[source].strip()}   [{why}]")
        for before in code[max(0, k - context):k]:
            print(f"          {before[source].strip()}")
    if stretches:
        clocks = [k for k, r in enumerate(code) if "SR_CLOCKLO" in r[source]]
        print(f"\nstretches between the {len(clocks)} SM clock reads (instruction indices):")
        for lo, hi in zip([0] + clocks, clocks + [len(code)]):
            part = code[lo:hi]
            n = sum(value(r, samples) for r in part)
            if not part or not n:
                continue
            why = sorted(((sum(value(r, i) for r in part), header[i]) for i in reasons), reverse=True)
            print(f"  [{lo}, {hi}): {hi - lo} instructions, {100 * n / total:.1f}% of the samples: "
                  + ", ".join(f"{name[6:]} {100 * v / n:.0f}%" for v, name in why[:6] if v))
    print()


if __name__ == "__main__":
    main()
