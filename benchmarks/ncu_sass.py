"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute report.

    ncu --section SourceCounters --section WarpStateStats -k regex:NAME -c 1 -o rep \\
        python benchmarks/kernels.py --profile --quick --only prefill
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_sass.py sass.csv [--top 30] [--window 100]

Prints the stall reasons over the whole kernel, the instructions with the most samples (with
their two main reasons), and the samples per window of consecutive instructions, so that the
partitions of a warp-specialized kernel (each a contiguous stretch of SASS, starting at its
setmaxnreg) can be told apart: e.g. a consumer waiting on an mbarrier shows as long-scoreboard
samples on the branch after a SYNCS...TRYWAIT, and a serialized wgmma pipeline as barrier
samples on a WARPGROUP.DEPBAR after every HGMMA. Samples the CSV gives no reason column for
are counted as "other" (on Hopper mostly an HGMMA waiting for the tensor cores).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=30, help="instructions to list")
    parser.add_argument("--window", type=int, default=100, help="instructions per window")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if SAMPLES in r)
    col = {name: i for i, name in enumerate(rows[header])}
    data = [r for r in rows[header + 1:] if len(r) == len(rows[header])]
    reasons = [n for n in col if n.startswith("stall_") and "Not Issued" not in n]

    def stalls(r: list[str]) -> Counter:
        c = Counter({n[len("stall_"):]: _int(r[col[n]]) for n in reasons})
        # Samples whose reason the CSV has no column for: on Hopper mostly an HGMMA waiting
        # for the tensor cores to take it.
        c["other"] = max(_int(r[col[SAMPLES]]) - sum(c.values()), 0)
        return c

    total = sum((stalls(r) for r in data), Counter())
    count = sum(total.values()) or 1
    print(f"{count} samples over {len(data)} instructions")
    for name, n in total.most_common(10):
        print(f"  {name:16s} {n:9d} {100 * n / count:5.1f}%")
    print(f"\ntop {args.top} instructions (index, samples, main reasons, SASS):")
    top = sorted(range(len(data)), key=lambda i: -_int(data[i][col[SAMPLES]]))[:args.top]
    for i in sorted(top):
        main_reasons = ", ".join(f"{k} {v}" for k, v in stalls(data[i]).most_common(2))
        print(f"  {i:5d} {_int(data[i][col[SAMPLES]]):8d}  {main_reasons:32s} "
              f"{data[i][col['Source']].strip()[:70]}")
    print(f"\nper window of {args.window} instructions (start, samples, main reasons):")
    for lo in range(0, len(data), args.window):
        part = sum((stalls(r) for r in data[lo:lo + args.window]), Counter())
        marker = next((r[col["Source"]].strip()[:40] for r in data[lo:lo + args.window]
                       if "SETMAXREG" in r[col["Source"]]), "")
        main_reasons = ", ".join(f"{k} {v}" for k, v in part.most_common(3))
        print(f"  {lo:5d} {sum(part.values()):8d}  {main_reasons:48s} {marker}")


if __name__ == "__main__":
    main()
