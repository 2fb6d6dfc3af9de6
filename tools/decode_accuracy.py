"""Decode accuracy of the KV cache formats and of the NVFP4 scale schemes a cache could
use, on the CPU (reference decode), against float64 attention over the unquantized
keys and values: why the cache's NVFP4 second level is the token's own.

Schemes (K and V quantized alike, per token along the head dim):
    bf16, fp8, nvfp4, mxfp4        the cache's formats (`fp4attn.reference.kvcache`)
    nvfp4-pow2                     NVFP4 with the token's second level rounded up to a
                                   power of two (one byte a token instead of four)
    nvfp4-calibrated               NVFP4 with one second level per (sequence, KV head),
                                   fixed from the first 256 tokens (a prompt), as a
                                   cache with a calibrated tensor scale would: later,
                                   larger tokens saturate their block scales at 448
    nvfp4-rotated, mxfp4-rotated   the cache with `rotate_k` (Hadamard rotation of K, and
                                   of q at decode)
    nvfp4-smoothed, mxfp4-smoothed the cache with `smooth_k` (K less the mean of the first
                                   256 tokens, fixed)
    fp8-qe4m3, nvfp4-qe4m3,        the cache with q rounded to e4m3 at its row's own scale
    mxfp4-qe4m3                    (as the cache's FP8 tokens): what FP8 products of q and
                                   the keys' e4m3 (or E2M1-as-e4m3) codes would cost a
                                   decode recipe (docs/notes/decode.md)
Inputs (B=2, Hq=32, Hkv=8, L=4096, D=128, one query row at the end of the context):
    gaussian      K, V ~ N(0, 1)
    k-outliers    four key channels of each head 20x larger (the case rotation targets)
    drift         K and V growing 8x in magnitude from the first token to the last
    k-offset      K with a shared per-head offset of 3 in every channel

    python tools/decode_accuracy.py [--json benchmarks/results/log/decode-accuracy-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from fp4attn.formats.blocks import to_blocks
from fp4attn.formats.constants import E2M1_MAX, E4M3_MAX
from fp4attn.formats.minifloat import decode_e2m1, exact_div
from fp4attn.formats.nvfp4 import _blocks_scaled_to, nvfp4_global_encode_scale
from fp4attn.reference import robust
from fp4attn.reference.decode import reference_decode
from fp4attn.reference.kvcache import quantize_tokens, token_values

B, HQ, HKV, L, D = 2, 32, 8, 4096, 128
PROMPT = 256


def inputs(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(B, HKV, L, D, generator=g)
    v = torch.randn(B, HKV, L, D, generator=g)
    if kind == "k-outliers":
        ch = torch.randint(0, D, (HKV, 4), generator=g)
        for h in range(HKV):
            k[:, h, :, ch[h]] *= 20.0
    elif kind == "drift":
        ramp = torch.linspace(1.0, 8.0, L).reshape(1, 1, L, 1)
        k, v = k * ramp, v * ramp
    elif kind == "k-offset":
        k = k + 3.0
    return k.bfloat16().float(), v.bfloat16().float()


def per_token(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values a cache of format fmt stores for tokens x (..., D)."""
    flat = x.reshape(-1, x.shape[-1])
    vals, scale = token_values(quantize_tokens(flat, fmt), fmt, x.shape[-1])
    return (vals * scale[:, None]).reshape(x.shape)


def nvfp4_with(x: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """NVFP4 of x (..., D) along the last dim with the given encode scale (broadcast to
    (..., 1, 1)): TransformerEngine's operation order, block scales clamped at 448."""
    xb, layout = to_blocks(x, -1, 16)
    s_dec = exact_div(torch.ones_like(s_enc), s_enc)
    d, codes = _blocks_scaled_to(xb, xb.abs().amax(-1, keepdim=True), s_enc, s_dec, E2M1_MAX)
    vals = decode_e2m1(codes) * d.float() * s_dec
    return vals.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]


def nvfp4_pow2(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True)
    s_dec = torch.exp2(torch.ceil(torch.log2(amax / (E4M3_MAX * E2M1_MAX)))).clamp(min=2.0**-126)
    return nvfp4_with(x, (1.0 / s_dec).unsqueeze(-1))


def nvfp4_calibrated(x: torch.Tensor) -> torch.Tensor:
    amax = x[:, :, :PROMPT].abs().amax(dim=(-2, -1), keepdim=True)  # per (sequence, head), the prompt's
    s_enc = nvfp4_global_encode_scale(amax).unsqueeze(-1)
    return nvfp4_with(x, s_enc)


def quantized(k: torch.Tensor, v: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(K values, V values, rotated) as the scheme stores them."""
    if scheme.endswith("-smoothed"):
        fmt = scheme.removesuffix("-smoothed")
        mean = k[:, :, :PROMPT].double().mean(dim=2, keepdim=True).float()
        return per_token(k - mean, fmt), per_token(v, fmt), False
    if scheme.endswith("-rotated"):
        fmt = scheme.removesuffix("-rotated")
        return per_token(robust.rotate(k), fmt), per_token(v, fmt), True
    if scheme.endswith("-qe4m3"):
        fmt = scheme.removesuffix("-qe4m3")
        return per_token(k, fmt), per_token(v, fmt), False
    if scheme == "nvfp4-pow2":
        return nvfp4_pow2(k), nvfp4_pow2(v), False
    if scheme == "nvfp4-calibrated":
        return nvfp4_calibrated(k), nvfp4_calibrated(v), False
    return per_token(k, scheme), per_token(v, scheme), False


def metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double().flatten(), ref.double().flatten()
    return {"cos": float(o @ r / (o.norm() * r.norm())), "rel_l2": float((o - r).norm() / r.norm())}


SCHEMES = ("bf16", "fp8", "nvfp4", "mxfp4", "nvfp4-pow2", "nvfp4-calibrated", "nvfp4-rotated", "mxfp4-rotated",
           "nvfp4-smoothed", "mxfp4-smoothed", "fp8-qe4m3", "nvfp4-qe4m3", "mxfp4-qe4m3")
KINDS = ("gaussian", "k-outliers", "drift", "k-offset")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    scale = 1.0 / math.sqrt(D)
    lengths = torch.full((B,), L)
    records = []
    for kind in KINDS:
        k, v = inputs(kind, g)
        q = torch.randn(B, HQ, 1, D, generator=g).bfloat16().float()
        kk, vv = k.repeat_interleave(HQ // HKV, 1).double(), v.repeat_interleave(HQ // HKV, 1).double()
        ref = torch.softmax((q.double() @ kk.transpose(-1, -2)) * scale, -1) @ vv
        for scheme in SCHEMES:
            kq, vq, rotated = quantized(k, v, scheme)
            qq, sc = (robust.rotate(q), scale * robust.rotation_scale(D)) if rotated else (q, scale)
            if scheme.endswith("-qe4m3"):
                qq = per_token(qq, "fp8")
            ones = torch.ones(B, HKV, L)
            out = reference_decode(qq, kq, ones, vq, ones, lengths, scale=sc).out
            rec = {"inputs": kind, "scheme": scheme, **metrics(out, ref)}
            records.append(rec)
            print(f"{kind:11s} {scheme:17s} cos {rec['cos']:.5f}  rel_l2 {rec['rel_l2']:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"shape": dict(B=B, Hq=HQ, Hkv=HKV, L=L, D=D), "records": records}, indent=1))


if __name__ == "__main__":
    main()
