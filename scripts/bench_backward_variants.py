"""Backward launch variants for docs/notes/hopper-train.md, one run: the backward op
alone under each `BackwardConfig` (the defaults, then the dq_atomic variant in a few
launch shapes), next to the forward and to SDPA cuDNN bf16's forward+backward, causal.
Prints a Markdown table.

    python scripts/bench_backward_variants.py [--defaults-only]
"""

import sys

import torch
import triton

from fp4attn.kernels.hopper import training
from fp4attn.kernels.hopper.quantize import decode_nvfp4_rows
from fp4attn.kernels.hopper.training import BackwardConfig
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
# the defaults first, then dQ added by the dkdv programs with atomics (no dq kernel); the
# variants measured before are at commit 54392bf (benchmarks/results/h200-backward-variants.txt)
VARIANTS = {
    64: [BackwardConfig(), BackwardConfig(block_n_dkdv=64, dq_atomic=True),
         BackwardConfig(block_n_dkdv=64, dq_atomic=True, warps_dkdv=4),
         BackwardConfig(block_n_dkdv=64, dq_atomic=True, stages_dkdv=1)],
    128: [BackwardConfig(block_n_dkdv=64), BackwardConfig(block_n_dkdv=64, dq_atomic=True),
          BackwardConfig(block_n_dkdv=64, dq_atomic=True, stages_dkdv=1)],
}
print("| B,H,S,D | config | bwd ms | fwd ms | cuDNN fwd+bwd ms | ours fwd+bwd / cuDNN |")
print("|---|---|---|---|---|---|")
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
    for cfg in [default] if "--defaults-only" in sys.argv else VARIANTS[D]:
        training.BACKWARD_CONFIGS[D] = cfg
        try:
            ms = bench(lambda: torch.ops.fp4attn.hopper_train_backward(dout, *saved, r.p, r.p_build, 0, True, D**-0.5))
        except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
            print(f"| {B},{H},{S},{D} | {cfg} | failed: {type(e).__name__} | | | |")
            continue
        print(f"| {B},{H},{S},{D} | {cfg} | {ms:.2f} | {fwd:.2f} | {cudnn:.2f} | {cudnn / (ms + fwd):.2f}x |")
    training.BACKWARD_CONFIGS[D] = default
    # prep alone: the fused quantizers (and delta) before the two kernels
    out, _, q_codes, q_bscale, k_codes, k_bscale, *rest = saved
    decode = bench(lambda: (decode_nvfp4_rows(q_codes, q_bscale), decode_nvfp4_rows(k_codes, k_bscale)))
    qv, kv = decode_nvfp4_rows(q_codes, q_bscale), decode_nvfp4_rows(k_codes, k_bscale)
    prep = bench(lambda: training.backward_operands(dout, out, qv, kv, *rest))
    print(f"| {B},{H},{S},{D} | decoding the saved NVFP4 Q/K alone | {decode:.2f} | | | |")
    print(f"| {B},{H},{S},{D} | backward operand quantizers alone | {prep:.2f} | | | |")
