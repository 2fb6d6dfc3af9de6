"""Which code runs a KV cache append and a decode call, and with which launch: as data.

Pure Python, no Triton import; the decode counterpart of the attention's families
(`families.route`), whose target and backend rules it shares (FP4ATTN_TARGET,
FP4ATTN_BACKEND, TRITON_INTERPRET: `targets`) and whose CUDA C++ probe it asks
(`capability.cuda_kernels_unavailable`).

    backend     "triton": the Hopper kernels (`kernels/hopper/decode_triton.py`,
                `kvcache_triton.py`) on sm_90 at head dims 64 and 128; else the
                reference (`reference/decode.py`, `reference/kvcache.py`), logged once
    kernel      `split_kernel`: the CUDA C++ split kernel (`kernels/hopper/decode_cuda.py`)
                where it takes the call and builds, else the Triton one
    launch      `DecodeLaunch`: the key tile, warps and pipeline stages of the split
                kernel per (K format, V format, head dim) (`DECODE_LAUNCH`, each entry
                traced to a measurement in docs/notes/decode.md)
    splits      `split_plan`: split-K so that the programs fill whole waves of what an
                SM holds of the compiled kernel (`resident_programs`)
    route       `decode_route`: all of the above for one form of call, as one record
                (`DecodeRoute`), decided once per (device, cache geometry and formats,
                query rows, backend asked, environment) and reused by every later call
                of that form: the layers of a decode step share it. `explain_decode`
                returns it; `kernels/hopper/decode_op.py` executes it and decides nothing.

A launch changes speed only, never a value: the decode numerics do not depend on the
tile or the split a key falls in (`reference/decode.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

from fp4attn.routing import capability, targets
from fp4attn.routing.targets import BACKEND_ENV, INTERPRET_ENV, TARGET_ENV, requested_backend, target_of

DECODE_HEAD_DIMS = (64, 128)
DECODE_TARGETS = ("sm_90",)
# query rows of one sequence and KV head a program holds (GQA group x new tokens,
# padded to a power of two, at least MIN_BLOCK_M); more than MAX_BLOCK_M take more
# programs, each reading the cache again. Rows under 16 are fewer than an mma tile's,
# but the softmax runs on the real rows only (docs/notes/decode.md: 4 rows instead of
# 16 took 38 instead of 43 instructions a key and KV head in the NVFP4 loop)
MIN_BLOCK_M = 4
MAX_BLOCK_M = 64


@dataclass(frozen=True)
class DecodeLaunch:
    block_n: int  # keys a tile
    warps: int
    stages: int  # the software pipeline's depth over key tiles
    # programs resident on one SM, which the split plan fills in whole waves; 0: from the
    # compiled kernel's registers and shared memory (`resident_programs`)
    programs_per_sm: int = 0
    min_split_tiles: int = 4  # a split holds at least this many tiles (the combine and setup amortized)
    # dequantize by the inline-PTX bit placement (`decode_triton._fp4_asm`, `_fp8_asm`);
    # False: by float arithmetic (the interpreter's path, and a check of the asm's values)
    asm: bool = True
    splits: int = 0  # split-K splits; 0: `split_plan`'s (measurement only)
    # "": `split_kernel`'s choice; "triton" or "cuda" to measure one against the other
    kernel: str = ""


# The Triton split kernel's launch (`decode_launch` adapts it to the rows a program and the
# formats): the fewest instructions a key and KV head in the unmasked tile loop without a
# spill in the sm_90 machine code (tools/compile_check_decode.py); the numbers, and the
# H200 measurements since, in docs/notes/decode.md, "What runs today, and why".
DEFAULT_LAUNCH = DecodeLaunch(block_n=128, warps=4, stages=2)
DECODE_LAUNCH: dict[tuple[str, str, int], DecodeLaunch] = {}  # (K format, V format, head dim): measured overrides

# sm_90: 64 K registers, 64 warps, 32 programs and 227 KiB of shared memory an SM;
# registers are allocated per warp in units of 256
SM90_REGISTERS, SM90_WARPS, SM90_PROGRAMS, SM90_SHARED = 65536, 64, 32, 227 * 1024
# a split's fixed cost (setup, q, the masked tiles, its partial's write and combine),
# in tiles of the loop: what a plan pays for each split beyond the keys it reads
SPLIT_OVERHEAD_TILES = 1.0
MAX_SPLITS = 256


def block_m_for(rows: int) -> int:
    """Query rows a split-kernel program takes (a power of two from MIN_BLOCK_M to
    MAX_BLOCK_M) for `rows` rows a KV head (GQA group x new tokens)."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, 1 << (max(rows, 1) - 1).bit_length()))


