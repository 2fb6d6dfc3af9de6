"""The Blackwell cost model (`cost_model_sm100`) applied to the Hopper Triton forward on
one H200 SM, read off its sm_90 machine code: a prediction, set beside the H200's
measured speed of the same builds, which gives the model's error on kernels whose real
speed is known.

The arithmetic is `cost_model_sm100.predict`'s, unchanged: per program tile (here 64
query rows x 128 keys, the routed launch), the issue clocks of the tile loop's
instructions times its warps over the 4 schedulers, the tensor-core clocks of QK^T and
PV at the dense rates, the MUFU clocks at 16 per SM and clock; the Triton kernel is
serial (one program's warps issue, wait and build P), and since two of its programs fit
an SM (registers and shared memory) the tile takes the largest of the three, as a
pipelined build's.

The H200 figures: 132 SMs at 1.98 GHz, the H200's maximum SM clock, as the project's
other Hopper budgets count (docs/notes/hopper-forward.md, hopper-train.md); the tensor
cores' FLOP per SM and clock are the datasheet's dense peaks (BF16 989.4, FP8 1978.9
TFLOP/s) over 132 SMs at that clock (3786 and 7572), so a tensor-bound ceiling is the
datasheet's peak. ncu read 1.78 GHz under load on the warp-specialized forward
(benchmarks/results/log/h200-forward-ncu-ws.txt): an issue-bound figure at that clock
is 1.78 / 1.98 of the one here (`NCU_CLOCK_HZ`).

Which kernel runs each measured recipe is the routing's own answer at the measured key
count (`routed_kernel`), as on the H200, where the CUDA C++ kernel builds: the recipes
routed to the Gluon or CUDA kernels are listed as skipped, with the kernel named.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

from dev import machine_code
from dev.cost_model_sm100 import GPU
from dev.cost_model_sm100 import predict as _predict
from fp4attn import routing
from fp4attn.recipes import PRESETS, Recipe

SMS, CLOCK_HZ = 132, 1.98e9
H200 = GPU("H200", SMS, CLOCK_HZ, (("bf16", round(989.4e12 / (SMS * CLOCK_HZ))),
                                   ("fp8", round(1978.9e12 / (SMS * CLOCK_HZ)))))
NCU_CLOCK_HZ = 1.78e9  # sm__cycles_elapsed.avg.per_second, log/h200-forward-ncu-ws.txt
HEAD_DIM = 128
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# the H200 forward runs (benchmarks/results/README.md); a recipe's figures come from the
# first file that has it
# the grid measured with the Triton kernels this model reads: from 72cc83a the CUDA C++ kernel runs
# the exact recipes above a few hundred keys, so today's h200-forward.json times another kernel
MEASURED = ("log/h200-forward-ab7f5f9.json",)
TRITON = "hopper.forward_triton"


@dataclass(frozen=True)
class TritonBuild:
    """A compiled sm_90 Triton forward as `cost_model_sm100.predict` reads a serial build."""

    report: machine_code.KernelReport
    num_warps: int
    shared_bytes: int
    pipelined: bool = False

    @property
    def registers(self) -> int:
        return self.report.registers

    def tile_loop(self) -> list[str]:
        return self.report.tile_loop()


def routed_kernel(recipe: Recipe, keys: int) -> str:
    """The Hopper forward kernel that ran `recipe` in the measured grid (MEASURED) at D=128,
    non-causal, no mask, `keys` keys, on CUDA tensors where the CUDA C++ kernel builds (the
    H200's): today's routing, less the CUDA kernel's routes added after that grid (the
    exact recipes, bf16 QK^T, and affine MXFP4 P, P mode 5, from 72cc83a)."""
    launch = routing.forward_launch(HEAD_DIM, recipe.fast_accum, False)
    then = tuple((m, n) for m, n in launch.cuda_from_keys if recipe.fast_accum and m != 5)
    with mock.patch.object(routing.capability, "cuda_kernels_unavailable", lambda: None), \
            routing.override_launch(forward=replace(launch, cuda_from_keys=then)):
        return routing.hopper._hopper_forward_kernel(recipe, HEAD_DIM, False, "none", keys, True)


@functools.cache
def _build(fast_accum: bool, p_mode: int, sink_tiles: int) -> TritonBuild:
    kernel = machine_code.compile_forward(fast_accum, p_mode, False, HEAD_DIM, sink_tiles=sink_tiles)
    return TritonBuild(machine_code.inspect(kernel), kernel.metadata.num_warps, kernel.metadata.shared)


def build(recipe: Recipe) -> TritonBuild:
    """The Triton forward as its launcher runs `recipe` (D=128, non-causal, routed launch)."""
    return _build(recipe.fast_accum, routing.p_mode(recipe), routing.p_sink_tiles(recipe))


def predict(build: TritonBuild, recipe: Recipe) -> dict:
    """`cost_model_sm100.predict` for the H200: QK^T on the FP8 tensor cores for the
    `fast_accum` recipes (e4m3 operands), else on the bf16 ones; PV on the FP8 ones."""
    launch = routing.forward_launch(HEAD_DIM, recipe.fast_accum, False)
    return _predict(build, qk="fp8" if recipe.fast_accum else "bf16", pv="fp8", head_dim=HEAD_DIM,
                    block_m=launch.block_m, block_n=routing.KEY_TILE, gpu=H200)


def measured_records(name: str, files=MEASURED) -> tuple[str | None, list[dict]]:
    """(file, records) of recipe `name`'s kernel-alone runs (`quant_included` False) at
    D=128, non-causal, from the first of `files` that has any."""
    for f in files:
        rows = [r for r in json.loads((RESULTS / f).read_text())
                if r["impl"] == name and r["D"] == HEAD_DIM and not r["causal"] and not r["quant_included"]]
        if rows:
            return f, rows
    return None, []


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def compare(prediction: dict, records: list[dict]) -> dict:
    """The prediction against measured records: per shape, and at the geometric mean of
    the shapes' TFLOP/s; error = predicted / measured - 1."""
    pred = prediction["ceiling_tflops"]
    shapes = {f"{r['B']},{r['H']},{r['S']},{r['D']}": round(r["tflops"], 1) for r in records}
    meas = geomean(r["tflops"] for r in records)
    # the same clocks taken in turn (issue, then the products), as a serial build with one
    # program an SM: the bracket's other side
    serial = pred * prediction["clk_tile"] / (prediction["clk_issue"] + prediction["clk_tensor"])
    return {"predicted_tflops": pred, "measured_tflops": round(meas, 1), "measured_by_shape": shapes,
            "error": round(pred / meas - 1, 3),
            "error_by_shape": {s: round(pred / t - 1, 3) for s, t in shapes.items()},
            "error_at_ncu_clock": round(pred * NCU_CLOCK_HZ / CLOCK_HZ / meas - 1, 3),
            "serial_tflops": round(serial), "serial_error": round(serial / meas - 1, 3)}


