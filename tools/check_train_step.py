"""One process on a Hopper GPU: the causal train-fp8 step (forward+backward, quantization
included) with its backward on the Gluon kernels or the CUDA kernel (BackwardLaunch.cuda),
against SDPA cuDNN bf16 forward+backward in the same run. (At 49caccb it also took the training
forward on the CUDA kernel: measured no faster, docs/notes/hopper-train.md.)

    python tools/check_train_step.py [--out DIR] [--shapes B,H,S,D ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fp4attn
from fp4attn import routing
from tools.check_backward_cuda import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=["4,16,4096,128", "2,16,8192,128", "1,32,16384,128",
                                                     "8,16,4096,64"])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for text in args.shapes:
        B, H, S, D = map(int, text.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16() for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

        def ours():
            fp4attn.attention(q, k, v, is_causal=True, recipe="train-fp8").backward(dout)

        row = {"shape": [B, H, S, D], "sdpa_cudnn_ms": bench_ms(sdpa)}
        table = routing.backward_launch(D)
        for bwd_cuda in (False, True):
            with routing.override_launch(backward=dataclasses.replace(table, cuda=bwd_cuda)):
                ms = bench_ms(ours)
            key = f"bwd_{'cuda' if bwd_cuda else 'gluon'}"
            row[key + "_ms"] = ms
            row[key + "_x"] = row["sdpa_cudnn_ms"] / ms
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(f"{args.out}/train_step.json", "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| shape | cuDNN bf16 ms | backward on the Gluon kernels | backward on the CUDA kernel |")
    for r in rows:
        cells = [f"{r[k + '_ms']:.3f} ({r[k + '_x']:.2f}x)" for k in ("bwd_gluon", "bwd_cuda")]
        print(f"| {r['shape']} | {r['sdpa_cudnn_ms']:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
