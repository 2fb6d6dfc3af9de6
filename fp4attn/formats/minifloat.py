"""Bit-exact codecs for the small floating-point formats: E2M1, E4M3, E5M2, UE4M3, E8M0.

Every encoder rounds to nearest, ties to even, and saturates: a finite value beyond the
largest magnitude, and +-Inf, become +-max (PTX `cvt.rn.satfinite`, TransformerEngine
and torchao do the same). NaN stays NaN where the format has one.

The rounding is done on float32 with exact operations only: the exponent comes from
`torch.frexp`, the quantum is a power of two built from its bits, and dividing by a
power of two is exact, so `torch.round` (half to even) sees the exact ratio.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fp4attn.formats.checks import check_float_input
from fp4attn.formats.constants import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E5M2_MAX, E8M0_BIAS, E8M0_NAN


@dataclass(frozen=True)
class FloatSpec:
    """A sign-magnitude binary floating-point format."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_value: float

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number; subnormals share its quantum."""
        return 1 - self.bias


E2M1 = FloatSpec("e2m1", exp_bits=2, man_bits=1, bias=1, max_value=E2M1_MAX)
E4M3 = FloatSpec("e4m3", exp_bits=4, man_bits=3, bias=7, max_value=E4M3_MAX)
E5M2 = FloatSpec("e5m2", exp_bits=5, man_bits=2, bias=15, max_value=E5M2_MAX)

_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer tensors e in [-149, 127], built from the bits."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def exact_div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded float32 a / b.

    `python_float / tensor` is not: PyTorch computes it as reciprocal(tensor) * float,
    which differs from IEEE division in about a quarter of cases (measured on
    torch 2.13 CPU). Making both operands tensors gives the true division.
    """
    device = next((t.device for t in (a, b) if isinstance(t, torch.Tensor)), None)
    return torch.div(_float32_on(a, device), _float32_on(b, device))


def _float32_on(x: torch.Tensor | float, device: torch.device | None) -> torch.Tensor:
    """x as a float32 tensor on `device`. A Python number becomes a filled tensor:
    `torch.as_tensor(number, device="cuda")` copies from pageable host memory, which
    synchronizes the stream and left the GPU idle between the quantizers' kernels
    (docs/notes/hopper-forward.md)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype=torch.float32, device=device)
    return torch.full((), x, dtype=torch.float32, device=device)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) as int32 for positive finite float32 a, exact (from frexp)."""
    _, e = torch.frexp(a)
    return e - 1


def round_to_format(x: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """Round float32 `x` to the nearest value of `spec` (ties to even), saturating.

    Returns float32 values that lie exactly on the format's grid; NaN stays NaN.
    """
    check_float_input("round_to_format", x)
    x = x.float()
    a = x.abs()
    exp = floor_log2(torch.where(a > 0, a, torch.ones_like(a))).clamp(min=spec.emin)
    quantum = pow2(exp - spec.man_bits)
    q = torch.round(a / quantum) * quantum
    q = torch.clamp(q, max=spec.max_value)  # also turns Inf into max (satfinite)
    q = torch.copysign(q, x)
    return torch.where(torch.isnan(x), x, q)


# ----------------------------------------------------------------------------- E2M1
@functools.cache
def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant lookup table on `device`, copied there once (each copy from pageable
    host memory synchronizes the stream)."""
    return table.to(device)


_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
# Twice a magnitude (0, 1, 2, 3, 4, 6, 8, 12) indexes its code.
_E2M1_CODE_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of `x`: round to nearest even, saturate at +-6.

    E2M1 has no NaN: a NaN element gets code 0, and the block formats that use E2M1
    carry the NaN in their block scale instead.
    """
    check_float_input("encode_e2m1", x)
    v = round_to_format(x, E2M1)
    nan = torch.isnan(v)
    twice = (v.abs() * 2).masked_fill(nan, 0).to(torch.int64)
    code = _on_device(_E2M1_CODE_OF_TWICE, x.device)[twice]
    sign = torch.signbit(v) & ~nan
    return code | (sign.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, only the low 4 bits are read)."""
    return _on_device(_E2M1_TABLE, codes.device)[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim, element 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing E2M1 needs an even last dim, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`: uint8 codes with twice the last dim."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- FP8
def encode_fp8(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """float8 tensor (`torch.float8_e4m3fn` or `torch.float8_e5m2`) of `x`, RNE, saturating.

    The value is rounded here and the cast is then exact, so the result does not depend
    on whether torch's own cast saturates (it does on 2.13 CPU, not on 2.11 CUDA).
    """
    check_float_input("encode_fp8", x)
    spec = {"e4m3": E4M3, "e5m2": E5M2}.get(fmt)
    if spec is None:
        raise ValueError(f"unknown fp8 format {fmt!r}; accepted: 'e4m3', 'e5m2'")
    return round_to_format(x, spec).to(_TORCH_FP8[fmt])


def decode_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 values of a float8 tensor."""
    return x.float()


def encode_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M3 (the NVFP4 block-scale format) as uint8 codes 0..0x7F.

    Accepts only non-negative values (a negative scale has no meaning); rounds to
    nearest even and saturates at 448.
    """
    check_float_input("encode_ue4m3", x)
    if bool((x < 0).any()):
        raise ValueError("UE4M3 encodes non-negative values only; got a negative input")
    return encode_fp8(x, "e4m3").view(torch.uint8)


def decode_ue4m3(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of unsigned E4M3 codes (the sign bit must be 0)."""
    return (codes.to(torch.uint8) & 0x7F).view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------- E8M0
def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) of integer exponents in [-127, 127]; others raise."""
    if bool(((exponent < -E8M0_BIAS) | (exponent > E8M0_BIAS)).any()):
        raise ValueError("E8M0 exponents must lie in [-127, 127]")
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """float32 2**(code - 127); code 0xFF is NaN."""
    c = codes.view(torch.uint8).to(torch.int32)
    v = pow2(c - E8M0_BIAS)
    return torch.where(c == E8M0_NAN, torch.full_like(v, float("nan")), v)
