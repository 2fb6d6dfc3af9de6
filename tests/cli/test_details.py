"""The command line's details: `fp4attn --version`; a help string for every option of
every command; one exit status for "no CUDA GPU" (bench, selftest, blackwell-report);
every file a command's help names exists; scripts/report.sh installs the NVRTC wheel
(the `cuda` extra) only where an NVIDIA GPU answers; the accuracy plot's recipe names
do not overlap."""

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import fp4attn
from fp4attn.cli import bench, blackwell_report, selftest
from fp4attn.cli import main as cli
from fp4attn.cli.output import NO_GPU_STATUS

ROOT = Path(__file__).resolve().parents[2]


def _parsers():
    parser = argparse.ArgumentParser(prog="fp4attn")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in cli.COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        yield name, p


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fp4attn {fp4attn.__version__}"


def test_every_option_has_help():
    missing = [(name, a.option_strings or a.dest) for name, p in _parsers() for a in p._actions
               if a.help is None and not isinstance(a, argparse._HelpAction)]
    assert not missing, missing


def test_every_file_a_help_names_exists():
    for name, p in _parsers():
        text = p.format_help()
        for path in re.findall(r"`((?:fp4attn|tools|scripts|docs|benchmarks)/[\w./-]+\.\w+)`", " ".join(text.split())):
            assert (ROOT / path).exists(), (name, path)


@pytest.mark.parametrize("command,run", [
    ("bench", lambda: bench.main(argparse.Namespace(decode=False, backward=False))),
    ("selftest", lambda: selftest.main(argparse.Namespace(json=None, no_timing=False))),
    ("blackwell-report", lambda: blackwell_report.main(argparse.Namespace(out=Path("unused"), quick=True,
                                                                          case_timeout=None))),
])
def test_no_gpu_is_one_exit_status(command, run, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code == NO_GPU_STATUS == 2
    assert f"fp4attn {command}: no CUDA GPU found" in capsys.readouterr().err


def _report_extras(tmp_path, gpu: bool) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H100'\n" if gpu else "exit 9\n"))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FP4ATTN_REPORT_PRINT_EXTRAS": "1"}
    out = subprocess.run(["bash", str(ROOT / "scripts/report.sh")], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.strip()


def test_report_installs_nvrtc_only_with_a_gpu(tmp_path):
    assert _report_extras(tmp_path / "cpu", gpu=False) == "plot"
    assert _report_extras(tmp_path / "gpu", gpu=True) == "plot,cuda"


def test_accuracy_plot_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp4attn.cli.plots import accuracy_figure
    from fp4attn.recipes import PRESETS

    records = [dict(recipe=name, case=case, cos=0.99, B=1, H=4, S=1024, D=128, device="cpu")
               for name in PRESETS for case in ("gaussian", "hard")]
    fig = accuracy_figure(records)
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels()), key=lambda b: b.x0)
    assert len(boxes) == len(PRESETS)
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), "x labels overlap"
    assert all(b.y0 >= 0 for b in boxes), "x labels cut off at the bottom"
    plt.close(fig)


def test_help_runs_for_every_command(capsys):
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0 and f"usage: fp4attn {name}" in capsys.readouterr().out, name
