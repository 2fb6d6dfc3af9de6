"""Where a profiled kernel's warps wait, instruction by instruction, from Nsight Compute's
source page exported as CSV:

    ncu --set full --import-source no -k regex:attn_fwd --launch-skip 2 --launch-count 1 \\
        -o prof python3 tools/ncu_forward.py fp8-fastacc
    ncu -i prof.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 tools/ncu_sass_hotspots.py sass.csv [top]

Prints the kernel's stall reasons over all warp samples, then the same over the
instructions from the first to the last tensor-core instruction (the consumer's tile
loop in the forward kernels; NOPs left out: in a warp-specialized kernel they are where
the idle warps of the producer's warpgroup wait for the whole kernel), with the opcodes
that collect each main reason, then the `top` instructions by samples.
"""

import collections
import csv
import sys

TOTAL = "Warp Stall Sampling (All Samples)"


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def breakdown(rows, reasons, label: str) -> None:
    total = sum(number(r[TOTAL]) for r in rows) or 1.0
    sums = sorted(((sum(number(r[c]) for r in rows), c) for c in reasons), reverse=True)
    print(f"{label}: {len(rows)} instructions, {total:.0f} samples")
    for v, c in sums[:10]:
        by_op = collections.Counter()
        for r in rows:
            by_op[opcode(r["Source"])] += number(r[c])
        ops = ", ".join(f"{op} {n / total:.1%}" for op, n in by_op.most_common(4) if n)
        print(f"  {c[len('stall_'):]:16s} {v / total:6.1%}   ({ops})")


def main() -> None:
    with open(sys.argv[1]) as f:
        lines = f.read().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith('"Address"')):]  # after the kernel name
    rows = [r for r in csv.DictReader(lines) if r["Source"].strip()]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[TOTAL]) for r in rows) or 1.0
    breakdown(rows, reasons, "kernel")
    tensor = [i for i, r in enumerate(rows) if opcode(r["Source"]) in ("QGMMA", "HGMMA")]
    if tensor:
        loop = [r for r in rows[tensor[0]:tensor[-1] + 1] if opcode(r["Source"]) != "NOP"]
        share = sum(number(r[TOTAL]) for r in loop) / total
        breakdown(loop, reasons, f"first to last tensor-core instruction, NOPs left out ({share:.1%} of samples)")
    print(f"top {top} instructions (share of all samples, main reasons):")
    for r in sorted(rows, key=lambda r: -number(r[TOTAL]))[:top]:
        main_reasons = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:2]
        print(f"{number(r[TOTAL]) / total:6.1%} {r['Source'][:58]:58s} "
              + ", ".join(f"{c[len('stall_'):]} {v / total:.1%}" for v, c in main_reasons if v))


if __name__ == "__main__":
    main()
