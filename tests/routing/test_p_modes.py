"""The P builders are named (`routing.PMode`) with the integer codes the kernels were built
with: the tables keep their values, and the kernels' constexprs are the enum's."""

import pytest

from fp4attn import routing
from fp4attn.recipes import PRESETS
from fp4attn.routing import PMode


def test_codes_are_unchanged():
    assert {m.name: int(m) for m in PMode} == {
        "FP8_EXP2": 0, "MXFP4_DIRECTP": 1, "MXFP4_EXP2": 2, "MXFP4_DIRECTP_SINK": 3, "FP8_AFFINE": 4,
        "MXFP4_AFFINE": 5, "FP8_AFFINE_TRAINED": 6, "FP8_AFFINE_LAZY": 7}
    assert routing.P_MODES == {("fp8", "exp2"): 0, ("mxfp4", "directp"): 1, ("mxfp4", "exp2"): 2,
                               ("fp8", "affine"): 4, ("mxfp4", "affine"): 5}
    assert routing.GLUON_P_MODES == (0, 4, 7)
    assert routing.TRAIN_P_MODES[("fp8", "affine")] == 6
    assert all(isinstance(m, PMode) for m in (*routing.P_MODES.values(), *routing.GLUON_P_MODES))


def test_every_preset_has_a_named_mode():
    modes = {name: routing.p_mode(r) for name, r in PRESETS.items() if routing.hopper_forward_unsupported(r, 128)
             is None}
    assert modes and all(isinstance(m, PMode) for m in modes.values())
    assert modes["directp-robust"] == PMode.MXFP4_DIRECTP_SINK
    assert modes["fp8-ktile-affine-lazy-fastacc"] == PMode.FP8_AFFINE_LAZY
    assert routing.p_mode(PRESETS["train-affine"]) == PMode.FP8_AFFINE_TRAINED


def test_kernel_constants_are_the_enum():
    pytest.importorskip("triton")
    from fp4attn.kernels import common

    for m in PMode:
        if hasattr(common, f"P_MODE_{m.name}"):
            assert getattr(common, f"P_MODE_{m.name}").value == m.value, m
    assert {m.name for m in PMode} - {"MXFP4_EXP2"} <= {n[len("P_MODE_"):] for n in dir(common)
                                                        if n.startswith("P_MODE_")}
