"""The kernel families and a call's route: `KERNEL_FAMILIES` in order (the first family
of the call's target and direction that takes it runs it, else the reference, with the
reason); `route` decides, its `Route` is what `explain` returns and what the api
launches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fp4attn.recipes import Recipe
from fp4attn.routing import targets
from fp4attn.routing.blackwell import (
    BLACKWELL_TARGETS,
    CONSUMER_BLACKWELL_TARGETS,
    _blackwell_forward_kernel,
    _blackwell_train_kernel,
    _sm120_forward_kernel,
    blackwell_forward_unsupported,
    blackwell_train_unsupported,
)
from fp4attn.routing.hopper import (
    _hopper_forward_kernel,
    _hopper_forward_plans,
    _hopper_train_kernel,
    _hopper_train_plans,
    _plan_names,
    hopper_forward_unsupported,
    hopper_train_unsupported,
)
from fp4attn.routing.targets import TARGET_ENV, requested_backend, target_of


@dataclass(frozen=True)
class KernelFamily:
    """Kernels of one target and direction. `masks` are the mask kinds they take ("none",
    "key" for a key-padding mask; never "other"); `unsupported(recipe, head_dim, mask)`
    says why they cannot run a call with one of those, or None; `kernel(recipe, head_dim,
    causal, mask, keys, on_cuda)` names what runs; `plans`, with the same arguments, the
    plans that decide it, where the family has them (Hopper: `ForwardPlan`,
    `BackwardPlan`), which the route carries; `launcher` is the "module:function" the api
    calls."""

    name: str
    targets: tuple[str, ...]
    train: bool
    unsupported: Callable[[Recipe, int, str], str | None]
    kernel: Callable[[Recipe, int, bool, str, int, bool], str]
    launcher: str
    masks: tuple[str, ...] = field(default=("none", "key"))
    plans: Callable[[Recipe, int, bool, str, int, bool], tuple] | None = None


def _mask_unsupported(family: KernelFamily, mask: str) -> str | None:
    """Why `family` cannot take a mask of this kind, or None."""
    if mask in family.masks:
        return None
    if mask == "other":
        return "an attn_mask that is not a key mask (the kernels take key masks, broadcastable as (B, 1, 1, Sk), for now)"
    return "an attn_mask with a backward (the backward kernels take causal masks only, for now)"


# In order: the first family whose target matches and that accepts the call runs it.
KERNEL_FAMILIES: list[KernelFamily] = [
    KernelFamily("hopper-train", ("sm_90",), True, lambda r, d, m: hopper_train_unsupported(r, d),
                 _hopper_train_kernel, "fp4attn.kernels.hopper.train_op:hopper_train_attention", ("none",),
                 plans=_hopper_train_plans),
    KernelFamily("hopper-forward", ("sm_90",), False, lambda r, d, m: hopper_forward_unsupported(r, d),
                 _hopper_forward_kernel, "fp4attn.kernels.hopper.forward_op:hopper_attention",
                 plans=_hopper_forward_plans),
    KernelFamily("blackwell-train", BLACKWELL_TARGETS, True, blackwell_train_unsupported,
                 _blackwell_train_kernel, "fp4attn.kernels.blackwell.train_op:blackwell_train_attention", ("none",)),
    KernelFamily("blackwell-forward", BLACKWELL_TARGETS, False, blackwell_forward_unsupported,
                 _blackwell_forward_kernel, "fp4attn.kernels.blackwell.forward_op:blackwell_attention"),
    # inference only: the training backward has no sm_120 launch yet
    KernelFamily("consumer-blackwell-forward", CONSUMER_BLACKWELL_TARGETS, False,
                 lambda r, d, m: blackwell_forward_unsupported(r, d, m, "sm_120"), _sm120_forward_kernel,
                 "fp4attn.kernels.blackwell.forward_op:blackwell_attention"),
]


@dataclass(frozen=True)
class Route:
    """What a call runs: `backend` ("triton" or "reference"), `kernel` (the kernels'
    names, or "reference"), `target`, `reason` (why this backend), the `family`
    whose launcher the api calls (None on the reference), and the `plans` that named
    the kernels, where the family has them (Hopper's: each kernel's variant and why)."""

    backend: str
    kernel: str
    target: str
    reason: str
    family: KernelFamily | None = None
    plans: tuple = ()

    def as_dict(self) -> dict:
        out: dict[str, object] = {"backend": self.backend, "kernel": self.kernel, "target": self.target,
                                  "reason": self.reason,
                                  "launcher": self.family.launcher if self.family else None}
        if self.plans:
            out["plan"] = [p.as_dict() for p in self.plans]
        return out


def route(recipe: Recipe, *, device, head_dim: int, causal: bool, needs_grad: bool, mask: str,
          backend: str = "auto", keys: int = 0) -> Route:
    """The route of a call: kernels where a family of the call's target accepts it,
    else the reference, with the reason. `mask` is "none", "key" or "other" (see
    `KernelFamily`); `backend` as `fp4attn.attention`'s ("triton" raises where no
    kernel runs the call); `keys`, the call's key count (some launches depend on it)."""
    backend = requested_backend(backend)
    target = target_of(device)
    if backend == "reference":
        return Route("reference", "reference", target, "backend='reference' was asked for")
    device_type = device if isinstance(device, str) else device.type
    reasons = []
    if device_type != "cuda" and not targets.interpreting():
        reasons.append(f"inputs on {device_type} (kernels need CUDA, or TRITON_INTERPRET=1 with {TARGET_ENV}=sm_90: "
                       "the Hopper Triton kernels under the interpreter, slowly)")
    else:
        families = [f for f in KERNEL_FAMILIES if target in f.targets and f.train == needs_grad]
        if not families:
            what = "training kernels" if needs_grad else "kernels"
            reasons.append(f"no {what} are built for target {target}")
        for fam in families:
            why = _mask_unsupported(fam, mask) or fam.unsupported(recipe, head_dim, mask)
            if why is None:
                args = (recipe, head_dim, causal, mask, keys, device_type == "cuda")
                plans = fam.plans(*args) if fam.plans else ()
                return Route("triton", _plan_names(plans) if plans else fam.kernel(*args), target,
                             f"{fam.name} kernels run recipe {recipe.name!r} at head_dim {head_dim} on {target}",
                             fam, plans)
            reasons.append(f"a backward is needed and {why}" if needs_grad else why)
    reason = "; ".join(reasons)
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run recipe {recipe.name!r}: {reason}")
    return Route("reference", "reference", target, reason)
