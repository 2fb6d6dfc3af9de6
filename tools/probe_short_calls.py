"""Where a short forward call's time goes, causal against non-causal, and which kernel
would serve it best: for each recipe and masking at one shape, the kernel the route
names, the host time of the public call (nothing waiting on the GPU), its time launched
eagerly (do_bench, quantizers included), the same call replayed from a CUDA graph
(the kernels alone, no host cost), and the device time of each kernel it runs; then the
same with the table's launch changed to run the CUDA C++ kernel ("cuda") or not
("no-cuda"), persistent grid or not, to see which route the shape should take.

    python tools/probe_short_calls.py [--shape 16,16,2048,64] [--recipes a,b] [--table-only]
        [--profile N] [--json PATH]

`--table-only` times the table's launch alone; `--profile N` prints, per recipe and
masking, where the host time of N eager calls goes (cProfile, own time first).
"""

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

import fp4attn
from fp4attn import routing
from fp4attn.kernels.hopper.forward_cuda import P_MODE_BUILDS
from fp4attn.recipes import get_recipe
from fp4attn.tools.benchmark import calls_ms, device_kernels, graph_ms, host_ms, sdpa, time_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/
from dev.host_profile import print_host_profile  # noqa: E402

RECIPES = ["fp8-ktile-affine-fastacc", "fp8-affine-fastacc", "fp8-fastacc", "nvfp4-fp8-robust",
           "fp8-ktile-affine-lazy-fastacc", "fp8", "fp8-affine", "nvfp4-fp8", "directp-fast"]


def launches(recipe, head_dim: int, causal: bool):
    """(name, ForwardLaunch or None) to time: the table's, and the table's with the CUDA
    kernel on (both grids) or off for this recipe's P mode."""
    table = routing.FORWARD_LAUNCH[head_dim, recipe.fast_accum, causal]
    mode = int(routing.p_mode(recipe))
    others = tuple((m, n) for m, n in table.cuda_from_keys if m != mode)
    out = [("table", None)]
    if mode in P_MODE_BUILDS:  # the P modes the CUDA C++ kernel builds
        for persistent in (False, True):
            out.append((f"cuda{'-persistent' if persistent else ''}",
                        dataclasses.replace(table, cuda_from_keys=(*others, (mode, 1)), cuda_persistent=persistent)))
        out.append(("no-cuda", dataclasses.replace(table, cuda_from_keys=others)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="16,16,2048,64", help="B,H,S,D")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--table-only", action="store_true", help="time the table's launch only")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile the host work of N eager calls")
    p.add_argument("--json", help="write the records here")
    args = p.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    rows = []
    for causal in (False, True):
        f = sdpa("sdpa-cudnn")
        sdpa_ms = time_ms(lambda: f(q, k, v, causal))
        rows.append(dict(recipe="sdpa", causal=causal, launch="-", kernel="sdpa", eager_ms=sdpa_ms))
    for name in args.recipes.split(","):
        recipe = get_recipe(name)
        for causal in (False, True):
            for lname, launch in launches(recipe, D, causal)[:1 if args.table_only else None]:
                def call(recipe=recipe, causal=causal):
                    return fp4attn.attention(q, k, v, recipe=recipe, causal=causal)

                ctx = routing.override_launch(forward=launch) if launch else contextlib.nullcontext()
                with ctx:
                    kernel = fp4attn.explain(q, k, v, recipe=recipe, causal=causal)["kernel"]
                    try:
                        eager = time_ms(call)
                        host = host_ms(call, 20)
                        graph = graph_ms(call)
                        back = calls_ms(call)
                        kernels = device_kernels(call)
                    except Exception as e:  # a launch that cannot run the shape is a result
                        print(f"{name} causal={causal} {lname}: {type(e).__name__}: {str(e)[:160]}")
                        continue
                rows.append(dict(recipe=name, causal=causal, launch=lname, kernel=kernel, eager_ms=eager,
                                 host_ms=host, graph_ms=graph, calls_ms=back,
                                 kernels={kn: [n, ms] for kn, (n, ms) in kernels.items()}))
                r = rows[-1]
                print(f"{name:32s} causal={causal!s:5} {lname:15s} eager {eager:.3f} back to back {back:.3f} "
                      f"host {host:.3f} graph {graph:.3f} ms  {kernel}", flush=True)
                for kn, (n, ms) in sorted(r["kernels"].items(), key=lambda x: -x[1][1]):
                    print(f"      {ms * 1e3:8.1f} us x{n:.0f}  {kn[:110]}")
                if args.profile and launch is None:
                    print_host_profile(call, args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), shape=[B, H, S, D], rows=rows), f, indent=1)
    base = {r["causal"]: r["eager_ms"] for r in rows if r["recipe"] == "sdpa"}
    print(f"\n{torch.cuda.get_device_name()} ({B},{H},{S},{D}); ratios to SDPA cuDNN bf16 (eager)")
    # eager: flushed before every call; back to back: 20 eager calls after one flush, as the
    # graph's 20 replayed calls: their ratio is the host's launch cost alone (an L2 that keeps
    # one call's operands for the next serves both)
    print("| recipe | causal | launch | eager ms | back to back ms | graph ms | host ms | back to back/graph "
          "| vs SDPA | kernel |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["recipe"] == "sdpa":
            continue
        print(f"| {r['recipe']} | {r['causal']} | {r['launch']} | {r['eager_ms']:.3f} | "
              f"{r['calls_ms']:.3f} | {r['graph_ms']:.3f} | {r['host_ms']:.3f} | {r['calls_ms'] / r['graph_ms']:.2f} | "
              f"{base[r['causal']] / r['eager_ms']:.2f}x | "
              f"{r['kernel']} |")


if __name__ == "__main__":
    main()
