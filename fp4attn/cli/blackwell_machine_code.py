"""Compile the routed Blackwell kernels for sm_100a, sm_103a or sm_120a without a GPU and
read what their machine code uses: registers and spills from ptxas-blackwell, shared and
tensor memory from the compiler's metadata, the tensor-core instruction kinds from the
PTX, and whether the build is warp-specialized. `fp4attn compile-report` reports it for
every routed build, and the CPU tests hold the kernels to their design with it
(block-scaled FP4 MMAs, no spills, tensor memory within 512 columns). Reading the SASS
instruction by instruction, and the cost model that does, are development code
(`dev/machine_code_sm100.py`, `dev/cost_model_sm100.py`)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4attn.kernels.blackwell.forward_triton import attn_fwd_sm100_kernel
from fp4attn.kernels.kernel_args import BACKWARD_CALL, CALL, aligned_call, call_signature

ARCHS = {"sm_100a": 100, "sm_103a": 103, "sm_120a": 120}
# Triton's bundled CUDA tools (ptxas-blackwell, cuobjdump)
TOOLS = Path(triton.__file__).parent / "backends/nvidia/bin"

_POINTERS = ("Q", "QSC", "K", "KSC", "QS", "KS", "V", "VSC", "VS", "O", "LSE", "P_DBG", "KB")
# the forward's stride tuples, (batch, head, row) of each tensor
_STRIDES = ("q_strides", "q_sc_strides", "k_strides", "k_sc_strides", "v_strides", "v_sc_strides",
            "o_strides", "p_strides")
LENGTHS = ("Sq", "Sk")


def forward_signature(qk_fp4: bool, pv_fp4: bool, bf16: bool = False) -> dict[str, str | tuple[str, ...]]:
    """Argument types of `attn_fwd_sm100_kernel` as the launcher passes them."""
    wide = "*bf16" if bf16 else "*fp8e4nv"
    types = {"Q": "*u8" if qk_fp4 else wide, "K": "*u8" if qk_fp4 else wide,
             "QSC": "*fp8e4nv", "KSC": "*fp8e4nv", "V": "*u8" if pv_fp4 else wide, "VSC": "*u8",
             "O": "*bf16"}
    sig: dict[str, str | tuple[str, ...]] = {n: types.get(n, "*fp32") for n in _POINTERS}
    sig.update({n: ("i32",) * 3 for n in _STRIDES})
    sig["call"] = call_signature()
    return sig


def divisibility(sig: dict, aligned: list) -> dict:
    """Compile attributes specializing the arguments `aligned` as multiples of 16, as
    the JIT does for 16-byte aligned tensors and lengths that are multiples of 16. An
    entry of `aligned` is a name (of a tuple argument: each of its elements) or (name,
    i), element i of a tuple argument."""
    names = list(sig)
    paths: list[tuple[int, ...]] = []
    for n in aligned:
        if isinstance(n, tuple):
            paths.append((names.index(n[0]), n[1]))
        elif isinstance(sig[n], tuple):
            paths += [(names.index(n), i) for i in range(len(sig[n]))]
        else:
            paths.append((names.index(n),))
    return {path: [["tt.divisibility", 16]] for path in paths}


def compile_forward(qk_fp4: bool, pv_fp4: bool, causal: bool, head_dim: int, *, arch: str = "sm_100a",
                    block_m: int = 128, block_n: int = 128, num_warps: int = 8, num_stages: int = 2,
                    key_bias: bool = False, hw_cvt: bool = True, pipelined: bool = False, p_affine: bool = False,
                    bf16: bool = False):
    """The compiled Blackwell forward for one recipe family and launch shape; pointers,
    strides and lengths specialized as multiples of 16, as the JIT builds it at the
    bench shapes. bf16: Q, K, V and P in bf16 (qk_fp4 and pv_fp4 False)."""
    if bf16 and (qk_fp4 or pv_fp4):
        raise ValueError("compile_forward: bf16=True is the all-bf16 build (qk_fp4 and pv_fp4 False)")
    sig = forward_signature(qk_fp4, pv_fp4, bf16)
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, QK_FP4=qk_fp4, PV_FP4=pv_fp4,
                  CAUSAL=causal, HW_CVT=hw_cvt, KEY_BIAS=key_bias, WRITE_P=False, PIPELINED=pipelined,
                  P_AFFINE=p_affine, BF16=bf16)
    sig = {**sig, **{c: "constexpr" for c in consts}}
    aligned = [*_POINTERS, *_STRIDES, *aligned_call(CALL, LENGTHS)]
    src = ASTSource(attn_fwd_sm100_kernel, sig, constexprs=consts, attrs=divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(ptx: str, arch: str = "sm_100a") -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas-blackwell -v`."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        proc = subprocess.run([str(TOOLS / "ptxas-blackwell"), "-v", "--gpu-name", arch, str(path), "-o",
                               str(Path(d) / "k.cubin")], capture_output=True, text=True, check=True)
    text = proc.stdout + proc.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return regs, int(spill.group(1)), int(spill.group(2))


def mma_kinds(ptx: str) -> list[str]:
    """The distinct tensor-core instructions of a PTX text, without their operands,
    e.g. `tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X`."""
    return sorted(set(re.findall(r"\b(tcgen05\.mma[.\w:]*|wgmma\.mma_async[.\w:]*|mma\.sync[.\w:]*)", ptx)))


@dataclass(frozen=True)
class BlackwellReport:
    """What a compiled Blackwell kernel uses, with its PTX and Triton GPU IR."""

    registers: int
    spill_bytes: int
    shared_bytes: int
    tmem_columns: int
    mma_kinds: list[str]
    ptx: str = field(repr=False)
    ttgir: str = field(default="", repr=False)

    @property
    def pipelined(self) -> bool:
        """Whether the build is warp-specialized (partitions that run at once)."""
        return "ttg.warp_specialize" in self.ttgir


def inspect(kernel, arch: str = "sm_100a") -> BlackwellReport:
    """Registers, spills, shared and tensor memory and MMA kinds of a compiled kernel."""
    regs, spill_st, spill_ld = ptxas_report(kernel.asm["ptx"], arch)
    md = kernel.metadata
    return BlackwellReport(regs, spill_st + spill_ld, int(md.shared), int(getattr(md, "tmem_size", 0) or 0),
                           mma_kinds(kernel.asm["ptx"]), kernel.asm["ptx"], kernel.asm.get("ttgir", ""))


# ---------------------------------------------------------------------------- training backward
_BWD_FP8 = ("DO_T", "DO_C", "V_T", "Q_C", "K_C")
_BWD_BF16 = ("DK", "DV", "DQ")  # bf16 gradients out


def compile_backward(part: str, causal: bool, head_dim: int, *, p_mode: int = 0, arch: str = "sm_100a",
                     qk_fp4: bool | None = None, launch=None):
    """The training backward's Triton kernel `part` ("dkdv" or "dq", from
    `kernels.backward_triton`) compiled for `arch` at the Blackwell launch
    (`routing.BLACKWELL_BACKWARD_LAUNCH`, or `launch`), pointers and lengths
    specialized as multiples of 16. qk_fp4 (None: the launch's `qk_fp4_dq` or
    `qk_fp4_dkdv`): the scores by the block-scaled FP4 product of the NVFP4 payloads
    (QK_FP4); False: by the bf16 product of their grid values. The signature follows the
    kernel's own parameters, so it tracks their changes."""
    from fp4attn.kernels.backward_triton import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
    from fp4attn.reference.backward import DS_BLOCK
    from fp4attn.routing import BLACKWELL_BACKWARD_LAUNCH

    cfg = launch or BLACKWELL_BACKWARD_LAUNCH[head_dim]
    fn = attn_bwd_dkdv_kernel if part == "dkdv" else attn_bwd_dq_kernel
    if part == "dkdv":
        qk_fp4 = cfg.qk_fp4_dkdv if qk_fp4 is None else qk_fp4
        consts = dict(HEAD_DIM=head_dim, BLOCK_M=DS_BLOCK, BLOCK_N=cfg.block_n_dkdv, P_MODE=p_mode, CAUSAL=causal,
                      HW_CVT=cfg.hw_cvt, TMA=False, QK_FP4=qk_fp4)
        warps, stages = cfg.warps_dkdv, cfg.stages_dkdv
    else:
        qk_fp4 = cfg.qk_fp4_dq if qk_fp4 is None else qk_fp4
        consts = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m_dq, BLOCK_N=DS_BLOCK, CAUSAL=causal,
                      HW_CVT=cfg.hw_cvt, TMA=False, QK_FP4=qk_fp4)
        warps, stages = cfg.warps_dq, cfg.stages_dq
    # Q and K: the NVFP4 codes with their e4m3 block scales, or the bf16 grid values
    # (the block-scale pointers then None, as the launcher leaves them)
    qk = {"Q": "*u8", "K": "*u8", "QSC": "*fp8e4nv", "KSC": "*fp8e4nv"} if qk_fp4 else {"Q": "*bf16", "K": "*bf16"}
    sig = {}
    for param in fn.params:
        n = param.name
        if param.is_constexpr:
            sig[n] = "constexpr"
            consts.setdefault(n, param.default)
        elif n in ("QSC", "KSC") and not qk_fp4:
            sig[n] = "constexpr"
            consts[n] = None
        elif n == "call":
            sig[n] = call_signature(BACKWARD_CALL)
        else:
            sig[n] = qk.get(n) or ("*fp8e4nv" if n in _BWD_FP8 else "*bf16" if n in _BWD_BF16 else "*fp32")
    aligned = [*(n for n, t in sig.items() if isinstance(t, str) and t.startswith("*")),
               *aligned_call(BACKWARD_CALL, LENGTHS)]
    consts = {k: v for k, v in consts.items() if k in sig}
    src = ASTSource(fn, sig, constexprs=consts, attrs=divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                          options=dict(num_warps=warps, num_stages=stages))
