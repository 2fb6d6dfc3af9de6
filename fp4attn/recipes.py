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
P_BUILDS = ("directp", "exp2", "affine")
GRAD_FORMATS = ("e4m3", "e5m2", "bf16")
ROTATIONS = ("hadamard",)
QK_FALLBACKS = ("fp8",)
K_SCALES = ("token", "tile")
RESCALES = ("exact", "lazy")


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
        p_build: "directp" classifies the log-score straight into the E2M1 codes of
            round-to-nearest of its exponential (only with p="mxfp4"); "exp2" computes
            2**x and rounds it; "affine" reads the code off one rounded affine map of the
            log-score, no exponential (p="mxfp4": the paper's fast Direct-P, E2M1 code
            RNE(2y + 2); p="fp8": the e4m3 byte RNE(8x + 119.5); `reference.affine`).
        k_scale: FP8 K's scale (qk="fp8" only). "token": one per key, as Q's. "tile": one
            per block_n keys of a (batch, head): each score's key factor is then a constant
            of its tile, which the CUDA forward folds into the row's one FMA instead of a
            product per score (docs/notes/affine-p.md).
        rescale: when the online softmax moves a row's reference point (affine FP8 P,
            inference only). "exact": to every tile's running maximum. "lazy": only when
            a score of the tile would need an e4m3 byte above 126 (448, the format's
            largest) measured from the point the row has: a row's point then stays put
            for most tiles, as FlashAttention-4's conditional rescaling, and the map's
            offset leaves the bytes room above it (`reference.affine.K_FP8_LAZY`). A kernel
            then builds P without waiting for the tile's maximum (docs/notes/affine-p.md).
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

    Outlier-robust operands (`fp4attn.reference.robust`; all exact in real arithmetic,
    measured in docs/notes/robust-numerics.md):
        smooth_k: subtract K's mean over the keys of each (batch, head) before
            quantizing (the softmax removes the shift).
        rotate_qk: "hadamard" multiplies Q and K along the head dim by one Walsh-Hadamard
            matrix after a fixed random sign vector (QK^T unchanged up to the power of
            two folded into the scale); None leaves them.
        smooth_v: subtract V's mean over the keys of each (batch, head, channel) before
            quantizing and add it to the output (exact with consistent_norm, which it
            requires).
        p_sink: MXFP4 P only. In each 32-key block the largest P (the key that ties the
            block's maximum log-score) is kept outside the block's shared scale as an
            e4m3 value, and the block scale is set by the block's next largest P. An
            attention sink (one key holding most of a row's probability) then no
            longer rounds the other keys of its block to zero. On Hopper P is an e4m3
            tile already, so this is a different classification, not another product.
        p_sink_keys: with p_sink, only the 32-key blocks of keys [0, p_sink_keys)
            (absolute key index, the same for every query row, causal or not) keep
            their top keys apart; the other blocks are plain Direct-P (or exp2) MXFP4.
            0: every block. Attention sinks are the first tokens (the BOS token,
            [CLS]), so the first key tile carries the remedy: the kernels then pay it on
            one tile instead of every tile. A multiple of block_n (the kernels switch
            the P builder per key tile).
        qk_fallback: "fp8" quantizes Q and K of a (batch, KV head) in FP8 (per token)
            instead of NVFP4 where their logits are too sharp for NVFP4:
            `robust.logit_std` above `qk_fallback_logit_std` (qk="nvfp4" only).
        qk_fallback_logit_std: the threshold of qk_fallback.
        qk_four_over_six: NVFP4 Q/K blocks scaled so that their amax maps to 4 or to 6,
            whichever represents the block with the smaller largest error
            (`formats.quantize_nvfp4(four_over_six=True)`); the same payload format.
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
    smooth_k: bool = False
    rotate_qk: str | None = None
    smooth_v: bool = False
    p_sink: bool = False
    p_sink_keys: int = 0
    qk_fallback: str | None = None
    qk_fallback_logit_std: float = 1.25
    qk_four_over_six: bool = False
    k_scale: str = "token"
    rescale: str = "exact"

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
        if self.k_scale not in K_SCALES:
            raise ValueError(f"Recipe.k_scale={self.k_scale!r} is not supported; accepted: {K_SCALES}")
        if self.k_scale == "tile" and self.qk != "fp8":
            raise ValueError(f"Recipe.k_scale='tile' scales FP8 K per key tile; it needs qk='fp8', got qk={self.qk!r}")
        if self.k_scale == "tile" and (self.grad is not None or self.smooth_k or self.rotate_qk is not None):
            raise ValueError("Recipe.k_scale='tile' is an inference form without K transforms: it needs grad=None, "
                             "smooth_k=False and rotate_qk=None")
        if self.rescale not in RESCALES:
            raise ValueError(f"Recipe.rescale={self.rescale!r} is not supported; accepted: {RESCALES}")
        if self.rescale == "lazy" and not (self.p_build == "affine" and self.p == "fp8" and self.grad is None):
            raise ValueError("Recipe.rescale='lazy' moves the affine FP8 map's reference point; it needs "
                             f"p_build='affine', p='fp8' and grad=None, got p_build={self.p_build!r}, p={self.p!r}, "
                             f"grad={self.grad!r}")
        if self.p_build == "affine" and self.p not in ("fp8", "mxfp4"):
            raise ValueError(f"p_build='affine' builds FP8 or MXFP4 P; got p={self.p!r}")
        if self.p_build == "affine" and self.grad is not None and self.p != "fp8":
            raise ValueError("p_build='affine' trains with FP8 P only (the backward rebuilds P by the same map of "
                             f"the normalized log-score); got p={self.p!r} with grad={self.grad!r}")
        if self.p_build == "affine" and self.p_sink:
            raise ValueError("Recipe.p_sink=True is defined for p_build='directp' or 'exp2'; got p_build='affine'")
        if self.grad is not None and self.grad not in GRAD_FORMATS:
            raise ValueError(f"Recipe.grad={self.grad!r} is not supported; accepted: {GRAD_FORMATS} or None")
        if self.fast_accum and self.qk != "fp8":
            raise ValueError(f"Recipe.fast_accum=True sums FP8 Q/K products on the FP8 tensor cores; it needs "
                             f"qk='fp8', got qk={self.qk!r}")
        if self.rotate_qk is not None and self.rotate_qk not in ROTATIONS:
            raise ValueError(f"Recipe.rotate_qk={self.rotate_qk!r} is not supported; accepted: {ROTATIONS} or None")
        if self.smooth_v and not self.consistent_norm:
            raise ValueError("Recipe.smooth_v=True is exact only with consistent_norm=True (the row sum of the "
                             "represented P); got consistent_norm=False")
        if self.p_sink and self.p != "mxfp4":
            raise ValueError(f"Recipe.p_sink=True changes MXFP4 P's block scales; it needs p='mxfp4', got "
                             f"p={self.p!r}")
        if self.qk_four_over_six and self.qk != "nvfp4":
            raise ValueError(f"Recipe.qk_four_over_six=True picks NVFP4 block scales; it needs qk='nvfp4', got "
                             f"qk={self.qk!r}")
        if self.qk_fallback is not None:
            if self.qk_fallback not in QK_FALLBACKS:
                raise ValueError(f"Recipe.qk_fallback={self.qk_fallback!r} is not supported; accepted: "
                                 f"{QK_FALLBACKS} or None")
            if self.qk != "nvfp4":
                raise ValueError(f"Recipe.qk_fallback replaces NVFP4 Q/K; it needs qk='nvfp4', got qk={self.qk!r}")
            if not self.qk_fallback_logit_std > 0:
                raise ValueError(f"Recipe.qk_fallback_logit_std must be positive, got {self.qk_fallback_logit_std}")
        if self.block_n <= 0 or self.block_n % 32:
            raise ValueError(f"Recipe.block_n must be a positive multiple of 32, got {self.block_n}")
        if self.p_sink_keys < 0 or self.p_sink_keys % self.block_n:
            raise ValueError(f"Recipe.p_sink_keys must be a non-negative multiple of block_n={self.block_n} "
                             f"(the kernels switch the P builder per key tile), got {self.p_sink_keys}")
        if self.p_sink_keys and not self.p_sink:
            raise ValueError(f"Recipe.p_sink_keys={self.p_sink_keys} limits p_sink to the first keys; it needs "
                             "p_sink=True (or p_sink_keys=0)")

    @property
    def robust(self) -> bool:
        """Whether any outlier-robust field is set (a kernel that lacks one must say so)."""
        return bool(self.smooth_k or self.rotate_qk or self.smooth_v or self.p_sink or self.qk_fallback
                    or self.qk_four_over_six)

    def with_(self, **changes) -> Recipe:
        """A copy with some fields changed (named "custom" unless a name is given)."""
        changes.setdefault("name", "custom")
        return replace(self, **changes)


ROBUST_FIELDS = ("smooth_k", "rotate_qk", "smooth_v", "p_sink", "qk_fallback", "qk_four_over_six")


def robust_fields(recipe: Recipe) -> tuple[str, ...]:
    """The outlier-robust fields `recipe` sets (those of ROBUST_FIELDS that are not off)."""
    return tuple(f for f in ROBUST_FIELDS if getattr(recipe, f) not in (False, None))


def robust_unsupported_reason(recipe: Recipe, supported: tuple[str, ...] = ()) -> str | None:
    """Why kernels that apply only the robust fields `supported` cannot run `recipe`
    (which would silently compute another recipe), or None: for the routing's reasons."""
    missing = [f for f in robust_fields(recipe) if f not in supported]
    if not missing:
        return None
    return (f"outlier-robust field{'s' if len(missing) > 1 else ''} {', '.join(missing)} of recipe "
            f"{recipe.name!r} (the kernels apply {', '.join(supported) or 'none of them'})")


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
        # outlier-robust presets: what the measurements of docs/notes/robust-numerics.md
        # justify (K smoothing for shared key offsets, the FP8 Q/K fallback for heads
        # whose logits are too sharp for NVFP4, 4-or-6 NVFP4 block scales; for Direct-P
        # also the sink-aware P blocks and FP8 V, which keeps an attention sink's small
        # value vector)
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="exp2", smooth_k=True, qk_fallback="fp8",
               qk_four_over_six=True, name="nvfp4-fp8-robust"),
        # (p_sink on the first key tile only: sinks are the first tokens, and the remedy's
        # instructions are then paid on one tile, not on every tile)
        Recipe(qk="nvfp4", p="mxfp4", v="fp8", p_build="directp", smooth_k=True, p_sink=True, p_sink_keys=128,
               qk_fallback="fp8", qk_four_over_six=True, name="directp-robust"),
        # training: the two fields the training kernels' NVFP4 payload can carry (the FP8
        # fallback would need FP8 Q/K views in the backward kernels)
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="exp2", grad="e4m3", smooth_k=True, qk_four_over_six=True,
               name="train-robust"),
        # P from one affine map of the log-score, no exponential (reference/affine.py): the
        # paper's fast Direct-P (E2M1 codes), with NVFP4 or FP8 Q/K, and its FP8 form (the
        # e4m3 byte read off 8x + 119.5); docs/notes/affine-p.md measures them
        Recipe(qk="nvfp4", p="mxfp4", v="mxfp4", p_build="affine", name="directp-fast"),
        Recipe(qk="fp8", p="mxfp4", v="mxfp4", p_build="affine", name="fp8-directp-fast"),
        Recipe(qk="fp8", p="mxfp4", v="mxfp4", p_build="affine", fast_accum=True, name="fp8-directp-fast-fastacc"),
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="affine", name="fp8-affine"),
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="affine", fast_accum=True, name="fp8-affine-fastacc"),
        # and with FP8 K scaled per key tile: the CUDA forward then builds each FP8 P byte with
        # one FMA and one max, no product by a key's own scale (docs/notes/affine-p.md)
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="affine", k_scale="tile", fast_accum=True,
               name="fp8-ktile-affine-fastacc"),
        # and with the rows' points moved only when a byte would not fit (Recipe.rescale): the
        # CUDA forward then builds P without waiting for each tile's maximum
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="affine", k_scale="tile", fast_accum=True, rescale="lazy",
               name="fp8-ktile-affine-lazy-fastacc"),
        # FP8 training for Hopper: per-token e4m3 Q/K (QK^T summed exactly: the kernels multiply
        # the e4m3 values on the bf16 tensor cores), FP8 P/V, e4m3 gradient products; trained
        # on the Hopper training kernels (their per-token-scale forms) and the reference
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="exp2", grad="e4m3", name="train-fp8"),
        # training with affine FP8 P: the forward's codes from one affine map of the log-score
        # (no exponential), and the backward P from the same map of t - LSE, for dV and dS
        # alike (no exponential there either; `reference.backward`)
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="affine", grad="e4m3", name="train-affine"),
    )
}


