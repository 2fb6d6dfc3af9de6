"""The variant codes the kernels compile, as enums: how P is built (`PMode`; a recipe's
`p_mode` and `p_sink_tiles`), where the Gluon forward issues the next QK^T
(`WSOverlap`), how the Gluon dK/dV kernel stages a tile's numbers (`DkdvStaged`). The
launchers pass them as the Triton and Gluon constexprs; the CUDA forward's builds are
keyed by P mode."""

from __future__ import annotations

import enum

from fp4attn.recipes import Recipe
from fp4attn.routing.common import KEY_TILE


class PMode(enum.IntEnum):
    """How a kernel builds P: the P_MODE constexpr the launchers pass to the Triton and
    Gluon kernels (which compare it with `kernels.common`'s P_* constants, these values),
    and the key of the CUDA forward's builds (`forward_cuda.P_MODE_BUILDS`)."""

    FP8_EXP2 = 0  # FP8 P from exp2
    MXFP4_DIRECTP = 1  # MXFP4 P classified straight from the log-score (Direct-P)
    MXFP4_EXP2 = 2  # MXFP4 P from exp2
    MXFP4_DIRECTP_SINK = 3  # Direct-P, each block's top key apart in the first key tiles (Recipe.p_sink)
    FP8_AFFINE = 4  # FP8 P read off one affine map of the log-score, no exp (reference/affine.py)
    MXFP4_AFFINE = 5  # MXFP4 P off the affine map
    FP8_AFFINE_TRAINED = 6  # affine FP8 P measured from the integer grid, rebuilt so by the backward
    FP8_AFFINE_LAZY = 7  # affine FP8 P whose row point moves only when a byte would not fit (rescale="lazy")


# the forward kernels' P builders, by (Recipe.p, Recipe.p_build)
P_MODES = {("fp8", "exp2"): PMode.FP8_EXP2, ("mxfp4", "directp"): PMode.MXFP4_DIRECTP,
           ("mxfp4", "exp2"): PMode.MXFP4_EXP2, ("fp8", "affine"): PMode.FP8_AFFINE,
           ("mxfp4", "affine"): PMode.MXFP4_AFFINE}
# the P modes the Gluon warp-specialized kernel runs: FP8 P from exp2 and from the affine map
# (reference/affine.py); MXFP4 P ran there no faster than on the Triton kernel
# (docs/notes/hopper-forward.md)
GLUON_P_MODES = (PMode.FP8_EXP2, PMode.FP8_AFFINE, PMode.FP8_AFFINE_LAZY)
# the training kernels' P modes: as P_MODES, but a trained affine FP8 P measures its codes
# from the integer grid (P_MODE 6: `kernels.common.affine_reference_point`), from which the
# backward rebuilds them given the LSE (`reference.affine.snap_max`, `reference.backward`);
# the Triton kernels build it (forward and backward), not the Gluon, CUDA or sm_100 ones
P_MODE_AFFINE_TRAINED = PMode.FP8_AFFINE_TRAINED
# affine FP8 P with Recipe.rescale="lazy" (`kernels.common.lazy_reference_point`)
P_MODE_AFFINE_LAZY = PMode.FP8_AFFINE_LAZY
TRAIN_P_MODES = {**P_MODES, ("fp8", "affine"): P_MODE_AFFINE_TRAINED}
# Direct-P with each block's top key apart (Recipe.p_sink), which `p_mode` gives
P_MODE_DIRECTP_SINK = PMode.MXFP4_DIRECTP_SINK


class WSOverlap(enum.IntEnum):
    """Where the Gluon warp-specialized forward issues the next tile's QK^T (its OVERLAP
    constexpr, `forward_gluon_ws._ws_consumer`); one wait retires it with PV either way.

    BESIDE_PV: right after PV_j, so the tensor cores run the two back to back (S_{j+1},
        PV_j and O live together; no softmax temporaries beside them).
    BEFORE_SOFTMAX: before tile j's softmax, which then hides it (S_j, S_{j+1} and O live
        together through the softmax): faster where QK^T is long (bf16 QK^T, causal).
    """

    BESIDE_PV = 1
    BEFORE_SOFTMAX = 4


class DkdvStaged(enum.IntEnum):
    """How a tile's numbers (LSE, delta, dO's token scales, the channel scales) reach the
    Gluon dK/dV kernel's wgmma layouts (its STAGED constexpr, `backward_gluon.py`).

    TOGETHER: stored to shared memory together at the top of the tile and loaded from there
        (one CTA barrier for all of them).
    ASYNC_AHEAD: copied asynchronously into two-stage shared buffers a tile ahead (no
        registers held across the tile's products).
    """

    TOGETHER = 1
    ASYNC_AHEAD = 2


# A plan's launch and flags as `explain` reports them: sizes, flags, enum names (None: a
# register limit left to ptxas)
Variant = dict[str, int | bool | str | None]


def _mode_name(p_mode: int) -> str:
    """A P mode by name in a plan's reason (a number that names none, as it is)."""
    try:
        return PMode(p_mode).name
    except ValueError:
        return str(p_mode)


def trained_affine(recipe: Recipe) -> bool:
    """Whether `recipe` builds the trained affine FP8 P (P_MODE 6: codes measured from the
    integer grid, `reference.affine.snap_max(..., trained=True)`), forward and backward."""
    return recipe.p_build == "affine" and recipe.p == "fp8" and recipe.grad is not None


def p_mode(recipe: Recipe) -> PMode:
    """The forward kernels' P_MODE for `recipe` (`P_MODES`; MXFP4_DIRECTP_SINK for p_sink's
    Direct-P, FP8_AFFINE_TRAINED for the trained affine FP8 P, FP8_AFFINE_LAZY for lazy
    rescaling)."""
    if trained_affine(recipe):
        return P_MODE_AFFINE_TRAINED
    if recipe.rescale == "lazy":
        return P_MODE_AFFINE_LAZY
    if recipe.p_sink:
        if recipe.p_build != "directp":
            raise ValueError(f"the Hopper kernels build p_sink P by Direct-P only, got p_build={recipe.p_build!r}")
        return P_MODE_DIRECTP_SINK
    return P_MODES[(recipe.p, recipe.p_build)]


def p_sink_tiles(recipe: Recipe) -> int:
    """The forward kernels' SINK_TILES for `recipe`: with P_MODE 3, the number of first
    key tiles that keep the blocks' top keys apart (`Recipe.p_sink_keys`; 0, every tile).
    The kernels tile KEY_TILE keys, which `_shape_unsupported` requires of block_n."""
    if not recipe.p_sink or not recipe.p_sink_keys:
        return 0
    if recipe.p_sink_keys % KEY_TILE:
        raise ValueError(f"p_sink_keys={recipe.p_sink_keys} is not a whole number of the kernels' {KEY_TILE}-key "
                         "tiles")
    return recipe.p_sink_keys // KEY_TILE
