"""Compile the Blackwell kernels for sm_100a (or sm_120a) without a GPU and read their
machine code: registers and spills from ptxas-blackwell, shared and tensor memory from
the compiler's metadata, the tensor-core instruction kinds from the PTX, and instruction
counts from the SASS. Used by `fp4attn compile-report` and by the CPU tests that hold the
kernels to their design (block-scaled FP4 MMAs, no spills, tensor memory within 512
columns)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4attn.kernels.blackwell.forward_triton import attn_fwd_sm100_kernel

ARCHS = {"sm_100a": 100, "sm_103a": 103, "sm_120a": 120}
# the bundled cuobjdump (CUDA 12.8's) disassembles these; sm_103a cubins it refuses
SASS_ARCHS = ("sm_100a", "sm_120a")
_BIN = Path(triton.__file__).parent / "backends/nvidia/bin"

_POINTERS = ("Q", "QSC", "K", "KSC", "QS", "KS", "V", "VSC", "VS", "O", "LSE", "P_DBG", "KB")
_STRIDES = tuple(f"stride_{t}{d}" for t in ("q", "qs", "k", "ks", "v", "vs", "o", "p")
                 for d in ("b", "h", "m" if t in ("q", "qs", "o", "p") else "n" if t in ("k", "ks") else "d"))
_LENGTHS = ("Sq", "Sk")


def forward_signature(qk_fp4: bool, pv_fp4: bool, bf16: bool = False) -> dict[str, str]:
    """Argument types of `attn_fwd_sm100_kernel` as the launcher passes them."""
    wide = "*bf16" if bf16 else "*fp8e4nv"
    types = {"Q": "*u8" if qk_fp4 else wide, "K": "*u8" if qk_fp4 else wide,
             "QSC": "*fp8e4nv", "KSC": "*fp8e4nv", "V": "*u8" if pv_fp4 else wide, "VSC": "*u8",
             "O": "*bf16"}
    sig = {n: types.get(n, "*fp32") for n in _POINTERS}
    sig.update({n: "i32" for n in _STRIDES})
    sig.update({n: "i32" for n in ("H", "GROUP", "Sq", "Sk", "causal_offset")})
    sig["qk_scale"] = "fp32"
    return sig


def _divisibility(sig: dict, aligned: list[str]) -> dict:
    """Compile attributes specializing the arguments `aligned` as multiples of 16, as
    the JIT does for 16-byte aligned tensors and lengths that are multiples of 16."""
    names = list(sig)
    return {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}


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
    aligned = [n for n in sig if n in _POINTERS or n.startswith("stride") or n in _LENGTHS]
    src = ASTSource(attn_fwd_sm100_kernel, sig, constexprs=consts, attrs=_divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(ptx: str, arch: str = "sm_100a") -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas-blackwell -v`."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        proc = subprocess.run([str(_BIN / "ptxas-blackwell"), "-v", "--gpu-name", arch, str(path), "-o",
                               str(Path(d) / "k.cubin")], capture_output=True, text=True, check=True)
    text = proc.stdout + proc.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return regs, int(spill.group(1)), int(spill.group(2))


def sass_of(cubin: bytes) -> str:
    """The SASS of a cubin, by the bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(_BIN / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def mma_kinds(ptx: str) -> list[str]:
    """The distinct tensor-core instructions of a PTX text, without their operands,
    e.g. `tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X`."""
    return sorted(set(re.findall(r"\b(tcgen05\.mma[.\w:]*|wgmma\.mma_async[.\w:]*|mma\.sync[.\w:]*)", ptx)))


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;\n]*);")


@dataclass(frozen=True)
class PartitionLoop:
    """The tile loop of one partition of a warp-specialized build: its role ("mma": the
    MMA issue and the loads left beside it; "load": K and V by TMA; "softmax": P
    building; "correction": O rescaled in tensor memory), its opcodes in order, the warps
    running it and their register limit."""

    role: str
    opcodes: list[str]
    warps: int
    registers: int | None
    tail: list[str] | None = None  # the Gluon softmax's loop over the masked tiles (tail, diagonal)


