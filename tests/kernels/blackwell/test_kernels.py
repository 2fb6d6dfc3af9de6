"""The Blackwell (sm_100) forward under the Triton interpreter (CPU), held to the
reference: with TRITON_INTERPRET=1 and FP4ATTN_TARGET=sm_100, `fp4attn.attention(...,
backend="triton")` on CPU tensors routes to the Blackwell kernel, and its P tiles, LSE
and output agree with `reference_forward` of the same recipe on awkward shapes (GQA,
Sq != Sk, lengths not a multiple of the 128-key tile, both causal alignments, key
masks, head dims 64 and 128).

The block-scaled products run on the interpreter patch of tests/interpreter_blackwell.py
(decode, multiply in float64, round to float32), which the first test checks against
a float64 product of the reference quantizers' dequantized payloads."""

import textwrap

import pytest

from tests.interpreter import run_under_interpreter
from tests.interpreter_blackwell import BLACKWELL_PATCHES

pytest.importorskip("triton")

PATCH_CHECK = BLACKWELL_PATCHES + textwrap.dedent('''
    import triton

    from fp4attn.formats import quantize_mxfp4, quantize_nvfp4

    @triton.jit
    def _product(A, AS, B, BS, O, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SB: tl.constexpr):
        """O = A @ B^T of packed E2M1 rows A (M, K/2), B (N, K/2) with SB-element block scales."""
        m, n = tl.arange(0, M), tl.arange(0, N)
        kh, ks = tl.arange(0, K // 2), tl.arange(0, K // SB)
        a = tl.load(A + m[:, None] * (K // 2) + kh[None, :])
        bt = tl.load(B + n[None, :] * (K // 2) + kh[:, None])
        sa = tl.load(AS + m[:, None] * (K // SB) + ks[None, :])
        sb = tl.load(BS + n[:, None] * (K // SB) + ks[None, :])
        o = tl.dot_scaled(a, sa, "e2m1", bt, sb, "e2m1")
        tl.store(O + m[:, None] * N + n[None, :], o)

    g = torch.Generator().manual_seed(0)
    M, N, K = 32, 16, 128
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # blocks of very different scales
    y = torch.randn(N, K, generator=g)
    for quantize, sb in ((quantize_nvfp4, 16), (quantize_mxfp4, 32)):
        qx, qy = quantize(x, dim=-1), quantize(y, dim=-1)
        vx, vy = qx.block_values().reshape(M, K), qy.block_values().reshape(N, K)
        want = (vx.double() @ vy.double().T).float()
        out = torch.empty(M, N)
        _product[(1,)](qx.data, qx.scale, qy.data, qy.scale, out, M, N, K, sb)
        assert torch.equal(out, want), (sb, float((out - want).abs().max()))
    print("ok")
''')


@pytest.mark.interpreter
def test_interpreter_dot_scaled_patch_is_the_dequantized_product():
    """NVFP4 (e4m3 scales per 16) and MXFP4 (E8M0 per 32) operands through the patched
    interpreter's tl.dot_scaled equal, bit for bit, float64 products of the reference
    quantizers' represented values rounded to float32."""
    run_under_interpreter(PATCH_CHECK)


