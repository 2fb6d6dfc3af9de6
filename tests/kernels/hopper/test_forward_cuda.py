"""The CUDA C++ Hopper forward (fp4attn/kernels/hopper/forward_cuda.py) and its checking
build (dev/cuda/attn_fwd_fp8_check.cu, dev/forward_cuda_check.py).

CPU: every variant the launcher can pick compiles for sm_90a with NVRTC, without
local-memory spills and with ptxas keeping the wgmmas pipelined; so do the checking build's
switches and measured variants; the production source reads only `Variant`'s switches.
GPU (Hopper): the checking build of the recipe's arithmetic (`MEASURED["recipe"]`) against
the Triton/Gluon kernel on the same prepared operands: the arithmetic is the same, so nearly
every bf16 output is bit-identical (the float32 sums differ in order only) and the LSE
agrees to float32 rounding; both row-sum conversions (ROWSUM_INT), and their bit-identity
to each other; the launcher's build (fused softmax, polynomial exp2) and the fused
softmax alone against that build, P code by P code (the checking build's P dumps).
"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch

NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


@pytest.mark.compile
@pytest.mark.skipif(not NVRTC, reason="cuda-bindings (NVRTC) not installed")
def test_every_variant_compiles_without_spills(tmp_path, monkeypatch):
    from fp4attn.kernels.hopper import forward_cuda

    monkeypatch.setenv(forward_cuda.CACHE_ENV, str(tmp_path))  # a fresh build, not a cached one
    for variant in forward_cuda.all_variants():
        build = forward_cuda.compile_variant(variant, announce=False)
        assert build.cubin[:4] == b"\x7fELF", variant
        # three consumers live in 160 registers: ptxas keeps a few loop values in local memory
        # (about 20 accesses per key tile, none in the softmax; measured in the timings)
        # the affine-P causal build at head dim 128: 4 bytes stored and reloaded (measured)
        assert build.spill_bytes() <= (320 if variant.consumers == 3 else 8 if variant.affine_p else 0), \
            f"{variant}: ptxas spilled to local memory:\n{build.log}"
        assert not build.serialized_wgmma(), f"{variant}: ptxas serialized the wgmmas:\n{build.log}"
    # the second build of a variant comes from the cache
    assert list(tmp_path.rglob("*.cubin"))


@pytest.mark.compile
@pytest.mark.skipif(not NVRTC, reason="cuda-bindings (NVRTC) not installed")
def test_checking_build_compiles(tmp_path, monkeypatch):
    """The checking build (outside the package) compiles from the production headers: each of
    its switches once, and the measured softmax variants."""
    from dev import forward_cuda_check as check
    from fp4attn.kernels.hopper import forward_cuda

    monkeypatch.setenv(forward_cuda.CACHE_ENV, str(tmp_path))
    measured = [v for v in check.measured_variants() if (v.head_dim, v.causal) in ((128, False), (64, True))]
    for variant in check.checking_variants() + measured:
        production = variant.production()
        build = (forward_cuda.compile_variant(production, announce=False) if production is not None
                 else check.compile_check_variant(variant, announce=False))
        # the affine-P causal build at head dim 128: 4 bytes stored and reloaded (measured)
        assert build.spill_bytes() <= (320 if variant.consumers == 3 else 8 if variant.affine_p else 0), \
            f"{variant}: ptxas spilled to local memory:\n{build.log}"
        assert not build.serialized_wgmma(), f"{variant}: ptxas serialized the wgmmas:\n{build.log}"


def test_production_source_reads_only_the_variants_switches():
    """The production kernel's -D switches are `Variant`'s fields, and none of the checking
    build's switches appears in its source or headers (they live in dev/cuda/)."""
    from dev.forward_cuda_check import CheckVariant
    from fp4attn.kernels.hopper import forward_cuda

    def names(variant_type):
        return {f.metadata["define"] for f in dataclasses.fields(variant_type)}

    production = names(forward_cuda.Variant)
    source = forward_cuda.SOURCE.read_text()
    assert set(re.findall(r"^#ifndef (\w+)", source, re.MULTILINE)) == production
    checking = names(CheckVariant) - production
    assert checking
    cuda = Path(forward_cuda.SOURCE).parent
    for path in [forward_cuda.SOURCE, *cuda.glob("*_fwd.cuh"), cuda / "p_build.cuh", cuda / "named_barrier.cuh"]:
        text = path.read_text()
        assert not [n for n in checking if re.search(rf"\b{n}\b", text)], path.name


