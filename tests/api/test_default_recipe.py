"""The default recipe (`fp4attn.DEFAULT_RECIPE`): what `fp4attn.attention`, `explain`,
`patch_sdpa`, the diffusers processor and the plain "fp4attn" transformers name run; it
has kernels on every GPU target, and keeps FP8's accuracy where the paper's `directp`
loses it (an attention sink, sharp logits with large key channels)."""

import inspect

import pytest
import torch

import fp4attn
from fp4attn import routing
from fp4attn.cli.accuracy import make_inputs
from fp4attn.integrations import diffusers, sdpa
from fp4attn.metrics import error_metrics
from fp4attn.recipes import DEFAULT_RECIPE, PRESETS


def test_the_default_is_one_recipe_everywhere():
    assert fp4attn.DEFAULT_RECIPE == DEFAULT_RECIPE == "fp8-affine-fastacc" and DEFAULT_RECIPE in PRESETS
    for fn in (fp4attn.attention, fp4attn.explain, sdpa.patch_sdpa, diffusers.use_fp4attn,
               diffusers.FP4AttnProcessor.__init__):
        assert inspect.signature(fn).parameters["recipe"].default == DEFAULT_RECIPE, fn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=g).bfloat16() for _ in range(3))
    assert torch.equal(fp4attn.attention(q, k, v), fp4attn.attention(q, k, v, recipe=DEFAULT_RECIPE))
    assert fp4attn.explain(q, k, v)["recipe"] == DEFAULT_RECIPE


def test_the_transformers_name_runs_the_default():
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    from fp4attn.integrations.transformers import DEFAULT_NAME, register

    register()
    fn = AttentionInterface._global_mapping[DEFAULT_NAME]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).bfloat16() for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fn(module, q, k, v, None)
    want = fp4attn.attention(q, k, v, recipe=DEFAULT_RECIPE, causal=True).transpose(1, 2)
    assert torch.equal(out, want)


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "sm_103", "sm_120"])
def test_the_default_has_kernels_on_every_target(target, monkeypatch):
    monkeypatch.setenv(routing.TARGET_ENV, target)
    for head_dim in (64, 128):
        for causal in (False, True):
            for mask in ("none", "key"):
                r = routing.route(PRESETS[DEFAULT_RECIPE], device=torch.device("cuda"), head_dim=head_dim,
                                  causal=causal, needs_grad=False, mask=mask, backend="auto", keys=4096)
                assert r.backend == "triton", (target, head_dim, causal, mask, r.reason)


@pytest.mark.parametrize("case", ["sink", "hard"])
def test_the_default_keeps_fp8_accuracy_where_directp_loses_it(case):
    q, k, v = make_inputs(case, (1, 2, 256, 64), 3, "cpu")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    cos = {}
    for name in (DEFAULT_RECIPE, "fp8", "directp"):
        out = fp4attn.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), recipe=name, backend="reference")
        cos[name] = error_metrics(out.double(), want)["cos"]
    assert cos[DEFAULT_RECIPE] > 0.99 and cos[DEFAULT_RECIPE] > cos["fp8"] - 0.002, cos
    assert cos["directp"] < cos[DEFAULT_RECIPE] - 0.05, cos