FORWARD = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    import fp4attn
    from fp4attn.kernels.blackwell.forward_op import blackwell_attention
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.forward import key_bias_of_mask
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(1)
    CASES = (  # recipe, B, Hq, Hkv, Sq, Sk, D, causal, key mask
        # @cases
        ("directp", 1, 4, 2, 100, 200, 64, None, False),
        ("directp", 2, 2, 1, 130, 77, 128, "bottom_right", True),
        ("nvfp4-fp8", 1, 2, 2, 129, 300, 64, "top_left", False),
        ("nvfp4-fp8", 2, 4, 1, 64, 64, 128, None, True),
        ("fp8-directp", 1, 2, 1, 77, 150, 64, "bottom_right", False),
        ("fp8", 1, 2, 2, 200, 130, 64, "top_left", True),
        ("train-mxfp4pv", 1, 2, 1, 96, 96, 64, "top_left", False),
        ("train-robust", 1, 2, 1, 80, 100, 64, None, False),  # K smoothing, 4/6 scales
        (PRESETS["directp"].with_(rotate_qk="hadamard", smooth_k=True), 1, 2, 2, 64, 70, 128, "bottom_right", True),
        # @end
    )
    for name, B, HQ, HKV, sq, sk, D, causal, masked in CASES:
        r = PRESETS[name] if isinstance(name, str) else name
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        q[:, :, :3] *= 8.0  # a few sharp rows: blocks of P far below their row maximum
        mask = None
        if masked:  # key padding: batch item 0 sees its first 60% of keys
            mask = torch.ones(B, 1, 1, sk, dtype=torch.bool)
            mask[0, ..., int(0.6 * sk):] = False
        kx, vx = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        ref = reference_forward(q, kx, vx, r, scale=D**-0.5, causal=causal, attn_mask=mask, return_p=True)
        info = fp4attn.explain(q, k, v, causal=causal or False, recipe=r, enable_gqa=True, attn_mask=mask)
        assert info["backend"] == "triton" and info["target"] == "sm_100", info
        assert "blackwell" in info["kernel"], info
        out, lse = fp4attn.attention(q, k, v, causal=causal or False, recipe=r, enable_gqa=True,
                                     attn_mask=mask, backend="triton", return_lse=True)
        # the same call through the launcher, with every P tile written out
        key_bias = None if mask is None else key_bias_of_mask(mask, B, sk)
        _, _, p = blackwell_attention(q, k, v, r, scale=D**-0.5, causal_offset=causal_offset(causal, sq, sk),
                                      key_bias=key_bias, write_p=True)
        p = p[..., :sq, :]
        seen = torch.isfinite(ref.lse)
        assert torch.equal(seen, torch.isfinite(lse)), r
        assert bool(torch.isfinite(out.float()).all()), r
        same_p = float((p == ref.p).float().mean())
        lse_err = (lse[seen] - ref.lse[seen]).abs()
        close = float((lse_err < 1e-5).float().mean())
        # the output is stored in bf16 (one ulp: the interpreter rounds bf16 its own way)
        # after float32 sums in another order
        out_err = (out.float() - ref.out).abs()
        within = float((out_err <= ref.out.abs() * 2.0**-7 + 1e-5).float().mean())
        print(r.name, same_p, float(lse_err.max()), close, within)
        # a score that float32 summation order moves across a threshold of P changes one
        # code, and its row's LSE by up to about 0.1: a few such entries are allowed
        assert same_p >= 0.999 and close >= 0.99 and float(lse_err.max()) < 0.2 and within >= 0.999, r
    # @stop

    # the op's fake implementation (torch.compile traces it) gives the real op's shapes
    from torch._subclasses.fake_tensor import FakeTensorMode

    for write_p in (False, True):
        real = blackwell_attention(q, k, v, r, scale=0.1, causal_offset=None, write_p=write_p)
        with FakeTensorMode() as mode:
            fake = blackwell_attention(*(mode.from_tensor(t) for t in (q, k, v)), r, scale=0.1, causal_offset=None,
                                       write_p=write_p)
        assert [(tuple(a.shape), a.dtype) for a in real] == [(tuple(b.shape), b.dtype) for b in fake], write_p
    print("ok")
