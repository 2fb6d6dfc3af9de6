"""The fused Triton quantizers under the Triton interpreter (CPU): indexing, masking and
layouts against the reference quantizers. Every value they store is already on its
grid before the final cast, so even the interpreter (whose fp8 casts of values between
grid points are wrong) must reproduce the reference exactly, up to the sign of zero.
The GPU tests (test_hopper_quantize.py) are the numerical check; this one runs in CI."""

import textwrap

import pytest

from tests.interpreter import SPEEDUPS, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = SPEEDUPS + textwrap.dedent('''
    import torch
    from fp4attn.formats import quantize_fp8
    from fp4attn.kernels.hopper.operands import prepare_operands, prepare_operands_fused
    from fp4attn.kernels.hopper.train_op import (backward_operands, backward_operands_fp8, quantize_for_training,
                                                  quantize_for_training_fp8)
    from fp4attn.recipes import PRESETS
    from fp4attn.reference.operands import quantize_qk, quantize_v

    def same(a, b, name):
        x, y = a.float(), b.float()
        nan = torch.isnan(x)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan]), name

    def same_bytes(a, b, name):
        # bit for bit, but for the sign of zero, which the interpreter's casts drop (the
        # GPU test, test_hopper_quantize.py, holds it too)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        unsigned_zeros = [t.view(bits).masked_fill(t.float() == 0, 0) for t in (a, b)]
        assert torch.equal(*unsigned_zeros), name

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 70, 64, generator=g).bfloat16() * 4 for _ in range(4))
    v[0, 0, :35] *= 2.0**-18
    k[1, 2, 0] = 0.0
    dout[1, 0, :, 3] *= 2.0**-120
    for recipe in ("fp8", "fp8-fastacc", "nvfp4-fp8", "fp8-directp"):
        want = prepare_operands(q, k, v, PRESETS[recipe])
        got = prepare_operands_fused(q, k, v, PRESETS[recipe])
        for name in ("q", "k", "qs", "ks", "vt", "vs"):
            same(getattr(want, name), getattr(got, name), f"{recipe} {name}")
        # V^T's rows padded with zero keys to the key tile (70 keys -> 128), read unmasked
        assert got.vt_keys_padded and got.vt.stride(2) == 128 and got.vt.shape[-1] == 70
        rows = got.vt.as_strided((2, 3, 64, 128), got.vt.stride())
        assert not rows[..., 70:].float().any() and torch.equal(rows[..., :70].float(), got.vt.float())
    # non-finite V: the rest of the head keeps its MXFP4 window and values (the NaN bytes
    # of the non-finite blocks are the GPU test's: the interpreter's e4m3 cast of NaN is
    # not NaN)
    v_bad = v.clone()
    v_bad[1, 1, 40, 5] = float("inf")
    v_bad[0, 2, 3, 7] = float("nan")
    want = prepare_operands(q, k, v_bad, PRESETS["fp8-directp"])
    got = prepare_operands_fused(q, k, v_bad, PRESETS["fp8-directp"])
    same(want.vs, got.vs, "non-finite V vs")
    keep = ~want.vt.float().isnan()
    assert int((~keep).sum()) == 64, "one 32-key block per non-finite element"
    same(want.vt.float()[keep], got.vt.float()[keep], "non-finite V vt")
    # the training forward's quantization (the forward kernel's operands are the
    # inference quantizers', and what it saves), and the backward's operands from it
    for recipe in ("train", "train-mxfp4pv", "train-fp8"):
        r = PRESETS[recipe]
        if r.qk == "fp8":  # per-token FP8 Q/K: the saved e4m3 bytes, a scale per token
            fwd_ops, saved = quantize_for_training_fp8(q, k, v, r.v)
            q8, qs, k8, ks, q_amax, k_amax = saved[:6]
            for x, x8, xs, amax, name in ((q, q8, qs, q_amax, "q"), (k, k8, ks, k_amax, "k")):
                ref = quantize_qk(x, "fp8")
                same_bytes(ref.payload.data.squeeze(-2), x8, f"{recipe} saved {name} bytes")
                assert torch.equal(ref.scale.squeeze(-1), xs), f"{recipe} saved {name} scales"
                # the channels' max |e4m3 value x row scale|, as float32 bits
                assert torch.equal(ref.dequantize().abs().amax(-2), amax.view(torch.float32)), f"{recipe} {name} amax"
        else:
            fwd_ops, saved = quantize_for_training(q, k, v, r.v)
        want = prepare_operands(q, k, v, r)
        for name in ("q", "k", "qs", "ks", "vt", "vs"):
            same(getattr(want, name), getattr(fwd_ops, name), f"{recipe} forward {name}")
        out = torch.randn(dout.shape, generator=g).bfloat16()
        got = (backward_operands_fp8 if r.qk == "fp8" else backward_operands)(dout, out, *saved)

        def view(x, dim):
            f = quantize_fp8(x, dim=dim, block=None, fmt="e4m3")
            return f.data.squeeze(-2), f.scale.squeeze(-1)

        want = dict(zip(("do_t", "do_ts", "do_c", "do_cs", "v_t", "v_ts", "q_c", "q_cs", "k_c", "k_cs"),
                        [*view(dout.float(), -1), *view(dout.float(), -2), *view(quantize_v(v, r.v), -1),
                         *view(quantize_qk(q, r.qk).dequantize(), -2),
                         *view(quantize_qk(k, r.qk).dequantize(), -2)]))
        want.update(q=fwd_ops.q, k=fwd_ops.k)
        for name, a in want.items():
            same(a.contiguous(), getattr(got, name), f"{recipe} backward {name}")
        if r.qk == "fp8":  # the per-channel views of Q and K bit for bit, and the scales the kernels read
            for name in ("q_c", "k_c"):
                same_bytes(want[name].contiguous(), getattr(got, name), f"{recipe} backward {name} bytes")
            assert got.row_scales and torch.equal(got.qs, fwd_ops.qs) and torch.equal(got.ks, fwd_ops.ks), recipe
        torch.testing.assert_close(got.delta, (dout.float() * out.float()).sum(-1), rtol=1e-5, atol=1e-4)

    # the training forward's packed NVFP4 Q/K: codes as `quantize_nvfp4` packs them, the
    # decode giving back the grid values bit for bit (-0 included)
    from fp4attn.formats.nvfp4 import quantize_nvfp4
    from fp4attn.kernels.quantize.nvfp4 import decode_nvfp4_rows, quantize_qk_nvfp4
    x = q.clone()
    x[0, 1, 5, 3] = -0.0
    x[1, 0, 2, :16] *= 2.0**-20
    values, _, codes, bscale = quantize_qk_nvfp4(x, packed=True)
    ref = quantize_nvfp4(x, scale_dims=2)  # one tensor scale per (batch, head)
    assert torch.equal(codes, ref.data) and torch.equal(bscale.float(), ref.scale.float())
    assert torch.equal(decode_nvfp4_rows(codes, bscale).view(torch.int16), values.view(torch.int16))

    # the tensor and channel scales the kernels compute from the maxima of |x|:
    # all-zero (S_enc clamped to FP32_MAX, a subnormal decode scale), Inf (S_enc 1), NaN
    # (NaN scales), fp16 and fp32 inputs, and FP8 V with the training's scalar factor
    from fp4attn.kernels.quantize.v_operand import quantize_v_t
    for case in ("zero", "inf", "nan", "fp16", "fp32"):
        x = q.clone()
        if case == "zero":
            x.zero_()
        elif case in ("inf", "nan"):
            x[1, 2, 7, 9] = float(case)
        else:
            x = x.to(getattr(torch, {"fp16": "float16", "fp32": "float32"}[case]))
        want = prepare_operands(x, k, v, PRESETS["nvfp4-fp8"])
        got_v, got_s = quantize_qk_nvfp4(x)
        same(want.qs, got_s, f"nvfp4 {case} tensor scale")
        same(want.q, got_v, f"nvfp4 {case} values")
        want = prepare_operands(q, k, x, PRESETS["fp8"])
        vt, vs = quantize_v_t(x, "fp8")
        same(want.vs, vs, f"fp8 V {case} scales")
        keep = ~want.vt.float().isnan()
        same(want.vt.float()[keep], vt.float()[keep], f"fp8 V {case} values")
    # MXFP4 V in float32 down to subnormals: block exponents of subnormal maxima, a head
    # whose window clamps at the bottom of float32's range, blocks flushed below it
    vf = v.float()
    vf[0, 1] *= 2.0**-140
    vf[1, 0, 40:] *= 2.0**-130
    want = prepare_operands(q, k, vf, PRESETS["fp8-directp"])
    got = prepare_operands_fused(q, k, vf, PRESETS["fp8-directp"])
    for name in ("vt", "vs"):
        same(getattr(want, name), getattr(got, name), f"subnormal MXFP4 V {name}")
    factor = torch.tensor([0.375])
    vt, vs = quantize_v_t(q, "fp8", scale=factor)
    f = quantize_fp8((q.float() * factor).movedim(-2, -1), dim=-1, block=None, fmt="e4m3")
    same(f.scale.squeeze(-1), vs, "fp8 V with a factor, scales")
    same(f.data.squeeze(-2).float(), vt.float(), "fp8 V with a factor, values")
    print("ok")
''')


