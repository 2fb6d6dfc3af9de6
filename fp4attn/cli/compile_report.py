"""`fp4attn compile-report`: compile every routed Blackwell kernel for sm_100a (B200,
GB200), sm_103a (B300) or sm_120a (consumer Blackwell, not routed) on this machine, no
GPU needed, and report what each build uses: registers and spills (ptxas-blackwell -v),
shared memory and tensor-memory columns (the compiler's metadata), the tensor-core
instruction kinds in its PTX, and a predicted B200 ceiling per key tile from its machine
code (`tools.machine_code_sm100.predict_tile`: a prediction, not a measurement)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from fp4attn.cli.output import markdown_table, write_json
from fp4attn.recipes import PRESETS
from fp4attn.routing import (
    KEY_TILE,
    P_MODES,
    blackwell_forward_launch,
    blackwell_forward_unsupported,
    blackwell_train_unsupported,
)

HEAD_DIMS = (64, 128)
FP4_MMA = "block_scale"  # every NVFP4/MXFP4 product must be a block-scaled FP4 tcgen05.mma (or mma.sync on sm_120a)


def routed_builds(key_bias: bool = True) -> list[dict]:
    """One entry per routed (recipe, head dim, causal, key bias) of the Blackwell
    forward, with the kernel build that runs it (QK_FP4, PV_FP4)."""
    out = []
    for name, r in PRESETS.items():
        for d in HEAD_DIMS:
            for causal in (False, True):
                for kb in (False, True) if key_bias else (False,):
                    if blackwell_forward_unsupported(r, d, "key" if kb else "none") is not None:
                        continue
                    out.append(dict(kernel="blackwell.forward_triton", recipe=name, head_dim=d, causal=causal,
                                    key_bias=kb, qk_fp4=r.qk == "nvfp4", pv_fp4=r.p == "mxfp4"))
    return out


@functools.lru_cache(maxsize=None)
def build_report(qk_fp4: bool, pv_fp4: bool, causal: bool, head_dim: int, key_bias: bool, arch: str) -> dict:
    """Compile one build at its routed launch and read its machine code."""
    from fp4attn.tools.machine_code_sm100 import compile_forward, inspect, predict_tile

    launch = blackwell_forward_launch(head_dim, causal, key_bias)
    kernel = compile_forward(qk_fp4, pv_fp4, causal, head_dim, arch=arch, block_m=launch.block_m,
                             block_n=KEY_TILE, num_warps=launch.warps, num_stages=launch.stages, key_bias=key_bias)
    rep = inspect(kernel, arch)
    rec = dict(registers=rep.registers, spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes,
               tmem_columns=rep.tmem_columns, mma_kinds=rep.mma_kinds,
               e2m1_cvt=rep.ptx.count("cvt.rn.satfinite.e2m1x2.f32"),
               block_m=launch.block_m, warps=launch.warps, stages=launch.stages)
    if arch == "sm_100a":  # the B200 model reads the SASS
        rec["prediction"] = predict_tile(rep, qk_fp4=qk_fp4, pv_fp4=pv_fp4, head_dim=head_dim,
                                         block_m=launch.block_m, block_n=KEY_TILE, warps=launch.warps)
    return rec


def routed_backward_builds() -> list[dict]:
    """One entry per routed (training recipe, head dim, causal, kernel) of the Blackwell
    training backward: its dK/dV kernel (P rebuilt as the recipe builds it) and its dQ
    kernel."""
    out = []
    for name, r in PRESETS.items():
        for d in HEAD_DIMS:
            if blackwell_train_unsupported(r, d) is not None:
                continue
            for causal in (False, True):
                for part in ("dkdv", "dq"):
                    out.append(dict(kernel=f"hopper.backward_triton.{part}", recipe=name, head_dim=d, causal=causal,
                                    key_bias=False, part=part, p_mode=P_MODES[r.p, r.p_build] if part == "dkdv" else 0))
    return out


@functools.lru_cache(maxsize=None)
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


def records(arch: str = "sm_100a", key_bias: bool = True, backward: bool = True) -> list[dict]:
    """compile-report's records: one per routed build, with its machine-code figures.
    The training backward's records have `fp4_block_scaled` None: its S^T rebuild is a
    bf16 product of the NVFP4 grid values (exact; kind::f16), its gradient products
    FP8 (docs/notes/blackwell.md)."""
    out = []
    for e in routed_builds(key_bias):
        rec = build_report(e["qk_fp4"], e["pv_fp4"], e["causal"], e["head_dim"], e["key_bias"], arch)
        out.append({**e, "arch": arch, **rec, "fp4_block_scaled": fp4_products_ok(e, rec)})
    for e in routed_backward_builds() if backward else ():
        rec = backward_report(e["part"], e["p_mode"], e["causal"], e["head_dim"], arch)
        out.append({**e, "arch": arch, **rec, "fp4_block_scaled": None})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=("sm_100a", "sm_103a", "sm_120a"), default="sm_100a",
                   help="target to compile for (sm_120a: consumer Blackwell, not routed)")
    p.add_argument("--no-key-bias", action="store_true", help="skip the key-mask builds (half the compile time)")
    p.add_argument("--json", type=Path, default=None, help="write the records as JSON")


def main(args: argparse.Namespace) -> None:
    recs = records(args.arch, key_bias=not args.no_key_bias)
    rows = []
    for r in recs:
        pred = r.get("prediction", {})
        rows.append([r["kernel"].split(".")[-1], r["recipe"], r["head_dim"], "yes" if r["causal"] else "no", "yes" if r["key_bias"] else "no",
                     r["registers"], r["spill_bytes"], r["shared_bytes"], r["tmem_columns"],
                     "<br>".join(k.replace("tcgen05.mma.cta_group::1.", "") for k in r["mma_kinds"]),
                     pred.get("instructions_per_element", "-"), pred.get("predicted_tflops", "-"),
                     pred.get("bound", "-")])
    print(f"Blackwell builds for {args.arch}: blackwell.forward_triton and the training backward's "
          "hopper.backward_triton kernels (compiled here, not run; TFLOP/s a predicted ceiling on a B200, "
          "not a measurement)\n")
    print(markdown_table(["kernel", "recipe", "D", "causal", "key mask", "regs", "spill B", "smem B", "tmem cols",
                          "MMA kinds", "instr/elem", "pred. TFLOP/s", "bound"], rows))
    bad = [r for r in recs if r["spill_bytes"] or r["tmem_columns"] > 512 or r["fp4_block_scaled"] is False]
    write_json(args.json, {"arch": args.arch, "records": recs})
    if bad:
        raise SystemExit(f"{len(bad)} build(s) spill, use more than 512 tensor-memory columns or run an FP4 product "
                         f"without a block-scaled FP4 MMA: {[(r['recipe'], r['head_dim'], r['causal']) for r in bad]}")
