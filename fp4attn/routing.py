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
                `BACKWARD_LAUNCH`), each entry traced to a committed measurement

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
# (reference/affine.py). Affine MXFP4 P (5) ran there at the Triton kernel's speed (0.558x
# against 0.559x of cuDNN bf16, D=128 geomean, benchmarks/results/log/h200-forward-affine-mx-gluon.json):
# MXFP4 P stays on the Triton kernel
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
    (1: beside PV; 4: before the softmax).
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
    ws_overlap: int = 1
    cuda_from_keys: tuple[tuple[int, int], ...] = ()
    cuda_persistent: bool = False

    def cuda_keys(self, p_mode: int) -> int:
        """The key count from which P mode `p_mode` runs on the CUDA C++ kernel (0: never)."""
        return dict(self.cuda_from_keys).get(p_mode, 0)


# Keyed by (head dim, QK^T on the FP8 tensor cores, causal). The measurements behind each
# choice (TFLOP/s per variant and shape, H200) are in docs/notes/hopper-forward.md; the
# result files, in benchmarks/results/log/: h200-forward-ws-overlap4.txt (ws_overlap per
# case), h200-forward-fastacc.txt and h200-forward-d64-fastacc.txt (FP8 tensor-core QK^T,
# D=128 on the Gluon kernel, D=64 on the Triton one, TMA causal only), h200-forward-ws-2.txt
# (the Gluon kernel for FP8 P at D=128), h200-forward-tma.txt and h200-forward-pv-add.txt
# (bf16 QK^T: TMA and pv_add at D=128; D=64 keeps Triton's promotion).
# cuda_from_keys, by P mode (0 exp2 FP8 P, 4 affine FP8 P, 5 affine MXFP4 P, 7 affine FP8 P
# rescaled lazily):
# - e4m3 QK^T (the `fast_accum` recipes), P mode 0: at D=128 the CUDA kernel ran 2-7% faster
#   than the Gluon kernel at 4k keys and level with it (-2 to +1%) at 16k-32k, causal or not
#   (log/h200-forward-cuda-serial.txt, the fresh accumulators; 3-9% faster at 16k-32k in
#   log/h200-forward-cuda-fused-poly.txt); at D=64, three consumers, 0-12%
#   faster than the Triton kernel at 8k and -8 to +3% at 2k (log/h200-forward-cuda-consumers.txt,
#   -serial.txt).
# - P mode 4 (fp8-affine-fastacc) at D=64 non-causal ran 16-21% faster on the CUDA kernel than
#   on the Triton kernel at 2k-4k keys (0.96x / 1.04x of cuDNN bf16 against 0.83x / 0.86x);
#   causal the Triton kernel stayed ahead there (0.90x / 0.92x against 0.82x / 0.89x), and at
#   D=128 the Gluon kernel at 2k (1.04x against 1.02x) (log/h200-affine-bound-2.txt,
#   -2-causal.txt; docs/notes/affine-p.md).
# - P mode 7 (fp8-ktile-affine-lazy-fastacc) ran 14-43% faster on the CUDA kernel than on the
#   Triton/Gluon kernels at 2048-4096 keys, both head dims, causal or not (0.94x against 0.78x of
#   cuDNN bf16 at (16,16,2048,64) causal, 1.18x against 0.97x at (8,16,2048,128);
#   log/h200-lazy-rescale/probe-routing*.txt); shorter rows were not measured.
# - P mode 5 (fp8-directp-fast-fastacc), and bf16 QK^T (the exact recipes: directp-fast,
#   fp8-directp-fast, fp8-affine, fp8, nvfp4-fp8) in P modes 0, 4 and 5: in P mode 5 the CUDA
#   kernel ran 1.6-2.2x as fast as the Triton kernel at every measured shape (512-16k keys, both
#   head dims, causal or not); in modes 0 and 4 1.0-1.2x as fast as the Triton/Gluon kernels
#   non-causal from 512 keys (D=64) and 1024 (D=128), causal at D=128 from 1024, while causal at
#   D=64 the Triton kernel stayed ahead at 512-1024 keys (0.76x against 0.66x of cuDNN bf16,
#   fp8-affine at (32,16,1024,64)), level at 2048, behind at 8192 (0.87x against 0.96x)
#   (H100, log/h100-cuda-builds/probe-cudabuilds*.txt and probe-short*.txt; docs/notes/affine-p.md).
# cuda_persistent: non-causal, the persistent grid ran 1-6% faster than a CTA per unit (lazy
# affine P at D=128: 1.43x against 1.38x of cuDNN bf16 at 4k keys, 1.37x against 1.29x at 2k,
# 1.49x against 1.48x at 16k; D=64 +1-7%), the exact and exp2 builds alike; causal, 1-6% slower
# at D=128 and 30% at (16,16,2048,64): the static schedule hands CTA c the units of one query
# block length over and over there (132 CTAs = 12 x 11 blocks a head), the longest to some
# (benchmarks/results/log/h200-persistent/persistent-staged*.txt; docs/notes/hopper-forward.md).
FORWARD_LAUNCH: dict[tuple[int, bool, bool], ForwardLaunch] = {
    (128, True, False): ForwardLaunch(64, 4, 2, True, warp_specialized=True, cuda_persistent=True,
                                      cuda_from_keys=((0, 4096), (4, 4096), (5, 1024), (7, 2048))),
    (128, True, True): ForwardLaunch(64, 4, 2, True, warp_specialized=True, ws_overlap=4,
                                     cuda_from_keys=((0, 4096), (4, 4096), (5, 1024), (7, 2048))),
    (64, True, False): ForwardLaunch(64, 4, 3, True, cuda_persistent=True,
                                     cuda_from_keys=((0, 8192), (4, 2048), (5, 512), (7, 2048))),
    (64, True, True): ForwardLaunch(64, 4, 3, True, tma_kv=True,
                                    cuda_from_keys=((0, 8192), (4, 8192), (5, 512), (7, 2048))),
    **{(128, False, causal): ForwardLaunch(64, 4, 2, True, tma_kv=True, pv_add=True, warp_specialized=True,
                                           ws_overlap=4, cuda_from_keys=((0, 1024), (4, 1024), (5, 1024)),
                                           cuda_persistent=not causal) for causal in (True, False)},
    (64, False, False): ForwardLaunch(64, 4, 2, True, tma_kv=True, cuda_persistent=True,
                                      cuda_from_keys=((0, 512), (4, 512), (5, 512))),
    (64, False, True): ForwardLaunch(64, 4, 2, True, tma_kv=True, cuda_from_keys=((0, 2048), (4, 2048), (5, 512))),
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
    products in flight at once. dkdv_staged: a tile's numbers (LSE, delta, scales)
    moved through shared memory together (1), or copied asynchronously into two-stage
    buffers a tile ahead (2). *_maxnreg: register caps of the Gluon
    kernels' 4-warp programs (None: ptxas's choice).
    qk_fp4_dq (Blackwell): the Triton dQ kernel's S by the block-scaled FP4 product of
    the saved NVFP4 payloads (its QK_FP4; needs block_m_dq = 128), not a bf16 product.
    qk_fp4_dkdv (Blackwell): likewise the Triton dK/dV kernel's scores (its QK_FP4: S of
    two 64-query tiles at once, P^T taken from it), not a bf16 S^T.
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
    dkdv_staged: int = 1
    dq_gluon: bool = False
    dkdv_maxnreg: int | None = None
    dq_maxnreg: int | None = None
    qk_fp4_dq: bool = False
    qk_fp4_dkdv: bool = False
    # the CUDA C++ backward (`backward_cuda.py`: dK, dV and dQ in one FlashAttention-3-style pass)
    # where it takes the operands (`use_cuda_backward`); off in the table: slower than the Gluon
    # kernels as measured (docs/notes/hopper-train.md)
    cuda: bool = False


