"""`fp4attn compile-report` with the cost model's predictions (`cost_model_sm100`), the
serial kernel's builds for comparison and the unrouted Gluon forward (`forward_gluon_sm100`):
the report benchmarks/results/sm100-compile-report*.{json,txt} and
sm120-compile-report.{json,txt} hold. Predictions, not measurements; no GPU needed.

    python -m dev.cost_report_sm100 --arch sm_100a --comparison --json report.json > report.txt

Every routed build's record is compile-report's (`fp4attn.cli.compile_report`) with a
`prediction` beside it: on sm_100a a B200 prediction from its machine code (per partition
its issue per tile, the tensor-core and MUFU time, the overlap the schedule allows),
calibrated on the BF16 build of the same pipeline against FlashAttention-4's measured
BF16 forward, whose record the report carries (`calibration_report`); on sm_120a the
model's raw figure for an RTX 5090 beside SageAttention3's; none on sm_103a (the bundled
cuobjdump cannot read its SASS). On sm_100a it also compiles the Gluon pipelined forward
with FlashAttention-4's structure and models it against the bf16 build of that pipeline
(`gluon_records`, `gluon_calibration_report`; --no-gluon skips them)."""

from __future__ import annotations

import argparse
import functools
import re

from dev import machine_code_sm100
from dev.cost_model_sm100 import FA4_BF16_TFLOPS, RTX_5090, SAGEATTENTION3_RTX5090_TOPS, calibrate, predict
from fp4attn.cli import compile_report
from fp4attn.cli.blackwell_machine_code import compile_forward
from fp4attn.cli.output import markdown_table, write_json
from fp4attn.recipes import PRESETS
from fp4attn.routing import KEY_TILE, SERIAL_BLACKWELL_LAUNCH, BlackwellLaunch

# the calibration build: the bf16 form of the pipelined kernel (Q, K, V, P in bf16,
# kind::f16) at D=128, non-causal, FlashAttention-4's measured case; two stages (with
# three its load partition spills 112 bytes)
CALIBRATION_LAUNCH = BlackwellLaunch(warps=4, stages=2, pipelined=True)


@functools.cache
def forward_record(qk_fp4: bool, pv_fp4: bool, p_affine: bool, causal: bool, head_dim: int, key_bias: bool,
                   arch: str, launch=None, bf16: bool = False) -> dict:
    """compile-report's figures of one forward build at its routed launch (or `launch`,
    not routed; bf16: the all-bf16 build) with the model's prediction: on sm_100a for a
    B200, calibrated (`calibration_report`; the calibration build itself raw), on sm_120a
    its raw figure for an RTX 5090 beside SageAttention3's."""
    if launch is None and not bf16:  # routed: compile-report's own build and figures
        launch = compile_report.routed_launch(head_dim, causal, key_bias, arch)
        kernel = compile_report.forward_kernel(qk_fp4, pv_fp4, p_affine, causal, head_dim, key_bias, arch, launch)
        rec = dict(compile_report.build_report(qk_fp4, pv_fp4, p_affine, causal, head_dim, key_bias, arch))
    else:
        launch = launch or compile_report.routed_launch(head_dim, causal, key_bias, arch)
        kernel = compile_forward(qk_fp4, pv_fp4, causal, head_dim, arch=arch, block_m=launch.block_m,
                                 block_n=KEY_TILE, num_warps=launch.warps, num_stages=launch.stages,
                                 key_bias=key_bias, pipelined=launch.pipelined, p_affine=p_affine, bf16=bf16)
        rec = compile_report.build_figures(kernel, arch, launch)
    if arch not in machine_code_sm100.SASS_ARCHS:  # the model reads the SASS
        return rec
    rep = machine_code_sm100.read(kernel, arch, rec)
    kinds = ("bf16", "bf16") if bf16 else ("fp4" if qk_fp4 else "fp8", "fp4" if pv_fp4 else "fp8")
    if arch == "sm_100a":
        pred = predict(rep, qk=kinds[0], pv=kinds[1], head_dim=head_dim, block_m=launch.block_m, block_n=KEY_TILE)
        rec["prediction"] = pred if bf16 else calibrate(pred, calibration_report()["prediction"])
    else:  # sm_120a, uncalibrated: no consumer Blackwell kernel of known speed shares this pipeline
        pred = predict(rep, qk=kinds[0], pv=kinds[1], head_dim=head_dim, block_m=launch.block_m, block_n=KEY_TILE,
                       gpu=RTX_5090)
        rec["prediction"] = {**pred, "predicted_tflops": pred["ceiling_tflops"],
                             "predicted_vs_sageattention3": round(pred["ceiling_tflops"] / SAGEATTENTION3_RTX5090_TOPS, 2)}
    return rec