@dataclass(frozen=True)
class BlackwellReport:
    """What a compiled Blackwell kernel uses, and the instructions of its machine code."""

    registers: int
    spill_bytes: int
    shared_bytes: int
    tmem_columns: int
    mma_kinds: list[str]
    ptx: str = field(repr=False)
    sass: str = field(repr=False)
    ttgir: str = field(default="", repr=False)
    num_warps: int = 8
    gluon: bool = False  # the Gluon pipelined forward (`gluon_partition_loops`)

    @property
    def pipelined(self) -> bool:
        """Whether the build is warp-specialized (partitions that run at once)."""
        return "ttg.warp_specialize" in self.ttgir

    def instructions(self) -> list[tuple[int, str, str]]:
        """(address, opcode with modifiers, operands) of every SASS instruction."""
        return [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(self.sass)]

    def partitions(self) -> list[tuple[int, str]]:
        """(warps, IR body) of each worker partition of a warp-specialized build, in the
        IR's order."""
        pieces = re.split(r"^\s*partition\d+\(", self.ttgir, flags=re.M)[1:]
        return [(int(re.search(r"num_warps\((\d+)\)", body).group(1)), body) for body in pieces]

    @staticmethod
    def _inner_loops(ins) -> list[tuple[int, int]]:
        """(first, last) instruction indices of the innermost tile loops, in program order:
        backward branches before the kernel's last EXIT (after it ptxas puts the retry
        stubs of mbarrier waits, which branch back into the loops), spanning 20
        instructions or more (the waits' own spin loops are shorter) and holding no
        setmaxnreg (the partitions' dispatch)."""
        at = {a: i for i, (a, _, _) in enumerate(ins)}
        exits = [i for i, (_, op, _) in enumerate(ins) if op == "EXIT"]
        spans = []
        for i, (a, op, operands) in enumerate(ins[:exits[-1] if exits else 0]):
            m = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
            if m is None or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
                continue
            j = at[int(m.group(1), 16)]
            if i - j + 1 >= 20 and not any(o.startswith("USETMAXREG") for _, o, _ in ins[j:i + 1]):
                spans.append((j, i))
        return sorted((j, i) for j, i in spans
                      if not any(j <= j2 and i2 <= i and (j2, i2) != (j, i) for j2, i2 in spans))

    def partition_loops(self) -> dict[str, PartitionLoop]:
        """The tile loop of each partition of a pipelined build, by role: "mma" (the
        loop issuing tcgen05 MMAs, with the loads Triton leaves beside them: cp.async and
        the scale tiles' copies into tensor memory), "load" (where K and V come by TMA:
        the loop issuing UTMALDG and no MMA), "softmax" (the largest of the rest) and
        "correction" (the other). A loop is a backward branch before the kernel's last
        EXIT (after it ptxas puts the retry stubs of mbarrier waits, which branch back
        into the loops), holding no setmaxnreg (the partitions' dispatch) and 20
        instructions or more (the waits' own spin loops are shorter); of those, the
        innermost. Its register limit is that of the setmaxnreg before it; its warps come
        from the IR: the partition holding the MMA (`tc_gen5_mma`), the one holding the
        TMA copies and no MMA, the largest remaining worker partition for the
        correction, the launch's warps for the default (softmax) partition."""
        ins = self.instructions()
        inner = self._inner_loops(ins)
        loops = []
        for j, i in inner:
            alloc = [int(m.group(1), 16) for _, o, rest in ins[:j] if o.startswith("USETMAXREG.TRY_ALLOC")
                     for m in [re.search(r"0x([0-9a-f]+)", rest)] if m]
            loops.append(([o for _, o, _ in ins[j:i + 1]], alloc[-1] if alloc else None))
        mma = [lp for lp in loops if any(o.startswith("UTC") and "MMA" in o for o in lp[0])]
        tma = [lp for lp in loops if lp not in mma and any(o.startswith("UTMALDG") for o in lp[0])]
        rest = sorted((lp for lp in loops if lp not in mma and lp not in tma), key=lambda lp: -len(lp[0]))
        if len(mma) != 1 or len(tma) > 1 or len(rest) != 2:
            raise ValueError(f"expected one MMA loop, at most one TMA load loop and two others in a pipelined "
                             f"build, found {len(mma)}, {len(tma)} and {len(rest)}")
        parts = self.partitions()
        tma_ir = "async_tma_copy_global_to_local"
        mma_w = [w for w, body in parts if "tc_gen5_mma" in body]
        tma_w = [w for w, body in parts if "tc_gen5_mma" not in body and tma_ir in body]
        other_w = [w for w, body in parts if "tc_gen5_mma" not in body and (not tma or tma_ir not in body)]
        warps = {"mma": mma_w[0], "softmax": self.num_warps, "correction": max(other_w)}
        roles = [("mma", mma[0]), ("softmax", rest[0]), ("correction", rest[1])]
        if tma:
            warps["load"] = tma_w[0]
            roles.append(("load", tma[0]))
        return {role: PartitionLoop(role, lp[0], warps[role], lp[1]) for role, lp in roles}

    def gluon_partition_loops(self) -> dict[str, PartitionLoop]:
        """The tile loops of the Gluon pipelined forward (`forward_gluon`), by role, each
        run once per key tile for the CTA's two query tiles: "softmax0" and "softmax1"
        (each query tile's softmax warpgroup: its first loop, the full key tiles without
        a mask; the second, the tail tile, is not counted), "correction" (the scale tiles
        into tensor memory and O's rescale), "mma" (the tcgen05 issue) and "load" (TMA).
        Loops as in `partition_loops` (innermost backward branches of 20 instructions or
        more before the last EXIT, with no setmaxnreg); the softmax loops are those with
        MUFU (alpha's ex2), in pairs per partition in program order (the unmasked loop
        first), the correction the other loop with tensor-memory loads and stores.
        Warps from the IR: the launch's for the default partition (softmax0), the worker
        partitions in `gl.warp_specialize`'s order (softmax1, correction, MMA, load)."""
        ins = self.instructions()
        inner = self._inner_loops(ins)

        def ops(span):
            return [o for _, o, _ in ins[span[0]:span[1] + 1]]

        def regs(span):
            r = [int(m.group(1), 16) for _, o, rest in ins[:span[0]] if o.startswith("USETMAXREG")
                 for m in [re.search(r"0x([0-9a-f]+)", rest)] if m]
            return r[-1] if r else None

        mma = [sp for sp in inner if any(o.startswith("UTC") and "MMA" in o for o in ops(sp))]
        load = [sp for sp in inner if sp not in mma and any(o.startswith("UTMALDG") for o in ops(sp))]
        soft = [sp for sp in inner if sp not in mma and any(o.startswith("MUFU") for o in ops(sp))]
        corr = [sp for sp in inner if sp not in mma + load + soft
                and any(o.startswith("LDTM") for o in ops(sp)) and any(o.startswith("STTM") for o in ops(sp))]
        if len(mma) != 1 or len(load) != 1 or len(soft) != 4 or len(corr) != 1:
            raise ValueError(f"expected one MMA loop, one TMA load loop, four softmax loops and one correction "
                             f"loop in the Gluon build, found {len(mma)}, {len(load)}, {len(soft)} and {len(corr)}")
        parts = self.partitions()
        if [w for w, _ in parts] != [4, 4, 1, 1]:
            raise ValueError(f"Gluon build: worker partitions of {[w for w, _ in parts]} warps, expected [4, 4, 1, 1]")
        # the default partition's code follows the workers' in the SASS: its pair is the last
        full = [soft[2], soft[0]]
        for sp, tail in ((soft[0], soft[1]), (soft[2], soft[3])):
            if len(ops(sp)) > len(ops(tail)):
                raise ValueError("Gluon build: a softmax partition's first loop is longer than its tail loop")
        tails = {"softmax0": soft[3], "softmax1": soft[1]}
        roles = [("softmax0", full[0], self.num_warps), ("softmax1", full[1], parts[0][0]),
                 ("correction", corr[0], parts[1][0]), ("mma", mma[0], parts[2][0]), ("load", load[0], parts[3][0])]
        return {role: PartitionLoop(role, ops(sp), w, regs(sp), ops(tails[role]) if role in tails else None)
                for role, sp, w in roles}

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.sass))

    @functools.cached_property
    def opcodes(self) -> list[str]:
        """Every SASS instruction's opcode with modifiers, in order."""
        return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;\n]*;", self.sass)

    def loops(self) -> list[list[str]]:
        """The opcodes of each loop (a backward branch and what it jumps over)."""
        ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;\n]*);", self.sass)
        at = {int(a, 16): i for i, (a, _, _) in enumerate(ins)}
        spans = []
        for i, (a, op, operands) in enumerate(ins):
            m = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
            if m and int(m.group(1), 16) < int(a, 16) and int(m.group(1), 16) in at:
                spans.append((at[int(m.group(1), 16)], i))
        return [[op for _, op, _ in ins[i:j + 1]] for i, j in sorted(spans, key=lambda s: s[1] - s[0])]

    def tile_loop(self) -> list[str]:
        """The unmasked key-tile loop of the serial kernel: the shortest loop holding
        tensor-core instructions (UTCQMMA/UTCHMMA/UTCOMMA, tcgen05; OMMA/QMMA/HMMA,
        mma.sync on sm_120a) and no EXIT (the first of the kernel's two tile loops in
        program order is the unmasked one; both are the same size)."""
        for loop in self.loops():
            if any("MMA" in op for op in loop) and "EXIT" not in loop:
                return loop
        raise ValueError("no loop with tensor-core instructions in the SASS")