ONE_PASS_SCRIPT = SPEEDUPS + textwrap.dedent('''
    import torch
    from fp4attn.kernels.quantize.v_operand import quantize_v_t

    # V read once (`_v_kernel` with STATS and QUANT: the ticket, the head's count, the
    # statistic read back, MXFP4's exponents computed again) against the two-launch form,
    # on heads of one block (which never wait, so the interpreter can run them in turn)
    g = torch.Generator().manual_seed(1)
    for fmt, tokens, S in (("fp8", False, 100), ("mxfp4", False, 128), ("fp8", True, 27)):
        v = torch.randn(2, 3, S, 64, generator=g).bfloat16() * 3
        v[0, 1, : S // 2] *= 2.0**-20
        v[1, 2, S // 3, 5] = float("nan")
        v[1, 0, 1, 7] = float("inf")
        pad = 32 if tokens else 128  # one block of the program's keys a head, padding included
        once = quantize_v_t(v, fmt, pad_keys_to=pad, tokens=tokens, one_pass=True)
        twice = quantize_v_t(v, fmt, pad_keys_to=pad, tokens=tokens, one_pass=False)
        for a, b in zip(once, twice):
            x, y = a.float(), b.float()
            nan = torch.isnan(x)
            assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan]), (fmt, tokens)
    print("ok")
''')


