"""The Hopper kernels' launch tables, as data: the forward's (`FORWARD_LAUNCH`) and the
backward's (`BACKWARD_LAUNCH`), keyed by what decides a launch, each entry with a
one-line reason (the measurements behind it: docs/notes/hopper-forward.md and
hopper-train.md, "What runs today, and why"); the interpreter's launch; and
`override_launch`, which replaces a launch for the current thread, to measure one
against another.

A launch changes speed only, never a value (query rows are independent; the key tile
is part of the recipe), with one exception named where it is set: `cuda_from_keys` runs
a recipe's forward on the CUDA C++ kernel from a key count on, whose softmax rounds
differently (P codes equal to the Triton kernel's on >= 99.9% of entries: a score's
float32 rounding on a code boundary, or the exp2 builders' polynomial, moves a code;
tests/kernels/hopper/test_forward_cuda.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from fp4attn.routing import targets
from fp4attn.routing.variants import DkdvStaged, PMode, WSOverlap


@dataclass(frozen=True)
class ForwardLaunch:
    """Launch shape and code variant of the Hopper forward; speed only.

    block_m, warps, stages: the Triton kernel's program (rows, warps, pipeline depth).
    p_hw_cvt: FP8 P rounded by the packed hardware conversion (RNE, as the bit
    arithmetic it replaces; False is the formulation the interpreter tests run). tma_kv: K
    and V^T tiles by TMA where the operands allow it. pv_add: each tile's PV added into
    O by a float32 addition of its own (lets ptxas chain the wgmmas).
    warp_specialized: FP8 P on the Gluon kernel `forward_gluon_ws.attn_fwd_ws_kernel`
    (a producer warp and one consumer warpgroup per 64 rows, bit-identical to the
    Triton kernel's pv_add path); ws_overlap: where it issues the next tile's QK^T
    (`WSOverlap`).
    cuda_from_keys: (P mode, keys) pairs: the forward of P mode `p_mode` on the CUDA C++
    kernel (`forward_cuda`: FlashAttention-3's schedule, fused softmax; its builds by P mode
    in `forward_cuda.P_MODE_BUILDS`) from `keys` keys on, on CUDA tensors where it can be
    built (`cuda_kernels_unavailable`); a P mode not listed never runs there. Inference only:
    the training forward stays on the kernels its backward rebuilds P like.
    cuda_persistent: the CUDA kernel on a persistent grid (one CTA per SM taking the work
    units in turn; the same results bit for bit) instead of a CTA per unit.
    """

    block_m: int = 128
    warps: int = 8
    stages: int = 3
    p_hw_cvt: bool = False
    tma_kv: bool = False
    pv_add: bool = False
    warp_specialized: bool = False
    ws_overlap: WSOverlap = WSOverlap.BESIDE_PV
    cuda_from_keys: tuple[tuple[PMode, int], ...] = ()
    cuda_persistent: bool = False

    def __post_init__(self):
        # the variant codes as their enums (a plain 4 or (0, 4096) reads the same), checked here
        object.__setattr__(self, "ws_overlap", WSOverlap(self.ws_overlap))
        object.__setattr__(self, "cuda_from_keys", tuple((PMode(m), int(n)) for m, n in self.cuda_from_keys))

    def cuda_keys(self, p_mode: int) -> int:
        """The key count from which P mode `p_mode` runs on the CUDA C++ kernel (0: never)."""
        # keyed by int: a plain int P mode finds its PMode entry (an IntEnum hashes as its value)
        from_keys: dict[int, int] = dict(self.cuda_from_keys)
        return from_keys.get(p_mode, 0)


# Keyed by (kernel head dim, QK^T on the FP8 tensor cores: the `fast_accum` recipes, causal).
# One line each on why; the measurements (H200 unless said, against cuDNN bf16 in the same
# run) and their result files are in docs/notes/hopper-forward.md, "What runs today, and why".
class LaunchTable(dict):
    """A launch table that counts its changes (`version`): the plans made from it are cached
    by version, so that a changed entry (a test's monkeypatch, a measurement's edit) makes
    new plans while a call reads the version as one attribute, with no Python frame."""

    version = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key):
        super().__delitem__(key)
        self.version += 1

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.version += 1

    def setdefault(self, key, default=None):
        self.version += 1
        return super().setdefault(key, default)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def clear(self):
        super().clear()
        self.version += 1

    def __ior__(self, other):  # type: ignore[misc]  # (dict's own skips `update`)
        self.update(other)
        return self


FORWARD_LAUNCH: LaunchTable = LaunchTable({
    # Gluon unpromoted (616-656 against Triton's 450-505 TFLOP/s); the next QK^T beside PV (before the
    # softmax lost 7-8% here); CUDA from 1-4k keys by P mode; persistent grid (+1-6% non-causal)
    (128, True, False): ForwardLaunch(
        block_m=64, warps=4, stages=2, p_hw_cvt=True, warp_specialized=True, cuda_persistent=True,
        cuda_from_keys=((PMode.FP8_EXP2, 4096), (PMode.FP8_AFFINE, 4096), (PMode.MXFP4_AFFINE, 1024),
                        (PMode.FP8_AFFINE_LAZY, 2048))),
    # as above, the next QK^T before the softmax (+3-5% causal); a CTA a unit (persistent lost 1-6% causal)
    (128, True, True): ForwardLaunch(
        block_m=64, warps=4, stages=2, p_hw_cvt=True, warp_specialized=True, ws_overlap=WSOverlap.BEFORE_SOFTMAX,
        cuda_from_keys=((PMode.FP8_EXP2, 4096), (PMode.FP8_AFFINE, 4096), (PMode.MXFP4_AFFINE, 1024),
                        (PMode.FP8_AFFINE_LAZY, 2048))),
    # Triton, three programs an SM (the Gluon kernel ran 364 against 392 TFLOP/s); CUDA from 8k keys for exp2
    # FP8 P (0-12% faster), 2k for affine FP8 P (+16-21%), 512 for affine MXFP4 P (1.6-2.2x)
    (64, True, False): ForwardLaunch(
        block_m=64, warps=4, stages=3, p_hw_cvt=True, cuda_persistent=True,
        cuda_from_keys=((PMode.FP8_EXP2, 8192), (PMode.FP8_AFFINE, 2048), (PMode.MXFP4_AFFINE, 512),
                        (PMode.FP8_AFFINE_LAZY, 2048))),
    # Triton with K and V^T by TMA (+11% causal); causal, affine FP8 P stays on Triton below 8k keys (it
    # led the CUDA kernel at 2-4k)
    (64, True, True): ForwardLaunch(
        block_m=64, warps=4, stages=3, p_hw_cvt=True, tma_kv=True,
        cuda_from_keys=((PMode.FP8_EXP2, 8192), (PMode.FP8_AFFINE, 8192), (PMode.MXFP4_AFFINE, 512),
                        (PMode.FP8_AFFINE_LAZY, 2048))),
    # bf16 QK^T at D=128: Gluon for FP8 P, the next QK^T before the softmax (+4-8% causal); the Triton
    # kernel (MXFP4 P, key masks) with TMA (+21%) and pv_add (+7-9%); CUDA from 1k keys (1.0-1.2x);
    # persistent where non-causal
    **{(128, False, causal): ForwardLaunch(
        block_m=64, warps=4, stages=2, p_hw_cvt=True, tma_kv=True, pv_add=True, warp_specialized=True,
        ws_overlap=WSOverlap.BEFORE_SOFTMAX, cuda_persistent=not causal,
        cuda_from_keys=((PMode.FP8_EXP2, 1024), (PMode.FP8_AFFINE, 1024), (PMode.MXFP4_AFFINE, 1024)))
       for causal in (True, False)},
    # bf16 QK^T at D=64: Triton, K and V^T by TMA; CUDA from 512 keys (1.0-1.2x non-causal); persistent
    (64, False, False): ForwardLaunch(
        block_m=64, warps=4, stages=2, p_hw_cvt=True, tma_kv=True, cuda_persistent=True,
        cuda_from_keys=((PMode.FP8_EXP2, 512), (PMode.FP8_AFFINE, 512), (PMode.MXFP4_AFFINE, 512))),
    # causal: Triton ahead of CUDA at 512-1024 keys in exp2 and affine FP8 P (level at 2048); affine
    # MXFP4 P from 512
    (64, False, True): ForwardLaunch(
        block_m=64, warps=4, stages=2, p_hw_cvt=True, tma_kv=True,
        cuda_from_keys=((PMode.FP8_EXP2, 2048), (PMode.FP8_AFFINE, 2048), (PMode.MXFP4_AFFINE, 512))),
})


@dataclass(frozen=True)
class BackwardLaunch:
    """Launch shape of the Hopper backward (speed only: dS's scale block, the other
    tile side, is fixed by the recipe).

    block_n_dkdv / block_m_dq, warps_*, stages_*: the Triton kernels' programs.
    hw_cvt: e4m3 rounding by cvt.rn.satfinite (False: float32 bit arithmetic).
    tma: the loops' operand tiles by TMA where the lengths are whole tiles.
    dkdv_gluon / dq_gluon: dK/dV and dQ by the Gluon kernels (`backward_gluon.py`)
    where the lengths are whole tiles and P is FP8 (dK/dV). dkdv_in_flight: dK/dV half
    products in flight at once (1 or 2). dkdv_staged: how a tile's numbers reach the
    dK/dV kernel's layouts (`DkdvStaged`). *_maxnreg: register caps of the Gluon
    kernels' 4-warp programs (None: ptxas's choice).
    qk_fp4_dq (Blackwell): the Triton dQ kernel's S by the block-scaled FP4 product of
    the saved NVFP4 payloads (its QK_FP4; needs block_m_dq = 128), not a bf16 product.
    qk_fp4_dkdv (Blackwell): likewise the Triton dK/dV kernel's scores (its QK_FP4: S of
    two 64-query tiles at once, P^T taken from it), not a bf16 S^T.
    cuda: the CUDA C++ backward (`backward_cuda.py`: dK, dV and dQ in one
    FlashAttention-3-style pass) where it takes the operands (`use_cuda_backward`).
    """

    block_n_dkdv: int = 128
    block_m_dq: int = 128
    warps_dkdv: int = 8
    warps_dq: int = 8
    stages_dkdv: int = 2
    stages_dq: int = 2
    hw_cvt: bool = True
    tma: bool = False
    dkdv_gluon: bool = False
    dkdv_in_flight: int = 1
    dkdv_staged: DkdvStaged = DkdvStaged.TOGETHER
    dq_gluon: bool = False
    dkdv_maxnreg: int | None = None
    dq_maxnreg: int | None = None
    qk_fp4_dq: bool = False
    qk_fp4_dkdv: bool = False
    cuda: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dkdv_staged", DkdvStaged(self.dkdv_staged))  # a plain 1 or 2 reads the same


# Keyed by kernel head dim: the fastest variants at causal (4,16,4096,128) and (8,16,4096,64).
# One line each on why; the measurements (backward ms, H200) and their result files are in
# docs/notes/hopper-train.md, "What runs today, and why". The CUDA C++ backward is off in
# both: slower than the Gluon kernels as measured (docs/notes/hopper-train.md).
BACKWARD_LAUNCH: LaunchTable = LaunchTable({
    # Gluon dK/dV (1.69 against Triton's 2.21 ms) with the numbers staged together (1.68 -> 1.47) and two
    # half products in flight (+4%); Gluon dQ; both capped at 168 registers, three programs an SM
    64: BackwardLaunch(block_n_dkdv=64, warps_dkdv=4, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True,
                       dkdv_in_flight=2, dkdv_staged=DkdvStaged.TOGETHER, dq_gluon=True, dkdv_maxnreg=168,
                       dq_maxnreg=168),
    # Gluon dK/dV (1.33 against 2.98 ms) with the numbers copied a tile ahead (1.294 -> 1.250: in registers
    # they spilled); Gluon dQ (0.90 -> 0.78)
    128: BackwardLaunch(block_n_dkdv=64, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True,
                        dkdv_staged=DkdvStaged.ASYNC_AHEAD, dq_gluon=True),
})

_FORWARD_OVERRIDE: contextvars.ContextVar[ForwardLaunch | None] = contextvars.ContextVar("forward_launch",
                                                                                        default=None)
_BACKWARD_OVERRIDE: contextvars.ContextVar[BackwardLaunch | None] = contextvars.ContextVar("backward_launch",
                                                                                          default=None)


@contextlib.contextmanager
def override_launch(*, forward: ForwardLaunch | None = None, backward: BackwardLaunch | None = None) -> Iterator[None]:
    """Run the Hopper kernels with these launches instead of the table's, in this thread
    (and context) only, for measuring one launch against another:

        with fp4attn.routing.override_launch(forward=ForwardLaunch(64, 4, 2, True)):
            fp4attn.attention(q, k, v, recipe="fp8")
    """
    for name, value, kind in (("forward", forward, ForwardLaunch), ("backward", backward, BackwardLaunch)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"override_launch({name}=...) takes a {kind.__name__}, got {type(value).__name__}")
    forward_token = _FORWARD_OVERRIDE.set(forward) if forward is not None else None
    backward_token = _BACKWARD_OVERRIDE.set(backward) if backward is not None else None
    try:
        yield
    finally:
        if forward_token is not None:
            _FORWARD_OVERRIDE.reset(forward_token)
        if backward_token is not None:
            _BACKWARD_OVERRIDE.reset(backward_token)


# Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) the kernels run the Triton
# forms it can: no inline PTX (the packed e4m3 conversion), TMA, Gluon or CUDA C++ kernel
# (`kernels.interpreter_compat` gives it the rest); the same numbers, slowly. The routes are
# still named by the table's launches (`table_forward_launch`), as on the GPU: the
# interpreter stands in for an H200 (`explain`, tools/sanitize_driver.py --list)
INTERPRETER_FORWARD_LAUNCH = ForwardLaunch(64, 4, 2)


def table_forward_launch(head_dim: int, qk_fp8: bool, causal: bool) -> ForwardLaunch:
    """The Hopper forward's launch on the GPU for this kernel head dim, QK^T format and
    masking (the table's, or `override_launch`'s)."""
    return _FORWARD_OVERRIDE.get() or FORWARD_LAUNCH[head_dim, qk_fp8, causal]


def forward_launch(head_dim: int, qk_fp8: bool, causal: bool, interpreter: bool | None = None) -> ForwardLaunch:
    """The launch the Hopper forward runs: `table_forward_launch`, or under the
    interpreter (`interpreter`; None: `interpreting()`) INTERPRETER_FORWARD_LAUNCH unless
    overridden."""
    if (targets.interpreting() if interpreter is None else interpreter) and _FORWARD_OVERRIDE.get() is None:
        return INTERPRETER_FORWARD_LAUNCH
    return table_forward_launch(head_dim, qk_fp8, causal)


def table_backward_launch(head_dim: int) -> BackwardLaunch:
    """The Hopper backward's launch on the GPU at this kernel head dim."""
    return _BACKWARD_OVERRIDE.get() or BACKWARD_LAUNCH[head_dim]


def backward_launch(head_dim: int, interpreter: bool | None = None) -> BackwardLaunch:
    """The launch the Hopper backward runs: `table_backward_launch`, or under the
    interpreter (`interpreter`; None: `interpreting()`) its float32 rounding instead of the
    PTX conversion and no CUDA C++ kernel, unless overridden."""
    launch = table_backward_launch(head_dim)
    if (targets.interpreting() if interpreter is None else interpreter) and _BACKWARD_OVERRIDE.get() is None:
        return dataclasses.replace(launch, hw_cvt=False, cuda=False)
    return launch
