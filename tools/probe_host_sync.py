"""Does one call of a training recipe make the host wait for the GPU? Runs a causal
forward+backward through `fp4attn.attention` under `torch.cuda.set_sync_debug_mode`,
which warns at every operation that synchronizes the host with the device (an `.item()`,
a copy from pageable host memory, `nonzero`), and prints where each came from. Then the
host's time per call three ways: issuing one call after a synchronization (the host's
work, plus any wait inside the call), back-to-back calls without synchronizing (the
larger of the host's and the GPU's time per call), and the GPU's time per call
(`do_bench`).

    python tools/probe_host_sync.py [--shape 4,16,4096,128] [--recipes train,train-fp8]
"""

import argparse
import time
import traceback
import warnings

import torch
import triton

import fp4attn

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4,16,4096,128")
ap.add_argument("--recipes", default="train,train-robust,train-fp8")
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
           for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)


def step(recipe):
    def f():
        q.grad = k.grad = v.grad = None
        fp4attn.attention(q, k, v, causal=True, recipe=recipe, backend="triton").backward(dout)
    return f


print(f"(B,H,S,D) = {(B, H, S, D)}, causal forward+backward; {torch.cuda.get_device_name()}\n")
rows = []
for recipe in args.recipes.split(","):
    f = step(recipe)
    f()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            f()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # (the mode's own notice, "a prototype feature", is not an operation)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    print(f"{recipe}: {len(syncs)} synchronizing operation(s) in one call")
    for w in syncs[:10]:
        print(f"  {str(w.message)[:120]} at {w.filename}:{w.lineno}")

    def issue():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    one = sorted(issue() for _ in range(20))[10] * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        f()
    torch.cuda.synchronize()
    back = (time.perf_counter() - t0) / 30 * 1e3
    gpu = triton.testing.do_bench(f, warmup=5, rep=100, return_mode="median")
    rows.append((recipe, len(syncs), one, back, gpu))

print("\n| recipe | synchronizing ops a call | host ms to issue one call (median) | ms a call, back to back | do_bench ms |")
print("|---|---|---|---|---|")
for r, n, one, back, gpu in rows:
    print(f"| {r} | {n} | {one:.3f} | {back:.3f} | {gpu:.3f} |")
