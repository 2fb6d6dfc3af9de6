"""Bit-exact number formats: element codecs and block quantizers.

Element codecs round to nearest even and saturate; block quantizers work along any dim
and return payload objects with `.data`, `.scale` and `.dequantize()`.
"""

from fp4attn.formats.fp8 import FP8Tensor, quantize_fp8
from fp4attn.formats.minifloat import (
    E2M1,
    E4M3,
    E5M2,
    FloatSpec,
    decode_e2m1,
    decode_e8m0,
    decode_fp8,
    decode_ue4m3,
    encode_e2m1,
    encode_e8m0,
    encode_fp8,
    encode_ue4m3,
    pack_e2m1,
    round_to_format,
    unpack_e2m1,
)
from fp4attn.formats.mx import MXFP4Tensor, quantize_mxfp4
from fp4attn.formats.nvfp4 import NVFP4Tensor, quantize_nvfp4

__all__ = [
    "E2M1", "E4M3", "E5M2", "FloatSpec", "FP8Tensor", "MXFP4Tensor", "NVFP4Tensor",
    "decode_e2m1", "decode_e8m0", "decode_fp8", "decode_ue4m3", "encode_e2m1", "encode_e8m0",
    "encode_fp8", "encode_ue4m3", "pack_e2m1", "quantize_fp8", "quantize_mxfp4", "quantize_nvfp4",
    "round_to_format", "unpack_e2m1",
]
