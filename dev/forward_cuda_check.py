"""The Hopper CUDA forward's checking build (dev/cuda/attn_fwd_fp8_check.cu): the production
kernel's headers (fp4attn/kernels/hopper/cuda/) with what only the checks and measurements
need, kept out of the installed source. `CheckVariant` adds its switches to the
production `Variant`'s; `launch_checking` runs it (or, where no checking switch is set,
the production kernel) on prepared operands, like `forward_cuda.launch_forward_cuda`.

- the recipe's arithmetic operation for operation (`MEASURED["recipe"]`,
  `fused_softmax=False`): bit-identical to the Gluon kernel, the base the tests and
  benchmarks/bench_forward_cuda.py hold the production kernel to; `rowsum_int` its row
  sums' conversion on the integer units;
- P's codes of every key tile (`p_dump=` a `p_dump_buffer`), compared entry for entry with
  the recipe build's and the Triton kernel's;
- timing builds (wrong outputs): `ablate_softmax`, `affine_ablate`, `ablate_epilogue`;
  `mx_subnormal=False`, the MXFP4 builder's subtraction in every build (measured beside).
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4attn.kernels.hopper import forward_cuda
from fp4attn.kernels.hopper.forward_cuda import BLOCK_N, Variant, define
from fp4attn.kernels.hopper.nvrtc_build import Build, compile_source, load_function, options_for
from fp4attn.kernels.hopper.operands import KernelOperands

SOURCE = Path(__file__).with_name("cuda") / "attn_fwd_fp8_check.cu"


@dataclass(frozen=True)
class CheckVariant(Variant):
    """A production `Variant` and the checking build's switches (each one of the checking
    source's -D switches); all at their defaults, the production kernel."""

    # False: the recipe's arithmetic operation for operation (the row sums from the softmax)
    fused_softmax: bool = define("FUSED_SOFTMAX", True)
    rowsum_int: bool = define("ROWSUM_INT", False)  # fused_softmax=False: the row sums' e4m3 -> f16 on the integer units
    dump_p: bool = define("DUMP_P", False)  # every tile's P codes written to a buffer
    ablate_softmax: bool = define("ABLATE_SOFTMAX", False)  # timing only: no softmax (the kernel's ceiling)
    # affine_p timing builds: 1 without the key-scale product, 2 also without the row maximum
    # (docs/notes/affine-p.md places the softmax's cost with them)
    affine_ablate: int = define("AFFINE_ABLATE", 0)
    ablate_epilogue: bool = define("ABLATE_EPILOGUE", False)  # timing only: no epilogue, no outputs
    # affine_mx with K per key and no key bias: codes read off subnormal FMA results (the
    # production form); False, the subtraction (measured beside)
    mx_subnormal: bool = define("MX_SUBNORMAL_OK", True)

    def __post_init__(self):
        super().__post_init__()
        if (self.affine_p or self.key_tile_scale) and not self.fused_softmax:
            raise ValueError("CheckVariant: affine_p and key_tile_scale are forms of the fused softmax; they need "
                             "fused_softmax=True")
        if self.affine_ablate and (not self.affine_p or self.lazy_rescale or self.affine_mx):
            raise ValueError("CheckVariant: affine_ablate ablates the affine FP8 P with exact rescaling")
        if self.ablate_softmax + (not self.fused_softmax) + bool(self.affine_ablate) > 1:
            raise ValueError("CheckVariant: one checking softmax at a time: ablate_softmax, fused_softmax=False or "
                             "affine_ablate")

    @property
    def rowsum_by_pv(self) -> bool:
        return self.fused_softmax

    def production(self) -> Variant | None:
        """The production `Variant` this is, where no checking switch is set (else None)."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(Variant)}
        return Variant(**base) if self == CheckVariant(**base) else None


# the row sums' e4m3 -> f16 on the integer units per (head dim, causal) in the recipe build:
# bit-identical results; at D=128 7-9% faster non-causal, 0.4-1.8% causal, at D=64 0 to -1%
# (benchmarks/results/log/h200-forward-cuda-softmax.txt, cuda against cuda_isum)
ROWSUM_INT = {(128, False): True, (128, True): True, (64, False): False, (64, True): False}

# the softmax variants measured beside the launcher's (benchmarks/bench_forward_cuda.py
# --variants; CheckVariant fields over the table's); exp2 in f16x2 was measured and removed
# (benchmarks/results/log/h200-forward-cuda-softmax.txt, commit 0702b95)
MEASURED = {
    # the recipe's arithmetic operation for operation: bit-identical to the Gluon kernel
    # (the checking script's base), row sums converted on the integer units at D=128
    "recipe": {"fused_softmax": False, "exp_poly": 0, "consumers": 2},
    "cvt": {"fused_softmax": False, "exp_poly": 0, "rowsum_int": False, "consumers": 2},  # row sums by cvt: bit-identical
    "fused": {"exp_poly": 0, "consumers": 2},  # the fused softmax, every exp2 by MUFU
    "fpoly8": {"exp_poly": 8},  # half of the exp2s by polynomial
    "c2": {"consumers": 2},  # two consumer warpgroups at head dim 64 too (the launcher's take three)
}
EXACT_VARIANTS = ("recipe", "cvt")  # bit-identical to each other and to the Gluon kernel, or wrong


def check_variant_for(head_dim: int, causal: bool, key_bias: bool = False, affine_p: bool = False,
                      key_tile_scale: bool = False, lazy_rescale: bool = False, affine_mx: bool = False,
                      qk_bf16: bool = False, **fields) -> CheckVariant:
    """The launcher's build (`forward_cuda.variant_for`) with checking `fields` over it; the
    recipe's arithmetic (fused_softmax=False) takes its row-sum conversion from ROWSUM_INT."""
    base = forward_cuda.variant_for(head_dim, causal, key_bias, affine_p, key_tile_scale, lazy_rescale, affine_mx,
                                    qk_bf16)
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(Variant)}
    if not fields.get("fused_softmax", True):
        kw["rowsum_int"] = ROWSUM_INT[head_dim, causal]
    return CheckVariant(**{**kw, **fields})


