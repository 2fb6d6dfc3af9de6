"""What every kernel family shares: the key tile, the kernel head dims (a smaller one
zero-padded up: `kernel_head_dim`), the gradient formats the training kernels take, and
the rule on a recipe's shape that follows (`_shape_unsupported`)."""

from __future__ import annotations

from fp4attn.recipes import Recipe

# the Hopper forward's key tile: equals Recipe.block_n of every preset (the tile is part of
# the numerics), and the fused quantizers pad V^T's rows to a multiple of it
KEY_TILE = 128
HOPPER_HEAD_DIMS = (64, 128)
# the gradients' format (Recipe.grad) that every training kernel runs
TRAIN_GRAD_FORMATS = ("e4m3",)


def kernel_head_dim(head_dim: int) -> int | None:
    """The Hopper kernel head dim that runs `head_dim`: itself (64, 128), or for a
    smaller multiple of 16 the next one up, the inputs zero-padded. Padding is exact in
    every recipe: zero channels add nothing to a score, leave NVFP4's tensor amax, FP8's
    per-token amax and MXFP4 V's window unchanged, and come out as zero columns. Two
    robust fields depend on the head dim itself, so the inference launchers take the
    caller's: the Q/K fallback's statistic divides by it, and the rotation's Hadamard
    blocks are its. None above 128."""
    if head_dim % 16:
        return None
    return next((d for d in HOPPER_HEAD_DIMS if head_dim <= d), None)


def _shape_unsupported(recipe: Recipe, head_dim: int) -> str | None:
    """What every kernel family shares: consistent normalization, the key tile, the head
    dims (`kernel_head_dim`)."""
    if not recipe.consistent_norm:
        return "consistent_norm=False (kernels sum the represented P values)"
    if recipe.block_n != KEY_TILE:
        return f"block_n={recipe.block_n} (kernels tile {KEY_TILE} keys)"
    if kernel_head_dim(head_dim) is None:
        return (f"head_dim {head_dim} (kernels run multiples of 16 up to {HOPPER_HEAD_DIMS[-1]}; below 64 and 128 "
                "zero-padded)")
    return None
