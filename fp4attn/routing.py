"""Which kernel runs a call, and with which launch: the routing of every op, as data.

Pure Python, no Triton import: `fp4attn.attention` and `fp4attn.explain` ask this
module, the launchers read their launch tables from it, and a reader finds here every
decision a call goes through:

    target      the GPU generation the call runs for: "sm_90" (Hopper), "sm_100"
                (datacenter Blackwell), "sm_120", other "sm_XY", or "cpu";
                FP4ATTN_TARGET overrides it (with TRITON_INTERPRET=1 that runs a
                target's Triton kernels on CPU tensors under the interpreter)
    family      a set of kernels for one target and direction (`KERNEL_FAMILIES`);
                the first family whose target matches and which accepts the recipe,
                head dim and mask runs the call, else the reference
    launch      the launch shape of that family's kernel (`FORWARD_LAUNCH`,
                `BACKWARD_LAUNCH`), each entry with a one-line reason and its
                measurements in the family's note (docs/notes/)
    plan        on Hopper, the kernel that runs the call and its variant, decided
                once from the call's data (`hopper_forward_plan`,
                `hopper_backward_plan`): `explain` reports it, the launchers
                execute it and decide nothing

A launch changes speed only, never a value (query rows are independent; the key tile
is part of the recipe), with one exception named where it is set: `cuda_from_keys` runs
a recipe's forward on the CUDA C++ kernel from a key count on, whose softmax rounds
differently (P codes equal to the Triton kernel's on >= 99.9% of entries: a score's
float32 rounding on a code boundary, or the exp2 builders' polynomial, moves a code;
tests/test_cuda_forward.py).
`override_launch` replaces a launch for the current thread, to measure one against
another.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fp4attn.recipes import Recipe, robust_fields, robust_unsupported_reason

TARGET_ENV = "FP4ATTN_TARGET"  # "sm_90", "sm_100", "sm_120", "cpu": route as if on that target
BACKEND_ENV = "FP4ATTN_BACKEND"  # overrides backend="auto"
BACKENDS = ("auto", "reference", "triton")
TARGETS = ("sm_90", "sm_100", "sm_103", "sm_120", "sm_121", "cpu")
INTERPRET_ENV = "TRITON_INTERPRET"

# the Hopper forward's key tile: equals Recipe.block_n of every preset (the tile is part of
# the numerics), and the fused quantizers pad V^T's rows to a multiple of it
KEY_TILE = 128
HOPPER_HEAD_DIMS = (64, 128)


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
TRAIN_GRAD_FORMATS = ("e4m3",)


# ---------------------------------------------------------------------------- targets
def target_of(device) -> str:
    """The target a call on `device` (a torch.device or its type string) runs for:
    FP4ATTN_TARGET if set, else "cpu" for anything but CUDA, else "sm_<major><minor>"."""
    override = os.environ.get(TARGET_ENV)
    if override:
        if override not in TARGETS:
            raise ValueError(f"{TARGET_ENV}={override!r} is not a target; accepted: {TARGETS}")
        return override
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cuda":
        return "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (TRITON_INTERPRET=1): then a
    target's kernels run on CPU tensors."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


# ---------------------------------------------------------------------------- launches
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
FORWARD_LAUNCH: dict[tuple[int, bool, bool], ForwardLaunch] = {
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
}


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
BACKWARD_LAUNCH: dict[int, BackwardLaunch] = {
    # Gluon dK/dV (1.69 against Triton's 2.21 ms) with the numbers staged together (1.68 -> 1.47) and two
    # half products in flight (+4%); Gluon dQ; both capped at 168 registers, three programs an SM
    64: BackwardLaunch(block_n_dkdv=64, warps_dkdv=4, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True,
                       dkdv_in_flight=2, dkdv_staged=DkdvStaged.TOGETHER, dq_gluon=True, dkdv_maxnreg=168,
                       dq_maxnreg=168),
    # Gluon dK/dV (1.33 against 2.98 ms) with the numbers copied a tile ahead (1.294 -> 1.250: in registers
    # they spilled); Gluon dQ (0.90 -> 0.78)
    128: BackwardLaunch(block_n_dkdv=64, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True,
                        dkdv_staged=DkdvStaged.ASYNC_AHEAD, dq_gluon=True),
}

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
    if (interpreting() if interpreter is None else interpreter) and _FORWARD_OVERRIDE.get() is None:
        return INTERPRETER_FORWARD_LAUNCH
    return table_forward_launch(head_dim, qk_fp8, causal)


# The CUDA C++ kernels' sources, compiled by NVRTC at first use (the wheel ships them:
# pyproject's package-data, tests/test_packaging.py)
CUDA_SOURCE_DIR = Path(__file__).resolve().parent / "kernels" / "hopper" / "cuda"
CUDA_SOURCES = ("attn_fwd_fp8.cu", "attn_bwd_fp8.cu", "decode_split.cu")  # forward_cuda, backward_cuda, decode_cuda
_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def missing_cuda_sources() -> list[str]:
    """The CUDA C++ sources, and the headers they include by quoted name, that are not
    installed under `CUDA_SOURCE_DIR`."""
    missing, seen, todo = [], set(), list(CUDA_SOURCES)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = CUDA_SOURCE_DIR / name
        if not path.is_file():
            missing.append(name)
            continue
        todo += _QUOTED_INCLUDE.findall(path.read_text(errors="replace"))
    return sorted(missing)


@functools.lru_cache(maxsize=1)
def cuda_kernels_unavailable() -> str | None:
    """Why the CUDA C++ kernels (the forward and decode's split kernel) cannot be built and
    loaded here, None where they can: the one probe each of their routes asks. They need
    NVRTC's Python bindings (cuda-bindings, the `cuda` extra), a CUDA 13 torch (NVRTC 13's
    cubins need a CUDA 13 driver, which such a torch already requires), and their sources
    (`missing_cuda_sources`)."""
    import torch

    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # no `cuda` package at all
        found = False
    if not found:
        return "cuda-bindings (NVRTC) is not installed"
    cuda = torch.version.cuda
    if cuda is None or int(cuda.split(".")[0]) < 13:
        return f"torch is not a CUDA 13 build (CUDA {cuda}), which NVRTC 13's kernels need"
    missing = missing_cuda_sources()
    if missing:
        return f"the kernel sources are not installed ({', '.join(missing)} missing in {CUDA_SOURCE_DIR})"
    return None


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
    return _cuda_forward_refusal(launch, p_mode, keys, on_cuda, training) is None and cuda_kernels_unavailable() is None


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


def table_backward_launch(head_dim: int) -> BackwardLaunch:
    """The Hopper backward's launch on the GPU at this kernel head dim."""
    return _BACKWARD_OVERRIDE.get() or BACKWARD_LAUNCH[head_dim]


