"""The SASS of the Blackwell builds read instruction by instruction, for the cost model
(`cost_model_sm100`) and the compile tests that hold the kernels' loops to their design:
the tile loop of each partition of a warp-specialized build, the serial kernel's tile
loop, the Gluon forward's five partitions (`forward_gluon_sm100`, built here by
`compile_forward_gluon`). The figures `fp4attn compile-report` prints (registers, spills,
memory, MMA kinds) come from `fp4attn.cli.blackwell_machine_code`, whose report this one
extends; the SASS comes from Triton's bundled cuobjdump (CUDA 12.8's), which reads
sm_100a and sm_120a cubins and refuses sm_103a ones."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field, fields

import triton
from triton.backends.compiler import GPUTarget

from fp4attn.cli.blackwell_machine_code import ARCHS, LENGTHS, TOOLS, BlackwellReport, divisibility, inspect

# the bundled cuobjdump disassembles these; sm_103a cubins it refuses
SASS_ARCHS = ("sm_100a", "sm_120a")


def sass_of(cubin: bytes) -> str:
    """The SASS of a cubin, by the bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(TOOLS / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


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
class BlackwellSass(BlackwellReport):
    """A compiled Blackwell kernel's figures (`BlackwellReport`) and its SASS, read
    instruction by instruction: loops, the partitions' tile loops."""

    sass: str = field(default="", repr=False)
    num_warps: int = 8  # the launch's (the metadata counts the partitions' warps too)
    gluon: bool = False  # the Gluon pipelined forward (`gluon_partition_loops`)

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
        """The tile loops of the Gluon pipelined forward (`forward_gluon_sm100`), by role, each
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


def read(kernel, arch: str = "sm_100a", record: dict | BlackwellReport | None = None,
         gluon: bool = False) -> BlackwellSass:
    """A compiled kernel's figures and SASS (empty where the bundled cuobjdump cannot read
    the target). record: the build's figures already read (a `BlackwellReport`, or a
    compile-report record), so that ptxas does not run again; gluon: the Gluon pipelined
    forward (`compile_forward_gluon`)."""
    if record is None:
        record = inspect(kernel, arch)
    if isinstance(record, BlackwellReport):
        record = {f.name: getattr(record, f.name) for f in fields(record)}
    figures = {n: record[n] for n in ("registers", "spill_bytes", "shared_bytes", "tmem_columns", "mma_kinds")}
    ttgir = kernel.asm.get("ttgir", "")
    warps = re.search(r'"ttg.num-warps" = (\d+)', ttgir)  # the launch's (metadata counts the partitions' too)
    return BlackwellSass(**figures, ptx=kernel.asm["ptx"], ttgir=ttgir,
                         sass=sass_of(kernel.asm["cubin"]) if arch in SASS_ARCHS else "",
                         num_warps=int(warps.group(1)) if warps else int(kernel.metadata.num_warps), gluon=gluon)


def _gluon_desc_sig(dtype, block: list[int]) -> str:
    """The signature type of a Gluon TMA descriptor argument with the default NVMMA
    shared layout of its tile (as a launcher building `TensorDescriptor`s would)."""
    from triton.experimental.gluon import language as gl

    name = {gl.uint8: "u8", gl.bfloat16: "bf16", gl.float8e4nv: "fp8e4nv"}[dtype]
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, dtype)!r}>"


def compile_forward_gluon(p_kind: int, head_dim: int = 128, causal: bool = False, arch: str = "sm_100a"):
    """The compiled Gluon pipelined forward (`forward_gluon_sm100.attn_fwd_sm100_gluon_kernel`)
    for `arch` (sm_100a, or sm_103a), one P builder (`forward_gluon_sm100.P_AFFINE_MXFP4`,
    `P_EXP2_FP8`, `P_BF16`),
    causal or not, pointers and lengths specialized as multiples of 16 (as the JIT does
    at the bench shapes)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from dev import forward_gluon_sm100 as fg

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
    aligned = [n for n, t in sig.items() if t.startswith("*") or n in LENGTHS]
    src = GluonASTSource(fg.attn_fwd_sm100_gluon_kernel, {**sig, **{c: "constexpr" for c in consts}},
                         constexprs=consts, attrs=divisibility(sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32), options=dict(num_warps=fg.NUM_WARPS))