''')


# the affine P builders (reference/affine.py) on the same checks: directp-fast and FP8
# Q/K with affine MXFP4 P pipelined at D=64 and 128, and affine FP8 P
AFFINE_CASES = """
    ("directp-fast", 2, 2, 1, 100, 150, 64, "bottom_right", True),
    ("directp-fast", 1, 2, 2, 70, 130, 128, None, False),
    ("fp8-directp-fast", 1, 2, 1, 90, 140, 128, "top_left", False),
    ("fp8-affine", 2, 2, 1, 64, 100, 64, None, True),
    ("fp8-affine", 1, 2, 1, 80, 90, 128, "bottom_right", False),
"""


def _forward_with_cases(cases: str) -> str:
    """FORWARD's case loop (its checks, without what follows it) over other cases."""
    head, rest = FORWARD.split("# @cases\n")
    body = rest.split("# @end\n")[1].split("# @stop\n")[0]
    return head.rstrip(" ") + cases.lstrip("\n") + "    # @end\n" + body + 'print("ok")\n'


AFFINE = _forward_with_cases(AFFINE_CASES)

# The GPU's affine MXFP4 path (HW_CVT in 128-row programs: the scores and the map two keys
# at a time, the row sums from the code bytes, forward_triton.py) is inline PTX, which the
# interpreter does not run. Here an emulator of the instructions it uses, each defined as
# the PTX ISA defines it (float32 lanes rounded once; prmt's byte selection; dp4a),
# stands in for the interpreter's missing inline asm, and the launch takes HW_CVT.
PTX_EMULATOR = textwrap.dedent(r'''
    import re as _re

    def _f32(u):
        return u.view(np.float32)

    def _bits(f):
        return np.asarray(f, dtype=np.float32).view(np.uint32)

    def _ftz(f):
        tiny = np.abs(f) < np.float32(2.0**-126)
        return np.where(tiny, np.copysign(np.float32(0), f), f).astype(np.float32)

    def _max_min_nan(op, a, b):
        r = op(_f32(a), _f32(b))  # NumPy's maximum and minimum propagate NaN
        return np.where(np.isnan(r), np.uint32(0x7FFFFFFF), _bits(r))

    def _prmt(a, b, sel):
        """prmt.b32, default mode: byte i of the result is byte (s & 7) of b:a for s the
        selector's nibble i, its sign bit replicated where s & 8."""
        both = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
        out = np.zeros_like(a)
        for i in range(4):
            s = (sel >> np.uint32(4 * i)) & np.uint32(0xF)
            shift = (s & np.uint32(7)).astype(np.uint64) * np.uint64(8)
            byte = ((both >> shift) & np.uint64(0xFF)).astype(np.uint32)
            sign = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
            byte = np.where(s & np.uint32(8), sign, byte)
            out |= byte << np.uint32(8 * i)
        return out

    def _bytes(x, i):
        return (x >> np.uint32(8 * i)) & np.uint32(0xFF)

    PTX_RUN = set()  # the instructions emulated so far

    def _run_ptx(text, regs, n):
        """The instructions of the kernels' inline PTX that this emulator knows, on
        uint32 arrays of n lanes (a 64-bit register as its (low, high) halves)."""
        def v(tok):
            if tok in regs:
                return regs[tok]
            value = int(tok[2:], 16) if tok.startswith("0f") else int(tok, 0)
            return np.full(n, value & 0xFFFFFFFF, np.uint32)

        def halves(tok):
            return [x.strip() for x in tok[1:-1].split(",")]

        for line in text.split("\n"):
            line = line.strip().rstrip(";").strip()
            if not line or line in ("{", "}") or line.startswith(".reg"):
                continue
            op, rest = line.split(None, 1)
            PTX_RUN.add(op)
            a = _re.findall(r"\{[^}]*\}|[^,\s{}]+", rest)
            if op == "mov.b64" and a[0].startswith("{"):
                lo, hi = halves(a[0])
                regs[lo], regs[hi] = regs[a[1]]
            elif op == "mov.b64" and a[1].startswith("{"):
                regs[a[0]] = tuple(v(x) for x in halves(a[1]))
            elif op == "mov.b64":
                imm = int(a[1], 0)
                regs[a[0]] = (v(str(imm & 0xFFFFFFFF)), v(str(imm >> 32)))
            elif op == "mov.b32":
                regs[a[0]] = v(a[1])
            elif op == "mul.rn.ftz.f32x2":  # each lane one float32 product, denormals flushed
                regs[a[0]] = tuple(_bits(_ftz(_ftz(_f32(x)) * _ftz(_f32(y))))
                                   for x, y in zip(regs[a[1]], regs[a[2]]))
            elif op == "fma.rn.f32x2":  # by a power of two, denormals kept: the product is
                # exact in float64, and the float64 sum of two 24-bit significands rounded
                # again to float32 is the FMA's one rounding (53 >= 2 * 24 + 2)
                assert all(np.all(np.frexp(_f32(y))[0] == 0.5) for y in regs[a[2]]), line
                regs[a[0]] = tuple(_bits((_f32(x).astype(np.float64) * _f32(y) + _f32(z)).astype(np.float32))
                                   for x, y, z in zip(regs[a[1]], regs[a[2]], regs[a[3]]))
            elif op == "min.relu.s32":  # max(min(a, b), 0) on int32
                x, y = v(a[1]).view(np.int32), v(a[2]).view(np.int32)
                regs[a[0]] = np.maximum(np.minimum(x, y), 0).view(np.uint32)
            elif op == "cvt.pack.sat.u4.s32.b32":  # (c << 8) | (a << 4) | b, a and b clamped to [0, 15]
                x, y = (np.clip(v(t).view(np.int32), 0, 15).astype(np.uint32) for t in a[1:3])
                regs[a[0]] = (v(a[3]) << np.uint32(8)) | (x << np.uint32(4)) | y
            elif op == "max.NaN.f32":
                regs[a[0]] = _max_min_nan(np.maximum, v(a[1]), v(a[2]))
            elif op == "min.NaN.f32":
                regs[a[0]] = _max_min_nan(np.minimum, v(a[1]), v(a[2]))
            elif op == "mad.lo.u32":
                regs[a[0]] = ((v(a[1]).astype(np.uint64) * v(a[2]) + v(a[3])) & 0xFFFFFFFF).astype(np.uint32)
            elif op == "add.u32":
                regs[a[0]] = ((v(a[1]).astype(np.uint64) + v(a[2])) & 0xFFFFFFFF).astype(np.uint32)
            elif op == "prmt.b32":
                regs[a[0]] = _prmt(v(a[1]), v(a[2]), v(a[3]))
            elif op == "dp4a.u32.u32":
                x, y = v(a[1]), v(a[2])
                regs[a[0]] = (v(a[3]) + sum(_bytes(x, i) * _bytes(y, i) for i in range(4))).astype(np.uint32)
            else:
                raise NotImplementedError(f"PTX emulator: {line}")
        return regs

    class _AsmCall:
        def __init__(self, outs):
            self.outs = outs

        def get_result(self, i):
            return self.outs[i]

    def _create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        """Inline PTX with 32-bit operands, `pack` elements a call (consecutive along the
        last axis, $ operands numbered as Triton's), run by `_run_ptx`."""
        shape = tuple(types[0].shape)
        lanes = int(np.prod(shape)) // pack
        regs = {}
        for i, h in enumerate(values):
            data = np.ascontiguousarray(np.broadcast_to(h.data, shape))
            assert data.itemsize == 4, data.dtype
            data = data.view(np.uint32).reshape(lanes, pack)
            for j in range(pack):
                regs[f"${(len(types) + i) * pack + j}"] = data[:, j].copy()
        regs = _run_ptx(asm, regs, lanes)
        outs = []
        for k, ty in enumerate(types):
            words = np.stack([regs[f"${k * pack + j}"] for j in range(pack)], axis=1).reshape(shape)
            outs.append(_interp.TensorHandle(words.view(_interp._get_np_dtype(ty.scalar)), ty.scalar))
        return _AsmCall(outs)

    _interp.InterpreterBuilder.create_inline_asm = _create_inline_asm
