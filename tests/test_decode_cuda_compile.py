"""The CUDA decode split kernel compiles for sm_90a (NVRTC, no GPU needed) in every form
the routing can pick, without spills, and with the mma and dequantizing instructions
its design counts on; its routing refuses what it cannot run."""

import pytest

from fp4attn import decode_routing as R

pytest.importorskip("cuda.bindings.nvrtc")
from fp4attn.kernels.hopper import decode_cuda  # noqa: E402


@pytest.mark.parametrize("variant", decode_cuda.all_variants((0, 2, 3)), ids=str)
def test_every_variant_compiles_without_spills(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))
    build = decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(variant.defines()), str(variant),
                                       announce=False)
    assert build.spill_bytes() == 0, build.log
    # at most 255 registers, and at least two CTAs of four warps an SM with their rings
    regs = build.registers(decode_cuda.KERNEL_NAME)
    assert regs is not None and R.resident_programs(regs, variant.warps, variant.shared_bytes()) >= 2, (regs, variant)
    if variant.stages == R.cuda_stages(variant.k_format, variant.v_format) and variant.stages:
        # the routed ring keeps the tiles out of registers: three CTAs an SM
        assert R.resident_programs(regs, variant.warps, variant.shared_bytes()) >= 3, (regs, variant)
    assert build.registers(decode_cuda.COMBINE_NAME) is not None


def test_the_ring_sizes_are_the_kernels():
    """The host sizes a CTA's shared memory from its own figures of a lane's ring slot and
    of a warp's copy of a tile's scales, which every build checks against decode_split.cu's
    `Codes` and `TileScales` (static_asserts on SLOT_BYTES and SCALE_BYTES: a wrong figure
    does not compile): the slot an odd number of 16-byte units holding a lane's codes
    (NVFP4 D=128: 32 + 32 bytes), the scales 16 token scales each of K and V and, for
    NVFP4, 16 rows of D/16 block scales."""
    variant = decode_cuda.Variant(128, "nvfp4", "nvfp4", False)
    for name, wrong_value in (("SLOT_BYTES", 160), ("SCALE_BYTES", 256)):
        assert f"-D{name}=" in " ".join(variant.defines())
        wrong = [d if not d.startswith(f"-D{name}=") else f"-D{name}={wrong_value}" for d in variant.defines()]
        with pytest.raises(RuntimeError, match="size is not the kernel"):
            decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(wrong), "wrong", use_cache=False,
                                       announce=False)
    sizes = {(v.head_dim, v.k_format, v.v_format): (v.slot_bytes(), v.scale_bytes()) for v in decode_cuda.all_variants()}
    assert sizes[(128, "nvfp4", "nvfp4")] == (80, 384) and sizes[(128, "fp8", "fp8")] == (144, 160)
    assert sizes[(64, "nvfp4", "fp8")] == (48, 208)
    assert all(slot % 32 == 16 and scales % 16 == 0 for slot, scales in sizes.values()), sizes


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