def report(files=MEASURED) -> dict:
    """Every preset measured at D=128 non-causal in `files`: the Triton-routed ones
    predicted and compared, the others skipped with the kernel that ran them; `overall`
    is the geometric mean of predicted / measured over the compared recipes, less 1."""
    rows, skipped = {}, {}
    for name, recipe in PRESETS.items():
        source, records = measured_records(name, files)
        if not records:
            continue
        kernels = sorted({routed_kernel(recipe, r["S"]) for r in records})
        if kernels != [TRITON]:
            skipped[name] = ", ".join(kernels)
            continue
        b = build(recipe)
        p = predict(b, recipe)
        figures = ("tile_loop_instructions", "instructions_per_element", "programs_per_sm", "clk_issue",
                   "clk_tensor", "clk_mufu", "clk_tile", "bound")
        rows[name] = {"source": source, "qk": "fp8" if recipe.fast_accum else "bf16",
                      "p_mode": routing.p_mode(recipe), "sink_tiles": routing.p_sink_tiles(recipe),
                      "registers": b.registers, "stack": b.report.stack, "shared_bytes": b.shared_bytes,
                      "warps": b.num_warps, **{k: p[k] for k in figures}, **compare(p, records)}
    ratios = [r["predicted_tflops"] / r["measured_tflops"] for r in rows.values()]
    overall = {"error": round(geomean(ratios) - 1, 3), "min": round(min(ratios) - 1, 3),
               "max": round(max(ratios) - 1, 3), "recipes": len(ratios)} if ratios else {}
    return {"gpu": {"name": H200.name, "sms": H200.sms, "clock_hz": H200.clock_hz,
                    "flop_per_clk": dict(H200.flop_per_clk), "mufu_per_clk": H200.mufu_per_clk},
            "prediction": "cost_model_sm100's model, not a measurement", "head_dim": HEAD_DIM,
            "causal": False, "recipes": rows, "skipped": skipped, "overall": overall}


def main() -> None:
    r = report()
    print(f"H200 cost model (a prediction), D={HEAD_DIM} non-causal, Triton forward builds; "
          f"{r['gpu']['clock_hz'] / 1e9:.2f} GHz, {r['gpu']['flop_per_clk']} FLOP/clk/SM")
    print("| recipe | QK^T | P_MODE | regs | programs/SM | instr/score | issue / tensor / MUFU clk | bound "
          "| predicted | measured (geomean) | error |")
    for name, x in r["recipes"].items():
        print(f"| `{name}` | {x['qk']} | {x['p_mode']} | {x['registers']} | {x['programs_per_sm']} "
              f"| {x['instructions_per_element']} | {x['clk_issue']} / {x['clk_tensor']} / {x['clk_mufu']} "
              f"| {x['bound']} | {x['predicted_tflops']} | {x['measured_tflops']} | {x['error']:+.1%} |")
        print(f"    {x['source']}: {x['measured_by_shape']} -> {x['error_by_shape']}")
        print(f"    at {NCU_CLOCK_HZ / 1e9} GHz {x['error_at_ncu_clock']:+.1%}; issue + tensor in turn "
              f"{x['serial_tflops']} ({x['serial_error']:+.1%})")
    print("skipped:", r["skipped"])
    print("overall:", r["overall"])


if __name__ == "__main__":
    main()