@functools.lru_cache(maxsize=1)
def calibration_report() -> dict:
    """The cost model on the BF16 build of the same pipeline against FlashAttention-4's
    BF16 forward (`cost_model_sm100.FA4_BF16_TFLOPS`): its record, with the raw model's
    error there."""
    rec = forward_record(False, False, False, False, 128, False, "sm_100a", CALIBRATION_LAUNCH, bf16=True)
    model = rec["prediction"]["ceiling_tflops"]
    return {"kernel": "blackwell.forward_triton (bf16, the calibration build)", "recipe": "bf16", "head_dim": 128,
            "causal": False, "key_bias": False, "arch": "sm_100a", **rec,
            "fa4_bf16_measured_tflops": FA4_BF16_TFLOPS, "model_error": round(model / FA4_BF16_TFLOPS - 1, 3)}


# the Gluon pipeline with FlashAttention-4's structure (`forward_gluon_sm100`: two
# 128-row query tiles a CTA, load and MMA warps, a softmax warpgroup per tile and a
# correction warpgroup), D=128 non-causal, not routed: its builds by recipe (P builder)
GLUON_RECIPES = {"directp-fast": "P_AFFINE_MXFP4", "nvfp4-fp8": "P_EXP2_FP8"}


@functools.cache
def gluon_build_report(p_kind: str, calibrate: bool = True, causal: bool = False) -> dict:
    """Compile one Gluon pipelined build (`forward_gluon_sm100.<p_kind>`, causal or not)
    for sm_100a and read it; its prediction (per full key tile: the masked tiles' loop,
    the tail and the causal diagonal, beside it a score) calibrated on the bf16 build of
    the same Gluon pipeline (`gluon_calibration_report`; calibrate False: the raw model,
    for the calibration build itself)."""
    from dev import forward_gluon_sm100 as fg
    from dev.cost_model_sm100 import calibrate as calibrate_prediction

    kind = getattr(fg, p_kind).value
    rep = machine_code_sm100.read(machine_code_sm100.compile_forward_gluon(kind, causal=causal), "sm_100a",
                                  gluon=True)
    kinds = {"P_AFFINE_MXFP4": ("fp4", "fp4"), "P_EXP2_FP8": ("fp4", "fp8"), "P_BF16": ("bf16", "bf16")}[p_kind]
    pred = predict(rep, qk=kinds[0], pv=kinds[1], head_dim=128, block_m=fg.BLOCK_M.value, block_n=fg.BLOCK_N.value)
    if calibrate:
        pred = calibrate_prediction(pred, gluon_calibration_report()["prediction"])
    return dict(registers=rep.registers, spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes,
                tmem_columns=rep.tmem_columns, mma_kinds=rep.mma_kinds,
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", rep.ptx)),
                block_m=fg.BLOCK_M.value, query_tiles=2, warps=fg.NUM_WARPS + 10, pipelined=True, gluon=True,
                prediction=pred)


@functools.lru_cache(maxsize=1)
def gluon_calibration_report() -> dict:
    """The cost model on the bf16 build of the Gluon pipeline against FlashAttention-4's
    BF16 forward: the model's error on this pipeline, and the factor its FP4 builds'
    `predicted_tflops` are scaled by."""
    rec = gluon_build_report("P_BF16", calibrate=False)
    model = rec["prediction"]["ceiling_tflops"]
    return {"kernel": "blackwell.forward_gluon (Gluon pipelined, bf16, the calibration build)", "recipe": "bf16",
            "head_dim": 128, "causal": False, "key_bias": False, "arch": "sm_100a", **rec,
            "fa4_bf16_measured_tflops": FA4_BF16_TFLOPS, "model_error": round(model / FA4_BF16_TFLOPS - 1, 3)}


def gluon_records() -> list[dict]:
    """The Gluon pipelined builds (not routed), D=128, non-causal and causal, each
    calibrated on the Gluon bf16 build."""
    out = []
    for name, p_kind in GLUON_RECIPES.items():
        for causal in (False, True):
            r = PRESETS[name]
            e = dict(kernel="blackwell.forward_gluon (Gluon pipelined, not routed)", recipe=name, head_dim=128,
                     causal=causal, key_bias=False, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4",
                     p_affine=r.p_build == "affine")
            rec = gluon_build_report(p_kind, causal=causal)
            out.append({**e, "arch": "sm_100a", **rec, "routed": False,
                        "fp4_block_scaled": compile_report.fp4_products_ok(e, rec)})
    return out


