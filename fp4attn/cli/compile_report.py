"""`fp4attn compile-report`: compile every routed Blackwell kernel for sm_100a (B200,
GB200), sm_103a (B300) or sm_120a (consumer Blackwell, not routed) on this machine, no
GPU needed, and report what each build uses: registers and spills (ptxas-blackwell -v),
shared memory and tensor-memory columns (the compiler's metadata), the tensor-core
instruction kinds in its PTX, whether it is pipelined (warp-specialized), and a B200
prediction from its machine code (`tools.cost_model_sm100`: per partition its issue per
tile, the tensor-core and MUFU time, the overlap the schedule allows; calibrated on the
BF16 build of the same pipeline against FlashAttention-4's measured BF16 forward, whose
record the report carries). On sm_100a it also compiles the Gluon pipelined forward with
FlashAttention-4's structure (`kernels.blackwell.forward_gluon`, not routed) and models
it against the bf16 build of that pipeline (`gluon_records`, `gluon_calibration_report`;
--no-gluon skips them). Predictions, not measurements."""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

from fp4attn.cli.output import markdown_table, write_json
from fp4attn.recipes import PRESETS
from fp4attn.routing import (
    BLACKWELL_BACKWARD_LAUNCH,
    KEY_TILE,
    P_MODES,
    SERIAL_BLACKWELL_LAUNCH,
    BlackwellLaunch,
    blackwell_forward_launch,
    blackwell_forward_unsupported,
    blackwell_train_unsupported,
)

HEAD_DIMS = (64, 128)
FP4_MMA = "block_scale"  # every NVFP4/MXFP4 product must be a block-scaled FP4 tcgen05.mma (or mma.sync on sm_120a)


def _p_builder(recipe) -> str:
    return recipe.p_build if recipe.p == "mxfp4" else ("affine" if recipe.p_build == "affine" else "exp2")


# the routing target each compile-report architecture stands for
TARGET_OF_ARCH = {"sm_100a": "sm_100", "sm_103a": "sm_103", "sm_120a": "sm_120"}


def routed_builds(key_bias: bool = True, arch: str = "sm_100a") -> list[dict]:
    """One entry per routed (recipe, head dim, causal, key bias) of the Blackwell
    forward on `arch`'s target, with the kernel build that runs it (QK_FP4, PV_FP4,
    P_AFFINE)."""
    out = []
    for name, r in PRESETS.items():
        for d in HEAD_DIMS:
            for causal in (False, True):
                for kb in (False, True) if key_bias else (False,):
                    if blackwell_forward_unsupported(r, d, "key" if kb else "none", TARGET_OF_ARCH[arch]) is not None:
                        continue
                    out.append(dict(kernel="blackwell.forward_triton", recipe=name, head_dim=d, causal=causal,
                                    key_bias=kb, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4",
                                    p_affine=r.p_build == "affine"))
    return out


def _launch(pv_fp4: bool, p_affine: bool, causal: bool, head_dim: int, key_bias: bool, arch: str):
    return blackwell_forward_launch(head_dim, causal, key_bias, TARGET_OF_ARCH[arch])


@functools.cache
def build_report(qk_fp4: bool, pv_fp4: bool, p_affine: bool, causal: bool, head_dim: int, key_bias: bool,
                 arch: str, launch=None, bf16: bool = False) -> dict:
    """Compile one build at its routed launch (or `launch`) and read its machine code;
    on sm_100a with the cost model's prediction for a B200, calibrated
    (`calibration_report`), on sm_120a its raw figure for an RTX 5090 beside
    SageAttention3's."""
    from fp4attn.tools.cost_model_sm100 import RTX_5090, SAGEATTENTION3_RTX5090_TOPS, calibrate, predict
    from fp4attn.tools.machine_code_sm100 import compile_forward, inspect

    launch = launch or _launch(pv_fp4, p_affine, causal, head_dim, key_bias, arch)
    kernel = compile_forward(qk_fp4, pv_fp4, causal, head_dim, arch=arch, block_m=launch.block_m,
                             block_n=KEY_TILE, num_warps=launch.warps, num_stages=launch.stages, key_bias=key_bias,
                             pipelined=launch.pipelined, p_affine=p_affine, bf16=bf16)
    rep = inspect(kernel, arch)
    rec = dict(registers=rep.registers, spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes,
               tmem_columns=rep.tmem_columns, mma_kinds=rep.mma_kinds,
               e2m1_cvt=rep.ptx.count("cvt.rn.satfinite.e2m1x2.f32"),
               tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", rep.ptx)),
               block_m=launch.block_m, warps=launch.warps, stages=launch.stages, pipelined=rep.pipelined)
    kinds = ("bf16", "bf16") if bf16 else ("fp4" if qk_fp4 else "fp8", "fp4" if pv_fp4 else "fp8")
    if arch == "sm_100a":  # the model reads the SASS (the bundled cuobjdump cannot for sm_103a)
        pred = predict(rep, qk=kinds[0], pv=kinds[1], head_dim=head_dim, block_m=launch.block_m, block_n=KEY_TILE)
        rec["prediction"] = pred if bf16 else calibrate(pred, calibration_report()["prediction"])
    elif arch == "sm_120a":  # uncalibrated: no consumer Blackwell kernel of known speed shares this pipeline
        pred = predict(rep, qk=kinds[0], pv=kinds[1], head_dim=head_dim, block_m=launch.block_m, block_n=KEY_TILE,
                       gpu=RTX_5090)
        rec["prediction"] = {**pred, "predicted_tflops": pred["ceiling_tflops"],
                             "predicted_vs_sageattention3": round(pred["ceiling_tflops"] / SAGEATTENTION3_RTX5090_TOPS, 2)}
    return rec