def _operands(B, H, Hkv, Sq, Sk, D, seed=0):
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((B, H, Sq, D), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn((B, Hkv, Sk, D), device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn((B, Hkv, Sk, D), device="cuda", generator=g).to(torch.bfloat16)
    return prepare_operands_fused(q, k, v, get_recipe("fp8-fastacc"))


def _compare(ops, causal_offset, key_bias=None, **variant):
    from dev.forward_cuda_check import MEASURED, launch_checking
    from fp4attn.kernels.hopper.forward_op import launch_forward

    D = ops.q.shape[-1]
    scale = D ** -0.5
    out, lse = launch_checking(ops, scale=scale, causal_offset=causal_offset, key_bias=key_bias,
                               **{**MEASURED["recipe"], **variant})
    ref, ref_lse, _ = launch_forward(ops, scale=scale, causal_offset=causal_offset, p_mode=0,
                                     key_bias=key_bias)
    torch.cuda.synchronize()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key differ"
    assert (out[~seen] == 0).all(), "a row that sees no key must come out 0"
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1e-2)
    same = (out == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of the outputs are bit-identical to the Triton/Gluon kernel's"


SHAPES = [
    # B, H, Hkv, Sq, Sk, D, causal ("bottom_right": offset Sk - Sq, "top_left": 0)
    (1, 2, 2, 1, 1, 128, None),
    (1, 2, 2, 113, 1023, 128, None),
    (2, 4, 2, 1023, 113, 128, None),
    (1, 2, 2, 1024, 1024, 128, "top_left"),
    (1, 2, 2, 113, 1023, 128, "bottom_right"),
    (1, 2, 2, 1023, 113, 128, "bottom_right"),  # early rows see no key
    (2, 4, 1, 300, 700, 128, "top_left"),
    (1, 2, 2, 1, 1, 64, None),
    (2, 4, 2, 113, 1023, 64, None),
    (1, 2, 2, 1023, 1023, 64, "bottom_right"),
    (1, 4, 2, 700, 300, 64, "top_left"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("rowsum_int", [False, True], ids=["rowsum_cvt", "rowsum_int"])
@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal", SHAPES)
def test_matches_triton_kernels(B, H, Hkv, Sq, Sk, D, causal, rowsum_int):
    ops = _operands(B, H, Hkv, Sq, Sk, D)
    offset = None if causal is None else (0 if causal == "top_left" else Sk - Sq)
    _compare(ops, offset, rowsum_int=rowsum_int)  # the recipe's arithmetic, either row-sum conversion


@pytest.mark.gpu
@pytest.mark.parametrize("D,causal", [(128, False), (64, True)])
def test_rowsum_int_is_bit_identical(D, causal):
    """The row sums' conversion on the integer units changes no bit of the results."""
    from dev.forward_cuda_check import MEASURED, launch_checking

    ops = _operands(2, 4, 2, 777, 1500, D, seed=3)
    offset = 0 if causal else None
    kw = dict(scale=D ** -0.5, causal_offset=offset, **MEASURED["recipe"])
    out0, lse0 = launch_checking(ops, rowsum_int=False, **kw)
    out1, lse1 = launch_checking(ops, rowsum_int=True, **kw)
    assert torch.equal(out0, out1)
    assert torch.equal(lse0, lse1)


@pytest.mark.gpu
@pytest.mark.parametrize("D,causal", [(128, False), (64, True)])
def test_key_bias(D, causal):
    B, Sq, Sk = 2, 200, 333
    ops = _operands(B, 2, 2, Sq, Sk, D, seed=1)
    keep = torch.rand((B, Sk), device="cuda") > 0.3
    keep[:, 0] = True
    bias = torch.where(keep, 0.0, -float("inf")).float()
    _compare(ops, 0 if causal else None, key_bias=bias)


@pytest.mark.gpu
def test_unsupported_operands_are_named():
    from fp4attn.kernels.hopper.forward_cuda import cuda_unsupported_reason, launch_forward_cuda

    ops = _operands(1, 2, 2, 64, 64, 128)
    # mixed Q/K formats: the kernel multiplies e4m3 by e4m3 or bf16 by bf16
    mixed = type(ops)(ops.q, ops.k.to(torch.bfloat16), ops.qs, ops.ks, ops.vt, ops.vs)
    assert "e4m3 Q/K (the fast_accum recipes) or bf16 Q/K" in cuda_unsupported_reason(mixed)
    with pytest.raises(ValueError, match="got torch.float8_e4m3fn and torch.bfloat16"):
        launch_forward_cuda(mixed, scale=1.0, causal_offset=None)
    bf16_v = type(ops)(ops.q, ops.k, ops.qs, ops.ks, ops.vt.to(torch.bfloat16), ops.vs)
    assert "e4m3 V^T" in cuda_unsupported_reason(bf16_v)


FUSED_SHAPES = [  # B, H, Hkv, Sq, Sk, D, causal, key bias
    (1, 2, 2, 113, 1023, 128, None, False),
    (1, 2, 2, 1023, 113, 128, "bottom_right", False),
    (2, 4, 1, 300, 700, 128, "top_left", True),
    (2, 4, 2, 1500, 2000, 64, None, False),
    (1, 2, 2, 1023, 1023, 64, "bottom_right", True),
    (1, 3, 1, 200, 450, 64, "top_left", False),
]
# the fused softmax with every exp2 by MUFU, the launcher's build ({}: three consumer
# warpgroups per CTA at head dim 64), and two consumers at head dim 64
FUSED_VARIANTS = {"fused": {"exp_poly": 0, "consumers": 2}, "launcher": {}, "consumers2": {"consumers": 2}}


@pytest.mark.gpu
@pytest.mark.parametrize("name,B,H,Hkv,Sq,Sk,D,causal,bias", [
    (name, *shape) for name, kw in FUSED_VARIANTS.items() for shape in FUSED_SHAPES
    if name != "consumers2" or shape[5] == 64])
def test_fused_softmax(name, B, H, Hkv, Sq, Sk, D, causal, bias):
    """The fused softmax (one FMA per score, row sums from the PV product), alone, with
    the launcher's polynomial exp2s, and with two or three consumer warpgroups: P codes equal to
    the recipe's arithmetic on >= 99.9% of entries, outputs within bf16 rounding, the same
    rows empty."""
    from dev.forward_cuda_check import MEASURED, launch_checking, p_codes_by_slab, p_dump_buffer
    from fp4attn.kernels.hopper.forward_cuda import CONSUMERS

    ops = _operands(B, H, Hkv, Sq, Sk, D, seed=5)
    offset = None if causal is None else (0 if causal == "top_left" else Sk - Sq)
    key_bias = None
    if bias:
        # its own generator: the test's inputs do not depend on which tests ran before it
        g = torch.Generator(device="cuda").manual_seed(6)
        keep = torch.rand((B, Sk), device="cuda", generator=g) > 0.3
        keep[:, 0] = True
        key_bias = torch.where(keep, 0.0, -float("inf")).float()
    kw = dict(scale=D ** -0.5, causal_offset=offset, key_bias=key_bias)
    variant = FUSED_VARIANTS[name]
    base_p = p_dump_buffer(ops, MEASURED["recipe"]["consumers"])
    fused_p = p_dump_buffer(ops, variant.get("consumers", CONSUMERS[D, causal is not None]))
    out, lse = launch_checking(ops, p_dump=base_p, **MEASURED["recipe"], **kw)
    f_out, f_lse = launch_checking(ops, p_dump=fused_p, **variant, **kw)
    torch.cuda.synchronize()
    seen = torch.isfinite(lse)
    assert torch.equal(seen, torch.isfinite(f_lse))
    assert (f_out[~seen] == 0).all()
    # the polynomial moves single P codes of rows with few keys (LSE measured within 8.4e-3)
    torch.testing.assert_close(f_lse[seen], lse[seen], atol=1e-3 if variant.get("exp_poly") == 0 else 1e-2, rtol=0)
    # one P code moved by the polynomial moves an output of a short row by up to one e4m3
    # step of p (2**-4 below p = 1) times |v| over the row sum: 0.0225 measured at a row of
    # 73 keys (top-left causal, key mask), where bf16 rounding alone stays under 2e-2
    atol = 2e-2 if variant.get("exp_poly") == 0 else 4e-2
    torch.testing.assert_close(f_out.float(), out.float(), atol=atol, rtol=1e-2)
    base_p, fused_p = p_codes_by_slab(base_p, Sq, causal is not None), p_codes_by_slab(fused_p, Sq, causal is not None)
    valid = base_p != 0xFF
    same_p = ((fused_p == base_p) & valid).sum().item() / valid.sum().item()
    assert same_p >= 0.999, f"P codes identical on {same_p:.5f} of the entries"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-fastacc", "fp8-directp-fast-fastacc", "directp-fast", "fp8-affine",
                                  "nvfp4-fp8"])
@pytest.mark.parametrize("D,causal,Hkv,masked", [(128, False, 2, False), (128, True, 1, True), (64, True, 2, False),
                                                 (64, False, 1, True)])
def test_routed_through_attention(D, causal, Hkv, masked, name):
    """`fp4attn.attention(recipe=name)` on the CUDA kernel (routed from one key on here,
    for the recipe's P mode): close to the Gluon/Triton kernels' outputs; a NaN in one
    query row gives NaN in that row only; a batch item's output does not depend on
    another's values."""
    import fp4attn
    from fp4attn import routing

    torch.manual_seed(0)
    B, H, Sq, Sk = 2, 4, 300, 777
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(B, 1, 1, Sk, device="cuda", dtype=torch.bool)
        mask[1, ..., 500:] = False
    recipe = fp4attn.get_recipe(name)
    kw = dict(recipe=name, causal=causal, attn_mask=mask, enable_gqa=Hkv != H)
    table = dataclasses.replace(routing.FORWARD_LAUNCH[D, recipe.fast_accum, causal], cuda_from_keys=())
    with routing.override_launch(forward=table):
        assert fp4attn.explain(q, k, v, **kw)["kernel"] != "hopper.forward_cuda"
        ref = fp4attn.attention(q, k, v, **kw)
    launch = dataclasses.replace(table, cuda_from_keys=((routing.p_mode(recipe), 1),))
    with routing.override_launch(forward=launch):
        assert fp4attn.explain(q, k, v, **kw)["kernel"] == "hopper.forward_cuda"
        out = fp4attn.attention(q, k, v, **kw)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
        bad = q.clone()
        bad[0, 1, 7] = float("nan")
        out_nan = fp4attn.attention(bad, k, v, **kw)
        assert torch.isnan(out_nan[0, 1, 7]).all()
        # NaN stays in the rows the recipe's quantization shares it with (per-token FP8 Q: the
        # row; NVFP4 Q's tensor scale: the head), as on the other kernels, and never leaves
        # the head
        with routing.override_launch(forward=table):
            assert torch.equal(torch.isnan(out_nan), torch.isnan(fp4attn.attention(bad, k, v, **kw)))
        rows = torch.ones(B, H, Sq, dtype=torch.bool, device="cuda")
        rows[0, 1] = False
        assert not torch.isnan(out_nan[rows]).any()
        other = v.clone()
        other[0] *= 100.0
        assert torch.equal(fp4attn.attention(q, k, other, **kw)[1], out[1])


@pytest.mark.skipif(not NVRTC, reason="cuda-bindings (NVRTC) not installed")
def test_unknown_variant_fields_are_named():
    """A misspelt variant field is refused with the accepted ones, before any launch."""
    from fp4attn.kernels.hopper.forward_cuda import launch_forward_cuda
    from fp4attn.kernels.hopper.operands import KernelOperands

    z = torch.zeros(1, 1, 16, 64)
    ops = KernelOperands(z, z, z[..., 0], z[..., 0], z.transpose(-1, -2), z[0, :, 0])
    with pytest.raises(ValueError, match=r"unknown variant fields \['exp_polly'\]; accepted: .*'exp_poly'"):
        launch_forward_cuda(ops, scale=1.0, causal_offset=None, exp_polly=4)


def test_three_consumers_only_at_head_dim_64():
    """Three consumer warpgroups fit 160 registers per thread at head dim 64 only."""
    from fp4attn.kernels.hopper.forward_cuda import Variant

    assert Variant(64, True, consumers=3).block_m == 192 and Variant(64, True, consumers=3).threads == 512
    with pytest.raises(ValueError, match="consumers must be 2, or 3 at head dim 64; got 3 at head dim 128"):
        Variant(128, False, consumers=3)


@pytest.mark.parametrize("causal", [False, True])
def test_p_codes_by_slab_aligns_builds(causal):
    """P dumps of builds with 2 and 3 consumers per CTA land in one layout: each entry of a
    64-row slab's thread carries its slab number, computed from either build's grid (causal
    grids run the query blocks last to first)."""
    from dev.forward_cuda_check import p_codes_by_slab

    Sq, tiles = 500, 3
    layouts = []
    for consumers in (2, 3):
        blocks = -(-Sq // (64 * consumers))
        buf = torch.empty((2, blocks, tiles, 128 * consumers, 64), dtype=torch.uint8)
        for cta in range(blocks):
            block = blocks - 1 - cta if causal else cta  # the query block this CTA runs
            for c in range(consumers):
                buf[:, cta, :, 128 * c:128 * (c + 1)] = block * consumers + c  # the slab of its rows
        layouts.append(p_codes_by_slab(buf, Sq, causal))
    assert layouts[0].shape == layouts[1].shape == (2, 8, tiles, 128, 64)
    assert torch.equal(layouts[0], layouts[1])
    assert torch.equal(layouts[0][0, :, 0, 0, 0], torch.arange(8, dtype=torch.uint8))


PERSISTENT_SHAPES = [  # B, H, Hkv, Sq, Sk, D, causal: more units than SMs, units of several lengths
    (3, 8, 2, 1500, 1100, 128, None),
    (2, 16, 4, 1023, 2100, 128, "bottom_right"),
    (4, 6, 6, 777, 777, 128, "top_left"),
    (5, 8, 2, 1100, 1500, 64, None),
    (2, 12, 3, 1500, 1500, 64, "bottom_right"),
    (1, 2, 2, 113, 1023, 64, "top_left"),  # fewer units than SMs
]


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["exp2", "affine", "lazy"])
@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal", PERSISTENT_SHAPES)
def test_persistent_grid_equals_one_cta_per_unit(B, H, Hkv, Sq, Sk, D, causal, build):
    """A persistent grid (one CTA per SM taking work units in turn, the rings and turns running
    on from unit to unit) computes every unit as a CTA of its own does: outputs, LSE and P
    codes equal bit for bit."""
    from dev.forward_cuda_check import launch_checking, p_dump_buffer
    from fp4attn.kernels.hopper.forward_cuda import CONSUMERS, P_MODE_BUILDS

    ops = _operands(B, H, Hkv, Sq, Sk, D, seed=7)
    offset = None if causal is None else (0 if causal == "top_left" else Sk - Sq)
    kw = dict(scale=D ** -0.5, causal_offset=offset, **P_MODE_BUILDS[{"exp2": 0, "affine": 4, "lazy": 7}[build]])
    dumps = [p_dump_buffer(ops, CONSUMERS[D, causal is not None]) for _ in range(2)]
    one = launch_checking(ops, p_dump=dumps[0], **kw)
    persistent = launch_checking(ops, p_dump=dumps[1], persistent=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(one[0], persistent[0])
    assert torch.equal(one[1], persistent[1])
    assert torch.equal(dumps[0], dumps[1])


def _p_codes_as_rows(p_dump: torch.Tensor, rows: int, keys: int, causal: bool) -> torch.Tensor:
    """A `p_dump_buffer` as (B*H, rows, keys) bytes: word (cc, 2 half + i) of consumer thread t
    holds row 16 (t // 32) + (t % 32) // 4 + 8 i of its slab and keys 32 cc + 16 half +
    4 (t % 4) + (0..3) of its tile (the PV product's A fragment)."""
    from dev.forward_cuda_check import p_codes_by_slab

    slabs = p_codes_by_slab(p_dump, rows, causal)  # (BH, slabs, tiles, 128, 64)
    bh, n_slabs, tiles = slabs.shape[:3]
    # bytes of a thread: 16 cc + 4 (2 half + i) + b
    x = slabs.view(bh, n_slabs, tiles, 4, 8, 4, 4, 2, 2, 4)  # (.., warp, g, q, cc, half, i, b)
    x = x.permute(0, 1, 3, 8, 4, 2, 6, 7, 5, 9)  # (bh, slab, warp, i, g, tile, cc, half, q, b)
    return x.reshape(bh, n_slabs * 64, tiles * 128)[:, :rows, :keys]


# the recipes the CUDA kernel's builds run beyond the fast_accum FP8-P ones held above: affine
# MXFP4 P (P mode 5) with e4m3 Q/K, K per token or per key tile; and the exact recipes, bf16
# Q/K on the bf16 tensor cores (NVFP4 or e4m3 values), with exp2, affine FP8 and affine MXFP4 P
P_CODE_RECIPES = ["fp8-directp-fast-fastacc", "fp8-directp-fast-fastacc:ktile", "directp-fast", "fp8-directp-fast",
                  "fp8-affine", "fp8", "nvfp4-fp8"]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal,bias", FUSED_SHAPES)
@pytest.mark.parametrize("name", P_CODE_RECIPES)
def test_p_codes_match_triton_kernel(B, H, Hkv, Sq, Sk, D, causal, bias, name):
    """The CUDA kernel's launcher build on a recipe's prepared operands against the Triton
    kernel's checking path (P mode of the recipe, write_p): P codes (e4m3 bytes; for MXFP4 P
    of E2M1 x 2**(e_b + 8)) equal on >= 99.9% of the entries (the two sum QK^T on the same
    tensor cores; a code differs where a score's rounding sits on a boundary, or where the
    polynomial exp2 of the exp2 builds moves it), outputs and LSE as close as the fused
    softmax's, the same rows empty."""
    from dev.forward_cuda_check import launch_checking, p_dump_buffer
    from fp4attn.kernels.hopper.forward_cuda import CONSUMERS, P_MODE_BUILDS
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe
    from fp4attn.routing import p_mode

    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn((B, H, Sq, D), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn((B, Hkv, Sk, D), device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn((B, Hkv, Sk, D), device="cuda", generator=g).to(torch.bfloat16)
    recipe = get_recipe(name.split(":")[0])
    if name.endswith(":ktile"):
        recipe = dataclasses.replace(recipe, k_scale="tile", name=None)
    mode = p_mode(recipe)
    ops = prepare_operands_fused(q, k, v, recipe)
    assert ops.q.dtype == (torch.float8_e4m3fn if recipe.fast_accum else torch.bfloat16)
    offset = None if causal is None else (0 if causal == "top_left" else Sk - Sq)
    key_bias = None
    if bias:
        keep = torch.rand((B, Sk), device="cuda", generator=g) > 0.3
        keep[:, 0] = True
        key_bias = torch.where(keep, 0.0, -float("inf")).float()
    scale = D ** -0.5
    dump = p_dump_buffer(ops, CONSUMERS[D, causal is not None])
    out, lse = launch_checking(ops, scale=scale, causal_offset=offset, key_bias=key_bias, p_dump=dump,
                               **P_MODE_BUILDS[mode])
    ref, ref_lse, ref_p = launch_forward(ops, scale=scale, causal_offset=offset, p_mode=mode, write_p=1,
                                         key_bias=key_bias)
    torch.cuda.synchronize()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key differ"
    assert (out[~seen] == 0).all()
    codes = _p_codes_as_rows(dump, Sq, Sk, causal is not None)
    ref_codes = ref_p[:, :, :Sq, :Sk].reshape(B * H, Sq, Sk).to(torch.float8_e4m3fn).view(torch.uint8)
    # tiles a query block skips (causal) keep the buffer's 0xFF: the reference has 0 there
    valid = codes != 0xFF
    assert bool((ref_codes[~valid] == 0).all()), "a skipped tile held a key the row sees"
    same = ((codes == ref_codes) & valid).sum().item() / valid.sum().item()
    assert same >= 0.999, f"P codes identical on {same:.5f} of the entries"
    # a row's LSE is its running point and the log of its sum of represented P values, its
    # output that sum's P.V: where the row's codes are the same, only float32 summation
    # order tells the kernels apart; a code moved on a boundary (or by the exp2 builders'
    # polynomial) moves them by that code's share, most in short rows (a few 1e-2 of the
    # output and 1e-2 of the LSE of a causal row of six keys)
    rows_same = ((codes == ref_codes) | ~valid).all(dim=-1).reshape(B, H, Sq) & seen
    assert rows_same.sum() >= 0.5 * seen.sum(), f"{rows_same.sum()} of {seen.sum()} rows with every code the same"
    torch.testing.assert_close(out[rows_same].float(), ref[rows_same].float(), atol=2e-2, rtol=1e-2)
    exp2 = mode == 0
    torch.testing.assert_close(out.float(), ref.float(), atol=6e-2 if exp2 else 4e-2, rtol=1e-2)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[rows_same], ref_lse[rows_same], atol=1e-3, rtol=0)
