"""The CUDA decode split kernel compiles for sm_90a (NVRTC, no GPU needed) in every form
the routing can pick, without spills, and with the mma and dequantizing instructions
its design counts on; its routing refuses what it cannot run."""

import pytest

from fp4attn.routing import decode as R

pytest.importorskip("cuda.bindings.nvrtc")
from fp4attn.kernels.hopper import decode_cuda  # noqa: E402


@pytest.mark.compile
@pytest.mark.parametrize("variant", decode_cuda.all_variants((0, 2, 3)), ids=str)
def test_every_variant_compiles_without_spills(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))
    build = decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(variant.defines()), str(variant),
                                       announce=False)
    assert build.spill_bytes() == 0, build.log
    # at most 255 registers, and at least two CTAs of four warps an SM with their rings
    regs = build.registers(decode_cuda.KERNEL_NAME)
    assert regs is not None and R.resident_programs(regs, variant.warps, variant.shared_bytes()) >= 2, (regs, variant)
    if variant.stages:  # the ring keeps the tiles out of registers: 8 warps an SM at least
        # (bf16 and MXFP4 keys: q's f16 value in two bf16 parts, two accumulators a score:
        # 179-204 at D=128)
        assert regs <= (208 if variant.k_format in ("bf16", "mxfp4") else 168), regs
    assert build.registers(decode_cuda.COMBINE_NAME) is not None


@pytest.mark.compile
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
    assert R.cuda_unsupported_reason(**{**ok, "k_format": "bf16", "v_format": "bf16"}) is None
    assert R.cuda_unsupported_reason(**{**ok, "k_format": "mxfp4", "v_format": "mxfp4"}) is None
    for bad, word in ((dict(k_format="int4"), "formats"), (dict(k_format="mxfp4", head_dim=64), "MXFP4"),
                      (dict(v_format="mxfp4", head_dim=64), "MXFP4"),
                      (dict(head_dim=96), "head_dim"), (dict(sq=2), "new query rows"),
                      (dict(group=32), "query heads"), (dict(page_size=40), "page size")):
        assert word in R.cuda_unsupported_reason(**{**ok, **bad})
    args = tuple(ok.values())
    assert R.split_kernel(*args, on_gpu=False) == "triton"  # the interpreter
    assert R.split_kernel(*args, on_gpu=True, asked="triton") == "triton"
    with pytest.raises(ValueError, match="cannot run"):
        R.split_kernel("mxfp4", "fp8", 64, 4, 1, 256, True, "cuda")


@pytest.mark.parametrize("spec,want", [("0", 0), ("2", 2), ("3", 3), ("1", None), ("b2", None), ("", None)])
def test_ring_specs(spec, want):
    if want is None:
        with pytest.raises(ValueError, match="accepted 0"):
            R.parse_cuda_stages(spec)
    else:
        assert R.parse_cuda_stages(spec) == want


@pytest.mark.parametrize("formats", [("bf16", "fp8"), ("fp8", "bf16"), ("bf16", "bf16")])
def test_bf16_keys_or_values_take_a_ring_only(formats):
    """The warp copies bf16 tiles into shared memory together: no register prefetch."""
    with pytest.raises(ValueError, match="not for bf16 keys or values"):
        R.parse_cuda_stages("0", *formats)
    assert R.parse_cuda_stages("2", *formats) == 2
    assert all(v.stages for v in decode_cuda.all_variants((0, 2)) if "bf16" in (v.k_format, v.v_format))
