"""torchao as a second, independent oracle where its conventions agree with ours:
E2M1 rounding (every bf16 value) and OCP MXFP4 with the floor scale rule (scales and
packed bytes). torchao's NVFP4 orders its scale arithmetic differently from
TransformerEngine's reference (which fp4attn follows), so it is not used there."""

import pytest
import torch

pytest.importorskip("torchao")
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

from fp4attn.formats import encode_e2m1, quantize_mxfp4  # noqa: E402
from tests.oracles import all_16bit_values  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_codes_match_torchao_exhaustively(dtype):
    x = all_16bit_values(dtype)
    assert torch.equal(encode_e2m1(x), f32_to_f4_unpacked(x))


@pytest.mark.parametrize("spread", [0.0, 3.0, 10.0])
def test_mxfp4_matches_torchao(spread):
    g = torch.Generator().manual_seed(int(spread * 10))
    x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * spread)
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32)
    q = quantize_mxfp4(x)
    assert torch.equal(scale.view(torch.uint8).reshape(q.scale.shape), q.scale)
    assert torch.equal(data.view(torch.uint8).reshape(q.data.shape), q.data)
