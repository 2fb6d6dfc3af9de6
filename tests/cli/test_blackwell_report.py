"""`fp4attn blackwell-report`, the one command a Blackwell owner runs to send results
back: without a GPU it says so and exits 2; on a GPU (its parts stood in for here) it
writes the environment, the selftest's records, the compile report and the bench of
the recipes whose selftest passed, a summary, and one archive of the folder."""

import argparse
import json
import tarfile

import pytest
import torch

from fp4attn.cli import bench_blackwell, blackwell_report, compile_report, selftest


def test_without_a_gpu_it_says_so_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        blackwell_report.main(argparse.Namespace(out=tmp_path / "r", quick=True, case_timeout=None))
    assert e.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_it_writes_every_part_and_one_archive(monkeypatch, tmp_path):
    records = [dict(recipe="directp", status="pass"), dict(recipe="nvfp4-fp8", status="pass"),
               dict(recipe="nvfp4-fp8", status="FAIL", reason="hang: no result after 300 s"),
               dict(recipe="bf16", status="reference")]

    def fake_selftest(args):  # one case failed: the selftest writes its JSON, then exits 1
        args.json.write_text(json.dumps({"records": records}))
        print("selftest table")
        raise SystemExit(1)

    benched = {}

    def fake_bench(shapes, causal_modes, recipes, partial=None):
        benched["recipes"], benched["shapes"] = recipes, shapes
        return [dict(B=1, H=1, S=1, D=64, causal=False, impl="directp", quant_included=False, ms=1.0, tflops=1.0,
                     speedup_vs_cudnn_bf16=1.0)], []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(blackwell_report, "environment", lambda: {"gpu": "B200", "capability": [10, 0]})
    monkeypatch.setattr(selftest, "main", fake_selftest)
    monkeypatch.setattr(compile_report, "records", lambda arch, key_bias: [{"arch": arch}])
    monkeypatch.setattr(bench_blackwell, "run", fake_bench)
    out = tmp_path / "fp4attn-blackwell"
    summary = blackwell_report.main(argparse.Namespace(out=out, quick=True, case_timeout=None))
    # the failing recipe is not timed; the one that passed every case is
    assert benched == {"recipes": ["directp"], "shapes": blackwell_report.QUICK_SHAPES}
    assert summary["parts"]["selftest"]["exit_status"] == 1 and summary["parts"]["selftest"]["failed"] == 1
    assert json.loads((out / "compile-report.json").read_text()) == {"arch": "sm_100a", "records": [{"arch": "sm_100a"}]}
    assert "selftest table" in (out / "selftest.txt").read_text()
    with tarfile.open(tmp_path / "fp4attn-blackwell.tar.gz") as tar:
        names = set(tar.getnames())
    want = {"environment.json", "selftest.json", "selftest.txt", "compile-report.json", "bench.json", "bench.txt",
            "summary.json"}
    assert {f"fp4attn-blackwell/{n}" for n in want} <= names, names
