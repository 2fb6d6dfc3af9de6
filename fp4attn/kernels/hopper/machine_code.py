"""Compile the Hopper forward for sm_90 without a GPU and read its machine code:
registers, stack (spills) and instruction counts. Used by `scripts/compile_check.py`
and by the CPU tests that guard the kernel's structure (wgmma present, exp off MUFU
for Direct-P)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4attn.kernels.hopper.forward import attn_fwd_kernel

_POINTERS = ("Q", "K", "QS", "KS", "VT", "VS", "O", "LSE", "P_DBG")
_INTS = ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
         "stride_vd", "stride_ob", "stride_oh", "stride_om", "stride_pb", "stride_ph", "stride_pm",
         "H", "GROUP", "Sq", "Sk", "causal_offset")


@dataclass(frozen=True)
class KernelReport:
    registers: int
    stack: int
    sass: str

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.sass))


def compile_forward(qk_fp8: bool, p_mode: int, causal: bool, head_dim: int, *, num_warps=8, num_stages=3,
                    block_m=128, block_n=128):
    """The compiled kernel for one flag combination, as the JIT would build it (pointers
    and strides specialized as multiples of 16)."""
    elem = "*fp8e4nv" if qk_fp8 else "*bf16"
    types = {"Q": elem, "K": elem, "VT": "*fp8e4nv", "O": "*bf16", "P_DBG": "*fp32"}
    sig = {n: types.get(n, "*fp32") for n in _POINTERS}
    sig.update({n: "i32" for n in _INTS})
    sig["qk_scale"] = "fp32"
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, QK_FP8=qk_fp8, P_MODE=p_mode,
                  CAUSAL=causal, WRITE_P=0, QK_PROMOTE=True)
    sig.update({c: "constexpr" for c in consts})
    names = list(sig)
    aligned = [n for n in names if n in _POINTERS or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(attn_fwd_kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _cuobjdump(kernel, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def inspect_forward(*args, **kwargs) -> KernelReport:
    kernel = compile_forward(*args, **kwargs)
    usage = _cuobjdump(kernel, "--dump-resource-usage")
    return KernelReport(int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)),
                        _cuobjdump(kernel, "--dump-sass"))
