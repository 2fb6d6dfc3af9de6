"""The fused Triton quantizers (`kernels/quantize/`) produce the reference quantizers'
operands.

On a Hopper GPU (`gpu`, run on an H200): values identical (NaN where the reference has
NaN); e4m3 bytes identical up to the sign of zero (the reference keeps -0 for negative
values that round to zero).

Under the Triton interpreter on the CPU (`interpreter`): indexing, masking and layouts
against the reference quantizers. Every value they store is already on its grid before
the final cast, so even the interpreter (whose fp8 casts of values between grid points
are wrong) must reproduce the reference exactly, up to the sign of zero. The GPU tests
are the numerical check; these run in CI.

On the CPU: the host arithmetic's grid helpers give Triton's values."""

import textwrap

import pytest
import torch

from fp4attn.recipes import PRESETS
from tests.interpreter import SPEEDUPS, run_under_interpreter

pytest.importorskip("triton")


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(values equal incl. NaN positions, number of bytes that differ only by -0/+0)."""
    x, y = a.float(), b.float()
    nan = torch.isnan(x)
    values = torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])
    zero_sign = 0
    if a.dtype == torch.float8_e4m3fn:
        zero_sign = int(((a.view(torch.uint8) != b.view(torch.uint8)) & (x == 0)).sum())
    return values, zero_sign


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "fp8-fastacc", "fp8-directp", "nvfp4-fp8", "directp"])
@pytest.mark.parametrize("s,d", [(1, 64), (113, 128), (1000, 64), (4096, 128)])
def test_fused_quantizers_match_reference(recipe, s, d):
    from fp4attn.kernels.hopper.operands import prepare_operands, prepare_operands_fused

    q, k, v = (torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(3))
    v[0, 0, : s // 2] *= 2.0**-18  # MXFP4 V: blocks below the head's window
    k[1, 2, 0] = 0.0  # an all-zero row
    want = prepare_operands(q, k, v, PRESETS[recipe])
    got = prepare_operands_fused(q, k, v, PRESETS[recipe])
    for name in ("q", "k", "qs", "ks", "vt", "vs"):
        a, b = getattr(want, name), getattr(got, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        values, zero_sign = _same(a, b)
        assert values, f"{recipe} {name}: values differ"
        print(f"{recipe} {name}: {zero_sign} bytes differ only in the sign of zero")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tokens", [("fp8", False), ("mxfp4", False), ("fp8", True)])
@pytest.mark.parametrize("s,d", [(1, 64), (200, 128), (4096, 128), (8448, 64)])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_v_read_once_is_v_read_twice(fmt, tokens, s, d, special):
    """`quantize_v_t`'s one-launch form (each head's statistic and values from one read,
    its blocks waiting on the head's count) writes the two-launch form's bytes: several
    heads, padded rows, a head of 66 blocks (8448 keys: the most a GPU of 132 SMs takes
    in one pass), non-finite values in one head only."""
    from fp4attn.kernels.quantize.v_operand import ONE_PASS_BLOCKS_PER_SM, V_PROGRAM, quantize_v_t

    v = torch.randn(3, 5, s, d, device="cuda", dtype=torch.bfloat16) * 3
    v[1, 2, : s // 3] *= 2.0**-20
    if special != "none":
        v[2, 1, s // 2, d // 3] = float(special)
    blocks = -(-s // (32 if tokens else V_PROGRAM[d][0]))
    if blocks > ONE_PASS_BLOCKS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("more blocks a head than this GPU has SMs: the two-launch form only")
    once = quantize_v_t(v, fmt, pad_keys_to=128, tokens=tokens, one_pass=True)
    twice = quantize_v_t(v, fmt, pad_keys_to=128, tokens=tokens, one_pass=False)
    for a, b in zip(once, twice):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                                                  b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))
    rows = once[0].as_strided(once[0].shape[:-1] + (128 * -(-s // 128),), once[0].stride())
    assert torch.count_nonzero(rows[..., s:].view(torch.uint8)) == 0  # V^T's padding is zero


@pytest.mark.gpu
@pytest.mark.parametrize("s,d", [(1, 64), (113, 128), (1000, 128)])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_packed_nvfp4_payload_is_the_reference_bytes(s, d, special):
    """The training forward saves Q/K as packed NVFP4 (`quantize_qk_nvfp4(...,
    packed=True)`): codes and block-scale bytes equal `formats.quantize_nvfp4`'s (uint8
    views, -0 codes, NaN scales and all), and decoding them gives back the grid values
    the forward kernel multiplied, bit for bit."""
    from fp4attn.formats.nvfp4 import quantize_nvfp4
    from fp4attn.kernels.quantize.nvfp4 import decode_nvfp4_rows, quantize_qk_nvfp4
    from fp4attn.reference.operands import quantize_qk

    x = torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16) * 4
    x[0, 0, 0, :7] = 0.0
    x[0, 1, -1, 3] = -0.0
    x[1, 2, 0, :16] *= 2.0**-20  # a block whose elements round to (signed) zero
    if special != "none":
        x[1, 0, -1, 5] = float(special)
    ref = quantize_nvfp4(x, scale_dims=2)  # one tensor scale per (batch, head)
    values, ts, codes, bscale = quantize_qk_nvfp4(x, packed=True)
    assert torch.equal(codes, ref.data)
    assert torch.equal(bscale.view(torch.uint8), ref.scale.view(torch.uint8))
    # the kernels' scale: the head's, from its finite values (reference.operands)
    want_ts = quantize_qk(x, "nvfp4").scale.expand(*x.shape[:-1], 1)[..., 0]
    assert torch.equal(torch.isnan(ts), torch.isnan(want_ts))
    assert torch.equal(ts.nan_to_num().view(torch.int32), want_ts.nan_to_num().view(torch.int32))
    grid = ref.block_values().flatten(-2).to(torch.bfloat16)
    nan = torch.isnan(grid)
    assert torch.equal(nan, torch.isnan(values)) and torch.equal(values[~nan], grid[~nan])
    assert torch.equal(decode_nvfp4_rows(codes, bscale).view(torch.int16), values.view(torch.int16))


def _training_quantization(qk: str, v_fmt: str):
    """(the training recipe with `qk` Q/K and `v_fmt` V, its forward's quantization, the
    backward's operands from what that saves)."""
    from fp4attn.kernels.hopper import train_op

    if qk == "fp8":
        r = PRESETS["train-fp8"] if v_fmt == "fp8" else PRESETS["train-fp8"].with_(p="mxfp4", v="mxfp4",
                                                                                  p_build="directp")
        return r, train_op.quantize_for_training_fp8, train_op.backward_operands_fp8
    return (PRESETS["train" if v_fmt == "fp8" else "train-mxfp4pv"], train_op.quantize_for_training,
            train_op.backward_operands)


@pytest.mark.gpu
@pytest.mark.parametrize("qk", ["nvfp4", "fp8"])
@pytest.mark.parametrize("s,d,v_fmt", [(1, 64, "fp8"), (113, 128, "fp8"), (1000, 64, "fp8"), (239, 128, "mxfp4")])
def test_backward_operand_views_match_reference(s, d, v_fmt, qk):
    """The training forward's quantization (kernels/hopper/train_op.py) gives the forward
    kernel the inference quantizers' operands, and from what it saves the backward's
    operands are the reference backward's `low_precision_view`s of dO, V's represented
    values and the dequantized Q/K (NVFP4, or per-token FP8 for `train-fp8`), scale for
    scale, with Q/K's grid values (and, for FP8 Q/K, the per-token scales as saved)."""
    from fp4attn.formats import quantize_fp8
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.reference.operands import quantize_qk, quantize_v

    q, k, v, dout = (torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(4))
    dout[0, 1, 0] = 0.0  # an all-zero token
    dout[1, 0, :, 3] *= 2.0**-120  # a channel below FP8_MIN_AMAX
    k[1, 2, :, 5] = 0.0  # an all-zero channel of K
    out = torch.randn_like(dout)
    recipe, quantize, backward_operands = _training_quantization(qk, v_fmt)
    fwd, saved = quantize(q, k, v, v_fmt)
    want_fwd = prepare_operands_fused(q, k, v, recipe)
    for name in ("q", "k", "qs", "ks", "vt", "vs"):
        a, b = getattr(want_fwd, name), getattr(fwd, name)
        assert _same(a, b)[0], f"forward {name}"
    got = backward_operands(dout, out, *saved)
    torch.testing.assert_close(got.delta, (dout.float() * out.float()).sum(-1), rtol=1e-5, atol=1e-4)

    def view(x, dim):  # (e4m3 data in the kernel's layout, scale)
        f = quantize_fp8(x, dim=dim, block=None, fmt="e4m3")
        return f.data.squeeze(-2), f.scale.squeeze(-1)

    want = [*view(dout.float(), -1), *view(dout.float(), -2), *view(quantize_v(v, v_fmt), -1),
            *view(quantize_qk(q, qk).dequantize(), -2), *view(quantize_qk(k, qk).dequantize(), -2),
            want_fwd.q, want_fwd.k]
    names = ("do_t", "do_ts", "do_c", "do_cs", "v_t", "v_ts", "q_c", "q_cs", "k_c", "k_cs", "q", "k")
    if qk == "fp8":
        want += [want_fwd.qs, want_fwd.ks]
        names += ("qs", "ks")
    for name, a in zip(names, want):
        b = getattr(got, name)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        values, zero_sign = _same(a.contiguous(), b)
        assert values, f"{name}: values differ"


@pytest.mark.gpu
@pytest.mark.parametrize("s,d", [(1, 64), (113, 128), (1000, 64), (4096, 128)])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_fp8_training_quantizers_are_the_reference_bytes(s, d, special):
    """`train-fp8`'s quantizers (kernels/quantize/fp8_train.py), byte for byte
    (uint8 views; -0 included; NaN where the reference has NaN): the forward's pass
    keeps Q/K as `formats.quantize_fp8(x, dim=-1)`'s e4m3 bytes and row scales, gives
    the forward kernel the same values as bf16, and records each channel's max
    |represented value| over the finite ones; the backward's pass gives back the values
    and the per-channel view of the represented values,
    `quantize_fp8(values x scales, dim=-2, finite_scale=True)`'s bytes and scales (a row
    holding NaN or Inf, represented as NaN, spoils its own elements of the view, not
    its channels' scales: `reference/backward.py`, "Non-finite values")."""
    from fp4attn.formats import quantize_fp8
    from fp4attn.kernels.quantize.fp8_train import fp8_qk_views, quantize_qk_fp8_saved
    from fp4attn.reference.operands import quantize_qk

    def same_bytes(a, b, name):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float())), f"{name}: NaN positions differ"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan]), f"{name}: bytes differ"

    x = torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16) * 4
    x[0, 0, 0, :7] = 0.0
    x[0, 1, -1, 3] = -0.0
    x[1, 2, 0] *= 2.0**-118  # a row below FP8_MIN_AMAX: scale 1, (signed) zeros
    x[1, 1, -1, : d // 2] *= 2.0**-14  # elements that round to (signed) zero beside large ones
    if special != "none":
        x[1, 0, -1, 5] = float(special)
    values, y8, scales, amax = quantize_qk_fp8_saved(x)
    ref = quantize_qk(x, "fp8")
    same_bytes(ref.payload.data.squeeze(-2), y8, "e4m3 bytes")
    same_bytes(ref.values.to(torch.bfloat16), values, "bf16 values")
    same_bytes(ref.scale.squeeze(-1), scales, "row scales")
    represented = ref.dequantize()
    finite = torch.where(torch.isfinite(represented), represented.abs(), 0.0)
    same_bytes(finite.amax(-2), amax.view(torch.float32), "channel maxima")
    v, ct, cs = fp8_qk_views(y8, scales, amax)
    want = quantize_fp8(represented, dim=-2, block=None, fmt="e4m3", finite_scale=True)
    if special != "none":
        assert torch.isfinite(cs).all(), "a non-finite row gave its channels a NaN scale"
    same_bytes(values, v, "values from the bytes")
    same_bytes(want.data.squeeze(-2), ct, "per-channel view")
    same_bytes(want.scale.squeeze(-1), cs, "per-channel scales")


@pytest.mark.gpu
@pytest.mark.parametrize("qk", ["nvfp4", "fp8"])
@pytest.mark.parametrize("special", ["nan", "inf"])
def test_backward_operand_views_carry_non_finite_values(special, qk):
    """A NaN or Inf in dO, Q or V reaches the views as it reaches the reference's
    (`reference/backward.py`, "Non-finite values"): a per-token view (dO_t, V_t) gives
    the token holding it the NaN scale (each product of that token reads the element
    anyway); a per-channel view (dO_c, Q_c), whose scale spans every token, takes its
    scale from the finite values (the channel maxima recorded by atomics skip NaN and
    Inf) and holds NaN at exactly the spoiled elements (an Inf in Q: its NVFP4 block's,
    or its FP8 token's, represented values)."""
    from fp4attn.formats import quantize_fp8
    from fp4attn.reference.operands import quantize_qk, quantize_v

    q, k, v, dout = (torch.randn(1, 2, 130, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dout[0, 1, 7, 9] = float(special)
    v[0, 0, 100, 3] = float(special)
    q[0, 1, 64, 2] = float(special)
    _, quantize, backward_operands = _training_quantization(qk, "fp8")
    _, saved = quantize(q, k, v, "fp8")
    got = backward_operands(dout, torch.randn_like(dout), *saved)
    for name, x, dim in (("do_t", dout.float(), -1), ("do_c", dout.float(), -2), ("v_t", quantize_v(v, "fp8"), -1),
                         ("q_c", quantize_qk(q, qk).dequantize(), -2)):
        per_channel = dim == -2
        f = quantize_fp8(x, dim=dim, block=None, fmt="e4m3", finite_scale=per_channel)
        scale, want = getattr(got, name + "s"), f.scale.squeeze(-1)
        assert torch.equal(torch.isnan(want), torch.isnan(scale)), name
        keep = ~torch.isnan(want)
        assert torch.equal(want[keep], scale[keep]), name
        if per_channel:
            assert torch.isfinite(scale).all(), name
            spoiled = ~torch.isfinite(x).transpose(-1, -2)  # the view is stored (B, H, D, S)
            nan = torch.isnan(getattr(got, name).float())[..., :spoiled.shape[-1]]
            assert spoiled.any() and torch.equal(nan, spoiled), name
        else:
            assert bool(torch.isnan(scale).any()), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "fp8-directp", "nvfp4-fp8", "directp", "train", "nvfp4-fp8-robust",
                                    "directp-robust", "train-robust", "train-fp8"])
def test_kernel_paths_never_synchronize(recipe):
    """Quantizers, forward and (for `train`) backward queue their work without waiting
    for the GPU: a host-to-device copy of a Python constant synchronized the stream
    eight times per quantizer call and left the GPU idle between its kernels."""
    import fp4attn

    train = recipe.startswith("train")
    q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=train)
               for _ in range(3))
    fp4attn.attention(q, k, v, recipe=recipe, causal=True, backend="triton")  # compile, cache the tables
    if train:
        fp4attn.attention(q, k, v, recipe=recipe, causal=True, backend="triton").sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fp4attn.attention(q, k, v, recipe=recipe, causal=True, backend="triton")
        if train:
            out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# Under the Triton interpreter (CPU)
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
        # GPU tests above hold it too)
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