# the calibration build: the bf16 form of the pipelined kernel (Q, K, V, P in bf16,
# kind::f16) at D=128, non-causal, FlashAttention-4's measured case; two stages (with
# three its load partition spills 112 bytes)
CALIBRATION_LAUNCH = BlackwellLaunch(warps=4, stages=2, pipelined=True)


@functools.lru_cache(maxsize=1)
def calibration_report() -> dict:
    """The cost model on the BF16 build of the same pipeline against FlashAttention-4's
    BF16 forward (`tools.cost_model_sm100.FA4_BF16_TFLOPS`): its record, with the raw
    model's error there."""
    from fp4attn.tools.cost_model_sm100 import FA4_BF16_TFLOPS

    rec = build_report(False, False, False, False, 128, False, "sm_100a", CALIBRATION_LAUNCH, bf16=True)
    model = rec["prediction"]["ceiling_tflops"]
    return {"kernel": "blackwell.forward_triton (bf16, the calibration build)", "recipe": "bf16", "head_dim": 128,
            "causal": False, "key_bias": False, "arch": "sm_100a", **rec,
            "fa4_bf16_measured_tflops": FA4_BF16_TFLOPS, "model_error": round(model / FA4_BF16_TFLOPS - 1, 3)}


# the Gluon pipeline with FlashAttention-4's structure (`kernels.blackwell.forward_gluon`:
# two 128-row query tiles a CTA, load and MMA warps, a softmax warpgroup per tile and a
# correction warpgroup), D=128 non-causal, not routed: its builds by recipe (P builder)
GLUON_RECIPES = {"directp-fast": "P_AFFINE_MXFP4", "nvfp4-fp8": "P_EXP2_FP8"}


@functools.cache
def gluon_build_report(p_kind: str, calibrate: bool = True, causal: bool = False) -> dict:
    """Compile one Gluon pipelined build (`forward_gluon.<p_kind>`, causal or not) for
    sm_100a and read it; its prediction (per full key tile: the masked tiles' loop, the
    tail and the causal diagonal, beside it a score) calibrated on the bf16 build of the
    same Gluon pipeline (`gluon_calibration_report`; calibrate False: the raw model, for
    the calibration build itself)."""
    from fp4attn.kernels.blackwell import forward_gluon as fg
    from fp4attn.tools.cost_model_sm100 import calibrate as calibrate_prediction
    from fp4attn.tools.cost_model_sm100 import predict
    from fp4attn.tools.machine_code_sm100 import compile_forward_gluon, inspect

    kind = getattr(fg, p_kind).value
    rep = inspect(compile_forward_gluon(kind, causal=causal), "sm_100a", gluon=True)
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
    from fp4attn.tools.cost_model_sm100 import FA4_BF16_TFLOPS

    rec = gluon_build_report("P_BF16", calibrate=False)
    model = rec["prediction"]["ceiling_tflops"]
    return {"kernel": "blackwell.forward_gluon (Gluon pipelined, bf16, the calibration build)", "recipe": "bf16",
            "head_dim": 128, "causal": False, "key_bias": False, "arch": "sm_100a", **rec,
            "fa4_bf16_measured_tflops": FA4_BF16_TFLOPS, "model_error": round(model / FA4_BF16_TFLOPS - 1, 3)}


