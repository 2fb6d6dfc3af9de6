"""Where does the Hopper forward disagree with the reference? For one tile, compares the
kernel's log2 scores and P bytes with the reference's, for several launch settings."""

import itertools

import torch

import fp4attn.kernels.hopper.ops as ops
from fp4attn.formats import encode_fp8
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.forward import log2_scores
from fp4attn.reference.operands import quantize_qk

orig = ops.attn_fwd_kernel


class Launch:
    def __init__(self, **kw):
        self.kw = kw

    def __getitem__(self, grid):
        def launch(*a, **kw):
            kw.update(self.kw)
            return orig[grid](*a, **kw)
        return launch


torch.manual_seed(0)
for name, d, sk, (warps, stages) in itertools.product(["fp8", "nvfp4-fp8"], [64, 128], [128, 384], [(8, 3), (4, 1)]):
    q, k, v = (torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16) for s in (128, sk, sk))
    r = PRESETS[name]
    scale = d**-0.5
    ref = reference_forward(q, k, v, r, scale=scale, return_p=True)
    want = encode_fp8(ref.p * 256, "e4m3").view(torch.uint8)
    t_ref = log2_scores(quantize_qk(q, r.qk), quantize_qk(k, r.qk), scale, slice(None))
    ops.attn_fwd_kernel = Launch(num_warps=warps, num_stages=stages)
    out, _, p = ops.hopper_attention(q, k, v, r, scale=scale, causal_offset=None, write_p=1)
    _, _, t = ops.hopper_attention(q, k, v, r, scale=scale, causal_offset=None, write_p=2)
    ops.attn_fwd_kernel = orig
    t = t[..., :128, :]
    dt = (t - t_ref).abs()
    bad = dt > 1e-2
    cols = bad.any(-2)[0, 0].nonzero().flatten().tolist()
    rows = bad.any(-1)[0, 0].nonzero().flatten().tolist()
    print(f"{name} d={d} sk={sk} w={warps} s={stages} out cos={error_metrics(out, ref.out)['cos']:.5f} "
          f"P same={(p[..., :128, :] == want).float().mean().item():.4f} t maxerr={dt.max().item():.3g} "
          f"bad cols {len(cols)}: {cols[:12]} bad rows {len(rows)}: {rows[:12]}")
