"""`fp4attn bench`: forward speed of every kernel recipe against SDPA's cuDNN and flash
backends in bf16, measured in one run (speed on a shared machine is only meaningful
as a ratio). `--backward` times training instead (`fp4attn/cli/bench_train.py`).

Each recipe is checked once per shape against the reference (on a 1-batch, 2-head
slice of the same inputs) before it is timed. cuDNN's FP8 SDPA (`cudnn-fp8`, e4m3 in
and out) joins the baselines when the `nvidia-cudnn-frontend` package is installed
(`fp4attn/tools/cudnn_fp8.py`); whether it ran, and why not, is printed. Times are medians of
`triton.testing.do_bench`; TFLOP/s count 4 * B * H * D * (visible query-key pairs),
so causal runs count exactly the unmasked half. `--decode` times decode attention
over a quantized KV cache instead (`fp4attn/cli/bench_decode.py`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from fp4attn.cli import bench_decode
from fp4attn.cli.output import exit_no_gpu, markdown_table, write_json
from fp4attn.tools.benchmark import parse_shapes, sdpa, time_cudnn_fp8, time_ms, visible_pairs

SHAPES = [(8, 16, 4096, 128), (2, 16, 16384, 128), (1, 24, 32768, 128), (1, 12, 32768, 128),
          (4, 32, 4096, 128), (16, 16, 2048, 64), (4, 16, 8192, 64)]
RECIPES = ["fp8-directp", "fp8", "directp", "nvfp4-fp8", "fp8-directp-fastacc", "fp8-fastacc", "nvfp4-fp8-robust",
           "directp-robust", "fp8-affine", "fp8-affine-fastacc", "directp-fast", "fp8-directp-fast",
           "fp8-directp-fast-fastacc", "fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc"]
CAUSAL_MODES = {"both": (False, True), "yes": (True,), "no": (False,)}  # --causal
# torch.compile's modes (--model-step-compile): a typo fails at parsing, not after the bench
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_recipe(recipe, q, k, v, causal: bool) -> float:
    """Cosine of the kernel vs the reference on a (1, 2)-head slice; raises below 0.999."""
    from fp4attn.api import attention
    from fp4attn.metrics import error_metrics

    sl = (slice(0, 1), slice(0, 2))
    qs, ks, vs = q[sl], k[sl], v[sl]
    got = attention(qs, ks, vs, recipe=recipe, causal=causal, backend="triton")
    want = attention(qs, ks, vs, recipe=recipe, causal=causal, backend="reference")
    cos = error_metrics(got, want)["cos"]
    if not cos > 0.999:
        raise RuntimeError(f"{recipe.name} kernel disagrees with its reference: cos {cos}")
    return cos


def run_bench(shapes, recipes, causal_modes, variants: dict | None = None, partial: Path | None = None) -> list[dict]:
    """Time every implementation on every (shape, causal); `partial` gets the records
    written after each shape, so a cut-short run keeps what it measured."""
    from fp4attn.kernels.hopper.forward_op import hopper_attention, launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe
    from fp4attn.routing import p_mode, p_sink_tiles

    records, notes = [], []
    jobs = [(s, c) for s in shapes for c in causal_modes]
    for (B, H, S, D), causal in tqdm(jobs, desc="bench", unit="shape"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        flops = 4 * B * H * D * visible_pairs(S, S, causal)
        row = dict(B=B, H=H, S=S, D=D, causal=causal)
        timed = {}
        for impl in ("sdpa-cudnn", "sdpa-flash"):
            f = sdpa(impl)
            timed[(impl, False)] = time_ms(lambda: f(q, k, v, causal))
        fp8_ms, fp8_note = time_cudnn_fp8(q, k, v, causal)
        if fp8_ms is not None:
            timed[("cudnn-fp8", False)] = fp8_ms
        notes.append(f"{B},{H},{S},{D} causal={causal}: cuDNN FP8 SDPA {fp8_note}")
        for name in list(recipes) + list(variants or {}):
            recipe = (variants or {}).get(name) or get_recipe(name)
            cos = check_recipe(recipe, q, k, v, causal)
            scale = D**-0.5
            ops = prepare_operands_fused(q, k, v, recipe, scale)  # the operands `hopper_attention` runs on
            mode, sink_tiles = p_mode(recipe), p_sink_tiles(recipe)
            offset = 0 if causal else None
            timed[(name, False)] = time_ms(lambda: launch_forward(ops, scale=scale, causal_offset=offset, p_mode=mode,
                                                                  sink_tiles=sink_tiles))
            timed[(name, True)] = time_ms(lambda: hopper_attention(q, k, v, recipe, scale=scale,
                                                                 causal_offset=0 if causal else None))
            row[f"cos_{name}"] = cos
        base = timed[("sdpa-cudnn", False)]
        for (impl, quant), ms in timed.items():
            records.append({**{k_: row[k_] for k_ in ("B", "H", "S", "D", "causal")}, "impl": impl,
                            "quant_included": quant, "ms": ms, "tflops": flops / ms * 1e-9,
                            "speedup_vs_cudnn_bf16": base / ms})
        torch.cuda.empty_cache()
        write_json(partial, records)
    for n in dict.fromkeys(notes):
        print(n)
    return records


def _case(r: dict) -> tuple:
    """The (B, H, S, D, causal) a record measured."""
    return r["B"], r["H"], r["S"], r["D"], r["causal"]


def format_table(records: list[dict]) -> str:
    """TFLOP/s and speedup over cuDNN bf16: a row per case, a column per implementation."""
    impls = list(dict.fromkeys((r["impl"], r["quant_included"]) for r in records))
    by_key = {(_case(r), r["impl"], r["quant_included"]): r for r in records}
    rows = []
    for case in dict.fromkeys(map(_case, records)):
        cells = [by_key.get((case, i, qi)) for i, qi in impls]
        rows.append([",".join(map(str, case[:4])), case[4]]
                    + [f"{r['tflops']:.0f} ({r['speedup_vs_cudnn_bf16']:.2f}x)" if r else "-" for r in cells])
    return markdown_table(["B,H,S,D", "causal"] + [f"{i}{' +quant' if qi else ''}" for i, qi in impls], rows)


def geomean_speedups(records: list[dict], d: int = 128, causal: bool = False) -> dict[str, float]:
    out = {}
    for impl in dict.fromkeys(r["impl"] for r in records):
        xs = [r["speedup_vs_cudnn_bf16"] for r in records
              if r["impl"] == impl and r["D"] == d and r["causal"] == causal and not r["quant_included"]]
        if xs:
            out[impl] = math.exp(sum(map(math.log, xs)) / len(xs))
    return out


def plot(records: list[dict], path: Path, gpu: str | None = None) -> None:
    """Bar chart of kernel-alone TFLOP/s per shape; `gpu` names the device in the title
    (default: the current one), for plots redrawn from saved records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernel = [r for r in records if not r["quant_included"]]
    keys = list(dict.fromkeys(map(_case, kernel)))
    impls = list(dict.fromkeys(r["impl"] for r in kernel))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ys = [next((r["tflops"] for r in kernel if _case(r) == key and r["impl"] == impl), 0.0) for key in keys]
        ax.bar([j + i * w for j in range(len(keys))], ys, w, label=impl)
    ax.set_xticks([j + w * (len(impls) - 1) / 2 for j in range(len(keys))],
                  [f"{b},{h},{s},{d}{' c' if c else ''}" for b, h, s, d, c in keys], rotation=30, fontsize=7)
    ax.set_ylabel("TFLOP/s (forward)")
    gpu = gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    ax.set_title(f"fp4attn forward on {gpu} (kernel alone; c = causal)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="all", help="'all' or 'B,H,S,D;B,H,S,D'")
    p.add_argument("--recipes", help=f"comma-separated; default {','.join(RECIPES)} (forward), train (--backward)")
    p.add_argument("--backward", action="store_true",
                   help="causal forward+backward of the training recipes on the training shapes")
    p.add_argument("--decode", action="store_true",
                   help="decode attention over a quantized KV cache vs SDPA bf16 decode (fp4attn/cli/bench_decode.py)")
    p.add_argument("--model-step", action="store_true", help="with --backward: also a ~1B-parameter GPT step")
    p.add_argument("--model-step-compile", metavar="MODE", choices=COMPILE_MODES,
                   help=f"run the model step's GPT under torch.compile(mode=MODE), one of {', '.join(COMPILE_MODES)} "
                   "(reduce-overhead: CUDA graphs)")
    p.add_argument("--causal", default="both", choices=tuple(CAUSAL_MODES),
                   help="time causal calls, non-causal ones or both (default both)")
    p.add_argument("--variants", action="store_true", help="also time fp8-directp with exp2-built MXFP4 P")
    p.add_argument("--json", type=Path, help="default results/h200-forward.json (h200-train.json with --backward)")
    p.add_argument("--png", type=Path, help="the plot (default: the --json path with .png)")
    bench_decode.add_arguments(p)


def main(args: argparse.Namespace) -> list[dict]:
    from fp4attn.recipes import PRESETS

    if not torch.cuda.is_available():
        exit_no_gpu("bench", "it times the kernels on a CUDA GPU")
    if args.decode:
        args.json = args.json or Path("results/h200-decode.json")
        return bench_decode.main(args)
    if args.backward:
        from fp4attn.cli import bench_train

        args.json = args.json or Path("results/h200-train.json")
        return bench_train.main(args)
    from fp4attn.cli import bench_blackwell
    from fp4attn.routing import target_of

    target = target_of(torch.device("cuda"))
    if bench_blackwell.is_blackwell(target):  # the Blackwell kernels' own launchers

        args.json = args.json or Path(f"results/{target.replace('_', '')}-forward.json")
        return bench_blackwell.main(args)
    args.json = args.json or Path("results/h200-forward.json")
    shapes = SHAPES if args.shapes == "all" else parse_shapes(args.shapes, ";")
    causal = CAUSAL_MODES[args.causal]
    variants = {"fp8-directp/exp2-P": PRESETS["fp8-directp"].with_(p_build="exp2", name="fp8-directp/exp2-P")} \
        if args.variants else None
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    records = run_bench(shapes, (args.recipes or ",".join(RECIPES)).split(","), causal, variants, partial=args.json)
    print("TFLOP/s (speedup vs SDPA cuDNN bf16, same run)")
    print(format_table(records))
    for c in causal:
        print(f"geomean speedup, D=128, causal={c}:", {k: round(v, 3) for k, v in geomean_speedups(records, 128, c).items()})
    write_json(args.json, records)
    plot(records, args.png or args.json.with_suffix(".png"))
    return records