# Keyed by head dim; the fastest variants of causal (4,16,4096,128) and (8,16,4096,64),
# backward ms on the H200, docs/notes/hopper-train.md; files in benchmarks/results/log/: the
# Gluon dK/dV kernel (h200-backward-dkdv-gluon-2.txt), its numbers staged
# (h200-backward-dkdv-staged.txt) or copied asynchronously at D=128
# (h200-backward-dkdv-async-numbers.txt), the Gluon dQ (h200-backward-dq-gluon.txt),
# register caps at D=64 (h200-backward-gluon-maxnreg.txt).
BACKWARD_LAUNCH: dict[int, BackwardLaunch] = {
    64: BackwardLaunch(block_n_dkdv=64, warps_dkdv=4, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True,
                       dkdv_in_flight=2, dkdv_staged=1, dq_gluon=True, dkdv_maxnreg=168, dq_maxnreg=168),
    128: BackwardLaunch(block_n_dkdv=64, block_m_dq=64, warps_dq=4, tma=True, dkdv_gluon=True, dkdv_staged=2,
                        dq_gluon=True),
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
    tokens = [(_FORWARD_OVERRIDE, _FORWARD_OVERRIDE.set(forward)) if forward is not None else None,
              (_BACKWARD_OVERRIDE, _BACKWARD_OVERRIDE.set(backward)) if backward is not None else None]
    try:
        yield
    finally:
        for item in tokens:
            if item is not None:
                item[0].reset(item[1])


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


def forward_launch(head_dim: int, qk_fp8: bool, causal: bool) -> ForwardLaunch:
    """The launch the Hopper forward runs: `table_forward_launch`, or under the
    interpreter INTERPRETER_FORWARD_LAUNCH unless overridden."""
    if interpreting() and _FORWARD_OVERRIDE.get() is None:
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


def use_cuda_forward(launch: ForwardLaunch, p_mode: int, keys: int, on_cuda: bool, training: bool = False) -> bool:
    """Whether the forward runs on the CUDA C++ kernel (`ForwardLaunch.cuda_from_keys`; the
    launch is the table's for the recipe's Q/K: e4m3 for `fast_accum`, else bf16). Never for
    a training forward (`training`): its backward rebuilds P as the Triton kernels build it
    (the CUDA kernel's build of their arithmetic measured no faster for training:
    docs/notes/hopper-train.md)."""
    n = launch.cuda_keys(p_mode)
    return not training and n > 0 and keys >= n and on_cuda and cuda_kernels_unavailable() is None


def table_backward_launch(head_dim: int) -> BackwardLaunch:
    """The Hopper backward's launch on the GPU at this kernel head dim."""
    return _BACKWARD_OVERRIDE.get() or BACKWARD_LAUNCH[head_dim]


def backward_launch(head_dim: int) -> BackwardLaunch:
    """The launch the Hopper backward runs: `table_backward_launch`, or under the
    interpreter its float32 rounding instead of the PTX conversion unless overridden."""
    launch = table_backward_launch(head_dim)
    if interpreting() and _BACKWARD_OVERRIDE.get() is None:
        return dataclasses.replace(launch, hw_cvt=False, cuda=False)
    return launch


# The Q/K formats whose backward the Gluon kernels run: NVFP4 (one tensor scale per head
# for Q and for K) and per-token FP8 (`train-fp8`, a scale per query and per key: the
# kernels' ROW_SCALES form, as the Triton kernels'; docs/notes/hopper-train.md, "`train-fp8`
# on the Gluon backward"). Lengths that are not whole tiles run the Triton kernels.
GLUON_BACKWARD_QK = ("nvfp4", "fp8")


def backward_gluon_kernels(launch: BackwardLaunch, qk: str, p_mode: int, tma: bool) -> tuple[bool, bool]:
    """(dK/dV, dQ): whether each runs on its Gluon kernel (`backward_gluon.py`): where the
    launch asks for it (`dkdv_gluon`, `dq_gluon`), the loops' tiles arrive by TMA (`tma`:
    the launch's, with both lengths whole 64-token tiles), e4m3 is rounded by the
    hardware's conversion (`hw_cvt`), the Q/K format is one of GLUON_BACKWARD_QK and, for
    dK/dV, P is FP8 from exp2 (P mode 0), for dQ not the trained affine P (6)."""
    ok = tma and launch.hw_cvt and qk in GLUON_BACKWARD_QK
    # the Gluon dQ kernel builds P by exp2: not the trained affine P
    return launch.dkdv_gluon and ok and p_mode == 0, launch.dq_gluon and ok and p_mode != P_MODE_AFFINE_TRAINED


def use_cuda_backward(launch: BackwardLaunch, qk: str, p_mode: int, head_dim: int, sq: int, sk: int,
                      on_cuda: bool) -> bool:
    """Whether the backward runs on the CUDA C++ kernel (`BackwardLaunch.cuda`): per-token FP8
    Q/K with FP8 P from exp2 (`train-fp8`), head dim 64 or 128, Sq a multiple of 64 (dS's
    scale block) and Sk of 128 (a CTA's keys), on a GPU where the CUDA kernels build."""
    return (launch.cuda and qk == "fp8" and p_mode == 0 and head_dim in (64, 128) and sq % 64 == 0
            and sk % 128 == 0 and sq > 0 and on_cuda and cuda_kernels_unavailable() is None)


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


def _hopper_forward_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                           on_cuda: bool = True, training: bool = False) -> str:
    """The Hopper forward kernel that runs the call: the CUDA C++ kernel for the
    P modes and key counts of `cuda_from_keys`; the Gluon warp-specialized
    kernel for FP8 P where the launch asks for it and no key mask is given (its operands
    by TMA, which the fused quantizers' layouts allow); else the Triton kernel."""
    dk = kernel_head_dim(head_dim)
    launch = table_forward_launch(dk, recipe.fast_accum, causal)
    mode = p_mode(recipe)
    if use_cuda_forward(launch, mode, keys, on_cuda, training):
        return "hopper.forward_cuda"
    gluon = launch.warp_specialized and mode in GLUON_P_MODES and mask == "none"
    return "hopper.forward_gluon_ws" if gluon else "hopper.forward_triton"


