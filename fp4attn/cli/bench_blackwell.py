"""`fp4attn bench` on a Blackwell GPU (sm_100, sm_103, sm_120): forward speed of every
recipe the routing runs on this GPU's kernels against SDPA's cuDNN and flash backends in
bf16, measured in one run, with the same checks and records as the Hopper bench
(`cli/bench.py`): each recipe checked once per shape against the reference on a
(1, 2)-head slice, median times, exact causal FLOPs; `quant_included` False is the
kernel alone on operands quantized beforehand, True the whole `fp4attn.attention` call.

Each (shape, causal) runs in a worker process under the watchdog (`cli/watchdog.py`): a
kernel that hangs or crashes costs that shape's records, not the run.
"""

from __future__ import annotations

import argparse

import torch

from fp4attn.cli.output import write_json

SHAPES = [(8, 16, 4096, 128), (2, 16, 16384, 128), (1, 24, 32768, 128), (16, 16, 2048, 64), (4, 16, 8192, 64)]
SHAPE_TIMEOUT_S = 900.0  # one (shape, causal): compiles, checks and times every recipe


def is_blackwell(target: str) -> bool:
    """Whether `target` ("sm_100", "sm_120", ...) is a Blackwell GPU (compute capability
    10.x or 12.x), whose forward this module times."""
    return target.startswith(("sm_10", "sm_12"))


def routed_recipes(q, k, v, causal: bool) -> list[str]:
    """The inference presets the routing sends to a kernel for these inputs."""
    import fp4attn
    from fp4attn.recipes import PRESETS

    return [name for name in PRESETS
            if fp4attn.explain(q, k, v, recipe=name, causal=causal)["backend"] == "triton"]


def bench_shape(shape: list[int], causal: bool, recipes: list[str] | None = None, device: str = "cuda") -> list[dict]:
    """Records of one (B, H, S, D) and causal flag: SDPA cuDNN and flash bf16, and each
    routed recipe (those of them in `recipes` if given) alone and with its quantization.
    `device`: "cuda" (tests: "cpu" under the interpreter)."""
    import fp4attn
    from fp4attn.cli.bench import check_recipe
    from fp4attn.kernels.blackwell.forward_op import launch_forward
    from fp4attn.kernels.blackwell.operands import prepare_operands
    from fp4attn.recipes import get_recipe
    from fp4attn.tools.benchmark import sdpa, time_ms, visible_pairs

    B, H, S, D = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flops = 4 * B * H * D * visible_pairs(S, S, causal)
    timed = {}
    for impl in ("sdpa-cudnn", "sdpa-flash"):
        f = sdpa(impl)
        try:
            timed[(impl, False)] = time_ms(lambda: f(q, k, v, causal))
        except RuntimeError:  # a backend this torch lacks on this GPU
            pass
    cosines = {}
    names = routed_recipes(q, k, v, causal)
    for name in names if recipes is None else [n for n in names if n in recipes]:
        recipe = get_recipe(name)
        cosines[name] = check_recipe(recipe, q, k, v, causal)
        scale = D**-0.5
        ops, op_scale = prepare_operands(q, k, v, recipe, scale)
        offset = 0 if causal else None
        affine = recipe.p_build == "affine"
        timed[(name, False)] = time_ms(lambda: launch_forward(ops, scale=op_scale, causal_offset=offset,
                                                              p_affine=affine))
        timed[(name, True)] = time_ms(lambda: fp4attn.attention(q, k, v, recipe=recipe, causal=causal,
                                                                backend="triton"))
    base = timed.get(("sdpa-cudnn", False)) or timed.get(("sdpa-flash", False))
    return [dict(B=B, H=H, S=S, D=D, causal=causal, impl=impl, quant_included=quant, ms=ms, tflops=flops / ms * 1e-9,
                 speedup_vs_cudnn_bf16=base / ms if base else None, cos=cosines.get(impl))
            for (impl, quant), ms in timed.items()]


def run(shapes, causal_modes, recipes: list[str] | None = None, timeout_s: float = SHAPE_TIMEOUT_S,
        partial=None) -> tuple[list[dict], list[dict]]:
    """(records, failures): every (shape, causal) under the watchdog; a failure is
    {B, H, S, D, causal, reason}. `partial` gets the records after each shape."""
    from fp4attn.cli.watchdog import Watchdog

    records, failures = [], []
    with Watchdog(timeout_s) as dog:
        for shape in shapes:
            for causal in causal_modes:
                outcome, value = dog.run(f"{__name__}:bench_shape", list(shape), causal, recipes)
                if outcome == "ok":
                    records += value
                else:
                    B, H, S, D = shape
                    failures.append(dict(B=B, H=H, S=S, D=D, causal=causal, reason=f"{outcome}: {value}"))
                    print(f"bench {shape} causal={causal}: {outcome}: {value}")
                write_json(partial, records)
    return records, failures


def main(args: argparse.Namespace) -> list[dict]:
    """`fp4attn bench` on Blackwell (cli/bench.py calls this there)."""
    from fp4attn.cli.bench import CAUSAL_MODES, format_table, geomean_speedups
    from fp4attn.tools.benchmark import parse_shapes

    shapes = SHAPES if args.shapes == "all" else parse_shapes(args.shapes, ";")
    causal = CAUSAL_MODES[args.causal]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__} (Blackwell kernels)")
    recipes = args.recipes.split(",") if args.recipes else None
    records, failures = run(shapes, causal, recipes, partial=args.json)
    print("TFLOP/s (speedup vs SDPA cuDNN bf16, same run)")
    print(format_table(records))
    for c in causal:
        print(f"geomean speedup, D=128, causal={c}:",
              {k: round(v, 3) for k, v in geomean_speedups(records, 128, c).items()})
    write_json(args.json, records)
    if failures:
        write_json(args.json.with_name(args.json.stem + "-failures.json"), failures)
        raise SystemExit(f"{len(failures)} bench shape(s) failed: {failures}")
    return records
