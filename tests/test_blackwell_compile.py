"""The Blackwell kernels compile for sm_100a on a machine without a GPU, as routed, and
their machine code has the structure the design relies on: every NVFP4/MXFP4 product a
block-scaled FP4 tensor-core MMA, no register spills, tensor memory within its 512
columns, Direct-P's E2M1 pairs packed by the hardware conversion and no exponential per
P element (`fp4attn compile-report` prints the same records)."""

import pytest

pytest.importorskip("triton")

from fp4attn.cli import compile_report  # noqa: E402


@pytest.fixture(scope="module")
def records():
    """Every routed build without a key mask, and with one at each recipe family's
    largest build (D=128, causal)."""
    recs = compile_report.records("sm_100a", key_bias=False, backward=False)
    masked = [e for e in compile_report.routed_builds(key_bias=True)
              if e["key_bias"] and e["head_dim"] == 128 and e["causal"] and e["recipe"] in ("directp", "nvfp4-fp8")]
    for e in masked:
        rec = compile_report.build_report(e["qk_fp4"], e["pv_fp4"], True, 128, True, "sm_100a")
        recs.append({**e, **rec, "fp4_block_scaled": compile_report.fp4_products_ok(e, rec)})
    return recs


def test_every_recipe_family_is_routed_and_built(records):
    built = {(r["qk_fp4"], r["pv_fp4"]) for r in records}
    assert built == {(True, True), (True, False), (False, True), (False, False)}
    assert {"directp", "nvfp4-fp8", "fp8-directp", "fp8"} <= {r["recipe"] for r in records}


def test_no_spills_and_tensor_memory_within_512_columns(records):
    bad = [(r["recipe"], r["head_dim"], r["causal"], r["key_bias"], r["spill_bytes"], r["tmem_columns"])
           for r in records if r["spill_bytes"] or not 0 < r["tmem_columns"] <= 512]
    assert not bad, bad


def test_fp4_products_are_block_scaled_fp4_mmas(records):
    """NVFP4 QK^T: kind::mxf4nvf4 with e4m3 scales per 16 (scale_vec::4X); MXFP4 P.V:
    kind::mxf4 with E8M0 scales per 32 (scale_vec::2X); FP8 products kind::f8f6f4."""
    for r in records:
        kinds = " ".join(r["mma_kinds"])
        assert r["fp4_block_scaled"], (r["recipe"], r["mma_kinds"])
        if r["qk_fp4"]:
            assert "kind::mxf4nvf4.block_scale.scale_vec::4X" in kinds, (r["recipe"], kinds)
        if r["pv_fp4"]:
            assert "kind::mxf4.block_scale.scale_vec::2X" in kinds, (r["recipe"], kinds)
        if not (r["qk_fp4"] and r["pv_fp4"]):
            assert "kind::f8f6f4" in kinds, (r["recipe"], kinds)


def test_directp_packs_by_the_hardware_conversion_and_takes_no_exp_per_element(records):
    """Direct-P tiles: one cvt.rn.satfinite.e2m1x2.f32 per pair of P elements (64 per
    thread and 128x128 tile at 8 warps, in each of the two tile loops), and the only
    exps are per row (alpha): 2 per row and tile against one per element for FP8 P."""
    for r in records:
        pred = r["prediction"]
        if r["pv_fp4"]:
            assert r["e2m1_cvt"] >= 64, r["recipe"]
            assert pred["mufu_per_tile"] <= 2 * r["block_m"], (r["recipe"], pred)
        else:
            assert r["e2m1_cvt"] == 0
            assert pred["mufu_per_tile"] >= r["block_m"] * 128, (r["recipe"], pred)


def test_training_backward_builds_for_sm100_without_spills():
    """The training backward's Triton kernels at their Blackwell launch (the causal
    builds; `fp4attn compile-report` prints all): no spills, tensor memory within 512
    columns, the gradient products on the FP8 tensor cores and S^T rebuilt by a bf16
    product of the NVFP4 grid values (exact)."""
    for e in compile_report.routed_backward_builds():
        if not e["causal"]:
            continue
        rec = compile_report.backward_report(e["part"], e["p_mode"], True, e["head_dim"], "sm_100a")
        where = (e["kernel"], e["recipe"], e["head_dim"])
        assert rec["spill_bytes"] == 0 and 0 < rec["tmem_columns"] <= 512, (where, rec)
        kinds = " ".join(rec["mma_kinds"])
        assert "kind::f8f6f4" in kinds and "kind::f16" in kinds, (where, kinds)