def inspect(kernel, arch: str = "sm_100a", gluon: bool = False) -> BlackwellReport:
    """Registers, spills, shared and tensor memory, MMA kinds and SASS (empty where the
    bundled cuobjdump cannot read the target) of a compiled kernel; gluon: the Gluon
    pipelined forward (`compile_forward_gluon`)."""
    regs, spill_st, spill_ld = ptxas_report(kernel.asm["ptx"], arch)
    md = kernel.metadata
    sass = sass_of(kernel.asm["cubin"]) if arch in SASS_ARCHS else ""
    ttgir = kernel.asm.get("ttgir", "")
    warps = re.search(r'"ttg.num-warps" = (\d+)', ttgir)  # the launch's (metadata counts the partitions' too)
    return BlackwellReport(regs, spill_st + spill_ld, int(md.shared), int(getattr(md, "tmem_size", 0) or 0),
                           mma_kinds(kernel.asm["ptx"]), kernel.asm["ptx"], sass, ttgir,
                           int(warps.group(1)) if warps else int(md.num_warps), gluon)


# ---------------------------------------------------------------------------- training backward
_BWD_FP8 = ("DO_T", "DO_C", "V_T", "Q_C", "K_C")
_BWD_BF16 = ("DK", "DV", "DQ")  # bf16 gradients out
_BWD_INTS = ("H", "GROUP", "Sq", "Sk", "causal_offset")


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
        elif n in _BWD_INTS:
            sig[n] = "i32"
        elif n in ("qk_scale", "sm_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = qk.get(n) or ("*fp8e4nv" if n in _BWD_FP8 else "*bf16" if n in _BWD_BF16 else "*fp32")
    aligned = [n for n, t in sig.items() if t.startswith("*") or n in _LENGTHS]
    consts = {k: v for k, v in consts.items() if k in sig}
    src = ASTSource(fn, sig, constexprs=consts, attrs=_divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                          options=dict(num_warps=warps, num_stages=stages))


# ------------------------------------------------------------------ Gluon pipelined forward
def _gluon_desc_sig(dtype, block: list[int]) -> str:
    """The signature type of a Gluon TMA descriptor argument with the default NVMMA
    shared layout of its tile (as a launcher building `TensorDescriptor`s would)."""
    from triton.experimental.gluon import language as gl

    name = {gl.uint8: "u8", gl.bfloat16: "bf16", gl.float8e4nv: "fp8e4nv"}[dtype]
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, dtype)!r}>"