''')

AFFINE_X2 = BLACKWELL_PATCHES + PTX_EMULATOR + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    from fp4attn.kernels.blackwell import forward_op
    from fp4attn.kernels.blackwell.forward_op import blackwell_attention
    from fp4attn.recipes import PRESETS
    from fp4attn.reference.forward import key_bias_of_mask
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(5)
    for name, B, HQ, HKV, sq, sk, D, causal, masked in (
            ("directp-fast", 1, 2, 1, 100, 230, 64, None, True),  # pipelined, key mask, a partial tile
            ("directp-fast", 1, 2, 2, 70, 150, 64, "bottom_right", False),
            ("directp-fast", 1, 2, 1, 90, 140, 128, "top_left", False),  # D=128 pipelined
            ("fp8-directp-fast", 1, 2, 1, 64, 131, 64, None, False)):
        r = PRESETS[name]
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        q[:, :, :3] *= 8.0  # sharp rows: dropped blocks, codes 7
        q[:, :, 3:5] *= 0.01  # flat rows: code ties
        if D == 128:  # the second head's scores past 2**21 (log2 units): C rounds, the codes
            q[:, 1] *= 3.0e6  # are the float32 arithmetic's
        key_bias = None
        if masked:
            mask = torch.ones(B, 1, 1, sk, dtype=torch.bool)
            mask[0, ..., int(0.6 * sk):] = False
            key_bias = key_bias_of_mask(mask, B, sk)
            key_bias[0, :7] = -1.0e30  # finite scores far below the row's: code 0 off the map's binade
        kw = dict(scale=D**-0.5, causal_offset=causal_offset(causal, sq, sk), key_bias=key_bias, write_p=True)
        forward_op.interpreting = lambda: True
        plain = blackwell_attention(q, k, v, r, **kw)
        forward_op.interpreting = lambda: False  # HW_CVT: the two-wide path, its PTX emulated
        PTX_RUN.clear()
        x2 = blackwell_attention(q, k, v, r, **kw)
        assert {"mul.rn.ftz.f32x2", "fma.rn.f32x2", "min.relu.s32", "cvt.pack.sat.u4.s32.b32", "prmt.b32",
                "dp4a.u32.u32"} <= PTX_RUN, (name, PTX_RUN)
        for a, b in zip(plain, x2):  # bf16 compared by its bits, NaN equal to NaN
            a, b = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x for x in (a, b))
            nan = torch.isnan(a) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
            assert torch.equal(nan, torch.isnan(b) if b.is_floating_point() else nan), name
            assert torch.equal(a[~nan], b[~nan]), (name, D, causal)
        print(name, D, causal, "equal")
    print("ok")
''')


@pytest.mark.interpreter
def test_affine_mxfp4_two_wide_path_equals_the_scalar_one_under_the_interpreter():
    """The affine MXFP4 P of the GPU builds (two-wide scores and map, codes packed and
    row sums taken from the code bytes by PRMT and dp4a), its PTX run by the emulator
    above, gives the interpreter path's output, LSE and P tiles bit for bit: pipelined
    (key mask, causal; D=128 with scores past 2**21), NVFP4 and FP8 Q/K."""
    run_under_interpreter(AFFINE_X2)


# consumer Blackwell (FP4ATTN_TARGET=sm_120): the serial kernel at its own launches (32-
# and 64-row programs, `routing.SM120_FORWARD_LAUNCH`) on the same checks
SM120 = _forward_with_cases("""
    ("directp", 1, 2, 1, 100, 150, 128, "bottom_right", True),
    ("nvfp4-fp8", 2, 2, 1, 70, 130, 64, None, True),
    ("directp-fast", 1, 2, 2, 90, 100, 128, "top_left", False),
    ("fp8-affine", 1, 2, 1, 80, 90, 64, "bottom_right", False),
""").replace('"sm_100"', '"sm_120"')


@pytest.mark.interpreter
def test_blackwell_affine_p_matches_reference_under_the_interpreter():
    """The affine builders' P tiles equal the reference's (`reference.affine`) on >=
    99.9% of entries, LSE and output as the exact recipes' (the pipelined kernel, K and
    V by TMA descriptors, at D=64 and 128)."""
    run_under_interpreter(AFFINE)


