"""The Blackwell families (sm_100/sm_103, and consumer sm_120/sm_121): the launch tables
of the forward and of the training backward's Triton kernels, what the kernels take
(`blackwell_forward_unsupported`, `blackwell_train_unsupported`), and their names as
`explain` reports them."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from fp4attn.recipes import Recipe, robust_unsupported_reason
from fp4attn.routing import targets
from fp4attn.routing.common import TRAIN_GRAD_FORMATS, _shape_unsupported, kernel_head_dim
from fp4attn.routing.hopper_tables import BackwardLaunch
from fp4attn.routing.variants import trained_affine


@dataclass(frozen=True)
class BlackwellLaunch:
    """Launch shape of the Blackwell forward (`kernels.blackwell.forward_triton`); speed
    only. block_m rows per program on 128-lane tensor memory, warps (of the softmax
    partition where pipelined), pipeline stages; pipelined: the warp-specialized
    schedule (its PIPELINED constexpr: loads and MMA issue, softmax and the O correction
    in partitions that run at once), else one program's warps do all of it in turn."""

    block_m: int = 128
    warps: int = 4
    stages: int = 3
    pipelined: bool = True


# Keyed by (head dim, causal, key mask); not measured (no Blackwell GPU has run these
# kernels): chosen from the sm_100a builds, each with its reason in docs/notes/blackwell.md,
# "Launches". Every entry: the pipelined kernel, 4 warps a partition, 3 stages, which builds
# every routed recipe without a spill. SERIAL_BLACKWELL_LAUNCH, the kernel it replaced (8
# warps doing everything in turn), stays reachable by `override_blackwell_launch`.
BLACKWELL_FORWARD_LAUNCH: dict[tuple[int, bool, bool], BlackwellLaunch] = {
    (d, causal, key_mask): BlackwellLaunch() for d in (64, 128) for causal in (False, True) for key_mask in (False, True)
}
SERIAL_BLACKWELL_LAUNCH = BlackwellLaunch(warps=8, stages=2, pipelined=False)

_BLACKWELL_OVERRIDE: contextvars.ContextVar[BlackwellLaunch | None] = contextvars.ContextVar("blackwell_launch",
                                                                                            default=None)


@contextlib.contextmanager
def override_blackwell_launch(launch: BlackwellLaunch) -> Iterator[None]:
    """Run the Blackwell forward with `launch` instead of the table's, in this thread
    (and context) only: `with override_blackwell_launch(SERIAL_BLACKWELL_LAUNCH): ...`
    times or checks the serial kernel against the pipelined one."""
    if not isinstance(launch, BlackwellLaunch):
        raise TypeError(f"override_blackwell_launch takes a BlackwellLaunch, got {type(launch).__name__}")
    token = _BLACKWELL_OVERRIDE.set(launch)
    try:
        yield
    finally:
        _BLACKWELL_OVERRIDE.reset(token)


# Consumer Blackwell (sm_120 / sm_121: RTX 50xx, RTX PRO 6000, DGX Spark), keyed by (head
# dim, key mask); not measured: no tensor memory (accumulators in registers), so the serial
# kernel, each entry the smallest program of the sm_120a builds that no routed recipe
# spills in, causal or not (the spills of the larger ones: docs/notes/blackwell.md, "Launches").
SM120_FORWARD_LAUNCH: dict[tuple[int, bool], BlackwellLaunch] = {
    (64, False): BlackwellLaunch(block_m=64, warps=8, stages=1, pipelined=False),
    (64, True): BlackwellLaunch(block_m=32, warps=4, stages=1, pipelined=False),
    (128, False): BlackwellLaunch(block_m=32, warps=4, stages=2, pipelined=False),
    (128, True): BlackwellLaunch(block_m=32, warps=4, stages=2, pipelined=False),
}
CONSUMER_BLACKWELL_TARGETS = ("sm_120", "sm_121")


