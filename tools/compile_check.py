"""Compile every Hopper forward variant for sm_90 (no GPU needed) at its default launch
and print registers, stack, the key SASS instructions (QGMMA/HGMMA, MUFU.EX2) and the
instructions per score element of the unmasked tile loop, with the largest opcodes
(docs/notes/hopper-forward.md, "Instruction budget"); "full tile" counts what a tile off
the causal diagonal and before the last issues: the loop less the mask code that such a
tile branches around (`KernelReport.path`). Sequence lengths are specialized
as multiples of 16, as the JIT compiles them at the bench shapes. A second table does
the same for the warp-specialized Gluon kernel in its routed layout (its registers are
the consumer's and the producer's `setmaxnreg`; its tile loop is the consumer's).

`--backward` prints the backward's dK/dV and dQ kernels instead, Triton and Gluon (the
Gluon kernels with one scale per head and with a scale per token), each at its routed launch (docs/notes/hopper-train.md): registers, stack, shared memory,
programs per SM, the CTA barriers and instructions of the tile loop (per thread, and per
element of the 64 x 64 score tile for one warpgroup, 32 per thread).

    python tools/compile_check.py [--sass-dir DIR] [--backward]
"""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from fp4attn.kernels.hopper.operands import BLOCK_N
from fp4attn.routing import BACKWARD_LAUNCH, forward_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/
from dev.machine_code import (  # noqa: E402
    compile_backward,
    compile_backward_gluon,
    compile_forward_ws,
    inspect,
    inspect_forward,
    per_element,
)


def backward_table():
    print("| kernel | D | causal | warps | regs | stack | shared KB | programs/SM | loop BAR | loop instr/thread "
          "| full tile instr/thread | full tile instr/elem | largest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in (64, 128):
        cfg = BACKWARD_LAUNCH[d]
        triton_cfg = dataclasses.replace(cfg, dkdv_gluon=False, dq_gluon=False)
        for causal in (False, True):
            for part in ("dkdv", "dq"):
                warps = triton_cfg.warps_dkdv if part == "dkdv" else triton_cfg.warps_dq
                builds = [(f"{part} Triton", compile_backward(part, 0, causal, d, config=triton_cfg), warps)]
                if cfg.dkdv_gluon if part == "dkdv" else cfg.dq_gluon:
                    maxnreg = cfg.dkdv_maxnreg if part == "dkdv" else cfg.dq_maxnreg
                    for row_scales in (False, True):  # NVFP4 Q/K (`train`), per-token FP8 (`train-fp8`)
                        builds.append((f"{part} Gluon{' row scales' if row_scales else ''}", compile_backward_gluon(
                            causal, d, cfg.dkdv_in_flight, part=part, maxnreg=maxnreg, staged=cfg.dkdv_staged,
                            row_scales=row_scales), 4))
                for name, kernel, w in builds:
                    r = inspect(kernel)
                    loop = r.tile_loop()
                    shared = kernel.metadata.shared
                    programs = min(65536 // (r.registers * 32 * w), 228 * 1024 // (shared + 1024))
                    full = r.tile_path()
                    n, ops = per_element(full, 32)
                    top = ", ".join(f"{k} {v:.1f}" for k, v in ops[:4])
                    bars = sum(op.startswith("BAR") for op in loop)
                    print(f"| {name} | {d} | {causal} | {w} | {r.registers} | {r.stack} | {shared / 1024:.1f} "
                          f"| {programs} | {bars} | {len(loop)} | {len(full)} | {n:.1f} | {top} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass-dir", type=Path)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    if args.backward:
        backward_table()
        return
    print("| qk | P mode | causal | D | regs | stack | QGMMA | HGMMA | MUFU.EX2 | SASS lines | loop instr/elem "
          "| full tile instr/elem | largest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for qk_fp8 in (True, False):
        for p_mode in (0, 1, 2, 4, 5):
            for causal in (False, True):
                for d in (64, 128):
                    r = inspect_forward(qk_fp8, p_mode, causal, d)
                    launch = forward_launch(d, qk_fp8, causal)
                    per_thread = launch.block_m * BLOCK_N // (launch.warps * 32)
                    n_loop = len(r.tile_loop()) / per_thread
                    n, ops = per_element(r.tile_path(), per_thread)
                    top = ", ".join(f"{k} {v:.1f}" for k, v in ops[:4])
                    print(f"| {'fp8' if qk_fp8 else 'bf16'} | {p_mode} | {causal} | {d} | {r.registers} | {r.stack} "
                          f"| {r.count('QGMMA')} | {r.count('HGMMA')} | {r.count('MUFU.EX2')} "
                          f"| {r.sass.count(chr(10))} | {n_loop:.1f} | {n:.1f} | {top} |")
                    if args.sass_dir:
                        args.sass_dir.mkdir(parents=True, exist_ok=True)
                        name = f"fwd_qk{int(qk_fp8)}_p{p_mode}_c{int(causal)}_d{d}.sass"
                        (args.sass_dir / name).write_text(r.sass)
    print("\nWarp-specialized Gluon kernel, OVERLAP as routed at D=128 (`ForwardLaunch.ws_overlap`; fp8 Q/K: "
          "unpromoted)")
    print("| qk | P mode | causal | D | OVERLAP | setmaxnreg consumer / producer | stack | QGMMA | HGMMA | MUFU.EX2 "
          "| SASS lines | loop instr/elem | full tile instr/elem | largest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for qk_fp8, p_mode in ((False, 0), (False, 1), (True, 0), (False, 4), (True, 4)):
        for causal in (False, True):
            for d in (64, 128):
                overlap = forward_launch(128, qk_fp8, causal).ws_overlap
                kernel = compile_forward_ws(qk_fp8, p_mode, causal, d, overlap=overlap)
                r = inspect(kernel)
                regs = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])
                # the consumer's tile loop: the longest loop holding one tile's QK^T (the
                # prologue has the first tile's) and one PV, and no EXIT (a span that
                # runs on into the epilogue is not the loop, as `KernelReport.tile_loop`
                # has it). The mbarrier
                # waits are loops of their own, and branches back into the loop body make
                # shorter "loops" of part of it. It also holds the masks, which full tiles
                # branch around ("full tile").
                count = lambda lp, op: sum(o.startswith(op) for o in lp)  # noqa: E731
                ops = [op for _, op, _ in r.instructions()]
                def holds_one_tile(sp):  # QK^T's k-steps (32 e4m3 or 16 bf16 each) and PV's
                    body = ops[sp[0]:sp[1] + 1]
                    return (count(body, "QGMMA") + count(body, "HGMMA") == d // (32 if qk_fp8 else 16) + BLOCK_N // 32
                            and "EXIT" not in body)

                span = max((sp for sp in r.loop_spans() if holds_one_tile(sp)), key=lambda sp: sp[1] - sp[0])
                per_thread = 64 * BLOCK_N // 128
                n, top_ops = per_element(r.path(span), per_thread)
                top = ", ".join(f"{k} {v:.1f}" for k, v in top_ops[:4])
                print(f"| {'fp8' if qk_fp8 else 'bf16'} | {p_mode} | {causal} | {d} | {overlap} | {regs[0]} / {regs[2]} "
                      f"| {r.stack} | {r.count('QGMMA')} | {r.count('HGMMA')} | {r.count('MUFU.EX2')} | {r.sass.count(chr(10))} "
                      f"| {(span[1] - span[0] + 1) / per_thread:.1f} | {n:.1f} | {top} |")


if __name__ == "__main__":
    main()
