"""The H200 cost model (`dev/cost_model_sm90.py`) reads its figures off the sm_90 SASS
of the routed Triton forward builds, and the error docs/notes/cost-model-hopper.md
states for `directp` is the one the model computes against the H200 run in
benchmarks/results/log/h200-forward-ab7f5f9.json (CPU: two builds compiled, no GPU)."""

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton")

from dev import cost_model_sm90 as cm  # noqa: E402
from fp4attn.recipes import PRESETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTE = ROOT / "docs" / "notes" / "cost-model-hopper.md"


@pytest.fixture(scope="module")
def directp():
    return cm.build(PRESETS["directp"])


class _Loop:
    """A build whose tile loop is another's, repeated `times` times."""

    def __init__(self, build, times):
        self.build, self.times = build, times
        self.pipelined, self.num_warps = False, build.num_warps
        self.registers, self.shared_bytes = build.registers, build.shared_bytes

    def tile_loop(self):
        return self.build.tile_loop() * self.times


def test_routing_of_the_measured_recipes():
    """The Direct-P recipes run on the Triton kernel at the bench's key counts; the FP8-P
    ones on the Gluon or the CUDA kernel, so the model leaves them out."""
    assert cm.routed_kernel(PRESETS["directp"], 4096) == cm.TRITON
    assert cm.routed_kernel(PRESETS["fp8-directp-fastacc"], 32768) == cm.TRITON
    assert cm.routed_kernel(PRESETS["fp8"], 4096) == "hopper.forward_gluon_ws"
    assert cm.routed_kernel(PRESETS["fp8-fastacc"], 4096) == "hopper.forward_cuda"
    assert cm.routed_kernel(PRESETS["fp8-ktile-affine-fastacc"], 4096) == "hopper.forward_cuda"


@pytest.mark.compile
def test_figures_come_from_the_sass(directp):
    recipe = PRESETS["directp"]
    loop = directp.tile_loop()
    p = cm.predict(directp, recipe)
    assert p["tile_loop_instructions"] == len(loop) > 500
    assert directp.num_warps == 4 and p["programs_per_sm"] == 2
    # issue: the loop's instructions x 4 warps over 4 schedulers
    assert p["clk_issue"] == round(len(loop) * directp.num_warps / cm.H200.schedulers)
    # MUFU: the loop's MUFU instructions, 32 lanes a warp, 16 an SM and clock
    mufu = sum(op.startswith("MUFU") for op in loop)
    assert p["clk_mufu"] == round(mufu * directp.num_warps * 32 / 16)
    # tensor: bf16 QK^T and FP8 PV of a 64 x 128 tile at D=128, at the datasheet's per-SM rates
    flop = 2 * 64 * 128 * 128
    assert p["clk_tensor"] == round(flop / cm.H200.rate("bf16") + flop / cm.H200.rate("fp8"))
    assert cm.H200.rate("bf16") * cm.H200.sms * cm.H200.clock_hz == pytest.approx(989.4e12, rel=1e-3)
    # issue-bound: the ceiling is the tile's FLOP over the issue clocks
    assert p["bound"] == "instruction issue" and p["clk_tile"] == p["clk_issue"]
    assert p["ceiling_tflops"] == round(2 * flop / p["clk_issue"] * 132 * 1.98e9 / 1e12)
    # a loop twice as long: twice the issue clocks, half the speed
    p2 = cm.predict(_Loop(directp, 2), recipe)
    assert p2["clk_issue"] == 2 * p["clk_issue"]
    assert p2["ceiling_tflops"] == pytest.approx(p["ceiling_tflops"] / 2, abs=1)


@pytest.mark.compile
def test_fp8_qk_build_differs_by_its_own_sass(directp):
    """fp8-directp-fastacc: QK^T on the FP8 tensor cores (its own, shorter tensor time)
    and its own tile loop, whose length alone sets its issue clocks."""
    recipe = PRESETS["fp8-directp-fastacc"]
    fast = cm.build(recipe)
    assert any("QGMMA" in op for op in fast.tile_loop()) and not any("HGMMA" in op for op in fast.tile_loop())
    p, q = cm.predict(fast, recipe), cm.predict(directp, PRESETS["directp"])
    assert p["clk_tensor"] < q["clk_tensor"]
    assert p["clk_issue"] / q["clk_issue"] == pytest.approx(len(fast.tile_loop()) / len(directp.tile_loop()),
                                                              rel=1e-3)
    # the same arithmetic on the other build's loop gives the other build's issue clocks
    assert cm.predict(replace(directp, report=fast.report), recipe)["clk_issue"] == p["clk_issue"]


def _note_row(recipe: str) -> dict:
    """The cells of the note's prediction table in the row of `recipe`, by header."""
    lines = NOTE.read_text().splitlines()
    head = next(i for i, s in enumerate(lines) if s.startswith("| recipe |") and "error" in s)
    names = [c.strip() for c in lines[head].strip("|").split("|")]
    for s in lines[head + 2:]:
        if not s.startswith("|"):
            break
        cells = [c.strip() for c in s.strip("|").split("|")]
        if cells[0] == f"`{recipe}`":
            return dict(zip(names, cells))
    raise AssertionError(f"no row for {recipe} in {NOTE.name}")


@pytest.mark.compile
def test_stated_error_is_the_computed_one(directp):
    # the measured figure, read here from the results file itself
    rows = [r for r in json.loads((ROOT / "benchmarks/results/log/h200-forward-ab7f5f9.json").read_text())
            if r["impl"] == "directp" and r["D"] == 128 and not r["causal"] and not r["quant_included"]]
    assert len(rows) == 4
    measured = math.exp(sum(math.log(r["tflops"]) for r in rows) / len(rows))
    predicted = cm.predict(directp, PRESETS["directp"])["ceiling_tflops"]
    error = predicted / measured - 1
    source, records = cm.measured_records("directp")
    assert source == "log/h200-forward-ab7f5f9.json"
    got = cm.compare(cm.predict(directp, PRESETS["directp"]), records)
    assert got["error"] == pytest.approx(error, abs=5e-4)
    row = _note_row("directp")
    assert int(row["predicted TFLOP/s"]) == predicted
    stated = re.search(r"\(([\d.]+)\)", row["measured TFLOP/s, range (geomean)"]).group(1)
    assert float(stated) == pytest.approx(measured, abs=0.05)
    assert float(row["error"].rstrip("%")) == pytest.approx(100 * error, abs=0.05)
