"""The CUDA decode split kernel compiles for sm_90a (NVRTC, no GPU needed) in every form
the routing can pick, without spills, and with the mma and dequantizing instructions
its design counts on; its routing refuses what it cannot run."""

import pytest

from fp4attn import decode_routing as R

pytest.importorskip("cuda.bindings.nvrtc")
from fp4attn.kernels.hopper import decode_cuda  # noqa: E402


@pytest.mark.parametrize("variant", decode_cuda.all_variants(), ids=str)
def test_every_variant_compiles_without_spills(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))
    build = decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(variant.defines()), str(variant),
                                       announce=False)
    assert build.spill_bytes() == 0, build.log
    # at most 255 registers, and at least two CTAs of four warps an SM
    assert build.registers() is not None and R.resident_programs(build.registers(), variant.warps, 0) >= 2


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