SERIAL = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    import fp4attn
    from fp4attn.kernels.blackwell.forward_op import blackwell_attention
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.forward import key_bias_of_mask
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(4)
    # the serial kernel (one program's warps doing every step in turn), kept for
    # comparison: on the interpreter its float32 additions are the pipelined kernel's
    # (acc * alpha + P.V either way), so outputs, LSE and P tiles agree bit for bit
    from fp4attn.routing import SERIAL_BLACKWELL_LAUNCH, override_blackwell_launch

    for name, causal, masked in (("directp", "bottom_right", True), ("fp8", None, False)):
        r = PRESETS[name]
        B, sq, sk, D = 2, 130, 150, 64
        q = torch.randn(B, 2, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, 1, sk, D, generator=g).bfloat16() for _ in range(2))
        key_bias = None
        if masked:
            mask = torch.ones(B, 1, 1, sk, dtype=torch.bool)
            mask[1, ..., 100:] = False
            key_bias = key_bias_of_mask(mask, B, sk)
        kw = dict(scale=D**-0.5, causal_offset=causal_offset(causal, sq, sk), key_bias=key_bias, write_p=True)
        piped = blackwell_attention(q, k, v, r, **kw)
        with override_blackwell_launch(SERIAL_BLACKWELL_LAUNCH):
            assert "serial" in fp4attn.explain(q, k, v, recipe=r, causal=causal or False, enable_gqa=True)["kernel"]
            serial = blackwell_attention(q, k, v, r, **kw)
        assert "pipelined" in fp4attn.explain(q, k, v, recipe=r, causal=causal or False, enable_gqa=True)["kernel"]
        for a, b in zip(piped, serial):  # bf16 compared by its bits, NaN equal to NaN
            a, b = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x for x in (a, b))
            nan = torch.isnan(a) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
            assert torch.equal(nan, torch.isnan(b) if b.is_floating_point() else nan), name
            assert torch.equal(a[~nan], b[~nan]), name

    print("ok")
''')


@pytest.mark.interpreter
def test_serial_kernel_equals_the_pipelined_one_under_the_interpreter():
    """The serial kernel (one program's warps doing every step in turn, kept for
    comparison and where the pipelined build spills) gives the pipelined kernel's
    outputs, LSE and P tiles bit for bit (key mask, causal, GQA)."""
    run_under_interpreter(SERIAL)


@pytest.mark.interpreter
def test_sm120_route_matches_reference_under_the_interpreter():
    """Consumer Blackwell routed under backend="auto" (FP4ATTN_TARGET=sm_120): the P
    tiles, LSE and output held to the reference as on sm_100 (D=64 and 128, key masks,
    both causal alignments, GQA, Direct-P, FP8 P and the affine builders)."""
    assert SM120.count('"sm_120"') == 2 and '"sm_100"' not in SM120
    run_under_interpreter(SM120)


@pytest.mark.interpreter
def test_blackwell_forward_matches_reference_under_the_interpreter():
    """The routed (pipelined) kernel: P tiles equal the reference's on >= 99.9% of
    entries, the LSE within 1e-5 on >= 99% of rows (measured: every row within 1e-6),
    the bf16 output within half a bf16 ulp (plus float32 summation order) on >= 99.9% of
    entries; fully masked rows (Sq > Sk bottom-right, key padding) have LSE -inf and
    output 0 as the reference."""
    run_under_interpreter(FORWARD)


SELFTEST = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    from fp4attn.cli import selftest

    shape = (1, 2, 1, 70, 90)  # the GPU's shape is too slow for the interpreter
    recs = [selftest.check_forward("directp", 64, "bottom_right", False, "cpu", shape),
            selftest.check_forward("nvfp4-fp8", 128, None, True, "cpu", shape),
            selftest.check_forward("bf16", 64, None, False, "cpu", shape)]
    assert [r["status"] for r in recs] == ["pass", "pass", "reference"], recs
    assert all("blackwell" in r["kernel"] for r in recs[:2]), recs
    print("ok")
''')


@pytest.mark.interpreter
def test_selftest_checks_pass_on_the_blackwell_kernels():
    """`fp4attn selftest`'s forward check, as a Blackwell owner runs it, passes on the
    Blackwell kernels (routed by FP4ATTN_TARGET on the interpreter) and reports the
    recipes no kernel runs as on the reference."""
    run_under_interpreter(SELFTEST)


def test_selftest_without_a_gpu_says_so_and_exits_2(capsys, monkeypatch):
    import argparse

    import torch

    from fp4attn.cli import selftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        selftest.main(argparse.Namespace(json=None, no_timing=False))
    assert e.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


