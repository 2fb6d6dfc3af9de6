"""Compile the decode split kernel for sm_90 (no GPU needed) at its routed launch and
print, per cache format: registers, stack (spills), shared memory, the instructions of
the unmasked tile loop per thread and per key and KV head (warp instructions), the
largest opcodes, and what those predict against the memory: at the copy rate measured
on the H200 (4.27 TB/s, docs/notes/decode.md) a key and KV head's bytes take
bytes / (4.27e12 / 132 SMs / 1.98 GHz) cycles of one SM, and its instructions
(warp instructions) / 4 cycles at the SM's peak issue rate (four schedulers). The loop
is the static one: the rescale a tile skips when no row's maximum grew is counted.

    python tools/compile_check_decode.py [--rows 4] [--formats nvfp4,mxfp4,fp8,bf16] [--launch 128,4,2]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from fp4attn.kernels.hopper.decode_op import FORMAT_CODES
from fp4attn.kernels.hopper.decode_triton import decode_split_kernel
from fp4attn.reference.kvcache import format_layout
from fp4attn.routing.decode import DEFAULT_LAUNCH

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/
from dev.machine_code import _compile_sm90, inspect  # noqa: E402

COPY_BPS, SMS, CLOCK = 4.27e12, 132, 1.98e9


def build(fmt: str, rows: int, block_n: int, warps: int, stages: int, d: int = 128, group: int = 4):
    elem = "*bf16" if fmt == "bf16" else "*u8"
    sig = dict(Q="*bf16", KA=elem, KS="*u8", KT="*fp32", VA=elem, VS="*u8", VT="*fp32", TABLE="*i32", LENS="*i32",
               START="*i32", O_ACC="*fp32", O_ML="*fp32", stride_qb="i32", stride_qh="i32", stride_qs="i32",
               HKV="i32", PS="i32", TABLE_STRIDE="i32", SQ="i32", ROWS="i32", SPLIT_TOKENS="i32", qk_scale="fp32")
    consts = dict(GROUP=group, D=d, K_FMT=FORMAT_CODES[fmt], V_FMT=FORMAT_CODES[fmt], BLOCK_M=rows,
                  BLOCK_N=block_n, CAUSAL=True, HAS_START=False, ASM=True, HW=True, ALIGNED=True)
    # the pointers, strides, page size and split length are multiples of 16 at any real shape
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["stride_qb", "stride_qh", "stride_qs", "PS",
                                                                  "SPLIT_TOKENS"]
    return _compile_sm90(decode_split_kernel, sig, consts, aligned, warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4, help="BLOCK_M: query rows a program (GQA group x new tokens)")
    ap.add_argument("--formats", default="nvfp4,mxfp4,fp8,bf16")
    ap.add_argument("--launch", help="block_n,warps,stages (default: the routing table's)")
    args = ap.parse_args()
    bn, w, st = (map(int, args.launch.split(",")) if args.launch else
                 (DEFAULT_LAUNCH.block_n, DEFAULT_LAUNCH.warps, DEFAULT_LAUNCH.stages))
    bytes_per_cycle = COPY_BPS / SMS / CLOCK
    print("| format | rows | launch | regs | stack | smem KB | loop instr/thread | warp instr / key-head "
          "| issue cycles | memory cycles | largest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        kernel = build(fmt, args.rows, bn, w, st)
        r = inspect(kernel)
        loop = r.loops()[0]
        per_key = len(loop) * w / bn
        mem = 2 * format_layout(fmt, 128).bytes_per_token() / bytes_per_cycle
        top = ", ".join(f"{k} {v}" for k, v in collections.Counter(op.split(".")[0] for op in loop).most_common(5))
        print(f"| {fmt} | {args.rows} | {bn},{w},{st} | {r.registers} | {r.stack} | {kernel.metadata.shared / 1024:.1f} "
              f"| {len(loop)} | {per_key:.1f} | {per_key / 4:.1f} | {mem:.1f} | {top} |")


if __name__ == "__main__":
    main()
