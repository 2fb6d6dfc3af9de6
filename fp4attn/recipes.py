"""Recipes: the format of each attention operand and how P is built.

A recipe is data. The pure-PyTorch reference (`fp4attn.reference`) defines its numerics;
a kernel either reproduces a recipe (same codes and scales, fp32 sums in another order)
or is a different recipe with its own name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

QK_FORMATS = ("nvfp4", "fp8", "bf16")
P_FORMATS = ("mxfp4", "fp8", "bf16")
V_FORMATS = ("mxfp4", "fp8", "bf16")
P_BUILDS = ("directp", "exp2")
GRAD_FORMATS = ("e4m3", "e5m2", "bf16")


@dataclass(frozen=True)
class Recipe:
    """Formats of the attention operands.

    Attributes:
        qk: Q and K format. "nvfp4": E2M1 x E4M3 scale per 16 along the head dim x fp32
            tensor scale. "fp8": e4m3 with one fp32 scale per token. "bf16".
        p: format of the probability tile. "mxfp4": E2M1 x E8M0 scale per 32 keys.
            "fp8": e4m3 (P scaled by 2**8). "bf16".
        v: V format. "mxfp4": E2M1 x E8M0 scale per 32 keys. "fp8": e4m3 with one fp32
            scale per channel. "bf16".
        p_build: "directp" classifies the log-score straight into E2M1 codes (only with
            p="mxfp4"); "exp2" computes 2**x and rounds it.
        consistent_norm: the softmax denominator sums the represented P values (those
            the PV product consumes) rather than the unrounded exponentials.
        grad: format of the gradient products' operands in the backward; None for an
            inference-only recipe.
        block_n: keys per tile of the online softmax (a multiple of 32).
        fast_accum: FP8 Q/K only. False (the presets "fp8", "fp8-directp"): QK^T is
            the float32 sum of the exact e4m3 products, as the reference computes it;
            the Hopper kernels multiply the e4m3 values on the bf16 tensor cores, which
            hold them exactly and accumulate in float32. True ("fp8-fastacc",
            "fp8-directp-fastacc"): the products are summed on the FP8 tensor cores
            over the whole head dim, with the tensor core's own accumulation (fewer
            bits than float32; as torch._scaled_mm's use_fast_accum=True, FlashAttention-3's
            and cuDNN's FP8 attention), each key tile's PV still added in float32. That
            is a different recipe: no reference reproduces the tensor core's sums, the
            reference computes the exact ones, and the measured fraction of P codes
            identical to them is below 1 (docs/numerics.md).
    """

    qk: str = "nvfp4"
    p: str = "mxfp4"
    v: str = "mxfp4"
    p_build: str = "directp"
    consistent_norm: bool = True
    grad: str | None = None
    block_n: int = 128
    name: str = "custom"
    fast_accum: bool = False

    def __post_init__(self) -> None:
        for field, value, accepted in (
            ("qk", self.qk, QK_FORMATS),
            ("p", self.p, P_FORMATS),
            ("v", self.v, V_FORMATS),
            ("p_build", self.p_build, P_BUILDS),
        ):
            if value not in accepted:
                raise ValueError(f"Recipe.{field}={value!r} is not supported; accepted: {accepted}")
        if self.p_build == "directp" and self.p != "mxfp4":
            raise ValueError(f"p_build='directp' builds MXFP4 P only; got p={self.p!r} (use p_build='exp2')")
        if self.grad is not None and self.grad not in GRAD_FORMATS:
            raise ValueError(f"Recipe.grad={self.grad!r} is not supported; accepted: {GRAD_FORMATS} or None")
        if self.fast_accum and self.qk != "fp8":
            raise ValueError(f"Recipe.fast_accum=True sums FP8 Q/K products on the FP8 tensor cores; it needs "
                             f"qk='fp8', got qk={self.qk!r}")
        if self.block_n <= 0 or self.block_n % 32:
            raise ValueError(f"Recipe.block_n must be a positive multiple of 32, got {self.block_n}")

    def with_(self, **changes) -> Recipe:
        """A copy with some fields changed (named "custom" unless a name is given)."""
        changes.setdefault("name", "custom")
        return replace(self, **changes)


PRESETS: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(qk="nvfp4", p="mxfp4", v="mxfp4", p_build="directp", name="directp"),
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="exp2", name="nvfp4-fp8"),
        Recipe(qk="fp8", p="mxfp4", v="mxfp4", p_build="directp", name="fp8-directp"),
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="exp2", name="fp8"),
        Recipe(qk="fp8", p="mxfp4", v="mxfp4", p_build="directp", fast_accum=True, name="fp8-directp-fastacc"),
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="exp2", fast_accum=True, name="fp8-fastacc"),
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="exp2", grad="e4m3", name="train"),
        Recipe(qk="nvfp4", p="mxfp4", v="mxfp4", p_build="directp", grad="e4m3", name="train-mxfp4pv"),
        Recipe(qk="bf16", p="bf16", v="bf16", p_build="exp2", consistent_norm=False, grad="bf16", name="bf16"),
    )
}


def preset_names(on_kernels: bool) -> list[str]:
    """The presets worth running where they run: all of them on the Hopper kernels; on
    the reference, without the fast-accumulation ones, which it computes exactly, as
    their exact forms (`Recipe.fast_accum`)."""
    return [name for name, r in PRESETS.items() if on_kernels or not r.fast_accum]


def get_recipe(recipe: str | Recipe) -> Recipe:
    """The preset named `recipe`, or `recipe` itself if it is a Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str) or recipe not in PRESETS:
        raise ValueError(f"unknown recipe {recipe!r}; accepted: a fp4attn.Recipe or one of {tuple(PRESETS)}")
    return PRESETS[recipe]