def backward_launch(head_dim: int, interpreter: bool | None = None) -> BackwardLaunch:
    """The launch the Hopper backward runs: `table_backward_launch`, or under the
    interpreter (`interpreter`; None: `interpreting()`) its float32 rounding instead of the
    PTX conversion and no CUDA C++ kernel, unless overridden."""
    launch = table_backward_launch(head_dim)
    if (interpreting() if interpreter is None else interpreter) and _BACKWARD_OVERRIDE.get() is None:
        return dataclasses.replace(launch, hw_cvt=False, cuda=False)
    return launch


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
            and cuda_kernels_unavailable() is None)


def _mode_name(p_mode: int) -> str:
    try:
        return PMode(p_mode).name
    except ValueError:
        return str(p_mode)


# ---------------------------------------------------------------------------- plans
class ForwardKernel(enum.StrEnum):
    """The Hopper forward kernels a `ForwardPlan` names."""

    CUDA = "cuda"  # forward_cuda.launch_forward_cuda: the CUDA C++ kernel
    GLUON_WS = "gluon_ws"  # forward_gluon_ws.launch_forward_ws: the Gluon warp-specialized kernel
    TRITON = "triton"  # forward_triton.attn_fwd_kernel


class BackwardKernel(enum.StrEnum):
    """The Hopper backward kernels a `BackwardPlan` names, for dK/dV and for dQ."""

    CUDA = "cuda"  # backward_cuda.launch_backward_cuda: dK, dV and dQ in one pass
    GLUON = "gluon"  # backward_gluon.launch_dkdv_gluon, launch_dq_gluon
    TRITON = "triton"  # backward_triton.attn_bwd_dkdv_kernel, attn_bwd_dq_kernel