def _hopper_train_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                         on_cuda: bool = True) -> str:
    fwd = _hopper_forward_kernel(recipe, head_dim, causal, mask, keys, on_cuda, training=True)
    cfg = table_backward_launch(kernel_head_dim(head_dim))
    gluon = backward_gluon_kernels(cfg, recipe.qk, p_mode(recipe), cfg.tma)
    dkdv, dq = (f"backward_{'gluon' if g else 'triton'}.{part}" for g, part in zip(gluon, ("dkdv", "dq")))
    where = " (Gluon where the lengths are whole 64-token tiles)" if any(gluon) else ""
    return f"{fwd} + hopper.{dkdv} + hopper.{dq}{where}"


@dataclass(frozen=True)
class KernelFamily:
    """Kernels of one target and direction. `masks` are the mask kinds they take ("none",
    "key" for a key-padding mask; never "other"); `unsupported(recipe, head_dim, mask)`
    says why they cannot run a call with one of those, or None; `kernel(recipe, head_dim,
    causal, mask, keys, on_cuda)` names what runs; `launcher` is the "module:function" the
    api calls."""

    name: str
    targets: tuple[str, ...]
    train: bool
    unsupported: Callable[[Recipe, int, str], str | None]
    kernel: Callable[[Recipe, int, bool, str, int, bool], str]
    launcher: str
    masks: tuple[str, ...] = field(default=("none", "key"))


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
                 _hopper_train_kernel, "fp4attn.kernels.hopper.train_op:hopper_train_attention", ("none",)),
    KernelFamily("hopper-forward", ("sm_90",), False, lambda r, d, m: hopper_forward_unsupported(r, d),
                 _hopper_forward_kernel, "fp4attn.kernels.hopper.forward_op:hopper_attention"),
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
    names, or "reference"), `target`, `reason` (why this backend), and the `family`
    whose launcher the api calls (None on the reference)."""

    backend: str
    kernel: str
    target: str
    reason: str
    family: KernelFamily | None = None

    def as_dict(self) -> dict:
        return {"backend": self.backend, "kernel": self.kernel, "target": self.target, "reason": self.reason,
                "launcher": self.family.launcher if self.family else None}


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
                return Route("triton", fam.kernel(recipe, head_dim, causal, mask, keys, device_type == "cuda"), target,
                             f"{fam.name} kernels run recipe {recipe.name!r} at head_dim {head_dim} on {target}",
                             fam)
            reasons.append(f"a backward is needed and {why}" if needs_grad else why)
    reason = "; ".join(reasons)
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run recipe {recipe.name!r}: {reason}")
    return Route("reference", "reference", target, reason)
