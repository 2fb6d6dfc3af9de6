"""The Hopper forward's plan: which kernel runs a call (the CUDA C++ kernel, the Gluon
warp-specialized one or the Triton one), with which variant, and why, decided once from
the call's data (`hopper_forward_plan` -> `ForwardPlan`). `explain` reports it,
`forward_op.launch_forward` executes it and decides nothing."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from fp4attn.routing import capability
from fp4attn.routing.hopper_tables import _FORWARD_OVERRIDE, FORWARD_LAUNCH, ForwardLaunch, forward_launch
from fp4attn.routing.variants import GLUON_P_MODES, PMode, Variant, _mode_name


def _cuda_forward_refusal(launch: ForwardLaunch, p_mode: int, keys: int, on_cuda: bool, training: bool = False,
                          queries: int | None = None, write_p: bool = False,
                          unavailable: str | None = None) -> str | None:
    """Why the forward does not run on the CUDA C++ kernel, or None where it does: the P
    mode's key count in `cuda_from_keys` reached, not a training forward, no debug tiles,
    at least one query row, CUDA tensors where the CUDA kernels build (`unavailable`: the
    probe's answer, `cuda_kernels_unavailable`)."""
    n = launch.cuda_keys(p_mode)
    if training:
        return "a training forward, whose backward rebuilds P as the Triton and Gluon kernels build it"
    if not n:
        return f"P mode {_mode_name(p_mode)} is not in the launch's cuda_from_keys"
    if keys < n:
        return f"{keys} keys, below the launch's {n} for P mode {_mode_name(p_mode)}"
    if write_p:
        return "write_p (the P tiles are the Triton kernel's)"
    if queries is not None and queries < 1:
        return "no query rows"
    if not on_cuda:
        return "not CUDA tensors"
    return unavailable


def use_cuda_forward(launch: ForwardLaunch, p_mode: int, keys: int, on_cuda: bool, training: bool = False) -> bool:
    """Whether the forward runs on the CUDA C++ kernel (`ForwardLaunch.cuda_from_keys`; the
    launch is the table's for the recipe's Q/K: e4m3 for `fast_accum`, else bf16). Never for
    a training forward (`training`): its backward rebuilds P as the Triton kernels build it
    (the CUDA kernel's build of their arithmetic measured no faster for training:
    docs/notes/hopper-train.md). `hopper_forward_plan`'s rule."""
    # the probe asked last, only where all else holds
    return (_cuda_forward_refusal(launch, p_mode, keys, on_cuda, training) is None
            and capability.cuda_kernels_unavailable() is None)


def _gluon_forward_refusal(launch: ForwardLaunch, p_mode: int, write_p: bool, key_bias: bool, kv_tma: bool,
                           q_contiguous: bool) -> str | None:
    """Why the forward does not run on the Gluon warp-specialized kernel, or None where it
    does: a warp-specialized launch, FP8 P (GLUON_P_MODES), no debug tiles or key bias, Q
    contiguous and K, V^T loadable by TMA (the fused quantizers' layouts are)."""
    if not launch.warp_specialized:
        return "the launch is not warp-specialized"
    if p_mode not in GLUON_P_MODES:
        return f"P mode {_mode_name(p_mode)} (the Gluon kernel builds {', '.join(m.name for m in GLUON_P_MODES)})"
    if write_p:
        return "write_p (the Gluon kernel writes no P tiles)"
    if key_bias:
        return "a key bias (the Gluon kernel takes none)"
    if not kv_tma:
        return "K or V^T not loadable by TMA"
    if not q_contiguous:
        return "Q not contiguous"
    return None


class ForwardKernel(enum.StrEnum):
    """The Hopper forward kernels a `ForwardPlan` names."""

    CUDA = "cuda"  # forward_cuda.launch_forward_cuda: the CUDA C++ kernel
    GLUON_WS = "gluon_ws"  # forward_gluon_ws.launch_forward_ws: the Gluon warp-specialized kernel
    TRITON = "triton"  # forward_triton.attn_fwd_kernel


@dataclass(frozen=True)
class ForwardPlan:
    """What the Hopper forward runs for one call, decided once (`hopper_forward_plan`):
    `explain` reports it, `forward_op.launch_forward` executes it and nothing else.

    kernel: which kernel; launch: the launch it runs with (the table's entry, the
    interpreter's or `override_launch`'s); p_mode; the call's causal, key_bias, write_p
    and training, which the launcher checks a given plan against; tma_kv (Triton): K and
    V^T by TMA, the launch's where the operands allow it; stages (Triton): the launch's,
    at most 2 with write_p (its debug tile goes through shared memory); reason: one line
    on why this kernel."""

    kernel: ForwardKernel
    launch: ForwardLaunch
    p_mode: PMode
    causal: bool
    key_bias: bool
    write_p: bool
    training: bool
    tma_kv: bool
    stages: int
    reason: str

    @property
    def name(self) -> str:
        """The kernel's name as `explain` reports it: "hopper.forward_cuda", ..."""
        return f"hopper.forward_{self.kernel.value}"

    def variant(self) -> Variant:
        """The launch and flags the kernel runs with."""
        launch = self.launch
        if self.kernel is ForwardKernel.CUDA:
            return {"persistent": launch.cuda_persistent}
        if self.kernel is ForwardKernel.GLUON_WS:
            return {"stages": launch.stages, "ws_overlap": launch.ws_overlap.name, "p_hw_cvt": launch.p_hw_cvt}
        return {"block_m": launch.block_m, "warps": launch.warps, "stages": self.stages, "p_hw_cvt": launch.p_hw_cvt,
                "tma_kv": self.tma_kv, "pv_add": launch.pv_add}

    def as_dict(self) -> dict:
        return {"kernel": self.name, "p_mode": self.p_mode.name, **self.variant(), "reason": self.reason}


def hopper_forward_plan(*, head_dim: int, qk_fp8: bool, p_mode: int, causal: bool, keys: int,
                        queries: int | None = None, key_bias: bool = False, write_p: bool = False,
                        training: bool = False, on_cuda: bool = True, kv_tma: bool = True,
                        q_contiguous: bool = True, interpreter: bool = False) -> ForwardPlan:
    """The Hopper forward's plan for a call described by data: the kernel head dim (64,
    128), Q/K in e4m3 (`qk_fp8`: the `fast_accum` recipes) or bf16, the P mode, causal, the
    key and query counts (queries None: at least one), a key bias, debug tiles
    (`write_p`), a training forward, CUDA tensors, K and V^T loadable by TMA and Q
    contiguous (as the fused quantizers make them; `operands.tma_loadable`), the Triton
    interpreter. In order: the CUDA C++ kernel where the launch's `cuda_from_keys` reaches
    (`use_cuda_forward`), the Gluon warp-specialized kernel where the launch asks for it
    and the call allows it, else the Triton kernel."""
    # a pure function of these, the launch override, the table's version (a changed entry
    # makes new plans) and the probe's answer: made once for each distinct call (host time
    # at every launch)
    return _hopper_forward_plan(head_dim, qk_fp8, p_mode, causal, keys, queries, key_bias, write_p, training,
                                on_cuda, kv_tma, q_contiguous, interpreter, _FORWARD_OVERRIDE.get(),
                                FORWARD_LAUNCH.version, capability.cuda_kernels_unavailable() if on_cuda else None)


@functools.lru_cache(maxsize=4096)
def _hopper_forward_plan(head_dim, qk_fp8, p_mode, causal, keys, queries, key_bias, write_p, training, on_cuda,
                         kv_tma, q_contiguous, interpreter, override, table_version, unavailable) -> ForwardPlan:
    launch = forward_launch(head_dim, qk_fp8, causal, interpreter)  # `override` and `table_version`: its cache key
    mode = PMode(p_mode)
    call = dict(launch=launch, p_mode=mode, causal=causal, key_bias=key_bias, write_p=write_p, training=training)
    not_cuda = _cuda_forward_refusal(launch, mode, keys, on_cuda, training, queries, write_p, unavailable)
    if not_cuda is None:
        return ForwardPlan(ForwardKernel.CUDA, **call, tma_kv=False, stages=launch.stages,
                           reason=f"P mode {mode.name} from {launch.cuda_keys(mode)} keys (cuda_from_keys)")
    not_gluon = _gluon_forward_refusal(launch, mode, write_p, key_bias, kv_tma, q_contiguous)
    if not_gluon is None:
        return ForwardPlan(ForwardKernel.GLUON_WS, **call, tma_kv=False, stages=launch.stages,
                           reason=f"FP8 P on a warp-specialized launch; not the CUDA C++ kernel: {not_cuda}")
    return ForwardPlan(ForwardKernel.TRITON, **call, tma_kv=launch.tma_kv and kv_tma,
                       stages=min(launch.stages, 2) if write_p else launch.stages,
                       reason=f"not the CUDA C++ kernel: {not_cuda}; not the Gluon one: {not_gluon}")
