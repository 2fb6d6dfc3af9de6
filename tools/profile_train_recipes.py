"""Where the training recipes' time goes, side by side: the device time of each kernel of
one causal forward+backward through `fp4attn.attention` (the torch profiler's own span
of every kernel, summed per kernel name), per recipe, at one shape, in one process, with
the call's host-seen time (`triton.testing.do_bench`) beside the kernels' sum. For a
recipe that costs more than another while running the same attention kernels (the
operand quantizers differ, or a launch does): the rows that differ say which. Then the
host's side: whether the call makes the host wait for the GPU (the operations that
`torch.cuda.set_sync_debug_mode` warns at), the time to issue one call after a
synchronization and per call back to back (when the host's time exceeds the kernels'
the GPU idles between launches), and the Python functions that take the host's time per
call (cProfile, own time, the `--top` largest of each recipe).

    python tools/profile_train_recipes.py [--shape 4,16,4096,128] [--recipes train,train-robust] [--top 25]
"""

import argparse
import cProfile
import pstats
import time
import warnings

import torch
import triton

import fp4attn
from fp4attn.tools.benchmark import device_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4,16,4096,128")
ap.add_argument("--recipes", default="train,train-robust")
ap.add_argument("--top", type=int, default=25)
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


def issue_ms(f, calls=30):
    """Host ms to issue one call, the GPU's queue kept from filling (a sync between calls)."""
    spent = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        spent += time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / calls * 1e3


def synchronizing_ops(f) -> list[str]:
    """The operations of one call of f at which the host waits for the GPU."""
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
    return [f"{w.message} at {w.filename}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]


def back_to_back_ms(f, calls=30):
    """ms per call with nothing between calls: the larger of the host's and the GPU's time."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


syncs = {r: synchronizing_ops(step(r)) for r in recipes}
print("\n| host's side of one call | " + " | ".join(recipes) + " |")
print("|---|" + "---|" * len(recipes))
print("| operations that wait for the GPU | " + " | ".join(str(len(syncs[r])) for r in recipes) + " |")
fwd = {r: (lambda r=r: fp4attn.attention(q, k, v, causal=True, recipe=r, backend="triton")) for r in recipes}
print("| ms to issue the forward | " + " | ".join(f"{issue_ms(fwd[r]):.3f}" for r in recipes) + " |")
print("| ms to issue forward+backward | " + " | ".join(f"{issue_ms(step(r)):.3f}" for r in recipes) + " |")
print("| ms a forward+backward, back to back | " + " | ".join(f"{back_to_back_ms(step(r)):.3f}" for r in recipes)
      + " |")
for r in recipes:
    for op in syncs[r][:10]:
        print(f"{r}: the host waits at {op[:160]}")

for r in recipes:
    f = step(r)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(20):
        f()
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    print(f"\n{r}: the functions with the most own host time, ms per call (20 calls)\n")
    print("| function | calls a call | own ms | cumulative ms |")
    print("|---|---|---|---|")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])
    for (file, line, name), (_cc, nc, tt, ct, _) in rows[:args.top]:
        if name == "synchronize" or "synchronize" in name:
            continue
        print(f"| {file.split('/')[-1]}:{line} {name} | {nc / 20:g} | {tt / 20 * 1e3:.3f} | {ct / 20 * 1e3:.3f} |")