def blackwell_forward_launch(head_dim: int, causal: bool, key_mask: bool = False,
                             target: str = "sm_100") -> BlackwellLaunch:
    """The Blackwell forward's launch for this kernel head dim, masking and target
    (consumer Blackwell: `SM120_FORWARD_LAUNCH`), or the one `override_blackwell_launch`
    set."""
    override = _BLACKWELL_OVERRIDE.get()
    if override is not None:
        return override
    if target in CONSUMER_BLACKWELL_TARGETS:
        return SM120_FORWARD_LAUNCH[head_dim, key_mask]
    return BLACKWELL_FORWARD_LAUNCH[head_dim, causal, key_mask]


# The training backward's Triton kernels (`kernels/backward_triton.py`) at their Blackwell
# launch (`kernels.blackwell.train_op`), keyed by head dim; no TMA or Gluon paths (Hopper's
# wgmma code). Not measured: chosen from the sm_100a builds (the spills of the others:
# docs/notes/blackwell.md, "Launches"): dK/dV 64-key programs of 8 warps and one stage, the
# only shape without a spill; dQ 128-query programs, whose S is the block-scaled FP4 product
# (qk_fp4_dq: tcgen05 builds it for 128 rows only); dK/dV's scores that product too where it
# builds without a spill, at D=64 (qk_fp4_dkdv).
BLACKWELL_BACKWARD_LAUNCH: dict[int, BackwardLaunch] = {
    d: BackwardLaunch(block_n_dkdv=64, block_m_dq=128, warps_dkdv=8, warps_dq=8, stages_dkdv=1, stages_dq=2,
                      tma=False, dkdv_gluon=False, dq_gluon=False, qk_fp4_dq=True, qk_fp4_dkdv=d == 64)
    for d in (64, 128)
}


def blackwell_backward_launch(head_dim: int) -> BackwardLaunch:
    """The Blackwell backward's launch at this kernel head dim (the e4m3 rounding by
    bit arithmetic under the interpreter, which runs no inline PTX)."""
    from dataclasses import replace

    return replace(BLACKWELL_BACKWARD_LAUNCH[head_dim], hw_cvt=not targets.interpreting())


# datacenter Blackwell: B200/GB200 (compute capability 10.0) and B300/GB300 (10.3); the
# kernels build for sm_100a and sm_103a alike (`fp4attn compile-report --arch sm_103a`)
BLACKWELL_TARGETS = ("sm_100", "sm_103")

# the robust fields the Blackwell forward applies (in its quantizers: the reference's
# `robust_qk`); K smoothing and 4/6 scales also in training (the saved NVFP4 payload)
BLACKWELL_FORWARD_ROBUST_FIELDS = ("smooth_k", "rotate_qk", "qk_four_over_six")

# the Blackwell forward's (P, P build, V): MXFP4 P by Direct-P or by the affine map with
# MXFP4 V on the FP4 tensor cores, or FP8 P from exp2 or the affine map with FP8 V on
# the FP8 tensor cores (the P_AFFINE constexpr)
BLACKWELL_PV = (("mxfp4", "directp", "mxfp4"), ("mxfp4", "affine", "mxfp4"), ("fp8", "exp2", "fp8"),
                ("fp8", "affine", "fp8"))