def measured_variants() -> list[CheckVariant]:
    """The softmax variants built for measurement beside the launcher's (compile-checked too)."""
    return [check_variant_for(d, c, **kw) for d in forward_cuda.HEAD_DIMS for c in (False, True)
            for kw in MEASURED.values()]


def checking_variants() -> list[CheckVariant]:
    """One build of each checking switch (what the CPU compile check builds beside the
    measured ones): P dumps of the exp2, affine, lazy and MXFP4 builds, the recipe's
    arithmetic with a key bias, and the timing builds."""
    v = check_variant_for
    return [v(128, False, dump_p=True), v(64, True, key_bias=True, affine_p=True, dump_p=True),
            v(128, True, affine_p=True, lazy_rescale=True, key_tile_scale=True, dump_p=True),
            v(64, False, affine_p=True, affine_mx=True, qk_bf16=True, dump_p=True),
            v(128, True, key_bias=True, dump_p=True, **MEASURED["recipe"]),
            v(128, False, ablate_softmax=True), v(128, False, affine_p=True, affine_ablate=1),
            v(128, True, affine_p=True, key_tile_scale=True, affine_ablate=2),
            v(64, False, affine_p=True, lazy_rescale=True, ablate_epilogue=True),
            v(128, False, affine_p=True, affine_mx=True, mx_subnormal=False)]


# ---------------------------------------------------------------------------- build
def compile_check_variant(variant: CheckVariant, *, use_cache: bool = True, announce: bool = True) -> Build:
    """The checking build's cubin for sm_90a (no GPU needed)."""
    # the production headers it includes are found on the include path, and the cache key
    # hashes them (nvrtc_build.cache_key)
    options = options_for(variant.defines()) + [f"--include-path={forward_cuda.SOURCE.parent}"]
    return compile_source(SOURCE, options, f"the CUDA forward's checking build ({variant})", use_cache=use_cache,
                          announce=announce)


# ---------------------------------------------------------------------------- launch
class CheckParams(ctypes.Structure):
    # the checking kernel's `CheckParams`: the production parameter, then the P dump's address
    _fields_ = [("fwd", forward_cuda.Params), ("p_dump", ctypes.c_uint64), ("_pad", ctypes.c_uint8 * 56)]


assert ctypes.sizeof(CheckParams) == 704 and CheckParams.p_dump.offset == 640


