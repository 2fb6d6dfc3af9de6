"""`fp4attn compile-report`: compile every routed Blackwell kernel for sm_100a (B200,
GB200), sm_103a (B300) or sm_120a (consumer Blackwell) on this machine, no GPU needed,
and report what each build uses: registers and spills (ptxas-blackwell -v), shared memory
and tensor-memory columns (the compiler's metadata), the tensor-core instruction kinds in
its PTX, whether it is pipelined (warp-specialized), and the verdict: every NVFP4/MXFP4
product a block-scaled FP4 MMA (tcgen05 kind::mxf4nvf4 / mxf4, or mma.sync on sm_120a),
no spills, tensor memory within 512 columns (the command exits non-zero otherwise).

The cost model's predictions from the same builds, the serial kernel's builds for
comparison and the unrouted Gluon forward are development code: `python -m
dev.cost_report_sm100` prints this report with them (benchmarks/results/README.md)."""

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
    blackwell_forward_launch,
    blackwell_forward_unsupported,
    blackwell_train_unsupported,
)

HEAD_DIMS = (64, 128)
FP4_MMA = "block_scale"  # every NVFP4/MXFP4 product must be a block-scaled FP4 tcgen05.mma (or mma.sync on sm_120a)


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


def routed_launch(head_dim: int, causal: bool, key_bias: bool, arch: str):
    """The launch the routing gives a forward build on `arch`'s target."""
    return blackwell_forward_launch(head_dim, causal, key_bias, TARGET_OF_ARCH[arch])


def forward_kernel(qk_fp4: bool, pv_fp4: bool, p_affine: bool, causal: bool, head_dim: int, key_bias: bool,
                   arch: str, launch):
    """One forward build compiled for `arch` at `launch`."""
    from fp4attn.cli.blackwell_machine_code import compile_forward

    return compile_forward(qk_fp4, pv_fp4, causal, head_dim, arch=arch, block_m=launch.block_m, block_n=KEY_TILE,
                           num_warps=launch.warps, num_stages=launch.stages, key_bias=key_bias,
                           pipelined=launch.pipelined, p_affine=p_affine)


def build_figures(kernel, arch: str, launch) -> dict:
    """What one compiled forward build uses, read off its machine code, and the launch it
    was built at."""
    from fp4attn.cli.blackwell_machine_code import inspect

    rep = inspect(kernel, arch)
    return dict(registers=rep.registers, spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes,
                tmem_columns=rep.tmem_columns, mma_kinds=rep.mma_kinds,
                e2m1_cvt=rep.ptx.count("cvt.rn.satfinite.e2m1x2.f32"),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", rep.ptx)),
                block_m=launch.block_m, warps=launch.warps, stages=launch.stages, pipelined=rep.pipelined)


@functools.cache
def build_report(qk_fp4: bool, pv_fp4: bool, p_affine: bool, causal: bool, head_dim: int, key_bias: bool,
                 arch: str) -> dict:
    """Compile one forward build at its routed launch and read its machine code."""
    launch = routed_launch(head_dim, causal, key_bias, arch)
    kernel = forward_kernel(qk_fp4, pv_fp4, p_affine, causal, head_dim, key_bias, arch, launch)
    return build_figures(kernel, arch, launch)


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
                    out.append(dict(kernel=f"backward_triton.{part}", recipe=name, head_dim=d, causal=causal,
                                    key_bias=False, part=part, p_mode=P_MODES[r.p, r.p_build] if part == "dkdv" else 0,
                                    qk_fp4=getattr(BLACKWELL_BACKWARD_LAUNCH[d], f"qk_fp4_{part}"), pv_fp4=False))
    return out


@functools.cache
def backward_report(part: str, p_mode: int, causal: bool, head_dim: int, arch: str) -> dict:
    """Compile one training backward build at its Blackwell launch and read it."""
    from fp4attn.cli.blackwell_machine_code import compile_backward, inspect

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


def forward_records(arch: str = "sm_100a", key_bias: bool = True) -> list[dict]:
    """One record per routed forward build, with its machine-code figures and its
    `fp4_block_scaled` verdict."""
    out = []
    for e in routed_builds(key_bias, arch):
        rec = build_report(e["qk_fp4"], e["pv_fp4"], e["p_affine"], e["causal"], e["head_dim"], e["key_bias"], arch)
        out.append({**e, "arch": arch, **rec, "routed": True, "fp4_block_scaled": fp4_products_ok(e, rec)})
    return out


