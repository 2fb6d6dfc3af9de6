"""The affine P builders' accuracy study (docs/notes/affine-p.md), on the CPU reference:
every input family of `fp4attn accuracy` for the affine presets beside their exact
builders; consistent normalization off (the paper's claim that it matters for biased
codes); the FP8 map's offset K; and the paper's other option, selective native exponents
(the exact Direct-P codes for a block's largest entries, the affine map for the rest),
which the library does not ship: it is measured here only.

    python tools/affine_study.py --minilm --json benchmarks/results/accuracy-affine-cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import torch

from fp4attn.cli.accuracy import CASES, run_accuracy
from fp4attn.recipes import PRESETS
from fp4attn.reference import affine, directp


def _selective(codes_fn):
    """MXFP4 affine codes where the exact Direct-P code of the same block exponent is
    below `top`, the exact code at and above it (the entries that matter most)."""
    def classify(t, m_ref, top):
        codes, e_b = codes_fn(t, m_ref)
        x = t.float() - m_ref.float().unsqueeze(-1)
        exact, e_x = directp.directp_classify(x)
        return torch.where(exact >= top, exact, codes), e_b
    return classify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,4,1024,128")
    p.add_argument("--json", type=Path)
    p.add_argument("--minilm", action="store_true",
                   help="also all-MiniLM-L6-v2's attention operands (every layer) for the affine presets, "
                        "their exact builders and robust forms (about 10 minutes on two cores)")
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    torch.set_num_threads(2)
    records = []

    def run(recipes, cases, label):
        for r in run_accuracy(recipes, cases, shape):
            r["study"] = label
            records.append(r)
            print(f"{label:12s} {r['recipe']:34s} {r['case']:9s} cos {r['cos']:.5f}  p1 {r['cos_p1']:.4f}",
                  flush=True)

    robust = dict(smooth_k=True, qk_fallback="fp8", qk_four_over_six=True)
    robust_fast = [PRESETS["directp-fast"].with_(name="directp-fast + robust Q/K", **robust),
                   PRESETS["directp-fast"].with_(name="directp-fast + robust Q/K, v=fp8", v="fp8", **robust),
                   PRESETS["nvfp4-fp8-robust"].with_(p_build="affine", name="nvfp4-fp8-robust + affine P")]
    run(robust_fast, ("gaussian", "hard", "channels", "offset", "sharp", "sink"), "robust")
    pairs = ["fp8", "fp8-affine", "directp", "directp-fast", "fp8-directp", "fp8-directp-fast", "nvfp4-fp8"]
    run(pairs + [PRESETS["nvfp4-fp8"].with_(p_build="affine", name="nvfp4-fp8 + affine P")], CASES, "families")
    nocn = [PRESETS[n].with_(consistent_norm=False, name=f"{n}, consistent_norm off")
            for n in ("fp8-affine", "directp-fast", "fp8", "directp")]
    run(nocn, ("gaussian", "hard", "sharp", "mixture"), "no-cn")
    # the FP8 map's offset (the shipped K = 119.5)
    for k in (119.0, 119.5, 120.0):
        with mock.patch.object(affine, "K_FP8_F32", k):
            run([PRESETS["fp8-affine"].with_(name=f"fp8-affine K={k}")], ("gaussian", "sharp"), "offset")
    # selective native exponents: exact codes for a block's entries at or above E2M1 code `top`
    base = affine.affine_mxfp4_codes
    for top in (7, 6, 4):
        sel = _selective(base)
        with mock.patch.object(affine, "affine_mxfp4_codes", lambda t, m, top=top: sel(t, m, top)):
            run([PRESETS["directp-fast"].with_(name=f"directp-fast, exact codes >= {top}")],
                ("gaussian", "hard", "sharp"), "selective")
    if args.minilm:
        from fp4attn.cli.accuracy import minilm_records

        names = ["fp8", "fp8-affine", "directp", "directp-fast", "fp8-directp", "fp8-directp-fast", "nvfp4-fp8",
                 "directp-robust", "nvfp4-fp8-robust"]
        for r in minilm_records(names + robust_fast, device="cpu"):
            r["study"] = "minilm"
            records.append(r)
            print(f"minilm {r['recipe']:34s} {r['case']} cos {r['cos']:.5f} p1 {r['cos_p1']:.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
