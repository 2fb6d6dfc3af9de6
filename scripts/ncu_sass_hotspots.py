"""The SASS instructions of one profiled kernel that collect the most warp-stall samples,
from Nsight Compute's source page exported as CSV, with each one's main stall reasons:

    ncu --set full --import-source no -k regex:attn_fwd --launch-skip 2 --launch-count 1 \\
        -o prof python3 scripts/ncu_forward.py fp8-fastacc
    ncu -i prof.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 scripts/ncu_sass_hotspots.py sass.csv [top]
"""

import csv
import sys


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


rows = list(csv.DictReader(open(sys.argv[1])))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
total_col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
reason_cols = [c for c in rows[0] if c.startswith("stall_") or "Stall" in c and c != total_col and "Not-issued" not in c]
total = sum(number(r[total_col]) for r in rows) or 1.0
print(f"{len(rows)} instructions, {total:.0f} samples; columns: {', '.join(reason_cols[:40])}")
# the stall reasons summed over the kernel
sums = {c: sum(number(r[c]) for r in rows) for c in reason_cols}
print("kernel:", ", ".join(f"{c} {v / total:.1%}" for c, v in sorted(sums.items(), key=lambda x: -x[1])[:12]))
for r in sorted(rows, key=lambda r: -number(r[total_col]))[:top]:
    reasons = sorted(((number(r[c]), c) for c in reason_cols), reverse=True)[:3]
    print(f"{number(r[total_col]) / total:6.1%} {r.get('Address', '')} {r.get('Source', '')[:60]:60s} "
          + ", ".join(f"{c} {v / total:.1%}" for v, c in reasons if v))
