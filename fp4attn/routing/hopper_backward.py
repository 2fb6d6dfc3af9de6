"""The Hopper backward's plan: which kernels compute dK/dV and dQ (the CUDA C++ backward,
which computes both in one pass, else each on its Gluon or its Triton kernel), with
which variant, and why, decided once from the call's data (`hopper_backward_plan` ->
`BackwardPlan`). `explain` reports it, `train_op.launch_backward` executes it and
decides nothing."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from fp4attn.routing import capability
from fp4attn.routing.hopper_tables import _BACKWARD_OVERRIDE, BACKWARD_LAUNCH, BackwardLaunch, backward_launch
from fp4attn.routing.variants import P_MODE_AFFINE_TRAINED, PMode, Variant, _mode_name

# The Q/K formats whose backward the Gluon kernels run: NVFP4 (one tensor scale per head
# for Q and for K) and per-token FP8 (`train-fp8`, a scale per query and per key: the
# kernels' ROW_SCALES form, as the Triton kernels'; docs/notes/hopper-train.md). Lengths
# that are not whole tiles run the Triton kernels.
GLUON_BACKWARD_QK = ("nvfp4", "fp8")


def _gluon_backward_refusals(launch: BackwardLaunch, qk: str, p_mode: int, tma: bool) -> tuple[str | None, str | None]:
    """(dK/dV, dQ): why each does not run on its Gluon kernel, or None where it does."""
    common: str | None
    if not tma:
        common = "tiles not by TMA (a launch without tma, or lengths that are not whole 64-token tiles)"
    elif not launch.hw_cvt:
        common = "e4m3 rounded by bit arithmetic (hw_cvt off)"
    else:
        common = None if qk in GLUON_BACKWARD_QK else f"Q/K format {qk!r}"
    dkdv = ("the launch's dkdv_gluon is off" if not launch.dkdv_gluon else common
            or (None if p_mode == PMode.FP8_EXP2 else f"P mode {_mode_name(p_mode)} (the Gluon dK/dV kernel builds "
                                                     "FP8 P from exp2)"))
    # the Gluon dQ kernel builds P by exp2: not the trained affine P
    dq = ("the launch's dq_gluon is off" if not launch.dq_gluon else common
          or (None if p_mode != P_MODE_AFFINE_TRAINED else "the trained affine P (the Gluon dQ kernel builds P "
                                                           "by exp2)"))
    return dkdv, dq


def backward_gluon_kernels(launch: BackwardLaunch, qk: str, p_mode: int, tma: bool) -> tuple[bool, bool]:
    """(dK/dV, dQ): whether each runs on its Gluon kernel (`backward_gluon.py`): where the
    launch asks for it (`dkdv_gluon`, `dq_gluon`), the loops' tiles arrive by TMA (`tma`:
    the launch's, with both lengths whole 64-token tiles), e4m3 is rounded by the
    hardware's conversion (`hw_cvt`), the Q/K format is one of GLUON_BACKWARD_QK and, for
    dK/dV, P is FP8 from exp2 (P mode 0), for dQ not the trained affine P (6).
    `hopper_backward_plan`'s rule."""
    dkdv, dq = _gluon_backward_refusals(launch, qk, p_mode, tma)
    return dkdv is None, dq is None


def _cuda_backward_refusal(launch: BackwardLaunch, qk: str, p_mode: int, head_dim: int, sq: int | None,
                           sk: int | None, on_cuda: bool, unavailable: str | None = None) -> str | None:
    """Why the backward does not run on the CUDA C++ kernel, or None where it does (see
    `use_cuda_backward`); lengths None: not known, taken as whole tiles; `unavailable`:
    the probe's answer."""
    if not launch.cuda:
        return "the launch's cuda is off"
    if qk != "fp8" or p_mode != PMode.FP8_EXP2:
        return "not per-token FP8 Q/K with FP8 P from exp2"
    if head_dim not in (64, 128):
        return f"head dim {head_dim}"
    if sq is not None and (sq % 64 or sq <= 0):
        return f"{sq} queries (whole 64-row tiles, dS's scale block)"
    if sk is not None and sk % 128:
        return f"{sk} keys (whole 128-key blocks, a CTA's)"
    if not on_cuda:
        return "not CUDA tensors"
    return unavailable


def use_cuda_backward(launch: BackwardLaunch, qk: str, p_mode: int, head_dim: int, sq: int, sk: int,
                      on_cuda: bool) -> bool:
    """Whether the backward runs on the CUDA C++ kernel (`BackwardLaunch.cuda`): per-token FP8
    Q/K with FP8 P from exp2 (`train-fp8`), head dim 64 or 128, Sq a multiple of 64 (dS's
    scale block) and Sk of 128 (a CTA's keys), on a GPU where the CUDA kernels build.
    `hopper_backward_plan`'s rule."""
    # the probe asked last, only where all else holds
    return (_cuda_backward_refusal(launch, qk, p_mode, head_dim, sq, sk, on_cuda) is None
            and capability.cuda_kernels_unavailable() is None)


class BackwardKernel(enum.StrEnum):
    """The Hopper backward kernels a `BackwardPlan` names, for dK/dV and for dQ."""

    CUDA = "cuda"  # backward_cuda.launch_backward_cuda: dK, dV and dQ in one pass
    GLUON = "gluon"  # backward_gluon.launch_dkdv_gluon, launch_dq_gluon
    TRITON = "triton"  # backward_triton.attn_bwd_dkdv_kernel, attn_bwd_dq_kernel

    @property
    def module(self) -> str:
        """The kernel's module under fp4attn/kernels/, as `explain` names it: the Triton
        kernels are every architecture's (the Blackwell training runs them too), the
        Gluon and CUDA C++ ones Hopper's."""
        return "backward_triton" if self is BackwardKernel.TRITON else f"hopper.backward_{self.value}"


