"""Compile the Hopper forward kernel's variants for sm_90 without a GPU and report
registers, spills and the key SASS instructions (QGMMA/HGMMA, MUFU.EX2).

    python scripts/compile_check.py [--sass-dir DIR]
"""

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4attn.kernels.hopper.forward import attn_fwd_kernel


def compile_variant(qk_fp8: bool, p_mode: int, causal: bool, head_dim: int, write_p=False, warps=8, stages=3, bm=128, bn=128):
    ptr_q = "*fp8e4nv" if qk_fp8 else "*bf16"
    sig = {
        "Q": ptr_q, "K": ptr_q, "QS": "*fp32", "KS": "*fp32", "VT": "*fp8e4nv", "VS": "*fp32",
        "O": "*bf16", "LSE": "*fp32", "P_DBG": "*u8",
    }
    for n in ["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb",
              "stride_vh", "stride_vd", "stride_ob", "stride_oh", "stride_om", "stride_pb", "stride_ph",
              "stride_pm", "H", "GROUP", "Sq", "Sk", "causal_offset"]:
        sig[n] = "i32"
    sig["qk_scale"] = "fp32"
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, QK_FP8=qk_fp8, P_MODE=p_mode, CAUSAL=causal,
                  WRITE_P=write_p)
    for c in consts:
        sig[c] = "constexpr"
    # what the JIT specializes at run time: pointers and strides are multiples of 16
    names = list(sig)
    aligned = [n for n in names if n.isupper() and sig[n].startswith("*") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(attn_fwd_kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=stages))


def cuobjdump(kernel, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass-dir", type=Path)
    args = ap.parse_args()
    print("| qk | P mode | causal | D | regs | stack | QGMMA | HGMMA | MUFU.EX2 | SASS lines |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qk_fp8 in (True, False):
        for p_mode in (0, 1, 2):
            for causal in (False, True):
                for d in (64, 128):
                    k = compile_variant(qk_fp8, p_mode, causal, d)
                    s = cuobjdump(k, "--dump-sass")
                    res = cuobjdump(k, "--dump-resource-usage")
                    regs = re.search(r"REG:(\d+)", res).group(1)
                    stack = re.search(r"STACK:(\d+)", res).group(1)
                    count = lambda pat: len(re.findall(pat, s))
                    print(f"| {'fp8' if qk_fp8 else 'bf16'} | {p_mode} | {causal} | {d} | {regs} | {stack} "
                          f"| {count(r'QGMMA')} | {count(r'HGMMA')} | {count(r'MUFU.EX2')} | {s.count(chr(10))} |")
                    if args.sass_dir:
                        args.sass_dir.mkdir(parents=True, exist_ok=True)
                        (args.sass_dir / f"fwd_qk{int(qk_fp8)}_p{p_mode}_c{int(causal)}_d{d}.sass").write_text(s)


if __name__ == "__main__":
    main()