def backward_records(arch: str = "sm_100a") -> list[dict]:
    """One record per routed training backward build (none on sm_120a, which trains on
    the reference). The gradient products are FP8 (kind::f8f6f4); where a record's launch
    forms the scores from the NVFP4 payload (`qk_fp4`), its `fp4_block_scaled` says
    whether they are the block-scaled FP4 product (kind::mxf4nvf4, e4m3 scales per 16)
    with no bf16 product left (kind::f16); elsewhere it is None: the scores are a bf16
    product of the NVFP4 grid values (exact; the D=128 dK/dV kernel's S^T,
    docs/notes/archive/blackwell.md, "The training backward's score products")."""
    out = []
    for e in routed_backward_builds() if arch != "sm_120a" else ():
        rec = backward_report(e["part"], e["p_mode"], e["causal"], e["head_dim"], arch)
        fp4 = fp4_products_ok(e, rec) and not any("kind::f16" in k for k in rec["mma_kinds"])
        out.append({**e, "arch": arch, **rec, "routed": True, "fp4_block_scaled": fp4 if e["qk_fp4"] else None})
    return out


def records(arch: str = "sm_100a", key_bias: bool = True, backward: bool = True) -> list[dict]:
    """compile-report's records: every routed forward build (`forward_records`), then,
    with `backward`, every routed training backward build (`backward_records`)."""
    return forward_records(arch, key_bias) + (backward_records(arch) if backward else [])


def failures(recs: list[dict]) -> list[dict]:
    """The records of builds that spill, use more than 512 tensor-memory columns or run
    an FP4 product without a block-scaled FP4 MMA."""
    return [r for r in recs if r["spill_bytes"] or r["tmem_columns"] > 512 or r["fp4_block_scaled"] is False]


def kind_of(r: dict) -> str:
    """A record's kernel as the table names it: the forward's schedule, or the backward
    kernel's part."""
    if r["kernel"].startswith("blackwell"):
        return "pipelined" if r.get("pipelined") else "serial"
    return r["kernel"].split(".")[-1]


def machine_code_cells(r: dict) -> list:
    """A record's table cells from recipe to MMA kinds."""
    return [r["recipe"], r["head_dim"], "yes" if r["causal"] else "no", "yes" if r["key_bias"] else "no",
            r["registers"], r["spill_bytes"], r["shared_bytes"], r["tmem_columns"],
            "<br>".join(k.replace("tcgen05.mma.cta_group::1.", "") for k in r["mma_kinds"])]


MACHINE_CODE_COLUMNS = ["recipe", "D", "causal", "key mask", "regs", "spill B", "smem B", "tmem cols", "MMA kinds"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=tuple(TARGET_OF_ARCH), default="sm_100a",
                   help="target to compile for (sm_120a: consumer Blackwell, its forward only)")
    p.add_argument("--no-key-bias", action="store_true", help="skip the key-mask builds (half the compile time)")
    p.add_argument("--json", type=Path, default=None, help="write the records as JSON")


def main(args: argparse.Namespace) -> None:
    recs = records(args.arch, key_bias=not args.no_key_bias)
    verdict = {None: "-", True: "yes", False: "NO"}
    rows = [[kind_of(r), *machine_code_cells(r), verdict[r["fp4_block_scaled"]]] for r in recs]
    print(f"Blackwell builds for {args.arch}: every routed blackwell.forward_triton build and the training "
          "backward's backward_triton kernels (compiled here, not run)\n")
    print(markdown_table(["kernel", *MACHINE_CODE_COLUMNS, "FP4 block-scaled"], rows))
    write_json(args.json, {"arch": args.arch, "records": recs})
    bad = failures(recs)
    if bad:
        raise SystemExit(f"{len(bad)} build(s) spill, use more than 512 tensor-memory columns or run an FP4 product "
                         f"without a block-scaled FP4 MMA: {[(r['recipe'], r['head_dim'], r['causal']) for r in bad]}")