def gluon_records() -> list[dict]:
    """The Gluon pipelined builds (not routed), D=128, non-causal and causal, each
    calibrated on the Gluon bf16 build."""
    from fp4attn.recipes import PRESETS

    out = []
    for name, p_kind in GLUON_RECIPES.items():
        for causal in (False, True):
            r = PRESETS[name]
            e = dict(kernel="blackwell.forward_gluon (Gluon pipelined, not routed)", recipe=name, head_dim=128,
                     causal=causal, key_bias=False, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4",
                     p_affine=r.p_build == "affine")
            rec = gluon_build_report(p_kind, causal=causal)
            out.append({**e, "arch": "sm_100a", **rec, "routed": False, "fp4_block_scaled": fp4_products_ok(e, rec)})
    return out


def routed_backward_builds() -> list[dict]:
    """One entry per routed (training recipe, head dim, causal, kernel) of the Blackwell
    training backward: its dK/dV kernel (P rebuilt as the recipe builds it) and its dQ
    kernel, each with `qk_fp4` True where the launch forms its scores by the block-scaled
    FP4 product of the NVFP4 payload (`qk_fp4_dq`, `qk_fp4_dkdv`), False where by a bf16
    product of the NVFP4 grid values."""
    out = []
    for name, r in PRESETS.items():
        for d in HEAD_DIMS:
            if blackwell_train_unsupported(r, d) is not None:
                continue
            for causal in (False, True):
                for part in ("dkdv", "dq"):
                    out.append(dict(kernel=f"hopper.backward_triton.{part}", recipe=name, head_dim=d, causal=causal,
                                    key_bias=False, part=part, p_mode=P_MODES[r.p, r.p_build] if part == "dkdv" else 0,
                                    qk_fp4=getattr(BLACKWELL_BACKWARD_LAUNCH[d], f"qk_fp4_{part}"), pv_fp4=False))
    return out


@functools.cache
def backward_report(part: str, p_mode: int, causal: bool, head_dim: int, arch: str) -> dict:
    """Compile one training backward build at its Blackwell launch and read it."""
    from fp4attn.tools.machine_code_sm100 import compile_backward, inspect

    rep = inspect(compile_backward(part, causal, head_dim, p_mode=p_mode, arch=arch), arch)
    return dict(registers=rep.registers, spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes,
                tmem_columns=rep.tmem_columns, mma_kinds=rep.mma_kinds)


# the scale-block suffix of a block-scaled MMA: PTX spells it scale_vec::4X / ::2X (Triton
# 3.6's output) or block16 / block32 (Triton 3.9's)
SCALES_PER_16 = ("scale_vec::4X", "block16")
SCALES_PER_32 = ("scale_vec::2X", "block32")


def fp4_products_ok(entry: dict, rec: dict) -> bool:
    """Whether every NVFP4/MXFP4 product of the build is a block-scaled FP4 MMA: the
    NVFP4 QK^T as kind::mxf4nvf4 with e4m3 scales per 16, the MXFP4 PV as kind::mxf4
    (or mxf4nvf4) with E8M0 scales per 32."""
    kinds = rec["mma_kinds"]
    fp4 = [k for k in kinds if FP4_MMA in k and ("mxf4" in k)]
    ok = True
    if entry["qk_fp4"]:
        ok &= any("mxf4nvf4" in k and any(s in k for s in SCALES_PER_16) for k in fp4)
    if entry["pv_fp4"]:
        ok &= any(any(s in k for s in SCALES_PER_32) for k in fp4)
    if not (entry["qk_fp4"] or entry["pv_fp4"]):
        ok &= not fp4
    return ok