def decode_launch(k_format: str, v_format: str, head_dim: int, block_m: int = MIN_BLOCK_M) -> DecodeLaunch:
    """The split kernel's launch for these formats, head dim and rows a program."""
    if (k_format, v_format, head_dim) in DECODE_LAUNCH:
        return DECODE_LAUNCH[(k_format, v_format, head_dim)]
    small_tile = block_m >= 16 or "bf16" in (k_format, v_format)
    return dataclasses.replace(DEFAULT_LAUNCH, block_n=64 if small_tile else DEFAULT_LAUNCH.block_n,
                               warps=8 if block_m >= 32 else DEFAULT_LAUNCH.warps)


# The CUDA split kernel (`kernels/hopper/decode_cuda.py`: one warp a split, no barrier)
# takes one new query row a sequence over bf16 / FP8 / NVFP4 / MXFP4 (at D = 128) keys and
# values, up to 16 query heads a KV head, pages of a multiple of 16 tokens; the Triton
# kernel takes the rest (MXFP4 at D = 64, speculative steps, chunks of a prompt). MXFP4
# moved here for its launch path: the Triton pair's took 66 us of host a call at
# (8,32,8,4096), 1.44-1.50x its CUDA-graph time (H100). bf16 one-row steps moved here from
# the Triton pair, whose launches made an eager call 1.66x its CUDA-graph time (H200,
# (8,32,8,4096)); here 1.05, at the Triton kernels' graph time (H100, docs/notes/decode.md).
CUDA_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
CUDA_MAX_ROWS = 16
CUDA_TILE = 16  # keys a warp takes at a time
CUDA_WARPS = 4
# key tiles of a warp's cp.async ring (STAGES - 1 in flight a warp; 0: the next tile
# prefetched in registers, one in flight), per (K format, V format), as a launch names
# it ("cuda:<stages>"). Measured on the H200 (docs/notes/decode.md, "What runs today, and
# why"; benchmarks/results/log/h200-decode-ring/): a ring of 2 for NVFP4 (1.23-1.50x cuDNN
# bf16 against 1.03-1.06x in registers), registers for FP8 (1.20-1.26x against 0.80-0.92x
# through the ring); MXFP4 takes the ring (measured on an H100 at that default, notes);
# the mixed-format caches take the default, unmeasured.
CUDA_STAGES = 2
CUDA_RING: dict[tuple[str, str], int] = {("fp8", "fp8"): 0}


def cuda_ring_refused(k_format: str, v_format: str, stages: int) -> bool:
    """Whether the CUDA kernel has no build of this ring depth for these formats: 1 never
    (a ring holds at least 2 tiles), 0 (registers) not for bf16 keys or values (the warp
    copies their tiles into shared memory together)."""
    return stages == 1 or (stages == 0 and "bf16" in (k_format, v_format))


def parse_cuda_stages(spec: str, k_format: str = "", v_format: str = "") -> int:
    """The ring depth a launch's "cuda:<stages>" names: 0 or at least 2 (`cuda_ring_refused`)."""
    if not spec.isdigit() or cuda_ring_refused(k_format, v_format, int(spec)):
        raise ValueError(f"CUDA decode ring {spec!r}: accepted 0 (registers; not for bf16 keys or values) or a ring "
                         f"of n >= 2 tiles")
    return int(spec)


def cuda_stages(k_format: str, v_format: str) -> int:
    """The CUDA split kernel's ring depth for these formats."""
    return CUDA_RING.get((k_format, v_format), CUDA_STAGES)


# a CTA of the CUDA kernel as a split plan's program: its warps' keys together, each warp
# at least 128 keys (8 of its tiles)
CUDA_LAUNCH = DecodeLaunch(block_n=CUDA_TILE * CUDA_WARPS, warps=CUDA_WARPS, stages=1, min_split_tiles=8)


def cuda_unsupported_reason(k_format: str, v_format: str, head_dim: int, group: int, sq: int,
                            page_size: int) -> str | None:
    """Why the CUDA split kernel does not take this decode call (None: it does)."""
    if k_format not in CUDA_FORMATS or v_format not in CUDA_FORMATS:
        return f"formats {k_format}/{v_format} (it takes {CUDA_FORMATS})"
    if head_dim not in DECODE_HEAD_DIMS:
        return f"head_dim {head_dim}"
    if "mxfp4" in (k_format, v_format) and head_dim != 128:
        return f"MXFP4 at head_dim {head_dim} (it takes MXFP4 at 128)"
    if sq != 1:
        return f"{sq} new query rows a sequence (it takes 1)"
    if group > CUDA_MAX_ROWS:
        return f"{group} query heads a KV head (it takes up to {CUDA_MAX_ROWS})"
    if page_size % CUDA_TILE:
        return f"page size {page_size} (it takes multiples of {CUDA_TILE})"
    return None


