"""The outlier-robust recipes on the reference: the transforms are exact in real
arithmetic (reference/robust.py), and the robust presets hold the accuracy floors of
docs/notes/robust-numerics.md on fresh inputs of each family (seeds other than the
tuning runs' seed 0: 101 non-causal, 202 causal), against float64 attention."""

import pytest
import torch

from fp4attn.api import attention
from fp4attn.cli.accuracy import exact_attention, make_inputs
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS, Recipe
from fp4attn.reference import reference_forward, robust
from fp4attn.reference.directp import build_p


def test_hadamard_is_orthogonal_up_to_its_order_and_exact_on_bf16():
    """H H = n I for the butterfly, and a head dim that is not a power of two is rotated
    in blocks. Exact on a grid of multiples of 2**-4 below 16 (every partial sum of both
    passes needs at most 8 + 7 + 7 bits); to float32 rounding on Gaussian inputs, whose
    sums of values of unlike exponents can need more than float32's 24 bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-255, 256, (5, 128), generator=g).float() / 16
    assert torch.equal(robust.hadamard(robust.hadamard(x)), x * 128)
    y = torch.randint(-255, 256, (3, 96), generator=g).float() / 16
    assert robust.hadamard_block(96) == 32
    assert torch.equal(robust.hadamard(robust.hadamard(y)), y * 32)
    z = torch.randn(7, 96, generator=g).bfloat16().float()
    torch.testing.assert_close(robust.hadamard(robust.hadamard(z)), z * 32, rtol=1e-6, atol=1e-5)
    h = robust.hadamard(torch.eye(8))
    assert torch.equal(h @ h.T, 8 * torch.eye(8)) and torch.equal(h, h.T)
    # rotate / unrotate are adjoint: <rotate(a), b> = <a, unrotate(b)>
    a, b = torch.randn(2, 64, dtype=torch.float64).float().unbind()
    assert torch.isclose((robust.rotate(a) * b).sum(), (a * robust.unrotate(b)).sum(), rtol=1e-5)


@pytest.mark.parametrize("fields", [dict(smooth_k=True), dict(rotate_qk="hadamard"), dict(smooth_v=True),
                                    dict(smooth_k=True, rotate_qk="hadamard", smooth_v=True)])
@pytest.mark.parametrize("causal", [False, True])
def test_transforms_leave_attention_unchanged(fields, causal):
    """With every operand kept in float32-exact form (bf16 Q/K values, bf16 P and V) the
    transforms change the result only by bf16 rounding of what they produce: the same
    attention, on inputs with a large key offset, channel outliers and a V offset."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 70, 64, generator=g)
    k = torch.randn(2, 2, 70, 64, generator=g) + 5 * torch.randn(2, 2, 1, 64, generator=g)
    k[..., :3] *= 8
    v = torch.randn(2, 2, 70, 64, generator=g) + 3
    q, k, v = (t.bfloat16() for t in (q, k, v))
    exact = exact_attention(q, k, v, causal)
    base = Recipe(qk="bf16", p="bf16", v="bf16", p_build="exp2")
    plain = reference_forward(q, k, v, base, scale=0.125, causal="top_left" if causal else None).out
    robust_out = reference_forward(q, k, v, base.with_(**fields), scale=0.125,
                                   causal="top_left" if causal else None).out
    e_plain = error_metrics(plain, exact)["rel_l2"]
    e_robust = error_metrics(robust_out, exact)["rel_l2"]
    assert e_robust < max(2 * e_plain, 5e-3), (fields, e_plain, e_robust)


def test_sink_p_keeps_the_other_keys_of_the_sink_block():
    """Block [sink at x = 0, 31 keys at x = -5 (p = 1/32)]: shared-scale MXFP4 P rounds
    the 31 to zero; with p_sink the sink is 1 (FP8 P value) and the others get a scale
    of their own (1/32 exactly on the E2M1 grid)."""
    x = torch.full((1, 32), -5.0)
    x[0, 7] = 0.0
    for build in ("directp", "exp2"):
        shared = build_p(x, "mxfp4", build)
        assert shared[0, 7] == 1 and not bool(shared[0, :7].any())
        sink = build_p(x, "mxfp4", build, sink=True)
        assert sink[0, 7] == 1 and torch.equal(sink[0, :7], torch.full((7,), 2.0**-5))
    # NaN in x always reaches P
    x[0, 3] = float("nan")
    assert bool(torch.isnan(build_p(x, "mxfp4", "directp", sink=True)[0, 3]))


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_sink_keys_limit_the_sink_remedy_to_the_first_tiles(causal):
    """p_sink_keys=128 (directp-robust): the first key tile's P is the full remedy's
    (p_sink_keys=0), every later tile's plain Direct-P's, bit for bit (the running max,
    and so each tile's x, does not depend on P); a sink key in a later tile is then
    rounded as Direct-P rounds it, so the three recipes differ there."""
    g = torch.Generator().manual_seed(4)
    sq, sk = 300, 400
    q = torch.randn(1, 2, sq, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, sk, 64, generator=g).bfloat16() for _ in range(2))
    k[0, 0, 3] = (q[0].float().mean((0, 1)) * 6.0).bfloat16()  # sinks in tile 0 and tile 1
    k[0, 0, 200] = (q[0].float().mean((0, 1)) * 4.0).bfloat16()
    r = PRESETS["directp-robust"]
    assert r.p_sink and r.p_sink_keys == r.block_n == 128
    runs = {n: reference_forward(q, k, v, rr, scale=0.125, causal=causal, return_p=True)
            for n, rr in (("first", r), ("every", r.with_(p_sink_keys=0)), ("none", r.with_(p_sink=False, p_sink_keys=0)))}
    p = runs["first"].p
    assert torch.equal(p[..., :128], runs["every"].p[..., :128])
    assert torch.equal(p[..., 128:], runs["none"].p[..., 128:])
    assert not torch.equal(p[..., 128:], runs["every"].p[..., 128:])
    assert not torch.equal(p[..., :128], runs["none"].p[..., :128])
    # build_p over a whole row (the backward's form) splits at sink_keys the same way
    x = torch.randn(3, 256, generator=g) * 4 - 6
    x[:, 40] = x[:, 200] = 0.0
    both = build_p(x, "mxfp4", "directp", sink=True, sink_keys=128)
    assert torch.equal(both[:, :128], build_p(x, "mxfp4", "directp", sink=True)[:, :128])
    assert torch.equal(both[:, 128:], build_p(x, "mxfp4", "directp")[:, 128:])
    assert torch.equal(build_p(x, "mxfp4", "directp", sink=True, sink_keys=256), build_p(x, "mxfp4", "directp", sink=True))