# A plan's launch and flags as `explain` reports them: sizes, flags, enum names (None: a
# register limit left to ptxas)
Variant = dict[str, int | bool | str | None]


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
    # a pure function of these, the launch override and the probe's answer: made once for
    # each distinct call (host time at every launch)
    return _hopper_forward_plan(head_dim, qk_fp8, p_mode, causal, keys, queries, key_bias, write_p, training,
                                on_cuda, kv_tma, q_contiguous, interpreter, _FORWARD_OVERRIDE.get(),
                                cuda_kernels_unavailable() if on_cuda else None)


@functools.lru_cache(maxsize=4096)
def _hopper_forward_plan(head_dim, qk_fp8, p_mode, causal, keys, queries, key_bias, write_p, training, on_cuda,
                         kv_tma, q_contiguous, interpreter, override, unavailable) -> ForwardPlan:
    launch = forward_launch(head_dim, qk_fp8, causal, interpreter)  # `override` is its part of the cache key
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
        return f"hopper.backward_{self.dkdv.value}.dkdv + hopper.backward_{self.dq.value}.dq{where}"

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
    return _hopper_backward_plan(head_dim, qk, p_mode, queries, keys, on_cuda, tiles_tma, interpreter,
                                 _BACKWARD_OVERRIDE.get(), cuda_kernels_unavailable() if on_cuda else None)


@functools.lru_cache(maxsize=4096)
def _hopper_backward_plan(head_dim, qk, p_mode, queries, keys, on_cuda, tiles_tma, interpreter, override,
                          unavailable) -> BackwardPlan:
    launch = backward_launch(head_dim, interpreter)  # `override` is its part of the cache key
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


# ---------------------------------------------------------------------------- Blackwell (sm_100)
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


# Keyed by (head dim, causal, key mask). Not measured: no Blackwell GPU has run these
# kernels. Chosen from the sm_100a builds (docs/notes/blackwell.md, `fp4attn
# compile-report`): the pipelined kernel at 4 warps a partition and 3 stages builds every
# routed recipe at D=64/128, causal or not, with or without a key mask, without spills
# (2 stages: nvfp4-fp8 spills 8-32 bytes; S double-buffered in tensor memory: 8-16
# bytes), so every build runs pipelined. The kernel it replaced (8 warps doing everything
# in turn, 2 stages) stays reachable as SERIAL_BLACKWELL_LAUNCH, by
# `override_blackwell_launch`, for comparison; some of its builds spill (FP8 Q/K at D=128
# with a key mask or affine MXFP4 P), which costs speed, not numerics.
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


# Consumer Blackwell (sm_120 / sm_121: RTX 50xx, RTX PRO 6000, DGX Spark): no tensor
# memory, the block-scaled products are mma.sync (kind::mxf4nvf4) with accumulators in
# registers, so the serial kernel at programs small enough for a thread's share of the S
# and O tiles. Keyed by (head dim, key mask). Not measured: chosen from the sm_120a builds
# (`fp4attn compile-report --arch sm_120a`), the smallest launch without a spill for every
# routed recipe, causal or not: D=64 64 rows of 8 warps, one stage (4 warps spilled 8-64
# bytes); with a key mask 32 rows of 4 warps (nvfp4-fp8 causal spilled 80 bytes at 64
# rows); D=128 32 rows of 4 warps, two stages (64 rows spilled 120-1300 bytes).
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


