"""Block quantizers: MXFP4 (OCP MX v1.0), NVFP4 (TransformerEngine's operation order)
and block-scaled FP8, checked against float64 oracles and on named edge blocks."""

import numpy as np
import pytest
import torch

from fp4attn.formats import E4M3, decode_e2m1, quantize_fp8, quantize_mxfp4, quantize_nvfp4
from fp4attn.formats.constants import E2M1_VALUES
from tests.oracles import format_grid, nearest_even

E2M1_GRID = np.array(E2M1_VALUES)
E4M3_GRID = format_grid(4, 3, 7, 448.0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(dist, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dist == "normal":
        x = torch.randn(shape, generator=g)
    elif dist == "lognormal":
        x = torch.exp(torch.randn(shape, generator=g) * 3) * torch.randn(shape, generator=g).sign()
    else:  # heavy outliers
        x = torch.randn(shape, generator=g)
        x[torch.rand(shape, generator=g) < 0.01] *= 1000
    return x.to(dtype)


def mx_oracle(x: np.ndarray, rule: str) -> np.ndarray:
    """float64 MXFP4 of rows of 32, from log2 in float64."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        if rule == "floor":
            e = np.floor(np.log2(amax)) - 2
        else:
            e = np.ceil(np.log2(amax / 6))
    e = np.clip(np.where(amax > 0, e, -127), -127, 127)
    return nearest_even(x / 2.0**e, E2M1_GRID) * 2.0**e


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", ["normal", "lognormal", "outliers"])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mxfp4_matches_float64_oracle(dtype, dist, rule):
    x = _inputs(dist, (64, 256), dtype, seed=len(dist) * 7 + len(rule))
    got = quantize_mxfp4(x, dim=-1, scale_rule=rule).dequantize().double().numpy()
    want = mx_oracle(x.double().numpy().reshape(64, 8, 32), rule).reshape(64, 256)
    np.testing.assert_array_equal(got, want)


def test_mxfp4_along_other_dim_and_ragged_tail():
    x = torch.randn(3, 45, 5)
    q = quantize_mxfp4(x, dim=1)
    assert q.data.shape == (3, 5, 32) and q.scale.shape == (3, 5, 2)
    assert q.dequantize().shape == x.shape
    ref = quantize_mxfp4(x.transpose(1, 2).contiguous(), dim=-1).dequantize().transpose(1, 2)
    assert torch.equal(q.dequantize(), ref)
    # the zero padding of the tail does not change the tail block's scale
    padded = torch.nn.functional.pad(x.transpose(1, 2), (0, 19))
    assert torch.equal(quantize_mxfp4(padded, dim=-1).scale, q.scale)


def test_mxfp4_named_edge_blocks():
    blocks = torch.zeros(6, 32)
    blocks[1, 0] = 7.0  # amax 7: floor rule gives scale 1 and 7 saturates to 6
    blocks[2, :] = 1.0
    blocks[2, 3] = float("nan")
    blocks[3, 5] = float("inf")
    blocks[4, 0] = 2.0**-140  # below E8M0's range: exponent clamps to -127
    blocks[5, :4] = torch.tensor([0.25, 0.75, 1.25, 1.75])  # ties between E2M1 values
    blocks[5, 4] = 4.0
    q = quantize_mxfp4(blocks)
    assert q.scale.flatten().tolist() == [0, 127, 255, 255, 0, 127]
    v = q.dequantize()
    assert torch.equal(v[0], torch.zeros(32))
    assert v[1, 0].item() == 6.0
    assert bool(torch.isnan(v[2]).all()) and bool(torch.isnan(v[3]).all())
    assert v[4, 0].item() == 0.0
    assert v[5, :5].tolist() == [0.0, 1.0, 1.0, 2.0, 4.0]  # ties to even codes
    r = quantize_mxfp4(blocks[1:2], scale_rule="rceil")
    assert r.scale.item() == 128 and r.dequantize()[0, 0].item() == 8.0  # 7/2 = 3.5 -> 4


def test_mxfp4_payload_views():
    q = quantize_mxfp4(torch.randn(2, 64))
    assert q.data.dtype == torch.uint8 and q.data.view(torch.float4_e2m1fn_x2).shape == (2, 32)
    assert q.scale.view(torch.float8_e8m0fnu).float().shape == (2, 2)
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp4(torch.randn(32), scale_rule="round")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", ["normal", "lognormal", "outliers"])
def test_nvfp4_scales_and_elements_are_nearest_values(dtype, dist):
    x = _inputs(dist, (32, 128), dtype, seed=11 + len(dist))
    q = quantize_nvfp4(x)
    x64 = x.double().numpy().reshape(32, 8, 16)
    s_enc = np.float32(448.0 * 6.0) / np.float32(np.abs(x64).max())
    assert np.float32(1.0) / s_enc == q.global_scale.item()
    # block scale: nearest E4M3 of the float32 product amax_blk * (S_enc * (1/6))
    mult = np.float32(s_enc) * np.reciprocal(np.float32(6.0))
    d_in = (np.abs(x64).max(axis=-1).astype(np.float32) * mult).astype(np.float64)
    np.testing.assert_array_equal(q.scale.double().numpy(), nearest_even(d_in, E4M3_GRID))
    # elements: nearest E2M1 of the float32 product x * enc, clamped to +-6
    enc = (np.float32(1.0) / (q.scale.float().numpy() * q.global_scale.numpy())).astype(np.float32)
    scaled = (x64.astype(np.float32) * enc[..., None]).astype(np.float64)
    want = nearest_even(np.clip(scaled, -6, 6), E2M1_GRID)
    np.testing.assert_array_equal(decode_e2m1(q.codes()).double().numpy(), want)
    # and the represented values are within one E2M1 step of x
    err = (q.dequantize() - x.float()).abs() / x.float().abs().amax()
    assert float(err.max()) < 0.15


def test_nvfp4_edge_cases():
    z = quantize_nvfp4(torch.zeros(2, 32))
    assert z.global_scale.item() == pytest.approx(1 / 3.4028234663852886e38, rel=1e-6)
    assert torch.equal(z.dequantize(), torch.zeros(2, 32))
    x = torch.randn(2, 32)
    x[1, 16:] = 0
    assert torch.equal(quantize_nvfp4(x).dequantize()[1, 16:], torch.zeros(16))
    # NaN and +-Inf: the statistics of the finite values, the non-finite element's block
    # alone NaN (scale 0x7F, codes 0), every other byte that of x with it set to 0
    zeroed = x.clone()
    zeroed[0, 3] = 0.0
    want = quantize_nvfp4(zeroed)
    for value in (float("inf"), -float("inf"), float("nan")):
        x[0, 3] = value
        for f46 in (False, True):
            q = quantize_nvfp4(x, four_over_six=f46)
            w = quantize_nvfp4(zeroed, four_over_six=f46)
            assert torch.equal(q.global_scale, w.global_scale)
            assert q.scale.view(torch.uint8)[0, 0].item() == 0x7F
            assert torch.equal(q.scale.view(torch.uint8)[:, 1:], w.scale.view(torch.uint8)[:, 1:])
            assert torch.equal(q.scale.view(torch.uint8)[1], w.scale.view(torch.uint8)[1])
            assert not q.data[0, :8].any() and torch.equal(q.data[:, 8:], w.data[:, 8:])
            assert torch.equal(q.data[1], w.data[1])
            v = q.dequantize()
            assert bool(torch.isnan(v[0, :16]).all()) and bool(torch.isfinite(v[0, 16:]).all())
            assert bool(torch.isfinite(v[1]).all())
    assert torch.equal(want.global_scale, quantize_nvfp4(zeroed).global_scale)
    # per-slice tensor scales: a slice's non-finite value moves no other slice, and its own scale
    # is that of the slice with the value set to 0 (its statistic is over the finite values)
    y = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(0))
    y[1, 2, 5] = 0.0
    base = quantize_nvfp4(y, scale_dims=1)
    for seed in range(8):  # the replaced element as the slice's largest too
        z = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(seed))
        at_max = z[1].abs().argmax()
        zeroed_z = z.clone()
        zeroed_z[1].view(-1)[at_max] = 0.0
        z[1].view(-1)[at_max] = float("inf")
        assert torch.equal(quantize_nvfp4(z, scale_dims=1).global_scale,
                           quantize_nvfp4(zeroed_z, scale_dims=1).global_scale)
    y[1, 2, 5] = float("inf")
    q = quantize_nvfp4(y, scale_dims=1)
    assert torch.equal(q.global_scale, base.global_scale)
    assert torch.equal(q.data[0], base.data[0]) and torch.equal(q.data[2], base.data[2])


def test_nvfp4_block_values_exact_in_bf16():
    q = quantize_nvfp4(torch.randn(64, 128) * 10)
    bv = q.block_values()
    assert torch.equal(bv.bfloat16().float(), bv)


@pytest.mark.parametrize("fmt,fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_quantizer(fmt, fmax, dtype):
    x = _inputs("outliers", (16, 96), dtype, seed=3)
    q = quantize_fp8(x, dim=-1, block=32, fmt=fmt)
    assert q.data.shape == (16, 3, 32) and q.scale.shape == (16, 3)
    xb = x.float().reshape(16, 3, 32)
    amax = xb.abs().amax(-1)
    assert torch.equal(q.scale, amax / fmax)
    spec = E4M3 if fmt == "e4m3" else None
    if spec is not None:
        want = nearest_even((xb * (fmax / amax)[..., None]).double().numpy(), E4M3_GRID)
        np.testing.assert_array_equal(q.data.double().numpy(), want)
    assert float(((q.dequantize() - x.float()).abs() / amax.repeat_interleave(32, -1)).max()) < 2**-2


def test_fp8_finite_scale():
    """finite_scale: the scale of the block's finite values, each NaN or +-Inf a NaN
    element (0x7F), the same bytes as the default for finite blocks."""
    x = torch.randn(3, 64)
    base = quantize_fp8(x, dim=-1)
    assert torch.equal(quantize_fp8(x, dim=-1, finite_scale=True).data.view(torch.uint8),
                       base.data.view(torch.uint8))
    x[1, 5], x[2, 7], x[2, 9] = float("inf"), float("nan"), -float("inf")
    for fmt in ("e4m3", "e5m2"):
        q = quantize_fp8(x, dim=-1, fmt=fmt, finite_scale=True)
        zeroed = torch.where(torch.isfinite(x), x, 0.0)
        w = quantize_fp8(zeroed, dim=-1, fmt=fmt)
        assert torch.equal(q.scale, w.scale)
        bad = ~torch.isfinite(x).reshape(q.data.shape)
        assert bool((q.data.view(torch.uint8)[bad] == 0x7F).all())
        assert torch.equal(q.data.view(torch.uint8)[~bad], w.data.view(torch.uint8)[~bad])
        assert torch.equal(torch.isnan(q.dequantize()), ~torch.isfinite(x))


def test_fp8_edge_blocks_and_per_channel():
    x = torch.randn(4, 64)
    x[0] = 0
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    q = quantize_fp8(x, dim=-1)
    assert q.scale[0].item() == 1.0 and torch.equal(q.dequantize()[0], torch.zeros(64))
    assert bool(torch.isnan(q.dequantize()[1:3]).all())
    # a block so small that fmax / amax overflows float32 is flushed, never 0 * inf = NaN
    for fmt in ("e4m3", "e5m2"):
        tiny = torch.zeros(3, 64)
        tiny[0, 3], tiny[1, 3], tiny[2, 3] = 1e-37, -(2.0**-113), 2.0**-112
        t = quantize_fp8(tiny, dim=-1, fmt=fmt)
        assert t.scale[:2].flatten().tolist() == [1.0, 1.0]
        assert torch.equal(t.dequantize()[:2], torch.zeros(2, 64))
        assert t.dequantize()[2, 3].item() == pytest.approx(2.0**-112, rel=1e-6)  # the smallest block kept
        assert bool(torch.isfinite(t.dequantize()).all())
    v = torch.randn(2, 3, 50, 8)
    pc = quantize_fp8(v, dim=-2)  # one scale per channel, over the whole sequence
    assert pc.scale.shape == (2, 3, 8, 1)
    assert pc.dequantize().shape == v.shape
    with pytest.raises(ValueError, match="fp8 format"):
        quantize_fp8(x, fmt="e3m4")

