"""Every routed Hopper kernel once, at small awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool racecheck python tools/sanitize_driver.py

(`PART=sanitize bash tools/gpu_suite.sh` runs memcheck, racecheck and synccheck over it.)
Each case is a `fp4attn.attention` call: the inference recipes' forward (the fused
quantizers, then the Gluon warp-specialized kernel or the Triton kernel, with and
without a key mask), and the training recipes' forward and backward (the Gluon dK/dV
and dQ kernels where the lengths are whole 64-token tiles, the Triton ones otherwise).
`--list` prints the kernels each case runs on sm_90 (`fp4attn.explain`), without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import fp4attn

# (B, Hq, Hkv, Sq, Sk, D): odd lengths (masked tail tiles, Triton backward), whole tiles
# (the Gluon backward at both head dims), GQA, and a head dim below the kernel's
SHAPES = ((1, 2, 2, 113, 113, 128), (1, 2, 1, 256, 256, 128), (1, 2, 2, 256, 256, 64), (1, 4, 2, 128, 200, 48))
# one recipe of each kernel family: FP8 P with exact (bf16) and FP8-tensor-core QK^T,
# NVFP4 Q/K, MXFP4 P by Direct-P and by exp2; training with FP8 and MXFP4 P, and with
# per-token FP8 Q/K (the kernels' ROW_SCALES forms)
INFERENCE = ("fp8", "fp8-fastacc", "nvfp4-fp8", "directp", "fp8-directp")
TRAINING = ("train", "train-mxfp4pv", "train-fp8")
# `--quick` (the pytest run, within a GPU test's time limit): every kernel once, causal
QUICK_SHAPES = ((1, 2, 1, 256, 256, 128), (1, 2, 2, 128, 128, 64), (1, 2, 2, 113, 113, 64))
QUICK_RECIPES = ("fp8-fastacc", "nvfp4-fp8", "directp")


def cases(quick: bool = False):
    """(recipe, shape, causal, key mask, backward) of every call."""
    for shape in QUICK_SHAPES if quick else SHAPES:
        for causal in (True,) if quick else (False, True):
            for recipe in QUICK_RECIPES if quick else INFERENCE:
                yield recipe, shape, causal, False, False
            for recipe in TRAINING:
                yield recipe, shape, causal, False, True
        yield "nvfp4-fp8", shape, False, True, False


def inputs(shape, device, grad):
    B, Hq, Hkv, Sq, Sk, D = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, h, s, D, generator=g).to(device, torch.bfloat16) for h, s in
               ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v


def key_mask(shape, device):
    B, _, _, _, Sk, _ = shape
    mask = torch.ones(B, 1, 1, Sk, dtype=torch.bool, device=device)
    mask[..., Sk - Sk // 3:] = False  # the last third of the keys padded away
    return mask


def run(recipe, shape, causal, masked, backward, device="cuda", explain=False):
    q, k, v = inputs(shape, device, backward)
    kw = dict(causal=causal, recipe=recipe, enable_gqa=True, backend="triton",
              attn_mask=key_mask(shape, device) if masked else None)
    if explain:
        return fp4attn.explain(q, k, v, **kw)["kernel"]
    out = fp4attn.attention(q, k, v, **kw)
    if backward:
        out.float().square().sum().backward()
    torch.cuda.synchronize()
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print what each case runs on sm_90, without running it")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and recipes, every kernel still once")
    args = ap.parse_args()
    if args.list:
        os.environ.update(FP4ATTN_TARGET="sm_90", TRITON_INTERPRET="1")  # route as on an H200, run nothing
        for case in cases(args.quick):
            print(*case, run(*case, device="cpu", explain=True), sep=" | ")
        return
    if not torch.cuda.is_available():
        sys.exit("sanitize_driver: needs a CUDA GPU (--list works without one)")
    n = 0
    for case in cases(args.quick):
        run(*case)
        n += 1
    print(f"sanitize_driver: {n} calls ran")


if __name__ == "__main__":
    main()