# The Hopper backward's Triton kernels at their Blackwell launch (`kernels.blackwell.
# train_op`): no TMA or Gluon paths (those are Hopper's wgmma code). Not measured; from
# the sm_100a builds (`fp4attn compile-report`): 64-key dK/dV programs of 8 warps, one
# stage, without spills (two stages spilled 596 bytes at D=128 and 16 with Direct-P P at
# D=64; 4 warps 3020-7724; 32-key programs leave the tcgen05 tensor cores for mma.sync;
# 128-key programs spill 20-3428 bytes). dQ: 128-query programs, S by the block-scaled FP4
# product (qk_fp4_dq: tcgen05 builds it for 128 rows only), without spills at either head
# dim. dK/dV: the scores by the block-scaled FP4 product too (qk_fp4_dkdv: S of two query
# tiles, 128 rows) at D=64, 224-255 registers without spills; at D=128 that build spills
# 548 bytes (the bf16 build already takes 253-255 registers), so S^T stays a bf16 product
# there (docs/notes/blackwell.md, "The training backward's score products").
BLACKWELL_BACKWARD_LAUNCH: dict[int, BackwardLaunch] = {
    d: BackwardLaunch(block_n_dkdv=64, block_m_dq=128, warps_dkdv=8, warps_dq=8, stages_dkdv=1, stages_dq=2,
                      tma=False, dkdv_gluon=False, dq_gluon=False, qk_fp4_dq=True, qk_fp4_dkdv=d == 64)
    for d in (64, 128)
}


def blackwell_backward_launch(head_dim: int) -> BackwardLaunch:
    """The Blackwell backward's launch at this kernel head dim (the e4m3 rounding by
    bit arithmetic under the interpreter, which runs no inline PTX)."""
    from dataclasses import replace

    return replace(BLACKWELL_BACKWARD_LAUNCH[head_dim], hw_cvt=not interpreting())


# ---------------------------------------------------------------------------- what each family runs
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


# the outlier-robust fields the Hopper kernels apply: the forward's fused quantizers
# (smooth_k, qk_four_over_six, qk_fallback) and Direct-P with each 32-key block's top key
# apart (p_sink, P_MODE 3); the training keeps smooth_k and qk_four_over_six in its saved
# NVFP4 payload (the FP8 fallback would need FP8 Q/K views in the backward kernels)
HOPPER_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six", "qk_fallback", "p_sink")
HOPPER_TRAIN_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six")
# the Q/K formats the Hopper training kernels train, each with the robust fields its saved
# operands carry: the NVFP4 payload those above; per-token FP8 (`train-fp8`) none (its
# quantizers subtract no mean)
HOPPER_TRAIN_QK = {"nvfp4": HOPPER_TRAIN_ROBUST_FIELDS, "fp8": ()}
P_MODE_DIRECTP_SINK = PMode.MXFP4_DIRECTP_SINK


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


def hopper_robust_unsupported(recipe: Recipe, fields: tuple[str, ...] = HOPPER_ROBUST_FIELDS) -> str | None:
    """Why the Hopper kernels cannot apply `recipe`'s robust fields (they apply
    `fields`), or None."""
    if recipe.p_sink and recipe.p_build != "directp":
        return "p_sink with p_build='exp2' (the kernels build p_sink P by Direct-P)"
    return robust_unsupported_reason(recipe, fields)


def hopper_forward_unsupported(recipe: Recipe, head_dim: int) -> str | None:
    """Why the Hopper forward kernels cannot run `recipe` at `head_dim`, or None."""
    robust = hopper_robust_unsupported(recipe)
    if robust is not None:
        return robust
    if recipe.qk not in ("fp8", "nvfp4"):
        return f"Q/K format {recipe.qk!r} (kernels run 'fp8' and 'nvfp4')"
    if (recipe.p, recipe.p_build) not in P_MODES:
        return f"P {recipe.p!r} built by {recipe.p_build!r} (kernels run {sorted(P_MODES)})"
    if recipe.v not in ("fp8", "mxfp4"):
        return f"V format {recipe.v!r} (kernels run 'fp8' and 'mxfp4')"
    return _shape_unsupported(recipe, head_dim)


def hopper_train_unsupported(recipe: Recipe, head_dim: int) -> str | None:
    """Why the Hopper training kernels cannot train `recipe` at `head_dim`, or None."""
    if recipe.grad is None:
        return f"recipe {recipe.name!r} is inference-only (grad=None)"
    if recipe.grad not in TRAIN_GRAD_FORMATS:
        return f"gradient format {recipe.grad!r} (kernels run {TRAIN_GRAD_FORMATS})"
    if recipe.qk not in HOPPER_TRAIN_QK:
        return f"Q/K format {recipe.qk!r} for training (kernels train {' and '.join(map(repr, HOPPER_TRAIN_QK))} Q/K)"
    if recipe.fast_accum:
        return "fast_accum=True for training (the training kernels sum QK^T exactly: fast_accum=False)"
    fields = HOPPER_TRAIN_QK[recipe.qk]
    robust = hopper_robust_unsupported(recipe, fields)
    if robust is not None and not fields:
        names = robust_fields(recipe)
        kept = "; ".join(f"{', '.join(f)} with {qk!r} Q/K" for qk, f in HOPPER_TRAIN_QK.items() if f)
        return (f"outlier-robust field{'s' if len(names) > 1 else ''} {', '.join(names)} of recipe "
                f"{recipe.name!r} with {recipe.qk!r} Q/K for training (the training kernels apply none with "
                f"{recipe.qk!r} Q/K; {kept})")
    if robust is not None:
        return robust
    return hopper_forward_unsupported(recipe, head_dim)


