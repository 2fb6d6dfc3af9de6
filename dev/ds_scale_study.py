"""How `train-fp8`'s gradients change when dS's FP8 views take scales that a tiled kernel knows
before its tile loop (so that dK and dV could accumulate inside the tensor cores across tiles,
docs/notes/hopper-train.md), against the recipe's scale per row and 64-element block.
CPU, the reference backward, cosine of dQ, dK, dV to float64 autograd.

    python dev/ds_scale_study.py [--cases gaussian,offset,sharp,channels] [--json PATH]

Scales of dS's two views (dQ's: per query over keys; dK's: per key over queries):
- block:  the recipe's (`reference.backward.DS_BLOCK`): amax of each 64-element block of the row;
- row:    amax of the whole row (a kernel would need a second pass over dS);
- tensor: amax of the (batch, head) (cuDNN's per-tensor scale, with delayed scaling's exact amax);
- bound:  from norms known before the loop, P <= 1 and |dP_ij| <= |dO_i| |V_j|:
          per query |dO_i| max_j |V_j| + |delta_i|, per key |V_j| max_i |dO_i| + max_i |delta_i|.
"""

from __future__ import annotations

import argparse
import json

import torch

from fp4attn.api import attention
from fp4attn.cli.accuracy import make_inputs
from fp4attn.formats.constants import E4M3_MAX
from fp4attn.metrics import error_metrics
from fp4attn.reference import backward as ref_backward

MODES = ("block", "row", "tensor", "bound")


def fixed_scale_view(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as e4m3 values with the given scale (broadcast): round to nearest even, saturating at
    448 (clamped before the cast, which does not saturate on every torch), NaN kept."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def run(case: str, mode: str, shape=(1, 4, 1024, 128), seed=0):
    q, k, v = (t.to(torch.bfloat16) for t in make_inputs(case, shape, seed, "cpu"))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=True).backward(dout.double())

    original = ref_backward.low_precision_view
    if mode != "block":
        do, vf = dout.float(), v.float()
        o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), vf, is_causal=True)
        delta = (do * o).sum(-1)  # (B, H, Sq)
        do_n, v_n = do.norm(dim=-1), vf.norm(dim=-1)  # (B, H, Sq), (B, H, Sk)

        def view(x, contraction_dim, fmt, block=None):
            if block is None:
                return original(x, contraction_dim, fmt, block)
            if mode == "row":
                return original(x, contraction_dim, fmt)
            if mode == "tensor":
                amax = x.abs().amax(dim=(-2, -1), keepdim=True)
            elif contraction_dim == -1:  # dQ's view: per query row over the keys
                amax = (do_n * v_n.amax(-1, keepdim=True) + delta.abs())[..., None]
            else:  # dK's view: per key column over the queries
                amax = (v_n * do_n.amax(-1, keepdim=True) + delta.abs().amax(-1, keepdim=True))[..., None, :]
            return fixed_scale_view(x, (amax / E4M3_MAX).clamp_min(2.0**-112))

        ref_backward.low_precision_view = view
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe="train-fp8", is_causal=True, backend="reference").backward(dout)
    finally:
        ref_backward.low_precision_view = original
    return {f"cos_d{g}": error_metrics(got.grad, want.grad)["cos"] for g, (got, want) in zip("qkv", zip(leaves, exact))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="gaussian,offset,sharp,channels")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        for mode in MODES:
            r = {"case": case, "scales": mode, **run(case, mode)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| inputs | dS scales | cos dQ | cos dK | cos dV |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['scales']} | {r['cos_dq']:.4f} | {r['cos_dk']:.4f} | {r['cos_dv']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
