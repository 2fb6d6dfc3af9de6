"""The CUDA decode split kernel compiles for sm_90a (NVRTC, no GPU needed) in every form
the routing can pick, without spills, and with the mma and dequantizing instructions
its design counts on; its routing refuses what it cannot run."""

import pytest

from fp4attn import decode_routing as R

pytest.importorskip("cuda.bindings.nvrtc")
from fp4attn.kernels.hopper import decode_cuda  # noqa: E402


def _check_build(variant, tmp_path, monkeypatch):
    """The variant's build: no spills, at most 255 registers, at least two CTAs of four
    warps an SM with their rings, and through the ring (which keeps the tiles out of
    registers) 8 warps an SM at least."""
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))
    build = decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(variant.defines()), str(variant),
                                       announce=False)
    assert build.spill_bytes() == 0, build.log
    regs = build.registers(decode_cuda.KERNEL_NAME)
    assert regs is not None and R.resident_programs(regs, variant.warps, variant.shared_bytes()) >= 2, (regs, variant)
    if variant.stages:
        assert regs <= 168, regs
    return build


@pytest.mark.parametrize("variant", decode_cuda.all_variants((0, 2, 3)), ids=str)
def test_every_variant_compiles_without_spills(variant, tmp_path, monkeypatch):
    build = _check_build(variant, tmp_path, monkeypatch)
    assert build.registers(decode_cuda.COMBINE_NAME) is not None


def test_the_ring_slot_is_the_kernels():
    """The host sizes a CTA's shared memory from its own figure of a lane's ring slot,
    which every build checks against decode_split.cu's `Raw` (a static_assert on
    SLOT_BYTES: a wrong figure does not compile): an odd number of 16-byte units, and
    what a lane's fields add up to (NVFP4 D=128: 32 + 32 bytes of codes, 16 + 16 of
    token scales, 16 + 32 of block-scale rows)."""
    variant = decode_cuda.Variant(128, "nvfp4", "nvfp4", False)
    assert f"-DSLOT_BYTES={variant.slot_bytes()}" in variant.defines()
    wrong = [d if not d.startswith("-DSLOT_BYTES") else "-DSLOT_BYTES=160" for d in variant.defines()]
    with pytest.raises(RuntimeError, match="slot size"):
        decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(wrong), "wrong", use_cache=False,
                                   announce=False)
    sizes = {(v.head_dim, v.k_format, v.v_format): v.slot_bytes() for v in decode_cuda.all_variants()}
    assert sizes[(128, "nvfp4", "nvfp4")] == 144 and sizes[(128, "fp8", "fp8")] == 176
    assert all(b % 32 == 16 for b in sizes.values()), sizes


def test_routing_takes_the_cuda_kernel_only_where_it_can_run():
    ok = dict(k_format="nvfp4", v_format="fp8", head_dim=128, group=4, sq=1, page_size=256)
    assert R.cuda_unsupported_reason(**ok) is None
    for bad, word in ((dict(k_format="mxfp4"), "formats"), (dict(v_format="bf16"), "formats"),
                      (dict(head_dim=96), "head_dim"), (dict(sq=2), "new query rows"),
                      (dict(group=32), "query heads"), (dict(page_size=40), "page size")):
        assert word in R.cuda_unsupported_reason(**{**ok, **bad})
    args = tuple(ok.values())
    assert R.split_kernel(*args, on_gpu=False) == "triton"  # the interpreter
    assert R.split_kernel(*args, on_gpu=True, asked="triton") == "triton"
    with pytest.raises(ValueError, match="cannot run"):
        R.split_kernel("mxfp4", "fp8", 128, 4, 1, 256, True, "cuda")


@pytest.mark.parametrize("spec,want", [("0", 0), ("2", 2), ("3", 3), ("1", None), ("b2", None), ("", None)])
def test_ring_specs(spec, want):
    if want is None:
        with pytest.raises(ValueError, match="accepted 0"):
            R.parse_cuda_stages(spec)
    else:
        assert R.parse_cuda_stages(spec) == want


@pytest.mark.parametrize("variant", decode_cuda.fp8_product_variants(), ids=str)
def test_the_fp8_product_builds_compile_without_spills(variant, tmp_path, monkeypatch):
    """decode(products="fp8")'s builds (QK_FP8: the e4m3 mma.sync, the same products on
    f16 mma.sync, the exact path's products with q in e4m3) at both head dims, every value
    format, in registers and through the ring; the ring slot (forms 1 and 2: twice the key
    block-scale rows) checked by the build."""
    _check_build(variant, tmp_path, monkeypatch)


def test_sm90a_emulates_the_e4m3_mma_sync(tmp_path):
    """What the FP8-products build's SASS shows (docs/notes/decode.md): sm_90a has no
    native e4m3 mma.sync (no QMMA); ptxas converts the e4m3 operands to f16 (F2FP.F16.E4M3)
    and issues two HMMA.16816.F32 a product. So a plain 16-key tile of the e4m3 build holds
    as many HMMA as the exact build's (16 for the keys, 16 for the values at D = 128) and
    at least four conversions of the codes a product. If this fails, ptxas has changed
    what it makes of the instruction: recount (tools/decode_cuda_sass.py)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "decode_cuda_sass", pathlib.Path(__file__).parents[1] / "tools" / "decode_cuda_sass.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    try:
        tool.cuobjdump()
    except RuntimeError:
        pytest.skip("no cuobjdump")
    counts = {}
    for form in (0, 1, 2, 3):
        _, sass = tool.sass_of(decode_cuda.Variant(128, "nvfp4", "nvfp4", False, stages=2, qk_fp8=form), tmp_path)
        tile = tool.plain_tile(sass)
        counts[form] = {op: sum(o.startswith(op) for o in tile) for op in ("HMMA.16816.F32", "F2FP.F16.E4M3", "FFMA",
                                                                             "SEL")}
        counts[form]["all"] = len(tile)
        assert "QMMA" not in sass and "GMMA" not in sass
    assert counts[1]["HMMA.16816.F32"] == counts[0]["HMMA.16816.F32"] == counts[2]["HMMA.16816.F32"] == 32, counts
    # 8 products a tile (two n-tiles of 4), each its codes' 4 conversions at least
    assert counts[1]["F2FP.F16.E4M3"] >= counts[0]["F2FP.F16.E4M3"] + 32, counts
    # the block scales on the outputs: 4 FFMA a product
    assert counts[1]["FFMA"] - counts[0]["FFMA"] == counts[2]["FFMA"] - counts[0]["FFMA"] == 32, counts
    # form 2 (routed) is ptxas's emulation written out with q's conversions and row selection
    # out of the loop: no more SEL than the exact build, fewer instructions than form 1
    assert counts[2]["SEL"] <= counts[0]["SEL"] and counts[2]["all"] < counts[1]["all"], counts
    # form 3 (routed) changes q's prologue only: the exact build's loop
    assert counts[3] == counts[0], counts
