"""Compile the Hopper kernels for sm_90 without a GPU and read their machine code:
registers, stack (spills) and instruction counts. Used by `tools/compile_check.py`
and by the CPU tests that guard the kernel's structure (wgmma present, exp off MUFU
for Direct-P)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4attn.cli.blackwell_machine_code import divisibility
from fp4attn.kernels.backward_triton import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from fp4attn.kernels.hopper.forward_triton import attn_fwd_kernel
from fp4attn.kernels.kernel_args import BACKWARD_CALL, CALL, aligned_call, call_signature

_POINTERS = ("Q", "K", "QS", "KS", "VT", "VS", "O", "LSE", "P_DBG", "KB")
# the forward's stride tuples, (batch, head, row) of each tensor
_STRIDES = ("q_strides", "k_strides", "vt_strides", "o_strides", "p_strides")
# the JIT specializes an integer argument that is a multiple of 16 as such, which lets
# the compiler vectorize loads along it; the bench shapes (S = 2048 ... 32768, H = 12 ...
# 32) give the lengths that property, so the builds here assume it (`lengths_div16`)
_LENGTHS = ("Sq", "Sk")


@dataclass(frozen=True)
class KernelReport:
    registers: int
    stack: int
    sass: str

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.sass))

    @functools.cached_property
    def _parsed(self) -> tuple[tuple[int, str, str], ...]:
        # parsed once: the loop, tile and path queries each read every instruction
        return tuple((int(m.group(1), 16), m.group(2), m.group(3)) for m in
                     re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;\n]*);", self.sass))

    def instructions(self) -> list[tuple[int, str, str]]:
        """(address, opcode with modifiers, operands) of every SASS instruction."""
        return list(self._parsed)

    @staticmethod
    def _target(op: str, operands: str) -> int | None:
        m = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
        return int(m.group(1), 16) if m else None

    def loop_spans(self) -> list[tuple[int, int]]:
        """(first, last) instruction index of each loop (a backward branch and what it
        jumps over), shortest first."""
        ins = self.instructions()
        at = {a: i for i, (a, _, _) in enumerate(ins)}
        spans = [(at[t], i) for i, (a, op, operands) in enumerate(ins)
                 if (t := self._target(op, operands)) is not None and t < a and t in at]
        return sorted(spans, key=lambda s: s[1] - s[0])

    def loops(self) -> list[list[str]]:
        """The instructions of each loop (a backward branch and what it jumps over),
        shortest first, each an opcode with its modifiers (`FADD`, `LDG.E.U8`, ...)."""
        ops = [op for _, op, _ in self.instructions()]
        return [ops[i:j + 1] for i, j in self.loop_spans()]

    def _tile_span(self) -> tuple[int, int]:
        # the shortest loop holding half the kernel's tensor-core instructions (the
        # masked loop, where there is one, holds the other half); a backward branch
        # into the epilogue (ptxas places some loop bodies after it) spans the EXIT and
        # the stores: not a tile loop
        ops = [op for _, op, _ in self.instructions()]
        half = len(re.findall(r"\b[QH]GMMA\.", self.sass)) // 2
        gmmas = {(i, j): sum("GMMA." in op for op in ops[i:j + 1]) for i, j in self.loop_spans()
                 if "EXIT" not in ops[i:j + 1]}
        found = next(((i, j) for (i, j), n in gmmas.items() if n >= half), None)
        if found is None and gmmas:
            # tiles peeled before the loops (the forward's SINK_TILES) hold tensor-core
            # instructions of their own: the shortest loop holding the most of any loop
            most = max(gmmas.values())
            found = next(((i, j) for (i, j), n in gmmas.items() if n == most and n > 0), None)
        if found is None:
            raise ValueError("no tile loop found in the machine code")
        return found

    def tile_loop(self) -> list[str]:
        """The unmasked tile loop: the shortest loop holding one iteration's tensor-core
        instructions, half the kernel's (the masked loop holds the other half). TMA
        builds also have loops that only wait on an mbarrier, and a pipelined region
        with the PV product alone. Static: it includes code that a tile may branch
        around (`tile_path`)."""
        i, j = self._tile_span()
        return [op for _, op, _ in self.instructions()[i:j + 1]]

    def tile_path(self) -> list[str]:
        """`tile_loop` less the arithmetic that a full tile branches around (`path`)."""
        return self.path(self._tile_span())

    def path(self, span: tuple[int, int]) -> list[str]:
        """The loop `span` (`loop_spans`) less the regions its forward branches skip
        that issue no tensor-core, TMA, mbarrier or barrier instruction: the masks of
        the causal diagonal and of the last key tile, which ptxas leaves branched
        around, not predicated. The instructions a full tile (one off the diagonal,
        before the last) issues, as far as the SASS shows it statically."""
        ins = self.instructions()
        i, j = span
        keep = re.compile(r"GMMA|UTMA|SYNCS|BAR|WARPGROUP")
        skipped: set[int] = set()
        for k in range(i, j + 1):
            a, op, operands = ins[k]
            t = self._target(op, operands)
            if t is not None and a < t <= ins[j][0]:
                region = range(k + 1, next(m for m in range(k + 1, j + 1) if ins[m][0] >= t))
                if not any(keep.search(ins[m][1]) for m in region):
                    skipped.update(region)
        return [ins[k][1] for k in range(i, j + 1) if k not in skipped]


def per_element(loop: list[str], elements_per_thread: int) -> tuple[float, list[tuple[str, float]]]:
    """Instructions per score element of one tile loop, total and by opcode (its first
    word, e.g. FADD), given the elements each thread handles per tile."""
    ops = Counter(op.split(".")[0] for op in loop)
    return len(loop) / elements_per_thread, [(k, v / elements_per_thread) for k, v in ops.most_common()]


def _desc_sig(dtype: torch.dtype, block: list[int]) -> str:
    """The signature type of a Gluon kernel's TMA descriptor argument, as the launcher
    specializes it (`gluon_common.tma_descriptor`'s layout)."""
    from fp4attn.kernels.hopper.gluon_common import shared_layout

    name = "fp8e4nv" if dtype == torch.float8_e4m3fn else "bf16"
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{shared_layout(tuple(block), dtype)!r}>"


def _pointers_and(sig: dict, lengths=()) -> list[str]:
    """The pointer arguments of `sig` and the integers `lengths`: what the JIT
    specializes as multiples of 16 on a launch with torch tensors (16-byte aligned) and
    lengths that are multiples of 16, as at the bench shapes."""
    return [n for n, t in sig.items() if isinstance(t, str) and t.startswith("*") or n in lengths]


def _divisibility(sig: dict, aligned: list) -> dict:
    """The compile attributes that specialize the arguments `aligned` of `sig` as
    multiples of 16, as the JIT does: without them the build is another kernel (the
    backward's CPU build had no spills, the GPU's spilled its prefetched numbers:
    benchmarks/results/log/h200-backward-ncu.txt). An entry of `aligned` is a name (of a
    tuple argument: each of its elements) or (name, i), element i of a tuple argument."""
    return divisibility(sig, aligned)


def _compile_sm90(fn, sig: dict, consts: dict, aligned: list[str], num_warps: int, num_stages: int):
    """`fn` compiled as the JIT would build it for sm_90, the names in `aligned`
    specialized as multiples of 16."""
    sig = {**sig, **{c: "constexpr" for c in consts}}
    src = ASTSource(fn, sig, constexprs=consts, attrs=_divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_forward(qk_fp8: bool, p_mode: int, causal: bool, head_dim: int, *, num_warps=None, num_stages=None,
                    block_m=None, block_n=128, key_bias=False, p_hw_cvt=None, lengths_div16=True, vt_padded=True,
                    tma_kv=None, pv_add=None, sink_tiles=0):
    """The compiled forward for one flag combination; launch shape as `ops` launches it
    at this head dim unless given; sequence lengths specialized as multiples of 16 (as
    the JIT compiles it for such lengths) unless `lengths_div16` is False; V^T with rows
    padded to whole key tiles, as the fused quantizers give it, unless `vt_padded` is
    False (the training forward's). Strides are multiples of 16 either way. sink_tiles:
    P_MODE 3's SINK_TILES (`Recipe.p_sink_keys`), 0 every tile."""
    from fp4attn.routing import forward_launch

    launch = forward_launch(head_dim, qk_fp8, causal)
    num_warps, num_stages = num_warps or launch.warps, num_stages or launch.stages
    block_m = block_m or launch.block_m
    elem = "*fp8e4nv" if qk_fp8 else "*bf16"
    types = {"Q": elem, "K": elem, "VT": "*fp8e4nv", "O": "*bf16", "P_DBG": "*fp32"}
    sig = {n: types.get(n, "*fp32") for n in _POINTERS}
    tma_kv = launch.tma_kv if tma_kv is None else tma_kv
    qk_type = elem[1:]
    descs = dict(K_DESC=f"tensordesc<{qk_type}[{block_n}, {head_dim}]>",
                 VT_DESC=f"tensordesc<fp8e4nv[{head_dim}, {block_n}]>") if tma_kv else {}
    sig.update(descs or dict(K_DESC="constexpr", VT_DESC="constexpr"))
    sig.update({n: ("i32",) * 3 for n in _STRIDES})
    sig["call"] = call_signature()
    consts = dict(K_DESC=None, VT_DESC=None) if not tma_kv else {}
    consts.update(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, QK_FP8=qk_fp8, P_MODE=p_mode,
                  CAUSAL=causal, WRITE_P=0, KEY_BIAS=key_bias,
                  P_HW_CVT=launch.p_hw_cvt if p_hw_cvt is None else p_hw_cvt, VT_PADDED=vt_padded, TMA_KV=tma_kv, PV_ADD=launch.pv_add if pv_add is None else pv_add,
                  SINK_TILES=sink_tiles)
    aligned = [*_POINTERS, *_STRIDES] + (aligned_call(CALL, _LENGTHS) if lengths_div16 else [])
    return _compile_sm90(attn_fwd_kernel, sig, consts, aligned, num_warps, num_stages)


def compile_forward_ws(qk_fp8: bool, p_mode: int, causal: bool, head_dim: int, p_hw_cvt: bool = True,
                       stages: int = 2, overlap: int = 1, lengths=("H", "Sq", "Sk")):
    """The compiled warp-specialized Gluon forward (`forward_gluon_ws.attn_fwd_ws_kernel`)
    for one flag combination, at the launch `launch_forward_ws` gives it, with the
    integer arguments `lengths` specialized as multiples of 16 (as the JIT does when
    they are)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from fp4attn.kernels.hopper import forward_gluon_ws as fp

    BLOCK_M, BLOCK_N = fp.BLOCK_M, fp.BLOCK_N
    qk = torch.float8_e4m3fn if qk_fp8 else torch.bfloat16
    sig = {"q_desc": _desc_sig(qk, [BLOCK_M, head_dim]), "k_desc": _desc_sig(qk, [BLOCK_N, head_dim]),
           "v_desc": _desc_sig(torch.float8_e4m3fn, [head_dim, BLOCK_N]), "QS": "*fp32", "KS": "*fp32", "VS": "*fp32",
           "O": "*bf16", "LSE": "*fp32", "call": call_signature()}
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QK_FP8=qk_fp8, P_MODE=p_mode, CAUSAL=causal,
                  P_HW_CVT=p_hw_cvt, STAGES=stages, OVERLAP=overlap)
    src = GluonASTSource(fp.attn_fwd_ws_kernel, {**sig, **{c: "constexpr" for c in consts}}, constexprs=consts,
                         attrs=_divisibility(sig, [*_pointers_and(sig), *aligned_call(CALL, lengths)]))
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=fp.WS_WARPS, maxnreg=fp.WS_MAXNREG))


def compile_backward(part: str, p_mode: int, causal: bool, head_dim: int, config=None, lengths_div16=True,
                     row_scales=False):
    """The compiled backward kernel `part` ("dkdv" or "dq") with `config` (a
    `routing.BackwardLaunch`; default: the one `routing` gives at this head dim),
    sequence lengths specialized as multiples of 16 unless `lengths_div16` is False;
    `row_scales`: per-token Q/K scales (FP8 Q/K, ROW_SCALES), as `train-fp8` runs it."""
    from fp4attn.reference.backward import DS_BLOCK
    from fp4attn.routing import BACKWARD_LAUNCH

    cfg = config or BACKWARD_LAUNCH[head_dim]

    fp8 = ("DO_T", "DO_C", "V_T", "Q_C", "K_C")
    if part == "dkdv":
        fn, ptrs = attn_bwd_dkdv_kernel, ("Q", "K", "QS", "KS", "LSE", "DELTA", "DO_T", "DO_TS", "DO_C", "DO_CS",
                                          "V_T", "V_TS", "Q_C", "Q_CS", "DK", "DV")
        consts = dict(HEAD_DIM=head_dim, BLOCK_M=DS_BLOCK, BLOCK_N=cfg.block_n_dkdv, P_MODE=p_mode, CAUSAL=causal,
                      HW_CVT=cfg.hw_cvt)
        num_warps, num_stages = cfg.warps_dkdv, cfg.stages_dkdv
    else:
        fn, ptrs = attn_bwd_dq_kernel, ("Q", "K", "QS", "KS", "LSE", "DELTA", "DO_T", "DO_TS", "V_T", "V_TS",
                                        "K_C", "K_CS", "DQ")
        consts = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m_dq, BLOCK_N=DS_BLOCK, CAUSAL=causal, HW_CVT=cfg.hw_cvt)
        num_warps, num_stages = cfg.warps_dq, cfg.stages_dq
    sig = {n: "*fp8e4nv" if n in fp8 else "*bf16" if n in ("Q", "K") else "*fp32" for n in ptrs}
    # bf16 gradients, as a bf16 model's backward writes them
    sig.update({n: "*bf16" for n in ("DK", "DV", "DQ") if n in sig})
    if cfg.tma:  # the loop's tiles by TMA, as `train_op.backward_descriptors` builds them
        tiles = dict(Q=False, DO_T=False, DO_C=True, Q_C=True) if part == "dkdv" else dict(K=False, V_T=False, K_C=True)
        for n, channel_major in tiles.items():
            block = f"{head_dim}, {DS_BLOCK}" if channel_major else f"{DS_BLOCK}, {head_dim}"
            sig[n] = f"tensordesc<{sig[n][1:]}[{block}]>"
        consts["TMA"] = True
    if row_scales:
        consts["ROW_SCALES"] = True
    sig["call"] = call_signature(BACKWARD_CALL)
    aligned = [n for n in ptrs if sig[n].startswith("*")] + \
        (aligned_call(BACKWARD_CALL, _LENGTHS) if lengths_div16 else [])
    return _compile_sm90(fn, sig, consts, aligned, num_warps, num_stages)


def _cuobjdump(kernel, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def ptxas_messages(kernel) -> str:
    """ptxas's verbose report on the kernel's PTX for sm_90a: registers, spills, and the
    performance notes (C7511/C7514: wgmma.mma_async serialized, C7517: a wait injected)."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        proc = subprocess.run([str(tool), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def warp_specialize_dispatch(sass: str) -> tuple[set[int], set[int]]:
    """The SASS offsets of a warp-specialized kernel's partition dispatch, which Triton
    generates: the worker warps' loads of their dispatch byte (`LDS.U8`) and the default
    partition's stores of the dispatch word (`STS`) at the same shared-memory offset, the
    word above the kernel's own allocations. The two sides are ordered by named barrier
    1 (`BAR.SYNC` on both); compute-sanitizer's racecheck reports them as hazards
    (benchmarks/results/h200-sanitize.txt)."""
    loads = {int(m.group(1), 16): int(m.group(2), 16)
             for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+LDS\.U8 R\d+, \[R\d+\+UR\d+\+0x([0-9a-f]+)\]", sass)}
    stores = [(int(m.group(1), 16), int(m.group(2), 16))
              for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+STS \[UR\d+\+0x([0-9a-f]+)\]", sass)]
    words = {off + 4 for off in loads.values()}  # the byte of worker warp w is word - 4 + w, w >= 4
    return set(loads), {pc for pc, off in stores if off in words}


def inspect(kernel) -> KernelReport:
    """Registers, stack bytes and SASS of a compiled kernel."""
    usage = _cuobjdump(kernel, "--dump-resource-usage")
    return KernelReport(int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)),
                        _cuobjdump(kernel, "--dump-sass"))


def inspect_forward(*args, **kwargs) -> KernelReport:
    return inspect(compile_forward(*args, **kwargs))


def inspect_forward_ws(*args, **kwargs) -> KernelReport:
    return inspect(compile_forward_ws(*args, **kwargs))


def inspect_backward(*args, **kwargs) -> KernelReport:
    return inspect(compile_backward(*args, **kwargs))


# the quantizers' pointer signatures (kernels/quantize/), bf16 input, D = 128
_QUANTIZER_SIGS = {
    "_abs_max_kernel": dict(X="*bf16", AMAX="*i32", MEAN="*fp32", SUMSQ="*fp64", S="i32"),
    "_fp8_rows_kernel": dict(X="*bf16", Y="*fp8e4nv", S_OUT="*fp32", O="*bf16", DOT="*fp32", CAMAX="*i32", S="i32"),
    "_nvfp4_rows_kernel": dict(X="*bf16", Y="*bf16", AMAX="*i32", SDEC="*fp32", CODES="*u8", BSCALE="*fp8e4nv",
                               CAMAX="*i32", MEAN="*fp32", FB="*i8", S="i32"),
    "_nvfp4_decode_kernel": dict(CODES="*u8", BSCALE="*fp8e4nv", Y="*bf16", CT="*fp8e4nv", CS="*fp32",
                                 SCALE="*fp32", CAMAX="*i32", S="i32"),
    "_v_kernel": dict(V="*bf16", VT="*fp8e4nv", VS="*fp32", SCALE="*fp32", STATS_AT="*i32", Y="*fp8e4nv",
                      YS="*fp32", WORK="*i32", G="i32", S="i32", S_ROW="i32"),
    # fp8_train.py: per-token FP8 Q/K in training
    "_fp8_views_kernel": dict(Y8="*fp8e4nv", S_ROW="*fp32", CAMAX="*i32", V="*bf16", CT="*fp8e4nv", CS="*fp32",
                              S="i32"),
}


def compile_quantizer(name: str, num_warps: int = 4, **constexprs):
    """Quantizer kernel `name` of `kernels/quantize/` compiled for
    sm_90 with these constexprs (D = 128 unless given) and `num_warps` as its launcher
    runs it; pointers and lengths specialized as multiples of 16."""
    from fp4attn.kernels.quantize import fp8, fp8_train, nvfp4, statistics, v_operand

    fn = next(getattr(m, name) for m in (statistics, fp8, nvfp4, v_operand, fp8_train) if hasattr(m, name))
    sig = _QUANTIZER_SIGS[name]
    if name == "_fp8_rows_kernel" and constexprs.get("SAVED"):
        # the training forward's form: bf16 values for the forward kernel, e4m3 bytes kept
        sig = {**sig, "Y": "*bf16", "Y8": "*fp8e4nv"}
    # every defaulted constexpr spelled out: Triton's ASTSource cache key leaves out the
    # constexprs' names, so builds differing only in which defaulted flag is set shared
    # one cached cubin (HAS_MEAN=True and FOUR_OVER_SIX=True hashed alike)
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    return _compile_sm90(fn, sig, {**defaults, "D": 128, **constexprs}, _pointers_and(sig, ("S", "S_ROW")), num_warps,
                         1)


def compile_backward_gluon(causal: bool, head_dim: int, in_flight: int = 1, part: str = "dkdv",
                               maxnreg: int | None = None, staged: int = 1, row_scales: bool = False):
    """The compiled Gluon backward kernel `part` ("dkdv" or "dq", `backward_gluon.py`)
    as its launcher runs it: bf16 gradients; `row_scales`: per-token Q/K scales (FP8
    Q/K, ROW_SCALES), as `train-fp8` runs it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from fp4attn.kernels.hopper import backward_gluon as bp

    token, channel = [bp.BLOCK, head_dim], [head_dim, bp.BLOCK]
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    desc = _desc_sig
    if part == "dkdv":
        fn = bp.attn_bwd_dkdv_pipelined_kernel
        sig = {"q_desc": desc(bf16, token), "k_desc": desc(bf16, token), "do_t_desc": desc(e4m3, token),
               "do_c_desc": desc(e4m3, channel), "v_desc": desc(e4m3, token), "q_c_desc": desc(e4m3, channel),
               **{n: "*fp32" for n in ("QS", "KS", "LSE", "DELTA", "DO_TS", "DO_CS", "V_TS", "Q_CS")},
               "DK": "*bf16", "DV": "*bf16"}
    else:
        fn = bp.attn_bwd_dq_pipelined_kernel
        sig = {"q_desc": desc(bf16, token), "k_desc": desc(bf16, token), "do_t_desc": desc(e4m3, token),
               "v_desc": desc(e4m3, token), "k_c_desc": desc(e4m3, channel),
               **{n: "*fp32" for n in ("QS", "KS", "LSE", "DELTA", "DO_TS", "V_TS", "K_CS")}, "DQ": "*bf16"}
    sig["call"] = call_signature(BACKWARD_CALL)
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=bp.BLOCK, BLOCK_N=bp.BLOCK, CAUSAL=causal)
    if part == "dkdv":
        consts.update(IN_FLIGHT=in_flight, STAGED=staged)
    if row_scales:  # (left out otherwise: the NVFP4 builds' cache keys and sources as before)
        consts["ROW_SCALES"] = True
    src = GluonASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, constexprs=consts,
                         attrs=_divisibility(sig, [*_pointers_and(sig), *aligned_call(BACKWARD_CALL, ("H", "Sq", "Sk"))]))
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4, maxnreg=maxnreg))