def cuda_split_unavailable(k_format: str, v_format: str, head_dim: int, group: int, sq: int, page_size: int,
                           on_gpu: bool) -> str | None:
    """Why the CUDA split kernel does not run this decode call (None: it does)."""
    why = cuda_unsupported_reason(k_format, v_format, head_dim, group, sq, page_size) if on_gpu else \
        "the interpreter runs Triton kernels only"
    if why is None:
        why = capability.cuda_kernels_unavailable()  # the probe every CUDA C++ kernel shares
    return why


def split_kernel(k_format: str, v_format: str, head_dim: int, group: int, sq: int, page_size: int,
                 on_gpu: bool, asked: str = "") -> str:
    """"cuda" or "triton": which split kernel runs this decode call (`asked`: a launch's
    own choice, which must be possible)."""
    why = cuda_split_unavailable(k_format, v_format, head_dim, group, sq, page_size, on_gpu)
    if asked == "cuda" and why:
        raise ValueError(f"the CUDA decode kernel cannot run this call: {why}")
    if asked == "triton" or why:
        return "triton"
    return "cuda"


def resident_programs(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs of `warps` warps, `registers` a thread and `shared_bytes` of shared
    memory that fit one sm_90 SM at once (at least 1)."""
    per_warp = -(-registers * 32 // 256) * 256
    fit = min(SM90_REGISTERS // max(per_warp, 1) // warps, SM90_WARPS // warps, SM90_PROGRAMS)
    if shared_bytes:
        fit = min(fit, SM90_SHARED // shared_bytes)
    return max(1, fit)


def split_plan(launch: DecodeLaunch, max_len: int, programs: int, sms: int, resident: int) -> tuple[int, int]:
    """(splits, tokens per split) for `programs` (sequences x KV heads x row blocks) over
    keys up to `max_len`, `resident` programs to an SM: the splits whose waves (whole
    waves count: a part-filled last wave takes a wave's time) times tiles per split, plus
    each split's fixed cost, is least; each split at least `min_split_tiles` tiles. It
    depends on `max_len` only through its count of key tiles."""
    return _split_plan(launch, max(1, math.ceil(max_len / launch.block_n)), programs, sms, resident)


@functools.lru_cache(maxsize=1024)  # the search is ~100 us of Python; `DecodeRoute.split_plan` memoizes it per route
def _split_plan(launch: DecodeLaunch, tiles: int, programs: int, sms: int, resident: int) -> tuple[int, int]:
    if launch.splits:
        splits = min(launch.splits, tiles)
    else:
        slots = max(1, resident * sms)
        most = max(1, min(MAX_SPLITS, tiles // launch.min_split_tiles))

        def cost(s: int) -> float:
            return math.ceil(programs * s / slots) * (math.ceil(tiles / s) + SPLIT_OVERHEAD_TILES)

        splits = min(range(1, most + 1), key=lambda s: (cost(s), s))
    per = math.ceil(tiles / splits)
    return math.ceil(tiles / per), per * launch.block_n


def unsupported_reason(device, head_dim: int) -> str | None:
    """Why the Hopper kernels cannot run a cache of this head dim on `device` (None: they can)."""
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cuda" and not targets.interpreting():
        return (f"the cache is on {device_type} (the kernels need CUDA, or TRITON_INTERPRET=1 with {TARGET_ENV}=sm_90: "
                "the Hopper Triton kernels under the interpreter, slowly)")
    target = target_of(device)
    if target not in DECODE_TARGETS:
        return f"no decode kernels are built for target {target}"
    if head_dim not in DECODE_HEAD_DIMS:
        return f"head_dim {head_dim} (the decode kernels take {DECODE_HEAD_DIMS})"
    if not capability.TRITON_IMPORTABLE:
        return "Triton is not importable"
    return None


def backend_for(device, head_dim: int, backend: str = "auto") -> tuple[str, str]:
    """("triton" or "reference", why) for an append or decode call; backend="triton"
    raises where the kernels cannot run it."""
    backend = requested_backend(backend)
    if backend == "reference":
        return "reference", "backend='reference' was asked for"
    why = unsupported_reason(device, head_dim)
    if why is None:
        return "triton", f"Hopper decode kernels at head_dim {head_dim}"
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this KV cache: {why}")
    return "reference", why


def routing_env() -> tuple:
    """The environment a decode route depends on (FP4ATTN_BACKEND, FP4ATTN_TARGET,
    TRITON_INTERPRET) as they are now, read on every call as the attention's routing reads
    it; through os.environ's own mapping of encoded names where it has one (CPython's
    `_data`, which every assignment to os.environ updates): `os.environ.get` costs about a
    microsecond a name, more than the rest of a cached route's lookup."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(data) is dict:
        return data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]), data.get(_ENV_KEYS[2])
    return env.get(BACKEND_ENV), env.get(TARGET_ENV), env.get(INTERPRET_ENV)