def test_v_read_once_under_the_interpreter():
    run_under_interpreter(ONE_PASS_SCRIPT, timeout=600)


def test_fused_quantizers_under_the_interpreter():
    run_under_interpreter(SCRIPT, timeout=900)


E2M1_SCRIPT = SPEEDUPS + textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl
    from fp4attn.formats import decode_e2m1, encode_e2m1
    from fp4attn.kernels.quantize import elements as qz

    @triton.jit
    def e2m1(X, V, C, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + i, mask=i < N, other=0.0)
        v = qz._e2m1_value(x)
        tl.store(V + i, v, mask=i < N)
        tl.store(C + i, qz._e2m1_code(v), mask=i < N)

    # every 61st float32 from 0 to 16 (about 18 million), every rounding boundary and
    # tie, and the float32 on either side of each
    x = torch.arange(0, 0x41800000, 61, dtype=torch.int32).view(torch.float32)
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 7.99, 1e30])
    x = torch.cat([x, edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, torch.full((), 1e38))])
    v, c = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int32)
    block = 1 << 20
    e2m1[(triton.cdiv(x.numel(), block),)](x, v, c, x.numel(), BLOCK=block)
    want = encode_e2m1(x)
    assert torch.equal(c.to(torch.uint8), want), x[c.to(torch.uint8) != want][:8]
    assert torch.equal(v.view(torch.int32), decode_e2m1(want).view(torch.int32)), x[v != decode_e2m1(want)][:8]
    print("ok")
''')


def test_e2m1_rounding_helpers_are_the_reference_rounding():
    """The quantizers' E2M1 rounding (`_e2m1_value`: one mantissa bit on the float32
    bits, the 2**23 shift below 1) and the code it stores (`_e2m1_code`, from the
    value's bits) against `formats.encode_e2m1`, bit for bit, over a sweep of float32
    from 0 to 16 with every tie and its neighbours. Pure float32 arithmetic, which the
    interpreter does as the GPU."""
    run_under_interpreter(E2M1_SCRIPT, timeout=900)