def compile_forward_gluon(p_kind: int, head_dim: int = 128, causal: bool = False, arch: str = "sm_100a"):
    """The compiled Gluon pipelined forward (`forward_gluon.attn_fwd_sm100_gluon_kernel`)
    for `arch` (sm_100a, or sm_103a), one P builder (`forward_gluon.P_AFFINE_MXFP4`, `P_EXP2_FP8`, `P_BF16`),
    causal or not, pointers and lengths specialized as multiples of 16 (as the JIT does
    at the bench shapes)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fp4attn.kernels.blackwell import forward_gluon as fg

    bm, bn, d = fg.BLOCK_M.value, fg.BLOCK_N.value, head_dim
    p_kind = getattr(p_kind, "value", p_kind)
    if p_kind == fg.P_BF16.value:
        q, k, v = (_gluon_desc_sig(gl.bfloat16, [bm, d]), _gluon_desc_sig(gl.bfloat16, [bn, d]),
                   _gluon_desc_sig(gl.bfloat16, [d, bn]))
    else:
        q, k = _gluon_desc_sig(gl.uint8, [bm, d // 2]), _gluon_desc_sig(gl.uint8, [bn, d // 2])
        v = _gluon_desc_sig(gl.uint8, [d, bn // 2]) if p_kind == fg.P_AFFINE_MXFP4.value else \
            _gluon_desc_sig(gl.float8e4nv, [d, bn])
    sig = {"q_desc": q, "k_desc": k, "v_desc": v, "QSC": "*fp8e4nv", "KSC": "*fp8e4nv", "QS": "*fp32", "KS": "*fp32",
           "VSC": "*u8", "VS": "*fp32", "O": "*bf16", "LSE": "*fp32", "H": "i32", "GROUP": "i32", "Sq": "i32",
           "Sk": "i32", "causal_offset": "i32", "qk_scale": "fp32"}
    consts = dict(HEAD_DIM=head_dim, P_KIND=p_kind, CAUSAL=causal)
    aligned = [n for n, t in sig.items() if t.startswith("*") or n in _LENGTHS]
    src = GluonASTSource(fg.attn_fwd_sm100_gluon_kernel, {**sig, **{c: "constexpr" for c in consts}},
                         constexprs=consts, attrs=_divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32), options=dict(num_warps=fg.NUM_WARPS))