TRAIN = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    import fp4attn
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_backward, reference_forward
    from fp4attn.reference.forward import ForwardResult

    g = torch.Generator().manual_seed(2)
    for name, B, HQ, HKV, sq, sk, D, causal in (("train", 1, 2, 1, 100, 130, 64, "bottom_right"),
                                                ("train-mxfp4pv", 2, 2, 2, 96, 80, 64, "top_left"),
                                                ("train-robust", 1, 2, 1, 64, 64, 64, "top_left")):
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16().requires_grad_()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16().requires_grad_() for _ in range(2))
        info = fp4attn.explain(q, k, v, causal=causal, recipe=name, enable_gqa=True)
        assert info["backend"] == "triton" and "blackwell" in info["kernel"] and info["needs_grad"], info
        out, lse = fp4attn.attention(q, k, v, causal=causal, recipe=name, enable_gqa=True, backend="triton",
                                     return_lse=True)
        dout = torch.randn(out.shape, generator=g).bfloat16()
        out.backward(dout)
        r = PRESETS[name]
        kx, vx = (t.detach().repeat_interleave(HQ // HKV, 1) for t in (k, v))
        ref = reference_forward(q.detach(), kx, vx, r, scale=D**-0.5, causal=causal)
        seen = torch.isfinite(ref.lse)
        assert torch.equal(seen, torch.isfinite(lse)), r
        assert float((lse[seen] - ref.lse[seen]).abs().max()) < 1e-5, name
        fwd = ForwardResult(out.detach().float(), lse.detach(), ref.q, ref.k, ref.v)
        want = reference_backward(fwd, out.detach(), dout, r, scale=D**-0.5, causal=causal)
        G = HQ // HKV
        want = (want[0], want[1].reshape(B, HKV, G, sk, D).sum(2), want[2].reshape(B, HKV, G, sk, D).sum(2))
        for n, t, w in zip("qkv", (q, k, v), want):
            err = float((t.grad.float() - w).norm() / w.norm())
            print(name, "d" + n, err)
            assert t.grad.dtype == torch.bfloat16 and err < 1e-2, (name, n, err)

    # the training forward op's fake implementation (torch.compile traces it) gives the
    # real op's shapes and dtypes (GQA, lengths off the tiles: one query block of the real
    # op, the shapes all it gives here)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp4attn.kernels.blackwell.train_op import _train_forward_op

    q, k = torch.randn(2, 4, 40, 64, generator=g).bfloat16(), torch.randn(2, 2, 50, 64, generator=g).bfloat16()
    args = ("nvfp4", "fp8", "exp2", "fp8", 20, True, 0.125)
    real = _train_forward_op(q, k, k, *args)
    with FakeTensorMode() as mode:
        fake = _train_forward_op(*(mode.from_tensor(t) for t in (q, k, k)), *args)
    assert [(tuple(a.shape), a.dtype) for a in real] == [(tuple(b.shape), b.dtype) for b in fake]
    print("ok")
''')


@pytest.mark.interpreter
def test_blackwell_train_backward_matches_reference_under_the_interpreter():
    """`train`, `train-mxfp4pv` and `train-robust` (K smoothing and 4/6 NVFP4 block
    scales in the saved payload) through autograd on the Blackwell route (its forward,
    then the Triton backward kernels at their Blackwell launch): the LSE within 1e-5 of
    the reference forward's, and dQ, dK, dV (GQA sums included) within 1% relative L2
    of the reference backward's from the same output and LSE (measured 3.2-3.4e-3: the
    bf16 rounding of the gradients)."""
    run_under_interpreter(TRAIN)


TRAIN_FP4_SCORES = BLACKWELL_PATCHES + textwrap.dedent('''
    import dataclasses
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    from fp4attn import routing
    from fp4attn.kernels.blackwell.train_op import _train_backward_op, _train_forward_op
    from fp4attn.kernels.hopper.train_op import backward_operands, launch_backward
    from fp4attn.metrics import error_metrics
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_backward, reference_forward
    from fp4attn.reference.forward import ForwardResult
    from fp4attn.reference.masks import causal_offset

    f32 = (torch.float32,) * 3
    g = torch.Generator().manual_seed(6)
    for name, B, HQ, HKV, sq, sk, D, causal in (("train", 1, 4, 2, 113, 239, 64, "bottom_right"),
                                                ("train", 2, 2, 1, 200, 77, 128, "top_left"),
                                                ("train-mxfp4pv", 1, 2, 1, 130, 100, 64, None),
                                                ("train-robust", 1, 2, 2, 96, 150, 128, "bottom_right"),
                                                ("train", 1, 2, 1, 1, 70, 128, "bottom_right"),
                                                ("train", 1, 2, 1, 70, 150, 64, "top_left")):
        r = PRESETS[name]
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        q[:, :, :5] *= 6.0  # sharp rows
        dout = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        off = causal_offset(causal, sq, sk)
        args = (r.qk, r.p, r.p_build, r.v, off or 0, causal is not None, D**-0.5, r.smooth_k, r.qk_four_over_six)
        out, lse, *saved = _train_forward_op(q, k, v, *args)
        bwd = (r.p, r.p_build, off or 0, causal is not None, D**-0.5)
        # the route: the Blackwell backward op, gradients kept in float32
        got = _train_backward_op(dout, out, lse, *saved, *bwd, *f32)
        launch = routing.blackwell_backward_launch(D)
        assert launch.qk_fp4_dq and launch.block_m_dq == 128 and launch.qk_fp4_dkdv == (D == 64), launch
        # the same kernels with the scores by the bf16 product of the grid values, at the FP4
        # launch's 128-row and the former 64-row dQ programs: the interpreter multiplies both
        # products exactly (float64, rounded once), so every gradient is equal bit for bit
        # (the D=64 cases: the dK/dV kernel's S of two query tiles against its S^T a tile)
        ops = backward_operands(dout, out, *saved)
        for dq_launch in (dataclasses.replace(launch, qk_fp4_dq=False, qk_fp4_dkdv=False),
                          dataclasses.replace(launch, qk_fp4_dq=False, qk_fp4_dkdv=False, block_m_dq=64)):
            with routing.override_launch(backward=dq_launch):
                other = launch_backward(ops, lse, *bwd[:2], *bwd[2:], f32)
            for n, a, b in zip(("dq", "dk", "dv"), got, other):
                nan = torch.isnan(a)
                assert torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]), (name, D, n, dq_launch)
        # against the reference backward of the same forward (its quantized operands)
        kx, vx = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
        ref = reference_forward(q, kx, vx, r, scale=D**-0.5, causal=causal)
        fwd = ForwardResult(out.float(), lse, ref.q, ref.k, ref.v)
        want = reference_backward(fwd, out, dout, r, scale=D**-0.5, causal=causal)
        G = HQ // HKV
        want = (want[0], want[1].reshape(B, HKV, G, sk, D).sum(2), want[2].reshape(B, HKV, G, sk, D).sum(2))
        for n, a, w in zip(("dq", "dk", "dv"), got, want):
            err = error_metrics(a, w)["rel_l2"]
            print(name, D, sq, sk, causal, n, err)
            # measured 1e-8 to 3.4e-5 (an e4m3 code of P or dS that float32 summation
            # order moves across a rounding threshold: one element, by up to 1/8)
            assert a.dtype == torch.float32 and err < 1e-3, (name, D, sq, sk, causal, n, err)
    # the launch refuses an FP4 launch of the wrong shape or path, or without the payload,
    # rather than multiplying something else
    fp4 = dataclasses.replace(launch, qk_fp4_dkdv=True)
    for bad, kw, flag in ((dataclasses.replace(fp4, block_m_dq=64), dict(nvfp4=tuple(saved[:4])), "qk_fp4_dq"),
                          (dataclasses.replace(fp4, qk_fp4_dq=False, dkdv_gluon=True), dict(nvfp4=tuple(saved[:4])),
                           "qk_fp4_dkdv"),
                          (dataclasses.replace(fp4, qk_fp4_dq=False), {}, "qk_fp4_dkdv")):
        with routing.override_launch(backward=bad):
            try:
                launch_backward(ops, lse, *bwd, f32, **kw)
            except ValueError as e:
                assert flag in str(e), e
            else:
                raise AssertionError(bad)
    print("ok")
