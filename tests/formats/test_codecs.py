"""Element codecs: every code round-trips, and rounding equals a brute-force float64
nearest-even oracle exhaustively over bf16 and fp16 inputs and on random fp32."""

import numpy as np
import pytest
import torch

from fp4attn.formats import (
    E2M1,
    E4M3,
    E5M2,
    decode_e2m1,
    decode_e8m0,
    decode_ue4m3,
    encode_e2m1,
    encode_e8m0,
    encode_fp8,
    encode_ue4m3,
    pack_e2m1,
    round_to_format,
    unpack_e2m1,
)
from tests.oracles import all_16bit_values, format_grid, nearest_even

SPECS = [E2M1, E4M3, E5M2]


def _grid(spec):
    return format_grid(spec.exp_bits, spec.man_bits, spec.bias, spec.max_value)


def test_e2m1_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values.tolist()[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(values[8:].abs(), values[:8]) and bool(torch.signbit(values[8:]).all())
    assert torch.equal(encode_e2m1(values), codes)  # -0 keeps code 8


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_every_code_round_trips(fmt, dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values)
    back = encode_fp8(values[finite], fmt).view(torch.uint8)
    assert torch.equal(back, codes[finite])
    assert bool(torch.isnan(encode_fp8(values[torch.isnan(values)], fmt).float()).all())


def test_fp8_grid_matches_bit_layout():
    for spec, dtype in [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)]:
        grid = _grid(spec)
        codes = torch.arange(len(grid), dtype=torch.uint8)
        assert np.array_equal(codes.view(dtype).double().numpy(), grid)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_exhaustive_over_16bit_inputs(spec, dtype):
    x = all_16bit_values(dtype)
    got = round_to_format(x, spec).double().numpy()
    want = nearest_even(x.double().numpy(), _grid(spec))
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dist", ["normal", "lognormal", "uniform-wide"])
def test_rounding_random_fp32(spec, dist):
    g = torch.Generator().manual_seed(hash((spec.name, dist)) % 2**31)
    n = 200_000
    if dist == "normal":
        x = torch.randn(n, generator=g) * spec.max_value / 4
    elif dist == "lognormal":
        x = torch.exp(torch.randn(n, generator=g) * 8) * torch.sign(torch.randn(n, generator=g))
    else:
        x = (torch.rand(n, generator=g) - 0.5) * 4 * spec.max_value
    got = round_to_format(x, spec).double().numpy()
    np.testing.assert_array_equal(got, nearest_even(x.double().numpy(), _grid(spec)))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ties_go_to_even_code(spec):
    grid = _grid(spec)
    mids = torch.tensor((grid[:-1] + grid[1:]) / 2, dtype=torch.float32)
    got = round_to_format(mids, spec).double().numpy()
    even = np.where(np.arange(len(grid) - 1) % 2 == 0, grid[:-1], grid[1:])
    np.testing.assert_array_equal(got, even)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_saturation_and_specials(spec):
    m = spec.max_value
    x = torch.tensor([m * 1.01, -m * 4, float("inf"), -float("inf"), 1e30, float("nan")])
    got = round_to_format(x, spec)
    assert got[:5].tolist() == [m, -m, m, -m, m]
    assert bool(torch.isnan(got[5]))


def test_fp8_matches_torch_cast_where_torch_saturates():
    x = torch.randn(100_000) * 300
    for fmt, dtype, m in [("e4m3", torch.float8_e4m3fn, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)]:
        ours = encode_fp8(x, fmt).view(torch.uint8)
        theirs = x.clamp(-m, m).to(dtype).view(torch.uint8)
        assert torch.equal(ours, theirs)


def test_e2m1_nan_element_code_is_zero():
    assert encode_e2m1(torch.tensor([float("nan")])).item() == 0


def test_pack_low_nibble_first_and_float4_view():
    codes = torch.tensor([1, 15, 7, 8], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0xF1, 0x87]
    assert torch.equal(unpack_e2m1(packed), codes)
    assert packed.view(torch.float4_e2m1fn_x2).shape == (2,)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(codes[:3])


def test_e8m0_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    v = decode_e8m0(codes)
    assert bool(torch.isnan(v[255]))
    want = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float64)
    assert torch.equal(v[:255].double(), want)
    assert torch.equal(encode_e8m0(torch.arange(-127, 128)), codes[:255])
    # the same bytes mean the same values to torch
    assert torch.equal(codes[:255].view(torch.float8_e8m0fnu).float(), v[:255])
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        encode_e8m0(torch.tensor([128]))


def test_ue4m3():
    codes = torch.arange(127, dtype=torch.uint8)  # 0x7F is NaN
    v = decode_ue4m3(codes)
    assert torch.equal(encode_ue4m3(v), codes)
    assert encode_ue4m3(torch.tensor([1000.0])).item() == 0x7E  # saturates at 448
    with pytest.raises(ValueError, match="non-negative"):
        encode_ue4m3(torch.tensor([-1.0]))
