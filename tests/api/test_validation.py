"""Input checks: the quantizers and encoders refuse what they cannot quantize (an
out-of-range dim, an empty tensor, a non-float dtype) with an error naming what was
given and what is accepted, and `attention` / `explain` refuse zero-sized heads."""

import pytest
import torch

import fp4attn
from fp4attn.formats import (
    E4M3,
    encode_e2m1,
    encode_fp8,
    encode_ue4m3,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    round_to_format,
)

QUANTIZERS = [quantize_nvfp4, quantize_mxfp4, quantize_fp8]
ENCODERS = [encode_e2m1, encode_fp8, encode_ue4m3, lambda x: round_to_format(x, E4M3)]
NON_FLOAT = [torch.arange(32, dtype=torch.int32), torch.ones(32, dtype=torch.bool),
             torch.ones(32, dtype=torch.complex64), torch.arange(32, dtype=torch.uint8)]


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dim", [3, -4, 100])
def test_quantizer_rejects_out_of_range_dim(quantize, dim):
    """dim=3 of a 3-D tensor used to wrap around to dim 0."""
    with pytest.raises(IndexError, match=rf"{quantize.__name__}: dim={dim} .*3-D.*\[-3, 2\]"):
        quantize(torch.randn(2, 3, 32), dim=dim)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
def test_quantizer_rejects_non_int_dim(quantize):
    with pytest.raises(IndexError, match="dim=1.0"):
        quantize(torch.randn(2, 32), dim=1.0)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (2, 0, 16), ()])
def test_quantizer_rejects_empty(quantize, shape):
    with pytest.raises(ValueError, match=rf"{quantize.__name__}: x of shape .* has no elements"):
        quantize(torch.zeros(shape), dim=-1 if shape else 0)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("x", NON_FLOAT, ids=lambda x: str(x.dtype))
def test_quantizer_rejects_non_float(quantize, x):
    dtype = str(x.dtype).removeprefix("torch.")
    accepted = "accepted: float32, bfloat16, float16"
    with pytest.raises(TypeError, match=rf"{quantize.__name__}: x has dtype {dtype}; {accepted}"):
        quantize(x)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
def test_quantizer_rejects_non_tensor(quantize):
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        quantize([1.0] * 32)


@pytest.mark.parametrize("encode", ENCODERS)
@pytest.mark.parametrize("x", NON_FLOAT, ids=lambda x: str(x.dtype))
def test_encoder_rejects_non_float(encode, x):
    with pytest.raises(TypeError, match=r"x has dtype .*; accepted: float32, bfloat16, float16"):
        encode(x)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_accepts_every_dim_form(quantize, dtype):
    """A dim and its negative alias give the same payload (the check changes nothing
    that was accepted before)."""
    x = torch.randn(2, 48, 3).to(dtype)
    a, b = quantize(x, dim=1), quantize(x, dim=-2)
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("fn", [fp4attn.attention, fp4attn.explain], ids=lambda f: f.__name__)
def test_attention_takes_zero_head_dim_as_sdpa(fn):
    """No query/key channel: every score is 0, SDPA's uniform softmax (tests/api/test_sdpa_shapes.py)."""
    q = torch.randn(1, 2, 8, 0)
    fn(q, q, torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match="head_dim 8 is not supported; accepted: multiples of 16 up to 256"):
        fn(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))


@pytest.mark.parametrize("fn", [fp4attn.attention, fp4attn.explain], ids=lambda f: f.__name__)
def test_attention_rejects_zero_kv_heads_for_query_heads(fn):
    """0 k/v heads used to end in ZeroDivisionError (q heads % k/v heads)."""
    q, kv = torch.randn(1, 2, 8, 16), torch.randn(1, 0, 8, 16)
    with pytest.raises(ValueError, match=r"q heads \(2\) must be a multiple of k/v heads \(0\)"):
        fn(q, kv, kv, enable_gqa=True)
