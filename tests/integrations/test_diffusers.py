"""The diffusers processor on a tiny randomly initialised transformer."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from fp4attn.integrations.diffusers import FP4AttnProcessor, use_fp4attn  # noqa: E402
from fp4attn.metrics import error_metrics  # noqa: E402


def _model():
    from diffusers import Transformer2DModel

    torch.manual_seed(0)
    return Transformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=8, out_channels=8,
                              num_layers=1, norm_num_groups=4, cross_attention_dim=32).eval()


def test_use_fp4attn_on_a_transformer():
    model = _model()
    x = torch.randn(2, 8, 8, 8)
    ctx = torch.randn(2, 7, 32)
    with torch.no_grad():
        want = model(x, encoder_hidden_states=ctx).sample
        use_fp4attn(model, recipe="bf16")
        procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
        assert len(procs) == 2 and all(isinstance(p, FP4AttnProcessor) for p in procs)
        same = model(x, encoder_hidden_states=ctx).sample
        use_fp4attn(model, recipe="directp")  # re-installing wraps the original processor, not ours
        procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
        assert all(not isinstance(p.inner, FP4AttnProcessor) for p in procs)
        fast = model(x, encoder_hidden_states=ctx).sample
    assert error_metrics(same, want)["rel_l2"] < 2e-2
    assert 0.9 < error_metrics(fast, want)["cos"] < 0.99999


def test_use_fp4attn_rejects_non_models():
    with pytest.raises(TypeError, match="no attention processors"):
        use_fp4attn(torch.nn.Linear(2, 2))