_ENV_KEYS = tuple(getattr(os.environ, "encodekey", lambda k: k)(k) for k in (BACKEND_ENV, TARGET_ENV, INTERPRET_ENV))
_APPEND_ROUTES: dict[tuple, tuple[str, bool]] = {}


def append_route(device, head_dim: int) -> tuple[str, bool]:
    """("triton" or "reference", whether the kernels run on the GPU rather than under the
    interpreter): what writes a KV cache append (backend "auto"), decided once per
    (device, head dim, routing environment) as `decode_route` is."""
    key = (device, head_dim, routing_env())
    chosen = _APPEND_ROUTES.get(key)
    if chosen is None:
        chosen = _APPEND_ROUTES[key] = (backend_for(device, head_dim)[0], not targets.interpreting())
    return chosen


def append_backend(device, head_dim: int) -> str:
    return append_route(device, head_dim)[0]


# ----------------------------------------------------------------------------- the route
LAUNCHER = "fp4attn.kernels.hopper.decode_op:hopper_decode"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one record per form of call
class DecodeRoute:
    """What a decode call of one form runs, and why: `decode_route` decides it once and
    every later call of that form reuses it; `explain_decode` returns `as_dict()`, and
    `kernels/hopper/decode_op.py` executes it without deciding anything again.

    backend: "triton" (the Hopper kernels) or "reference". kernel: the split kernel,
    "cuda" (`decode_cuda.py`) or "triton" (`decode_triton.py`), or "reference". hw: the
    kernels run on the GPU (inline PTX, the CUDA C++ kernel), not under the interpreter.
    launch: what the split plan spreads over the keys: the Triton kernel's program
    (`decode_launch`), or the CUDA kernel's CTA (`CUDA_LAUNCH`, its warps' tiles
    together); ring: the CUDA kernel's ring depth (`cuda_stages`); block_m: query rows a
    Triton program holds; programs: the programs (CUDA: CTAs) a split of the keys takes.
    The split count itself follows the longest sequence, which grows every step:
    `split_plan` finds it, memoized per count of key tiles.
    """

    backend: str
    kernel: str
    target: str
    reason: str
    k_format: str
    v_format: str
    head_dim: int
    batch: int
    kv_heads: int
    group: int  # query heads a KV head
    sq: int  # new query rows a sequence
    page_size: int
    hw: bool = False
    launch: DecodeLaunch | None = None
    ring: int = 0
    block_m: int = 0
    programs: int = 0
    _plans: dict = field(default_factory=dict, init=False, repr=False)

    def split_plan(self, max_len: int, sms: int, resident: int) -> tuple[int, int]:
        """`split_plan` of this route's launch for keys up to `max_len`, `sms` SMs holding
        `resident` programs (CTAs) each; (splits, tokens per split)."""
        launch = self.launch
        assert launch is not None, "a reference route has no split plan"
        tiles = -(-max(max_len, 1) // launch.block_n)
        key = (tiles, sms, resident)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 4096:  # a bound on a long-lived process's memo
                self._plans.clear()
            plan = self._plans[key] = _split_plan(launch, tiles, self.programs, sms, resident)
        return plan

    def as_dict(self) -> dict:
        """What `fp4attn.explain(q, cache)` returns: "backend", "kernel"
        ("hopper.decode_cuda", "hopper.decode_triton" or "reference"), "target",
        "reason", "launcher", "formats" (K/V) and, on the kernels, "launch" (the split
        kernel's tile, warps and pipeline stages)."""
        out: dict = {"backend": self.backend, "kernel": "reference" if self.kernel == "reference" else
                     f"hopper.decode_{self.kernel}", "target": self.target, "reason": self.reason,
                     "launcher": None if self.backend == "reference" else LAUNCHER,
                     "formats": f"{self.k_format}/{self.v_format}"}
        launch = self.launch
        if launch is not None:
            out["launch"] = {"block_n": launch.block_n, "warps": launch.warps,
                             "stages": self.ring if self.kernel == "cuda" else launch.stages}
        return out


def decide_route(device, batch: int, kv_heads: int, q_heads: int, sq: int, head_dim: int, k_format: str,
                 v_format: str, page_size: int, backend: str = "auto") -> DecodeRoute:
    """The route of a decode call of q (batch, q_heads, sq, head_dim) on `device` over a
    cache of these K/V formats and page size, decided now (`decode_route` keeps it);
    backend="triton" raises where the kernels cannot run it."""
    chosen, why = backend_for(device, head_dim, backend)
    group = q_heads // kv_heads
    route = DecodeRoute("reference", "reference", target_of(device), why, k_format, v_format, head_dim, batch,
                        kv_heads, group, sq, page_size)
    if chosen != "triton":
        return route
    hw = not targets.interpreting()
    block_m = block_m_for(group * sq)
    not_cuda = cuda_split_unavailable(k_format, v_format, head_dim, group, sq, page_size, hw)
    if not_cuda is None:
        return dataclasses.replace(route, backend="triton", kernel="cuda", reason=f"{why}; the CUDA C++ split kernel",
                                   hw=hw, launch=CUDA_LAUNCH, ring=cuda_stages(k_format, v_format), block_m=block_m,
                                   programs=batch * kv_heads)
    return dataclasses.replace(route, backend="triton", kernel="triton",
                               reason=f"{why}; the Triton split kernel (not the CUDA C++ one: {not_cuda})", hw=hw,
                               launch=decode_launch(k_format, v_format, head_dim, block_m), block_m=block_m,
                               programs=batch * kv_heads * -(-group * sq // block_m))


_ROUTES: dict[tuple, DecodeRoute] = {}


def decode_route(device, batch: int, kv_heads: int, q_heads: int, sq: int, head_dim: int, k_format: str,
                 v_format: str, page_size: int, backend: str = "auto") -> DecodeRoute:
    """`decide_route`, once per form of call: the same arguments and the same routing
    environment (FP4ATTN_BACKEND, FP4ATTN_TARGET, TRITON_INTERPRET) give the same record.
    What else the decision reads (the CUDA kernels' probe, Triton's presence) is fixed for
    a process; a test that patches it calls `clear_routes`."""
    key = (device, batch, kv_heads, q_heads, sq, head_dim, k_format, v_format, page_size, backend, routing_env())
    route = _ROUTES.get(key)
    if route is None:
        route = decide_route(device, batch, kv_heads, q_heads, sq, head_dim, k_format, v_format, page_size, backend)
        if len(_ROUTES) >= 256:  # forms of call a process has seen: a bound, never reached in a generation
            _ROUTES.clear()
        _ROUTES[key] = route
    return route


@functools.lru_cache(maxsize=64)
def with_launch(route: DecodeRoute, launch: DecodeLaunch) -> DecodeRoute:
    """A kernel route with a launch other than the table's, to measure one against another
    (`fp4attn bench --decode --launches`, tools/): `launch`'s nonzero block_n, warps,
    stages, programs_per_sm and splits replace the table's, its asm replaces the table's;
    its kernel, "" (the route's choice), "triton", "cuda" or "cuda:<ring stages>", picks
    the split kernel (a ValueError where the CUDA kernel cannot run the call)."""
    table = decode_launch(route.k_format, route.v_format, route.head_dim, route.block_m)
    merged = DecodeLaunch(launch.block_n or table.block_n, launch.warps or table.warps, launch.stages or table.stages,
                          launch.programs_per_sm or table.programs_per_sm, table.min_split_tiles, bool(launch.asm),
                          launch.splits or table.splits, launch.kernel or table.kernel)
    asked, _, ring = merged.kernel.partition(":")
    kernel = split_kernel(route.k_format, route.v_format, route.head_dim, route.group, route.sq, route.page_size,
                          route.hw, asked)
    reason = f"{route.reason}; measured launch {launch}"
    if kernel == "cuda":
        plan = CUDA_LAUNCH
        if merged.splits:  # warps' splits asked for: whole CTAs of them
            plan = dataclasses.replace(plan, splits=max(1, -(-merged.splits // CUDA_WARPS)))
        return dataclasses.replace(route, kernel="cuda", reason=reason, launch=plan,
                                   ring=(parse_cuda_stages(ring, route.k_format, route.v_format) if ring
                                         else cuda_stages(route.k_format, route.v_format)),
                                   programs=route.batch * route.kv_heads)
    return dataclasses.replace(route, kernel="triton", reason=reason, launch=merged, ring=0,
                               programs=route.batch * route.kv_heads * -(-route.group * route.sq // route.block_m))


def clear_routes() -> None:
    """Forget every decided route (for tests that patch what a decision reads)."""
    _ROUTES.clear()
    _APPEND_ROUTES.clear()
    with_launch.cache_clear()
