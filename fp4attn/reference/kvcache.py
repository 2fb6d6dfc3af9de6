"""What a quantized KV cache stores for each token, and the values it stands for.

A cache must never re-quantize a token when later tokens arrive, so every scale here
belongs to one token and one KV head: the blocks run along the head dim (16 channels an
E4M3 scale for NVFP4, 32 an E8M0 scale for MXFP4) and the second level is the token's
own. These are the prefill reference's quantizers (`fp4attn.formats`) applied to one
token's D values at a time:

    "bf16"   the values in bfloat16 (an Inf, or a value that rounds to one, stored as
             NaN: `reference.operands`)
    "fp8"    `quantize_fp8(x, dim=-1, block=None)`: e4m3 codes, one float32 scale
             amax / 448 per token (FP8 K in the prefill recipes is per token too)
    "nvfp4"  `quantize_nvfp4(x, dim=-1, scale_dims=1)`: E2M1 codes packed two a byte
             (element 2i in the low nibble), one E4M3 scale per 16 channels and the
             token's float32 tensor scale S_dec = amax / (448 * 6) (TransformerEngine's
             rule with the token as the tensor, over its finite values; a block holding
             a NaN or Inf gets the NaN scale 0x7F and codes 0); a token holding NaN or
             Inf gets S_dec NaN
    "mxfp4"  `quantize_mxfp4(x, dim=-1)`: E2M1 codes, one E8M0 scale per 32 channels
             (OCP floor rule); a block holding NaN or Inf gets the NaN scale 0xFF

Byte payloads are stored as uint8 (e4m3 codes and scales as their bits). Per token and
KV head at D = 128: bf16 256 bytes, fp8 132, nvfp4 76, mxfp4 68.

The decode kernels compute in bf16 operands (`reference.decode`), so one MXFP4 rule is
added, applied when the token is written: a block whose exponent lies more than
MX_WINDOW below its token's largest finite block exponent is stored as zeros. Such a
block holds values below 2**-122 of the token's largest; bf16 cannot hold both at once.

Everything here is the definition; `fp4attn.kernels.hopper.kvcache_triton` writes the
same bytes on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4
from fp4attn.formats.constants import E8M0_BIAS, E8M0_NAN, MX_BLOCK, NVFP4_BLOCK
from fp4attn.formats.minifloat import decode_e2m1, decode_e8m0, decode_ue4m3, unpack_e2m1

CACHE_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
# the head dims each format stores: the 4-bit ones in whole blocks (NVFP4 16 channels,
# MXFP4 32), bf16 and FP8 (one scale per token) any; the decode kernels take 64 and 128
HEAD_DIM_MULTIPLES = {"bf16": 1, "fp8": 1, "nvfp4": NVFP4_BLOCK, "mxfp4": MX_BLOCK}
HEAD_DIM_MULTIPLE = MX_BLOCK  # the multiple every format stores


def head_dim_multiple(*formats: str) -> int:
    """The multiple of the head dim a cache holding K and V in `formats` needs."""
    for fmt in formats:
        check_format(fmt)
    return max(HEAD_DIM_MULTIPLES[fmt] for fmt in formats)
# MXFP4 blocks more than this many binades below their token's largest block are zeroed
# (module docstring): the decode kernels hold a block as E2M1 x 2**(e - e_token) in bf16,
# whose normal range ends 126 binades below 1 (the E2M1 half needs one more)
MX_WINDOW = 125


@dataclass(frozen=True)
class FormatLayout:
    """The per-token storage of one format at head dim D: bytes of codes (or bf16
    values), block scales and a token scale."""

    data: int  # entries of the payload per token
    data_dtype: torch.dtype  # uint8 (codes), or bfloat16 for "bf16"
    block_scales: int  # uint8 scale bytes per token (0: none)
    token_scale: bool  # one float32 per token
    block: int  # channels per block scale (0: none)

    def bytes_per_token(self) -> int:
        return self.data * self.data_dtype.itemsize + self.block_scales + 4 * self.token_scale


def format_layout(fmt: str, head_dim: int) -> FormatLayout:
    """The storage of `fmt` at `head_dim` (a multiple of `HEAD_DIM_MULTIPLES[fmt]`)."""
    check_format(fmt)
    if fmt == "bf16":
        return FormatLayout(head_dim, torch.bfloat16, 0, False, 0)
    if fmt == "fp8":
        return FormatLayout(head_dim, torch.uint8, 0, True, 0)
    if fmt == "nvfp4":
        return FormatLayout(head_dim // 2, torch.uint8, head_dim // NVFP4_BLOCK, True, NVFP4_BLOCK)
    return FormatLayout(head_dim // 2, torch.uint8, head_dim // MX_BLOCK, False, MX_BLOCK)


def check_format(fmt) -> None:
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"unknown KV cache format {fmt!r}; accepted: {CACHE_FORMATS}")


@dataclass(frozen=True)
class TokenPayload:
    """The stored form of N tokens (one KV head each), as the cache holds it."""

    data: torch.Tensor  # (N, layout.data): uint8, or bfloat16 for "bf16"
    block_scale: torch.Tensor | None  # (N, layout.block_scales) uint8
    token_scale: torch.Tensor | None  # (N,) float32


def quantize_tokens(x: torch.Tensor, fmt: str) -> TokenPayload:
    """The stored form of tokens x (N, D), each quantized on its own."""
    check_format(fmt)
    n, d = x.shape
    if fmt == "bf16":
        y = x.to(torch.bfloat16)
        return TokenPayload(y.masked_fill(torch.isinf(y), float("nan")), None, None)
    if fmt == "fp8":
        q = quantize_fp8(x, dim=-1, block=None, fmt="e4m3")
        return TokenPayload(q.data.reshape(n, d).view(torch.uint8), None, q.scale.reshape(n))
    if fmt == "nvfp4":
        q = quantize_nvfp4(x, dim=-1, scale_dims=1)
        finite = torch.isfinite(x).all(dim=-1)
        s_dec = torch.where(finite, q.global_scale.reshape(n), torch.full((n,), float("nan"), device=x.device))
        return TokenPayload(q.data, q.scale.view(torch.uint8), s_dec)
    q = quantize_mxfp4(x, dim=-1)
    scale = q.scale
    e = scale.to(torch.int32) - E8M0_BIAS
    finite = scale != E8M0_NAN
    e_ref = torch.where(finite, e, torch.full_like(e, -E8M0_BIAS)).amax(dim=-1, keepdim=True)
    flushed = finite & (e < e_ref - MX_WINDOW)
    data = q.data.reshape(n, d // MX_BLOCK, MX_BLOCK // 2).masked_fill(flushed.unsqueeze(-1), 0).reshape(n, d // 2)
    return TokenPayload(data, scale, None)


def token_values(payload: TokenPayload, fmt: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values, token scales) of stored tokens: float32 (N, D) and (N,), whose
    product is what the tokens stand for. The block values are exact in bfloat16 (the
    operands of the decode products); the token scale is 1 for "bf16" and "mxfp4"."""
    check_format(fmt)
    n = payload.data.shape[0]
    ones = torch.ones(n, device=payload.data.device)
    if fmt == "bf16":
        return payload.data.float(), ones
    if fmt == "fp8":
        return payload.data.view(torch.float8_e4m3fn).float(), payload.token_scale.float()
    codes = decode_e2m1(unpack_e2m1(payload.data)).reshape(n, -1, NVFP4_BLOCK if fmt == "nvfp4" else MX_BLOCK)
    if fmt == "nvfp4":
        vals = codes * decode_ue4m3(payload.block_scale).unsqueeze(-1)
        return vals.reshape(n, head_dim), payload.token_scale.float()
    return (codes * decode_e8m0(payload.block_scale).unsqueeze(-1)).reshape(n, head_dim), ones