def test_fallback_picks_fp8_for_sharp_heads_only():
    q, k, v = (t.bfloat16() for t in make_inputs("gaussian", (2, 2, 128, 64), 5, "cpu"))
    k[1, 0] *= 3.0
    q[1, 0] *= 3.0
    r = reference_forward(q, k, v, PRESETS["nvfp4-fp8-robust"], scale=0.125)
    assert r.qk_fallback.tolist() == [[False, False], [True, False]]


def test_recipe_fields_are_checked():
    with pytest.raises(ValueError, match="rotate_qk"):
        Recipe(rotate_qk="random")
    with pytest.raises(ValueError, match="p_sink"):
        Recipe(p="fp8", p_build="exp2", v="fp8", p_sink=True)
    with pytest.raises(ValueError, match="qk_fallback"):
        Recipe(qk="fp8", qk_fallback="fp8")
    with pytest.raises(ValueError, match="needs p_sink=True"):
        Recipe(p_sink_keys=128)
    for keys in (-128, 64, 200):
        with pytest.raises(ValueError, match="p_sink_keys must be a non-negative multiple of block_n=128"):
            Recipe(p_sink=True, p_sink_keys=keys)
    assert Recipe(p_sink=True, p_sink_keys=64, block_n=64).p_sink_keys == 64
    assert Recipe(p_sink=True).p_sink_keys == 0  # every block, as before the field
    with pytest.raises(ValueError, match="smooth_v"):
        Recipe(p="fp8", p_build="exp2", v="fp8", smooth_v=True, consistent_norm=False)


# the floors (docs/notes/robust-numerics.md), per family: (mean cos, 1st-percentile
# row cos) for nvfp4-fp8-robust and directp-robust; None: no floor on that metric
FLOORS = {
    "channels": {"nvfp4-fp8-robust": (0.98, None), "directp-robust": (0.97, None)},
    "offset": {"nvfp4-fp8-robust": (0.99, None), "directp-robust": (0.97, None)},
    "sharp": {"nvfp4-fp8-robust": (0.95, None), "directp-robust": (0.94, None)},
    "mixture": {"nvfp4-fp8-robust": (0.97, None), "directp-robust": (0.96, None)},
    "sink": {"nvfp4-fp8-robust": (0.985, 0.95), "directp-robust": (0.96, 0.90)},
}
SHAPE = (1, 2, 512, 128)


@pytest.mark.parametrize("case", list(FLOORS))
@pytest.mark.parametrize("causal", [False, True])
def test_robust_presets_hold_the_floors_on_fresh_inputs(case, causal):
    for seed in ((202,) if causal else (101,)):
        q, k, v = (t.bfloat16() for t in make_inputs(case, SHAPE, seed, "cpu"))
        exact = exact_attention(q, k, v, causal)
        for name, (cos, p1) in FLOORS[case].items():
            m = error_metrics(attention(q, k, v, recipe=name, causal=causal, backend="reference"), exact)
            assert m["cos"] >= cos, (case, seed, name, m)
            assert p1 is None or m["cos_p1"] >= p1, (case, seed, name, m)


@pytest.mark.parametrize("causal", [False, True])
def test_robust_presets_are_at_least_the_paper_presets_on_gaussian_inputs(causal):
    q, k, v = (t.bfloat16() for t in make_inputs("gaussian", SHAPE, 303, "cpu"))
    exact = exact_attention(q, k, v, causal)
    for paper in ("nvfp4-fp8", "directp"):
        base = error_metrics(attention(q, k, v, recipe=paper, causal=causal, backend="reference"), exact)
        rob = error_metrics(attention(q, k, v, recipe=f"{paper}-robust", causal=causal, backend="reference"), exact)
        assert rob["cos"] >= base["cos"] - 2e-4, (paper, base, rob)  # the same NVFP4 Q/K: equal up to noise
