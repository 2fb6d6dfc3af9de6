"""Where the robust quantizers' extra time goes, at one shape: the passes over Q and K
that the robust presets add (K's mean with the maximum of K - mean and the fallback
statistic in one pass, `_key_mean_kernel`; Q's maximum with its sum of squares) and the
NVFP4 quantizing pass with and without 4-or-6 scales, at several row blocks a program,
each with and without the next block's load issued before the current block's work
(the kernels' PREFETCH), and the training's packed passes at two block shapes; then the whole operand quantization of `nvfp4-fp8` and `nvfp4-fp8-robust`,
device time (sum of its kernels) and host-seen time. Device time of single launches by
`triton.testing.do_bench` (median). Prints Markdown tables.

    python tools/probe_key_pass.py [--shape 8,16,4096,128]
"""

import argparse
import time

import torch
import triton

from fp4attn.kernels.hopper.operands import prepare_operands_fused
from fp4attn.kernels.quantize import nvfp4
from fp4attn.kernels.quantize import statistics as qz
from fp4attn.recipes import PRESETS
from fp4attn.tools.benchmark import device_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="8,16,4096,128")
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))
G = B * H


def bench(f):
    return triton.testing.do_bench(f, warmup=20, rep=200, return_mode="median")


q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
k3 = k.view(G, S, D)
rows = [("copy of K (read + write)", bench(lambda: k.clone()))]
amax = torch.zeros(G, device="cuda", dtype=torch.int32)
sumsq = torch.zeros(G, device="cuda", dtype=torch.float64)
mean = torch.zeros(G * D, device="cuda", dtype=torch.float32)
grid, block = qz._row_grid(S, G, qz.CHANNEL_BLOCKS, most=32)
for name, kw in [("amax (paper Q/K)", {}), ("amax + sum sq, prefetch (robust Q)", dict(SUM_SQ=True))]:
    def f(kw=kw):
        return qz._abs_max_kernel[grid](k3, amax, mean, sumsq, S, D=D, BLOCK_S=block, BLOCKS=qz.CHANNEL_BLOCKS,
                                        PER_CHANNEL=False, num_warps=4, **kw)
    rows.append((name, bench(f)))

# the whole key pass as robust_qk_operands runs it (mean, extremes, sums of squares, choice)
sq_q = torch.zeros(G, device="cuda", dtype=torch.float64)
fb = torch.zeros(2 * G, device="cuda", dtype=torch.int8)
choice = dict(SQ_Q=sq_q, FB_Q=fb[:G], FB_K=fb[G:], S_Q=S, GROUP=1, GROUP_P2=1, SCALE=D**-0.5, LIMIT=1.25)
for rows_a_program in (512, 1024):
    work = qz._zero_views(k.device, *qz._key_pass_work(G, D, True, True))
    sums, sums_sq, ext, count = work
    mean_out = torch.empty(G, D, device="cuda", dtype=torch.float32)
    amax_out = torch.empty(G, device="cuda", dtype=torch.int32)
    blk, _, fold = qz._key_pass_block(S, D, 2)
    blocks = rows_a_program // blk
    gr = (triton.cdiv(S, blk * blocks), G)

    def f():
        count.zero_()
        qz._key_mean_kernel[gr](k3, sums, count, mean_out, S, D=D, BLOCK_S=blk, BLOCKS=blocks, HW_CVT=True,
                                FOLD=fold, STATS=True, EXT=ext, AMAX=amax_out, CHOICE=True, SUMSQ=sums_sq,
                                **choice, num_warps=4)
    rows.append((f"key pass (mean, extremes, sum sq, choice; with a zero fill), {rows_a_program} rows", bench(f)))

y = torch.empty(G, S, D, device="cuda", dtype=torch.bfloat16)
sdec = torch.empty(G, S, device="cuda", dtype=torch.float32)
amax_k = qz.abs_max_bits(k3, per_channel=False)
fbk = torch.zeros(G, device="cuda", dtype=torch.int8)
for f46, robust_k, blocks in ((False, False, 1), (False, False, 8), (True, True, 1), (True, True, 8), (True, False, 8)):
    gr, blk = qz._row_grid(S, G, blocks)
    def f():
        return nvfp4._nvfp4_rows_kernel[gr](k3, y, amax_k, sdec, y, y, amax_k, mean, fbk, S, D=D, BLOCK_R=blk,
                                            BLOCKS=blocks, PACKED=False, CHANNEL_AMAX=False, HAS_MEAN=robust_k,
                                            FOUR_OVER_SIX=f46, FALLBACK=robust_k, HW_CVT=True, num_warps=4)
    rows.append((f"nvfp4 rows{' 4-or-6' if f46 else ''}{' + mean + fallback' if robust_k else ''}, "
                 f"{blk} rows x {blocks} blocks{' (prefetch)' if blocks > 1 else ''}", bench(f)))

# the training's passes (`train_op.quantize_for_training`): the packed payload and the
# channel maxima besides, plain (`train`) and 4-or-6 with K's mean (`train-robust`), at
# 16-row blocks (the launcher's; 168 registers for the 4-or-6 build at D=128) and 8-row
# blocks (96), the same rows a program
codes = torch.empty(G, S, D // 2, device="cuda", dtype=torch.uint8)
bscale = torch.empty(G, S, D // 16, device="cuda", dtype=torch.float8_e4m3fn)
camax = torch.zeros(G * D, device="cuda", dtype=torch.int32)
for f46, rows_a_block in ((False, 16), (True, 16), (True, 8)):
    blocks = qz.CHANNEL_BLOCKS * 16 // rows_a_block
    gr, blk = qz._row_grid(S, G, blocks, most=rows_a_block)
    def f():
        return nvfp4._nvfp4_rows_kernel[gr](k3, y, amax_k, sdec, codes, bscale, camax, mean, fbk, S, D=D,
                                            BLOCK_R=blk, BLOCKS=blocks, PACKED=True, CHANNEL_AMAX=True, HAS_MEAN=f46,
                                            FOUR_OVER_SIX=f46, FALLBACK=False, HW_CVT=True, num_warps=4)
    rows.append((f"training nvfp4 rows{' 4-or-6 + mean' if f46 else ''} (packed, channel maxima), "
                 f"{blk} rows x {blocks} blocks", bench(f)))

print(f"(B,H,S,D) = {(B, H, S, D)}, bf16; one operand {k.numel() * 2 / 1e6:.0f} MB\n")
print("| kernel | ms | GB/s of one bf16 read |")
print("|---|---|---|")
for name, ms in rows:
    print(f"| {name} | {ms:.4f} | {k.numel() * 2 / ms * 1e-6:.0f} |")

print("\n| quantization of | device ms (sum of kernels) | host-seen ms (do_bench) | launch ms a call (no sync) | kernels |")
print("|---|---|---|---|---|")
for r in ("nvfp4-fp8", "nvfp4-fp8-robust"):
    def call(r=r):
        return prepare_operands_fused(q, k, v, PRESETS[r], scale=D**-0.5)
    host = bench(call)
    kern = device_kernels(call)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"| {r} | {sum(ms for _, ms in kern.values()):.3f} | {host:.3f} | {(t1 - t0) / 50 * 1e3:.3f} | "
          f"{sum(n for n, _ in kern.values())} |")
    for name, (n, ms) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
        print(f"|   {name[:60]} | {ms:.4f} | | | {n} |")