''')


@pytest.mark.interpreter
def test_blackwell_train_backward_fp4_scores_under_the_interpreter():
    """The Blackwell backward multiplies its scores from the saved NVFP4 payload by the
    block-scaled FP4 product (the QK_FP4 forms at the Blackwell launch: the dQ kernel's
    128-query programs, and at D=64 the dK/dV kernel's S of two 64-query tiles): on
    awkward shapes (Sq 1, 70, 96, 113, 130, 200 against Sk 70 to 239; at D=64 Sq 70, 113
    and 130, whose last step's second tile lies past Sq), both causal alignments (at D=64
    too, with key blocks no query sees), GQA, D=64 and 128, FP8 and Direct-P P, K
    smoothing and 4/6 scales, dQ, dK and dV in float32 equal bit for bit those of the same
    kernels with the scores from the grid values (128- and 64-query dQ programs, S^T a
    tile: the interpreter multiplies both products exactly), and are within 1e-3 relative
    L2 of the reference backward (measured 1e-8 to 3.4e-5); the launcher refuses an FP4
    launch on another path or shape, or without the payload."""
    run_under_interpreter(TRAIN_FP4_SCORES)


NONFINITE = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    import fp4attn
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 1, 40, 64, generator=g).bfloat16() for _ in range(3))
    for name in ("directp", "fp8", "directp-fast"):
        base, base_lse = fp4attn.attention(q, k, v, recipe=name, backend="triton", return_lse=True)
        for where, value in (("q", float("nan")), ("k", float("nan")), ("q", float("inf")), ("q", 3e38)):
            args = {"q": q.clone(), "k": k.clone(), "v": v}
            args[where][1, 0, 5, 3] = value  # batch item 1, token 5
            out, lse = fp4attn.attention(*args.values(), recipe=name, backend="triton", return_lse=True)
            ref = reference_forward(*args.values(), PRESETS[name], scale=0.125)
            assert torch.equal(torch.isnan(out), torch.isnan(ref.out)), (name, where, value)
            assert torch.equal(torch.isnan(lse), torch.isnan(ref.lse)), (name, where, value)
            # batch item 0 is untouched, bit for bit
            assert torch.equal(out[0].view(torch.int16), base[0].view(torch.int16)), (name, where, value)
            assert torch.equal(lse[0], base_lse[0]), (name, where, value)
    print("ok")
''')


