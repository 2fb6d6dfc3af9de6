"""Backward launch variants for docs/notes/hopper-train.md, one run: the backward op
alone under each `BackwardConfig` (the defaults, then the operand tiles by TMA in a
few launch shapes), next to the forward and to SDPA cuDNN bf16's forward+backward, causal.
Prints a Markdown table.

    python scripts/bench_backward_variants.py [--defaults-only]
"""

import dataclasses
import sys

import torch
import triton

from fp4attn.cli.bench import device_kernels
from fp4attn.kernels.hopper import training
from fp4attn.kernels.hopper.training import BackwardConfig
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
# the default first, then the Gluon dK/dV kernel with the other STAGED forms, then both Triton
# kernels. Measured before: the Gluon dQ kernel and the 168-register caps at commit
# 8062919 (benchmarks/results/h200-backward-gluon-maxnreg.txt), the Gluon dK/dV kernel's
# IN_FLIGHT at d417778 (h200-backward-dkdv-gluon-2.txt), the launch shapes and TMA tiles at
# 7f750d2 (h200-backward-variants-tma.txt), dq_atomic at 3f801e5
# (h200-backward-variants-dq-atomic.txt)
def _variants(cfg: BackwardConfig) -> list[BackwardConfig]:
    return [cfg, *(dataclasses.replace(cfg, dkdv_staged=s) for s in (0, 1, 2) if s != cfg.dkdv_staged),
            dataclasses.replace(cfg, dkdv_gluon=False, dq_gluon=False)]


VARIANTS = {d: _variants(training.BACKWARD_CONFIGS[d]) for d in (64, 128)}


def short(cfg: BackwardConfig) -> str:
    """The fields that differ from BackwardConfig()'s."""
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(BackwardConfig(), f.name)]
    return ", ".join(diff) or "BackwardConfig()"


print("| B,H,S,D | config | bwd ms | fwd ms | cuDNN fwd+bwd ms | ours fwd+bwd / cuDNN | max rel. diff to the first config |")
print("|---|---|---|---|---|---|---|")
for B, H, S, D in [(4, 16, 4096, 128), (8, 16, 4096, 64)]:
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        cudnn = bench(lambda: torch.autograd.grad(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout))
    r = PRESETS["train"]
    saved = torch.ops.fp4attn.hopper_train_forward(q, k, v, r.qk, r.p, r.p_build, r.v, 0, True, D**-0.5)
    fwd = bench(lambda: torch.ops.fp4attn.hopper_train_forward(q, k, v, r.qk, r.p, r.p_build, r.v, 0, True, D**-0.5))
    default = training.BACKWARD_CONFIGS[D]
    backward = lambda: torch.ops.fp4attn.hopper_train_backward(dout, *saved, r.p, r.p_build, 0, True, D**-0.5,  # noqa: E731
                                                               *[torch.bfloat16] * 3)
    first = None
    for cfg in [default] if "--defaults-only" in sys.argv else VARIANTS[D]:
        training.BACKWARD_CONFIGS[D] = cfg
        try:
            grads = backward()
            ms = bench(backward)
        except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
            print(f"| {B},{H},{S},{D} | {short(cfg)} | failed: {type(e).__name__} | | | | |")
            continue
        # the GPU tests check the default against the reference; the others against it
        first = first or grads
        diff = max(float((g - f).norm() / f.norm()) for g, f in zip(grads, first))
        bad = not all(bool(torch.isfinite(g).all()) for g in grads)
        print(f"| {B},{H},{S},{D} | {short(cfg)} | {ms:.2f} | {fwd:.2f} | {cudnn:.2f} | {cudnn / (ms + fwd):.2f}x | "
              f"{'non-finite' if bad else f'{diff:.1e}'} |")
        for name, (_, kms) in sorted(device_kernels(backward, reps=5).items(), key=lambda kv: -kv[1][1]):
            print(f"| {B},{H},{S},{D} | {short(cfg)}, kernel {name[:50]} | {kms:.3f} | | | | |")
    training.BACKWARD_CONFIGS[D] = default
    # prep alone: the saved Q/K decoded with their channel views, dO's views and delta
    out, _, *rest = saved
    prep = bench(lambda: training.backward_operands(dout, out, *rest))
    print(f"| {B},{H},{S},{D} | backward operand quantizers alone | {prep:.2f} | | | | |")
