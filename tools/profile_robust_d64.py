"""What `nvfp4-fp8-robust` costs against `nvfp4-fp8` as a user calls them
(`fp4attn.attention`, quantization included), and where: per shape, causal mode and
recipe, the call's median time (`triton.testing.do_bench`), the same call replayed from
a CUDA graph (no host work), the host's time to issue one call, the device time of its
kernels (torch profiler) split into the forward kernel and the rest (the operand
quantizers and their buffers' fills), and SDPA cuDNN bf16 in the same process. Then
each robust field alone on `nvfp4-fp8` (K smoothing, 4-or-6 block scales, the FP8 Q/K
fallback), and every kernel of each call. Each recipe is first checked against its
reference on one batch item. Prints Markdown tables.

    python tools/profile_robust_d64.py [--shapes "16,16,2048,64;8,16,4096,128"] [--no-fields]
"""

import argparse
import platform
import sys

import torch
import triton

import fp4attn
from fp4attn.cli.bench import check_recipe
from fp4attn.recipes import PRESETS
from fp4attn.tools.benchmark import device_kernels, host_ms, parse_shapes, sdpa, time_ms

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="16,16,2048,64;8,16,4096,128")
ap.add_argument("--no-fields", action="store_true", help="skip the robust fields one at a time")
ap.add_argument("--commit", default="", help="the commit measured, printed in the header")
args = ap.parse_args()

PAPER, ROBUST = PRESETS["nvfp4-fp8"], PRESETS["nvfp4-fp8-robust"]
FIELDS = {"+ smooth_k": PAPER.with_(smooth_k=True, name="nvfp4-fp8 + smooth_k"),
          "+ qk_four_over_six": PAPER.with_(qk_four_over_six=True, name="nvfp4-fp8 + qk_four_over_six"),
          "+ qk_fallback": PAPER.with_(qk_fallback="fp8", name="nvfp4-fp8 + qk_fallback")}


def graph_ms(fn) -> tuple[float | None, str]:
    """Median replay time of `fn` captured in a CUDA graph, and whether its output
    equals the eager call's."""
    try:
        want = fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        same = "yes" if torch.equal(out, want) else "NO"
        return time_ms(graph.replay), same
    except Exception as e:  # noqa: BLE001  a capture that fails is reported, not fatal
        return None, f"capture failed: {type(e).__name__}: {str(e)[:80]}"


def measure(recipe, q, k, v, causal: bool) -> dict:
    call = lambda: fp4attn.attention(q, k, v, is_causal=causal, recipe=recipe)  # noqa: E731
    ms = time_ms(call)
    g_ms, same = graph_ms(call)
    kern = device_kernels(call)
    fwd = sum(t for name, (_, t) in kern.items() if "attn_fwd" in name)
    dev = sum(t for _, t in kern.values())
    return dict(ms=ms, graph=g_ms, same=same, host=host_ms(call), dev=dev, fwd=fwd, rest=dev - fwd,
                launches=sum(n for n, _ in kern.values()), kernels=kern)


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def cost(r, base, key):
    return "" if r[key] is None or base[key] is None else f"{(r[key] / base[key] - 1) * 100:+.1f}%"


print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
      f"Python {platform.python_version()}{', commit ' + args.commit if args.commit else ''}")
print(f"command: python {' '.join(sys.argv)}\n")
print("ms per call; cost: against `nvfp4-fp8` in the same case; graph: the call replayed from a CUDA graph; "
      "host: time to issue one call; device: the sum of its kernels (profiler), `attn_fwd` the forward kernel, "
      "rest the quantizers and fills\n")
head = ("| B,H,S,D | causal | recipe | vs cuDNN bf16 | call ms | cost | graph ms | cost | host ms | device ms | "
        "cost | attn_fwd ms | rest ms | launches | graph = eager |")
print(head)
print("|" + "---|" * (head.count("|") - 1))
details = []
for B, H, S, D in parse_shapes(args.shapes, ";"):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    for causal in (False, True):
        cudnn = time_ms(lambda: sdpa("sdpa-cudnn")(q, k, v, causal))
        recipes = [PAPER, ROBUST] + ([] if args.no_fields or D != 64 else list(FIELDS.values()))
        base = None
        for recipe in recipes:
            check_recipe(recipe, q, k, v, causal)
            r = measure(recipe, q, k, v, causal)
            base = base or r
            details.append(((B, H, S, D), causal, recipe.name, r["kernels"]))
            print(f"| {B},{H},{S},{D} | {causal} | {recipe.name} | {cudnn / r['ms']:.2f}x | {r['ms']:.3f} | "
                  f"{cost(r, base, 'ms')} | {fmt(r['graph'])} | {cost(r, base, 'graph')} | {r['host']:.3f} | "
                  f"{r['dev']:.3f} | {cost(r, base, 'dev')} | {r['fwd']:.3f} | {r['rest']:.3f} | "
                  f"{r['launches']:.0f} | {r['same']} |", flush=True)
        torch.cuda.empty_cache()

print("\nEvery kernel of each call (device ms per call, launches per call):")
for shape, causal, name, kern in details:
    print(f"\n{shape} causal={causal} {name}:\n| kernel | launches | device ms |\n|---|---|---|")
    for kname, (n, ms) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kname[:80]} | {n:.0f} | {ms:.4f} |")