@pytest.mark.interpreter
def test_v_read_once_under_the_interpreter():
    run_under_interpreter(ONE_PASS_SCRIPT, timeout=600)


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_e2m1_rounding_helpers_are_the_reference_rounding():
    """The quantizers' E2M1 rounding (`_e2m1_value`: one mantissa bit on the float32
    bits, the 2**23 shift below 1) and the code it stores (`_e2m1_code`, from the
    value's bits) against `formats.encode_e2m1`, bit for bit, over a sweep of float32
    from 0 to 16 with every tie and its neighbours. Pure float32 arithmetic, which the
    interpreter does as the GPU."""
    run_under_interpreter(E2M1_SCRIPT, timeout=900)


FINITE_MAX_SCRIPT = SPEEDUPS + textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl
    from fp4attn.kernels.quantize import rows

    @triton.jit
    def channel_max(X, OUT, ROWS: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        x = tl.load(X + b * ROWS * D + tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :])
        tl.store(OUT + b * D + tl.arange(0, D), rows._finite_channel_max(x, ROWS, D))

    # every 4099th float32 bit pattern (both signs, NaN payloads, subnormals: about a
    # million), then the edges: zeros, the smallest subnormal, the largest finite, Inf,
    # the NaNs next to Inf and the last one
    x = torch.arange(-2**31, 2**31 - 1, 4099, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0, 1, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int64)
    x = torch.cat([x, edges.to(torch.int32), (edges | 0x80000000).sub(2**32).to(torch.int32)])
    ROWS, D = 64, 16
    x = torch.cat([x, torch.zeros(-x.numel() % (ROWS * D), dtype=torch.int32)]).view(torch.float32)
    blocks = x.view(-1, ROWS, D)
    # blocks of every kind: as drawn (mixed), nine in ten values Inf, all NaN
    mixed = blocks.clone()
    spoiled = torch.where(torch.rand(blocks.shape, generator=torch.Generator().manual_seed(0)) < 0.9, float("inf"),
                          blocks)
    spoiled[::3] = float("nan")
    x = torch.cat([mixed, spoiled]).contiguous()
    out = torch.empty((x.shape[0], D), dtype=torch.int32)
    channel_max[(x.shape[0],)](x, out, ROWS=ROWS, D=D)
    want = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=1).view(torch.int32)
    bad = out != want
    assert not bad.any(), (int(bad.sum()), out[bad][:4], want[bad][:4])
    print("ok")
''')


@pytest.mark.interpreter
def test_finite_channel_max_is_the_maximum_of_the_finite_values():
    """`rows._finite_channel_max`, the order key that keeps NaN and Inf out of V's and the
    K tiles' FP8 maxima in one instruction an element, against the maximum |x| over the
    finite values (0 where none is), bit for bit, over a sweep of float32 bit patterns
    (signs, subnormals, Inf and every NaN kind) in blocks mixed, nearly all non-finite
    and wholly non-finite. Integer arithmetic, which the interpreter does as the GPU."""
    run_under_interpreter(FINITE_MAX_SCRIPT, timeout=600)


# The host arithmetic (CPU)
def test_grid_helpers_equal_tritons():
    triton = pytest.importorskip("triton")
    from fp4attn.kernels.quantize.rows import _cdiv, _next_pow2

    for n in range(1, 5000, 7):
        assert _next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 32, 64, 128, 1024):
            assert _cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert _cdiv(0, 128) == 0 and _next_pow2(1) == 1 and _next_pow2(2**20 + 1) == 2**21