def blackwell_forward_unsupported(recipe: Recipe, head_dim: int, mask: str = "none",
                                  target: str = "sm_100") -> str | None:
    """Why the Blackwell forward cannot run `recipe` at `head_dim` with this mask kind
    ("none", "key"; see `KernelFamily`) on `target`, or None. Every launch it routes
    builds without a spill (the pipelined kernel on sm_100/sm_103, the consumer launches
    on sm_120), so no rule here is about registers."""
    if trained_affine(recipe):
        return "the trained affine FP8 P (its integer reference grid: the Hopper Triton kernels build it)"
    if recipe.rescale != "exact":
        return f"rescale={recipe.rescale!r} (the Blackwell kernels move the reference point at every tile)"
    robust = robust_unsupported_reason(recipe, BLACKWELL_FORWARD_ROBUST_FIELDS)
    if robust is not None:
        return robust
    if recipe.k_scale != "token":
        return f"k_scale={recipe.k_scale!r} (the Blackwell quantizers scale FP8 K per token)"
    if recipe.qk not in ("fp8", "nvfp4"):
        return f"Q/K format {recipe.qk!r} (Blackwell kernels run 'fp8' and 'nvfp4')"
    if (recipe.p, recipe.p_build, recipe.v) not in BLACKWELL_PV:
        return (f"P {recipe.p!r} built by {recipe.p_build!r} with V {recipe.v!r} (Blackwell kernels run "
                f"{list(BLACKWELL_PV)})")
    return _shape_unsupported(recipe, head_dim)


BLACKWELL_TRAIN_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six")


def blackwell_train_unsupported(recipe: Recipe, head_dim: int, mask: str = "none") -> str | None:
    """Why the Blackwell training kernels cannot train `recipe` at `head_dim`, or None."""
    if recipe.grad is None:
        return f"recipe {recipe.name!r} is inference-only (grad=None)"
    if recipe.grad not in TRAIN_GRAD_FORMATS:
        return f"gradient format {recipe.grad!r} (kernels run {TRAIN_GRAD_FORMATS})"
    if recipe.qk != "nvfp4":
        return f"Q/K format {recipe.qk!r} for training (kernels train 'nvfp4' Q/K)"
    if recipe.p == "mxfp4" and kernel_head_dim(head_dim) == 128:
        # its dK/dV build with Direct-P spills on sm_100a (255 registers, 244 bytes)
        return "MXFP4 P in training at head_dim 128 (the Blackwell dK/dV build would spill registers)"
    # the robust fields the training quantizers put into the saved NVFP4 payload
    robust = robust_unsupported_reason(recipe, BLACKWELL_TRAIN_ROBUST_FIELDS)
    if robust is not None:
        return robust
    return blackwell_forward_unsupported(recipe.with_(smooth_k=False, qk_four_over_six=False), head_dim, mask)


def _blackwell_train_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                            on_cuda: bool = True) -> str:
    return (f"{_blackwell_forward_kernel(recipe, head_dim, causal, mask)} + backward_triton.dkdv + "
            "backward_triton.dq (built for sm_100a; dQ's S, and at head_dim 64 dK/dV's, by the block-scaled "
            "FP4 product)")


def _sm120_forward_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                          on_cuda: bool = True) -> str:
    qk = "NVFP4 QK^T (mma.sync kind::mxf4nvf4)" if recipe.qk == "nvfp4" else "FP8 QK^T (mma.sync)"
    build = {"directp": "Direct-P", "affine": "affine", "exp2": "exp2"}[recipe.p_build]
    pv = f"{build} MXFP4 PV (mma.sync kind::mxf4nvf4)" if recipe.p == "mxfp4" else f"{build} FP8 PV (mma.sync)"
    return f"blackwell.forward_triton (sm_120 serial, {qk}, {pv})"


def _blackwell_forward_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                              on_cuda: bool = True) -> str:
    qk = "NVFP4 QK^T (kind::mxf4nvf4)" if recipe.qk == "nvfp4" else "FP8 QK^T (kind::f8f6f4)"
    build = {"directp": "Direct-P", "affine": "affine", "exp2": "exp2"}[recipe.p_build]
    pv = f"{build} MXFP4 PV (kind::mxf4)" if recipe.p == "mxfp4" else f"{build} FP8 PV (kind::f8f6f4)"
    dk = kernel_head_dim(head_dim)
    serial = dk is not None and not blackwell_forward_launch(dk, causal, mask == "key").pipelined
    return f"blackwell.forward_triton ({'serial' if serial else 'pipelined'}, {qk}, {pv})"
