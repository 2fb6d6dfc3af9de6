"""`fp4attn codes`: how often Direct-P's codes differ from MXFP4 rounding of exp2, and
what Direct-P and consistent normalization cost or buy in accuracy.

Codes are compared on whole score rows normalized by their maximum (x = t - max t),
the state of the last tile of an exact-max online softmax, with Q/K in NVFP4 as the
`directp` recipe has them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fp4attn.cli.accuracy import CASES, format_table, make_inputs, run_accuracy
from fp4attn.cli.output import markdown_table, write_json
from fp4attn.recipes import PRESETS
from fp4attn.reference import directp_classify, exp2_mxfp4_classify
from fp4attn.reference.forward import log2_scores
from fp4attn.reference.operands import quantize_qk


def code_agreement(case: str, shape, seed: int = 0, device: str = "cpu") -> dict:
    """Fractions of identical codes and block exponents, Direct-P vs exp2 + MXFP4."""
    q, k, _ = (t.to(torch.bfloat16) for t in make_inputs(case, shape, seed, device))
    t = log2_scores(quantize_qk(q, "nvfp4"), quantize_qk(k, "nvfp4"), q.shape[-1] ** -0.5, slice(None))
    x = t - t.amax(dim=-1, keepdim=True)
    c_d, e_d = directp_classify(x)
    c_e, e_e = exp2_mxfp4_classify(x)
    differ = c_d != c_e
    return {
        "case": case, "B": shape[0], "H": shape[1], "S": shape[2], "D": shape[3],
        "codes": differ.numel(), "codes_differing": int(differ.sum()),
        "codes_identical": 1 - differ.float().mean().item(),
        "blocks": e_d.numel(), "block_exp_identical": (e_d == e_e).float().mean().item(),
        "nonzero_codes": (c_d > 0).float().mean().item(),
    }


def ablation_recipes():
    d = PRESETS["directp"]
    return [
        d,
        d.with_(p_build="exp2", name="directp, P by exp2+round"),
        d.with_(consistent_norm=False, name="directp, l from unrounded exp"),
        PRESETS["fp8-directp"],
        PRESETS["fp8-directp"].with_(consistent_norm=False, name="fp8-directp, l from unrounded exp"),
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-B", type=int, default=1, help="batch size (default 1)")
    p.add_argument("-H", type=int, default=4, help="heads (default 4)")
    p.add_argument("-S", type=int, default=1024, help="sequence length, queries and keys (default 1024)")
    p.add_argument("-D", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the inputs and kernels run: cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--json", type=Path, help="also write the results here as JSON")


def main(args: argparse.Namespace) -> dict:
    shape = (args.B, args.H, args.S, args.D)
    agreement = [code_agreement(c, shape, args.seed, args.device) for c in CASES]
    print("Direct-P codes vs MXFP4(exp2(x)), rows normalized by their max:")
    print(markdown_table(["case", "codes", "differing", "block exponents identical", "nonzero codes"],
                         [[a["case"], a["codes"], a["codes_differing"], f"{a['block_exp_identical']:.6f}",
                           f"{a['nonzero_codes']:.4f}"] for a in agreement]))
    ablation = run_accuracy(ablation_recipes(), CASES, shape, seed=args.seed, device=args.device, backend="reference")
    print("\naccuracy of the Direct-P and normalization choices vs float64 attention:")
    print(format_table(ablation))
    result = {"agreement": agreement, "ablation": ablation}
    write_json(args.json, result)
    return result