# The recipe `fp4attn.attention`, `patch_sdpa`, the diffusers processor and the plain
# "fp4attn" transformers name run unless told otherwise: FP8 Q/K summed on the FP8 tensor
# cores, FP8 P read off the affine map, FP8 V per channel. It keeps `fp8`'s accuracy on
# every measured family (docs/accuracy.md: hard 0.9948, attention sink 0.9987, all-MiniLM
# layers min cos 0.9990) where the paper presets lose it (`directp`: hard 0.886, sink 0.685,
# MiniLM 1st-percentile row cos -0.02), runs 1.33x cuDNN bf16 on the H200, and has kernels
# on every GPU target (sm_90, sm_100/103, sm_120); the faster `fp8-ktile-affine-lazy-fastacc`
# (1.50x) loses 0.006 on the hard inputs and runs on Hopper only (the reference elsewhere).
DEFAULT_RECIPE = "fp8-affine-fastacc"


def training_presets() -> list[str]:
    """The presets with a backward (`Recipe.grad` not None), in the table's order."""
    return [name for name, r in PRESETS.items() if r.grad is not None]


def inference_only_message(recipe: Recipe) -> str:
    """What a backward through inference-only `recipe` says: which presets train."""
    return (f"recipe {recipe.name!r} is inference-only (Recipe.grad=None): it has no backward. Train with a "
            f"recipe that has one ({', '.join(map(repr, training_presets()))}, or a fp4attn.Recipe with grad "
            "set), or run the forward under torch.no_grad()")


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