def _routed_kernel_head_dim(head_dim: int) -> int:
    """`kernel_head_dim` of a call a Hopper family took: one it has no kernel for never gets
    a plan (`_shape_unsupported` sends it to the reference)."""
    dk = kernel_head_dim(head_dim)
    if dk is None:
        raise ValueError(f"head_dim {head_dim}: no Hopper kernel runs it (kernels run multiples of 16 up to "
                         f"{HOPPER_HEAD_DIMS[-1]}), so it has no plan")
    return dk


def hopper_forward_route_plan(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                              on_cuda: bool = True, training: bool = False) -> ForwardPlan:
    """`hopper_forward_plan` of a routed call: the recipe's Q/K dtype (`fast_accum`: e4m3)
    and P mode, a key mask as the key bias, the operands as the fused quantizers make them
    (TMA-loadable, contiguous), the GPU's launch (under the interpreter too, which stands
    in for an H200 here)."""
    return hopper_forward_plan(head_dim=_routed_kernel_head_dim(head_dim), qk_fp8=recipe.fast_accum,
                               p_mode=p_mode(recipe), causal=causal, keys=keys, key_bias=mask == "key",
                               training=training, on_cuda=on_cuda)


def hopper_backward_route_plan(recipe: Recipe, head_dim: int, on_cuda: bool = True) -> BackwardPlan:
    """`hopper_backward_plan` of a routed training call: lengths not known (the route
    takes none), so the kernels of whole tiles, with the GPU's launch."""
    return hopper_backward_plan(head_dim=_routed_kernel_head_dim(head_dim), qk=recipe.qk,
                                p_mode=p_mode(recipe), on_cuda=on_cuda)


def _hopper_forward_plans(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                          on_cuda: bool = True) -> tuple[ForwardPlan]:
    return (hopper_forward_route_plan(recipe, head_dim, causal, mask, keys, on_cuda),)


def _hopper_train_plans(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                        on_cuda: bool = True) -> tuple[ForwardPlan, BackwardPlan]:
    return (hopper_forward_route_plan(recipe, head_dim, causal, mask, keys, on_cuda, training=True),
            hopper_backward_route_plan(recipe, head_dim, on_cuda))


def _plan_names(plans) -> str:
    return " + ".join(p.name for p in plans)


def _hopper_forward_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                           on_cuda: bool = True) -> str:
    """The Hopper forward kernel that runs the call (`hopper_forward_route_plan`)."""
    return _plan_names(_hopper_forward_plans(recipe, head_dim, causal, mask, keys, on_cuda))


def _hopper_train_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                         on_cuda: bool = True) -> str:
    """The Hopper training kernels that run the call: the forward's, then the backward's."""
    return _plan_names(_hopper_train_plans(recipe, head_dim, causal, mask, keys, on_cuda))


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
    return (f"{_blackwell_forward_kernel(recipe, head_dim, causal, mask)} + hopper.backward_triton.dkdv + "
            "hopper.backward_triton.dq (built for sm_100a; dQ's S, and at head_dim 64 dK/dV's, by the "
            "block-scaled FP4 product)")


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


def requested_backend(backend: str) -> str:
    """`backend` checked, with FP4ATTN_BACKEND applied to "auto"."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted: {BACKENDS}")
    env = os.environ.get(BACKEND_ENV)
    if backend == "auto" and env:
        if env not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={env!r} is not a backend; accepted: {BACKENDS}")
        return env
    return backend


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
    if device_type != "cuda" and not interpreting():
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