def comparison_builds() -> list[dict]:
    """The serial kernel's D=128 non-causal builds of the four exact recipe families, not
    routed where the pipelined one is: the schedule's effect in the model."""
    return [dict(kernel="blackwell.forward_triton (serial, for comparison)", recipe=name, head_dim=128, causal=False,
                 key_bias=False, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4", p_affine=False)
            for name, r in PRESETS.items() if name in ("directp", "nvfp4-fp8", "fp8-directp", "fp8")]


def records(arch: str = "sm_100a", key_bias: bool = True, backward: bool = True, comparison: bool = False,
            gluon: bool = False) -> list[dict]:
    """compile-report's records: one per routed build, with its machine-code figures
    (and `comparison`: the serial builds of `comparison_builds`, `routed` False; `gluon`,
    on sm_100a: the Gluon pipelined builds of `gluon_records`, `routed` False).
    The training backward's gradient products are FP8 (kind::f8f6f4); where a record's
    launch forms the scores from the NVFP4 payload (`qk_fp4`), its `fp4_block_scaled`
    says whether they are the block-scaled FP4 product (kind::mxf4nvf4, e4m3 scales per
    16) with no bf16 product left (kind::f16); elsewhere it is None: the scores are a
    bf16 product of the NVFP4 grid values (exact; the D=128 dK/dV kernel's S^T,
    docs/notes/blackwell.md, "The training backward's score products")."""
    out = []
    for e in routed_builds(key_bias, arch):
        rec = build_report(e["qk_fp4"], e["pv_fp4"], e["p_affine"], e["causal"], e["head_dim"], e["key_bias"], arch)
        out.append({**e, "arch": arch, **rec, "routed": True, "fp4_block_scaled": fp4_products_ok(e, rec)})
    for e in comparison_builds() if comparison and arch == "sm_100a" else ():
        rec = build_report(e["qk_fp4"], e["pv_fp4"], False, False, 128, False, arch, SERIAL_BLACKWELL_LAUNCH)
        out.append({**e, "arch": arch, **rec, "routed": False, "fp4_block_scaled": fp4_products_ok(e, rec)})
    if gluon and arch == "sm_100a":
        out += gluon_records()
    for e in routed_backward_builds() if backward and arch != "sm_120a" else ():
        rec = backward_report(e["part"], e["p_mode"], e["causal"], e["head_dim"], arch)
        fp4 = fp4_products_ok(e, rec) and not any("kind::f16" in k for k in rec["mma_kinds"])
        out.append({**e, "arch": arch, **rec, "routed": True, "fp4_block_scaled": fp4 if e["qk_fp4"] else None})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=tuple(TARGET_OF_ARCH), default="sm_100a",
                   help="target to compile for (sm_120a: consumer Blackwell, its forward only)")
    p.add_argument("--no-key-bias", action="store_true", help="skip the key-mask builds (half the compile time)")
    p.add_argument("--comparison", action="store_true", help="also the serial kernel's D=128 builds, not routed")
    p.add_argument("--no-gluon", action="store_true",
                   help="skip the Gluon pipelined builds (sm_100a, D=128, not routed)")
    p.add_argument("--json", type=Path, default=None, help="write the records as JSON")


def main(args: argparse.Namespace) -> None:
    gluon = args.arch == "sm_100a" and not getattr(args, "no_gluon", False)
    recs = records(args.arch, key_bias=not args.no_key_bias, comparison=args.comparison, gluon=gluon)
    calibration = calibration_report() if args.arch == "sm_100a" else None
    gluon_calibration = gluon_calibration_report() if gluon else None
    rows = []
    for r in recs + ([calibration] if calibration else []) + ([gluon_calibration] if gluon_calibration else []):
        pred = r.get("prediction", {})
        kind = "pipelined" if r.get("pipelined") else "serial" if r["kernel"].startswith("blackwell") else \
            r["kernel"].split(".")[-1]
        if r.get("gluon"):
            kind = "Gluon pipelined" + (" (calibration)" if "calibration" in r["kernel"] else " (not routed)")
        elif "calibration" in r["kernel"] or "comparison" in r["kernel"]:
            kind += " (calibration)" if "calibration" in r["kernel"] else " (comparison, not routed)"
        rows.append([kind, r["recipe"], r["head_dim"], "yes" if r["causal"] else "no",
                     "yes" if r["key_bias"] else "no", r["registers"], r["spill_bytes"], r["shared_bytes"],
                     r["tmem_columns"], "<br>".join(k.replace("tcgen05.mma.cta_group::1.", "") for k in r["mma_kinds"]),
                     pred.get("instructions_per_element", "-"), pred.get("bound", "-"),
                     pred.get("ceiling_tflops", "-"), pred.get("predicted_tflops", "-"),
                     pred.get("predicted_vs_fa4_bf16", pred.get("predicted_vs_sageattention3", "-"))])
    gpu = "an RTX 5090, uncalibrated" if args.arch == "sm_120a" else "a B200"
    print(f"Blackwell builds for {args.arch}: blackwell.forward_triton and the training backward's "
          f"hopper.backward_triton kernels (compiled here, not run; TFLOP/s predicted for {gpu} by "
          "tools/cost_model_sm100.py, not measured)\n")
    print(markdown_table(["kernel", "recipe", "D", "causal", "key mask", "regs", "spill B", "smem B", "tmem cols",
                          "MMA kinds", "instr/elem (softmax)", "bound", "model TFLOP/s", "pred. TFLOP/s",
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
    bad = [r for r in recs if (r["routed"] or r.get("gluon")) and (r["spill_bytes"] or r["tmem_columns"] > 512 or
                                               r["fp4_block_scaled"] is False)]
    write_json(args.json, {"arch": args.arch, "records": recs, "calibration": calibration,
                           "gluon_calibration": gluon_calibration})
    if bad:
        raise SystemExit(f"{len(bad)} build(s) spill, use more than 512 tensor-memory columns or run an FP4 product "
                         f"without a block-scaled FP4 MMA: {[(r['recipe'], r['head_dim'], r['causal']) for r in bad]}")