@dataclass(frozen=True)
class BackwardPlan:
    """What the Hopper backward runs for one call, decided once (`hopper_backward_plan`):
    `explain` reports it, `train_op.launch_backward` executes it and nothing else.

    dkdv, dq: the kernel of each (both CUDA for the CUDA C++ backward, which computes
    them in one pass); launch: the launch they run with; p_mode; row_scales: per-token Q/K
    scales (FP8 Q/K: the kernels' ROW_SCALES form); tma: the loops' tiles by TMA (the
    launch's where the lengths are whole 64-token tiles and the operands contiguous);
    lengths_known: False where the plan was made without the lengths (explain's: the
    kernels of whole tiles, which `name` says); reason: one line on why."""

    dkdv: BackwardKernel
    dq: BackwardKernel
    launch: BackwardLaunch
    p_mode: PMode
    row_scales: bool
    tma: bool
    lengths_known: bool
    reason: str

    @property
    def triton_descriptors(self) -> bool:
        """Whether the Triton kernels read their tiles by TMA descriptors: the plan's TMA
        where one of them runs (the Gluon kernels build their own, once for both)."""
        return self.tma and not (self.dkdv is BackwardKernel.GLUON and self.dq is BackwardKernel.GLUON)

    @property
    def name(self) -> str:
        """The kernels' names as `explain` reports them."""
        if self.dkdv is BackwardKernel.CUDA:
            where = " (where the queries are whole 64-row tiles and the keys 128-key blocks)"
            return "hopper.backward_cuda" + ("" if self.lengths_known else where)
        gluon = BackwardKernel.GLUON in (self.dkdv, self.dq)
        where = " (Gluon where the lengths are whole 64-token tiles)" if gluon and not self.lengths_known else ""
        return f"{self.dkdv.module}.dkdv + {self.dq.module}.dq{where}"

    def variant(self) -> Variant:
        """The launch and flags the kernels run with."""
        launch = self.launch
        if self.dkdv is BackwardKernel.CUDA:
            return {}
        out: Variant = {"tma": self.tma, "hw_cvt": launch.hw_cvt, "row_scales": self.row_scales}
        if self.dkdv is BackwardKernel.GLUON:
            out.update(dkdv_in_flight=launch.dkdv_in_flight, dkdv_staged=launch.dkdv_staged.name,
                       dkdv_maxnreg=launch.dkdv_maxnreg)
        else:
            out.update(block_n_dkdv=launch.block_n_dkdv, warps_dkdv=launch.warps_dkdv, stages_dkdv=launch.stages_dkdv)
        if self.dq is BackwardKernel.GLUON:
            out.update(dq_maxnreg=launch.dq_maxnreg)
        else:
            out.update(block_m_dq=launch.block_m_dq, warps_dq=launch.warps_dq, stages_dq=launch.stages_dq)
        return out

    def as_dict(self) -> dict:
        return {"kernel": self.name, "p_mode": self.p_mode.name, **self.variant(), "reason": self.reason}


def hopper_backward_plan(*, head_dim: int, qk: str, p_mode: int, queries: int | None = None,
                         keys: int | None = None, on_cuda: bool = True, tiles_tma: bool = True,
                         interpreter: bool = False) -> BackwardPlan:
    """The Hopper backward's plan for a call described by data: the kernel head dim, the
    Q/K format ("nvfp4": a scale per head, "fp8": per token), the training P mode, the
    query and key counts (None: not known, taken as whole tiles, and the plan's name says
    so), CUDA tensors, whether the loops' tiles can arrive by TMA (`train_op.
    tiles_tma_loadable`: whole 64-token tiles, contiguous and aligned), the Triton
    interpreter. The CUDA C++ backward where the launch asks for it and it takes the call
    (`use_cuda_backward`); else dK/dV and dQ each on its Gluon kernel where the launch
    and the call allow it (`backward_gluon_kernels`), else on its Triton kernel."""
    # made once for each distinct call, launch override and table version (a changed entry
    # makes new plans)
    return _hopper_backward_plan(head_dim, qk, p_mode, queries, keys, on_cuda, tiles_tma, interpreter,
                                 _BACKWARD_OVERRIDE.get(), BACKWARD_LAUNCH.version,
                                 capability.cuda_kernels_unavailable() if on_cuda else None)


@functools.lru_cache(maxsize=4096)
def _hopper_backward_plan(head_dim, qk, p_mode, queries, keys, on_cuda, tiles_tma, interpreter, override,
                          table_version, unavailable) -> BackwardPlan:
    launch = backward_launch(head_dim, interpreter)  # `override` and `table_version`: its cache key
    mode = PMode(p_mode)
    known = queries is not None and keys is not None
    call = dict(launch=launch, p_mode=mode, row_scales=qk == "fp8", lengths_known=known)
    not_cuda = _cuda_backward_refusal(launch, qk, mode, head_dim, queries, keys, on_cuda, unavailable)
    if not_cuda is None:
        return BackwardPlan(BackwardKernel.CUDA, BackwardKernel.CUDA, **call, tma=False,
                            reason="the launch's cuda, per-token FP8 Q/K with FP8 P from exp2")
    tma = launch.tma and tiles_tma
    not_dkdv, not_dq = _gluon_backward_refusals(launch, qk, mode, tma)
    why = "; ".join(f"{part} on Triton: {no}" for part, no in (("dK/dV", not_dkdv), ("dQ", not_dq)) if no)
    return BackwardPlan(BackwardKernel.GLUON if not_dkdv is None else BackwardKernel.TRITON,
                        BackwardKernel.GLUON if not_dq is None else BackwardKernel.TRITON,
                        **call, tma=tma, reason=why or "both on their Gluon kernels")
