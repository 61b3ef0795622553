"""Whether a decode variant meets stop 89's rule for landing the four-stage partition, read
from an `abdecode.log` (or the ` row ` lines of one) of `scripts/gpu_check.sh variants abdecode`:

    python3 benchmarks/ab_land_rule.py $OUT/ab/abdecode.log [--tag gqa_variant_0]

By the mean of each build's repeats against main's: the equal rows of 64/8/128 on 8,192 keys
(B15 and B16) each 0.3% faster or more, no ragged row more than 0.5% slower and no other row
more than 0.3% slower. Prints each row's change and a verdict; exits 0 where the rule holds
(so that a device script can go on to the candidate's tables), 1 where it does not or the log
lacks either equal row (B15 or B16 64/8/128 L8192) for both builds: a run cut short by its
timeout must not pass on the rows it reached."""
import argparse
import collections
import re


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--tag", default="gqa_variant_0", help="the candidate build's tag in the log")
    args = parser.parse_args()
    times = collections.defaultdict(lambda: collections.defaultdict(list))  # row -> build -> us
    with open(args.log) as log:
        for line in log:
            m = re.match(r"(\S+) row (\d+) (.*?): ours ([\d.]+)", line)
            if m:
                times[m.group(3)][m.group(1)].append(float(m.group(4)))
    deciding_rows = {"B15 64/8/128 L8192", "B16 64/8/128 L8192"}
    compared, holds = set(), True
    for row, by_build in times.items():
        if "main" not in by_build or args.tag not in by_build:
            continue
        mean = {b: sum(v) / len(v) for b, v in by_build.items()}
        change = mean[args.tag] / mean["main"] - 1
        if "ragged" in row:
            ok = change <= 0.005
        elif row in deciding_rows:
            ok = change <= -0.003
        else:
            ok = change <= 0.003
        print(f"{row}: {100 * change:+.2f}% {'ok' if ok else 'FAILS'}")
        compared.add(row)
        holds &= ok
    missing = sorted(deciding_rows - compared)
    if missing:
        print(f"missing from the log for main or {args.tag}: {', '.join(missing)}")
    verdict = not missing and holds
    print("the rule holds: land" if verdict else "the rule does not hold: keep main")
    raise SystemExit(0 if verdict else 1)


if __name__ == "__main__":
    main()