@pytest.mark.interpreter
def test_nonfinite_inputs_propagate_as_the_reference_defines():
    """A NaN or Inf in q or k, or a score that overflows, gives NaN exactly in the
    output and LSE entries where the reference has NaN (reference/forward.py,
    "Non-finite values"), and the other batch item's output and LSE are bit-identical
    to a run without it."""
    run_under_interpreter(NONFINITE)


def test_padded_head_dims_rotate_at_the_callers_head_dim():
    """The kernels zero-pad head dims below 64 / 128, and the rotation's Hadamard blocks
    are the head dim's own (32: one block of 32; 48: blocks of 16), so the Blackwell
    quantizers quantize the caller's channels (`head_dim`) and pad the codes after: the
    operands are the unpadded inputs' plus zero channels, with the same softmax scale,
    with or without the rotation. Rotated at the padded width they would be another
    recipe's."""
    import torch
    import torch.nn.functional as F

    from fp4attn.kernels.blackwell.operands import prepare_operands
    from fp4attn.recipes import PRESETS

    def raw(t):
        return t.view(torch.uint8)

    g = torch.Generator().manual_seed(5)
    for d, fmt, rotate in ((32, "nvfp4", True), (48, "fp8", True), (32, "fp8", True), (32, "nvfp4", False)):
        r = PRESETS["nvfp4-fp8"].with_(qk=fmt, rotate_qk="hadamard" if rotate else None, smooth_k=True)
        q, k, v = (torch.randn(1, 2, 40, d, generator=g).bfloat16() * 2 for _ in range(3))
        padded = [F.pad(t, (0, 64 - d)) for t in (q, k, v)]
        want, want_scale = prepare_operands(q, k, v, r, d**-0.5)
        got, got_scale = prepare_operands(*padded, r, d**-0.5, head_dim=d)
        assert got_scale == want_scale, (d, fmt)
        n = d // 2 if fmt == "nvfp4" else d
        pairs = [(got.q, want.q, n), (got.k, want.k, n)]
        if fmt == "nvfp4":
            pairs += [(got.q_sc, want.q_sc, d // 16), (got.k_sc, want.k_sc, d // 16)]
        for a, b, m in pairs:
            assert torch.equal(raw(a[..., :m]), raw(b)) and not bool(raw(a[..., m:]).any()), (d, fmt)
        assert torch.equal(got.qs, want.qs) and torch.equal(got.ks, want.ks), (d, fmt)
        if rotate:
            other, other_scale = prepare_operands(*padded, r, d**-0.5)
            assert other_scale != want_scale or not torch.equal(raw(other.q[..., :n]), raw(want.q)), (d, fmt)


BENCH = BLACKWELL_PATCHES + textwrap.dedent('''
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_100"

    from fp4attn.cli import bench_blackwell
    from fp4attn.tools import benchmark

    calls = []

    def once(fn):  # the interpreter cannot time: run the call once, count it
        fn()
        calls.append(fn)
        return 1.0

    benchmark.time_ms = once
    recs = bench_blackwell.bench_shape([1, 2, 130, 64], True, ["directp-fast", "fp8-affine", "bf16"], device="cpu")
    impls = {(r["impl"], r["quant_included"]) for r in recs}
    # bf16 is not routed to a kernel, so not timed; SDPA flash runs on CPU tensors too
    assert {("directp-fast", False), ("directp-fast", True), ("fp8-affine", False), ("fp8-affine", True)} <= impls
    assert not any(i == "bf16" for i, _ in impls), impls
    assert all(r["cos"] > 0.999 for r in recs if r["impl"] in ("directp-fast", "fp8-affine")), recs
    print("ok")
''')


@pytest.mark.interpreter
def test_blackwell_bench_runs_each_routed_recipe_under_the_interpreter():
    """`fp4attn bench` on Blackwell (what `fp4attn blackwell-report` sends back): each
    routed recipe checked against its reference (cos > 0.999 on a slice), then timed
    alone (its own P builder) and with its quantization; recipes that no kernel runs are
    not timed. The timer is stood in for (the interpreter cannot time)."""
    run_under_interpreter(BENCH)
