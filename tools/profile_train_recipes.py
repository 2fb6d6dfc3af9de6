"""Where the training recipes' time goes, side by side: the device time of each kernel of
one causal forward+backward through `fp4attn.attention` (the torch profiler's own span
of every kernel, summed per kernel name), per recipe, at one shape, in one process, with
the call's host-seen time (`triton.testing.do_bench`) beside the kernels' sum. For a
recipe that costs more than another while running the same attention kernels (the
operand quantizers differ, or a launch does): the rows that differ say which.

    python tools/profile_train_recipes.py [--shape 4,16,4096,128] [--recipes train,train-robust]
"""

import argparse

import torch
import triton

import fp4attn
from fp4attn.tools.benchmark import device_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4,16,4096,128")
ap.add_argument("--recipes", default="train,train-robust")
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))
recipes = args.recipes.split(",")

gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
           for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)


def step(recipe):
    def f():
        q.grad = k.grad = v.grad = None
        fp4attn.attention(q, k, v, causal=True, recipe=recipe, backend="triton").backward(dout)
    return f


kernels, totals = {}, {}
for recipe in recipes:
    f = step(recipe)
    f()  # compile
    kernels[recipe] = device_kernels(f, reps=10)
    seen = triton.testing.do_bench(f, warmup=5, rep=100, return_mode="median")
    totals[recipe] = (sum(ms for _, ms in kernels[recipe].values()), seen)

print(f"(B,H,S,D) = {(B, H, S, D)}, causal forward+backward, bf16 inputs; {torch.cuda.get_device_name()}\n")
print("| kernel | " + " | ".join(f"{r} launches | {r} ms" for r in recipes) + " |")
print("|---|" + "---|---|" * len(recipes))
names = sorted({n for ks in kernels.values() for n in ks},
               key=lambda n: -max(ks.get(n, (0, 0.0))[1] for ks in kernels.values()))
for name in names:
    cells = []
    for r in recipes:
        n, ms = kernels[r].get(name, (0, 0.0))
        cells += [f"{n:g}", f"{ms:.3f}"]
    print(f"| {name[:70]} | " + " | ".join(cells) + " |")
print("| **sum of kernels (device ms)** | " + " | ".join(f" | {totals[r][0]:.3f}" for r in recipes) + " |")
print("| **host-seen ms (do_bench)** | " + " | ".join(f" | {totals[r][1]:.3f}" for r in recipes) + " |")
