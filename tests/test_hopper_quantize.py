"""Fused Triton quantizers produce the reference quantizers' operands (run on an H200).

Values must be identical (NaN where the reference has NaN); e4m3 bytes identical up to
the sign of zero (the reference keeps -0 for negative values that round to zero)."""

import pytest
import torch

from fp4attn.recipes import PRESETS

pytestmark = pytest.mark.gpu


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(values equal incl. NaN positions, number of bytes that differ only by -0/+0)."""
    x, y = a.float(), b.float()
    nan = torch.isnan(x)
    values = torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])
    zero_sign = 0
    if a.dtype == torch.float8_e4m3fn:
        zero_sign = int(((a.view(torch.uint8) != b.view(torch.uint8)) & (x == 0)).sum())
    return values, zero_sign


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


@pytest.mark.parametrize("s,d", [(1, 64), (113, 128), (1000, 64), (4096, 128)])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_fp8_training_quantizers_are_the_reference_bytes(s, d, special):
    """`train-fp8`'s quantizers (kernels/quantize/fp8_train.py), byte for byte
    (uint8 views; -0 included; NaN where the reference has NaN): the forward's pass
    keeps Q/K as `formats.quantize_fp8(x, dim=-1)`'s e4m3 bytes and row scales, gives
    the forward kernel the same values as bf16, and records each channel's max
    |represented value|; the backward's pass gives back the values and the per-channel
    view of the represented values, `quantize_fp8(values x scales, dim=-2)`'s bytes
    and scales."""
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
    same_bytes(represented.abs().amax(-2), amax.view(torch.float32), "channel maxima")
    v, ct, cs = fp8_qk_views(y8, scales, amax)
    want = quantize_fp8(represented, dim=-2, block=None, fmt="e4m3")
    same_bytes(values, v, "values from the bytes")
    same_bytes(want.data.squeeze(-2), ct, "per-channel view")
    same_bytes(want.scale.squeeze(-1), cs, "per-channel scales")


@pytest.mark.parametrize("qk", ["nvfp4", "fp8"])
@pytest.mark.parametrize("special", ["nan", "inf"])
def test_backward_operand_views_carry_non_finite_values(special, qk):
    """A NaN or Inf in dO, Q or V reaches the views as it reaches the reference's: the
    channel maxima recorded by atomics (float32 bits, NaN above Inf) give that channel
    a NaN scale, and the token's per-token scale is NaN (an Inf in Q through its NVFP4
    block's NaN scale, or its own NaN FP8 scale)."""
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
        f = quantize_fp8(x, dim=dim, block=None, fmt="e4m3")
        scale, want = getattr(got, name + "s"), f.scale.squeeze(-1)
        assert torch.equal(torch.isnan(want), torch.isnan(scale)), name
        # an Inf in Q makes its NVFP4 block's scale, or its token's FP8 scale, NaN: the views carry it
        assert bool(torch.isnan(scale).any()), name
        keep = ~torch.isnan(want)
        assert torch.equal(want[keep], scale[keep]), name


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