def _p_dump_shape(ops: KernelOperands, consumers: int) -> tuple[int, ...]:
    """(B*H, query blocks, key tiles, consumer threads, 64): a P dump of a build with
    `consumers` consumer warpgroups (64 query rows and 128 threads each)."""
    B, H, Sq, _ = ops.q.shape
    return (B * H, -(-Sq // (64 * consumers)), -(-ops.k.shape[2] // BLOCK_N), 128 * consumers, 64)


def p_dump_buffer(ops: KernelOperands, consumers: int) -> torch.Tensor:
    """A buffer for `launch_checking(p_dump=...)` of a build with `consumers` consumer
    warpgroups: (B*H, query blocks, key tiles, consumer threads, 64) uint8 filled with 0xFF
    (never a P code: tiles a block skips keep it)."""
    return torch.full(_p_dump_shape(ops, consumers), 0xFF, dtype=torch.uint8, device=ops.q.device)


def p_codes_by_slab(p_dump: torch.Tensor, rows: int, causal: bool) -> torch.Tensor:
    """A `p_dump_buffer` of any build as (B*H, 64-row slabs, key tiles, 128 threads, 64): the
    same layout whatever the consumers per CTA, so that two builds' P codes compare entry for
    entry; `rows` (Sq) bounds the slabs. The dump is by CTA, and causal grids run the query
    blocks last to first."""
    bh, blocks, tiles, threads, _ = p_dump.shape
    consumers = threads // 128
    if causal:
        p_dump = p_dump.flip(1)
    slabs = p_dump.view(bh, blocks, tiles, consumers, 128, 64).permute(0, 1, 3, 2, 4, 5)
    return slabs.reshape(bh, blocks * consumers, tiles, 128, 64)[:, :-(-rows // 64)]


def launch_checking(ops: KernelOperands, *, scale: float, causal_offset: int | None,
                    key_bias: torch.Tensor | None = None, p_dump: torch.Tensor | None = None,
                    affine_p: bool = False, lazy_rescale: bool = False, affine_mx: bool = False,
                    persistent: bool = False, **fields):
    """`forward_cuda.launch_forward_cuda` with the checking build's fields (`CheckVariant`,
    `MEASURED`) and p_dump, a `p_dump_buffer` that receives every tile's P codes: (out, lse).
    Where no checking field is set, the production kernel runs."""
    accepted = {f.name for f in dataclasses.fields(CheckVariant)} - {
        "head_dim", "causal", "key_bias", "dump_p", "affine_p", "key_tile_scale", "lazy_rescale", "affine_mx",
        "qk_bf16"}
    unknown = sorted(set(fields) - accepted)
    if unknown:
        raise ValueError(f"launch_checking: unknown variant fields {unknown}; accepted: {sorted(accepted)}")
    reason = forward_cuda.cuda_unsupported_reason(ops, causal_offset=causal_offset, key_bias=key_bias)
    if reason:
        raise ValueError(f"launch_checking: {reason}")
    D = ops.q.shape[-1]
    variant = check_variant_for(D, causal_offset is not None, key_bias is not None, affine_p, ops.k_tile_scales,
                                lazy_rescale, affine_mx, ops.q.dtype == torch.bfloat16, **fields,
                                dump_p=p_dump is not None)
    production = variant.production()
    if production is not None:
        kw = {name: getattr(production, name) for name in ("stages", "exp_poly", "consumers")}
        return forward_cuda.launch_forward_cuda(ops, scale=scale, causal_offset=causal_offset, key_bias=key_bias,
                                                affine_p=affine_p, lazy_rescale=lazy_rescale, affine_mx=affine_mx,
                                                persistent=persistent, **kw)
    if p_dump is not None:
        need = _p_dump_shape(ops, variant.consumers)
        if p_dump.dtype != torch.uint8 or tuple(p_dump.shape) != need or not p_dump.is_contiguous():
            raise ValueError(f"launch_checking: p_dump must be contiguous uint8 {need} (p_dump_buffer)")
    launch = forward_cuda.prepare_launch(ops, variant, scale=scale, causal_offset=causal_offset, key_bias=key_bias,
                                         persistent=persistent)
    params = CheckParams()
    params.fwd = launch.params
    params.p_dump = p_dump.data_ptr() if p_dump is not None else 0
    fn = load_function(("forward-check", variant), lambda: compile_check_variant(variant), forward_cuda.KERNEL_NAME,
                       ops.q.device, variant.shared_bytes())
    forward_cuda.launch_kernel(fn, params, variant, launch.grid, ops.q.device)
    return launch.out, launch.lse