def comparison_builds() -> list[dict]:
    """The serial kernel's D=128 non-causal builds of the four exact recipe families, not
    routed where the pipelined one is: the schedule's effect in the model."""
    return [dict(kernel="blackwell.forward_triton (serial, for comparison)", recipe=name, head_dim=128, causal=False,
                 key_bias=False, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4", p_affine=False)
            for name, r in PRESETS.items() if name in ("directp", "nvfp4-fp8", "fp8-directp", "fp8")]


def records(arch: str = "sm_100a", key_bias: bool = True, backward: bool = True, comparison: bool = False,
            gluon: bool = False) -> list[dict]:
    """compile-report's records, each routed forward build's with its prediction (and
    `comparison`: the serial builds of `comparison_builds`, `routed` False; `gluon`, on
    sm_100a: the Gluon pipelined builds of `gluon_records`, `routed` False), then the
    training backward's (`compile_report.backward_records`)."""
    out = []
    for e in compile_report.routed_builds(key_bias, arch):
        rec = forward_record(e["qk_fp4"], e["pv_fp4"], e["p_affine"], e["causal"], e["head_dim"], e["key_bias"], arch)
        out.append({**e, "arch": arch, **rec, "routed": True, "fp4_block_scaled": compile_report.fp4_products_ok(e, rec)})
    for e in comparison_builds() if comparison and arch == "sm_100a" else ():
        rec = forward_record(e["qk_fp4"], e["pv_fp4"], False, False, 128, False, arch, SERIAL_BLACKWELL_LAUNCH)
        out.append({**e, "arch": arch, **rec, "routed": False,
                    "fp4_block_scaled": compile_report.fp4_products_ok(e, rec)})
    if gluon and arch == "sm_100a":
        out += gluon_records()
    return out + (compile_report.backward_records(arch) if backward else [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    compile_report.add_arguments(p)
    p.add_argument("--comparison", action="store_true", help="also the serial kernel's D=128 builds, not routed")
    p.add_argument("--no-gluon", action="store_true",
                   help="skip the Gluon pipelined builds (sm_100a, D=128, not routed)")


def main(args: argparse.Namespace) -> None:
    gluon = args.arch == "sm_100a" and not args.no_gluon
    recs = records(args.arch, key_bias=not args.no_key_bias, comparison=args.comparison, gluon=gluon)
    calibration = calibration_report() if args.arch == "sm_100a" else None
    gluon_calibration = gluon_calibration_report() if gluon else None
    rows = []
    for r in recs + ([calibration] if calibration else []) + ([gluon_calibration] if gluon_calibration else []):
        pred = r.get("prediction", {})
        kind = compile_report.kind_of(r)
        if r.get("gluon"):
            kind = "Gluon pipelined" + (" (calibration)" if "calibration" in r["kernel"] else " (not routed)")
        elif "calibration" in r["kernel"] or "comparison" in r["kernel"]:
            kind += " (calibration)" if "calibration" in r["kernel"] else " (comparison, not routed)"
        rows.append([kind, *compile_report.machine_code_cells(r),
                     pred.get("instructions_per_element", "-"), pred.get("bound", "-"),
                     pred.get("ceiling_tflops", "-"), pred.get("predicted_tflops", "-"),
                     pred.get("predicted_vs_fa4_bf16", pred.get("predicted_vs_sageattention3", "-"))])
    gpu = "an RTX 5090, uncalibrated" if args.arch == "sm_120a" else "a B200"
    print(f"Blackwell builds for {args.arch}: blackwell.forward_triton and the training backward's "
          f"backward_triton kernels (compiled here, not run; TFLOP/s predicted for {gpu} by "
          "dev/cost_model_sm100.py, not measured)\n")
    print(markdown_table(["kernel", *compile_report.MACHINE_CODE_COLUMNS, "instr/elem (softmax)", "bound",
                          "model TFLOP/s", "pred. TFLOP/s",
                          "vs SageAttention3 (1038)" if args.arch == "sm_120a" else "vs FA4 BF16"], rows))
    if calibration:
        print(f"\ncalibration: the BF16 build of the pipeline, model {calibration['prediction']['ceiling_tflops']} "
              f"TFLOP/s against FlashAttention-4's measured {calibration['fa4_bf16_measured_tflops']:.0f} "
              f"(error {calibration['model_error']:+.1%}); pred. TFLOP/s = model x "
              f"{calibration['fa4_bf16_measured_tflops'] / calibration['prediction']['ceiling_tflops']:.3f}")
    if gluon_calibration:
        g = gluon_calibration
        print(f"\nGluon calibration: the BF16 build of the Gluon pipeline, model {g['prediction']['ceiling_tflops']} "
              f"TFLOP/s against FlashAttention-4's measured {g['fa4_bf16_measured_tflops']:.0f} "
              f"(error {g['model_error']:+.1%}); the Gluon builds' pred. TFLOP/s = model x "
              f"{g['fa4_bf16_measured_tflops'] / g['prediction']['ceiling_tflops']:.3f}. Per partition, "
              "instructions a tile loop (issue clocks a 128 x 128 tile):")
        for r in [x for x in recs if x.get("gluon")] + [g]:
            parts = r["prediction"]["partitions"]
            print(f"- {r['recipe']}{', causal' if r['causal'] else ''}: "
                  + ", ".join(f"{role} {p['instructions']} ({p['clk_issue_per_tile']})" for role, p in parts.items())
                  + f"; every partition's issue {r['prediction']['issue_per_element']} a score; the masked tiles' "
                  f"softmax {r['prediction']['masked_tile_instructions_per_element']} a score")
    bad = compile_report.failures([r for r in recs if r["routed"] or r.get("gluon")])
    write_json(args.json, {"arch": args.arch, "records": recs, "calibration": calibration,
                           "gluon_calibration": gluon_calibration})
    if bad:
        raise SystemExit(f"{len(bad)} build(s) spill, use more than 512 tensor-memory columns or run an FP4 product "
                         f"without a block-scaled FP4 MMA: {[(r['recipe'], r['head_dim'], r['causal']) for r in bad]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m dev.cost_report_sm100", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
