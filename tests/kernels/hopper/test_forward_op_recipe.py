"""The Hopper forward op rebuilds its `Recipe` from flat arguments (a custom op takes no
dataclass): the rebuilt recipe must give the kernels the preset's own P mode. It did not for
`train-affine` called without gradients (the trained affine P, P mode 6, ran as the inference
affine map, P mode 4: the selftest's `train-affine` forward failures on Hopper)."""

import pytest

from fp4attn import routing
from fp4attn.kernels.hopper.forward_op import op_recipe
from fp4attn.recipes import PRESETS


def _as_the_op_rebuilds_it(r):
    return op_recipe(qk=r.qk, p=r.p, v=r.v, p_build=r.p_build, fast_accum=r.fast_accum, smooth_k=r.smooth_k,
                     qk_four_over_six=r.qk_four_over_six, p_sink=r.p_sink, p_sink_keys=r.p_sink_keys,
                     k_scale=r.k_scale, rescale=r.rescale,
                     fallback_logit_std=r.qk_fallback_logit_std if r.qk_fallback else 0.0, grad=r.grad or "")


@pytest.mark.parametrize("name", sorted(n for n, r in PRESETS.items() if routing.hopper_robust_unsupported(r) is None))
def test_the_rebuilt_recipe_keeps_the_presets_p_mode(name):
    recipe = PRESETS[name]
    if recipe.qk not in ("nvfp4", "fp8") or recipe.p == "bf16":
        pytest.skip("not a forward the Hopper op runs")
    assert routing.p_mode(_as_the_op_rebuilds_it(recipe)) == routing.p_mode(recipe)


def test_train_affine_forward_builds_the_trained_p():
    assert routing.p_mode(_as_the_op_rebuilds_it(PRESETS["train-affine"])) == routing.P_MODE_AFFINE_TRAINED
