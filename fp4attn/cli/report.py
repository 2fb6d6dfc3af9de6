"""`fp4attn report`: the main job. The accuracy of every recipe and the Direct-P study
on the reference; on a CUDA GPU the same on that device."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from fp4attn.cli import accuracy, bench, codes
from fp4attn.cli.output import write_json
from fp4attn.cli.plots import plot_accuracy


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if env["cuda"]:
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def run_cli(module, argv: list[str]):
    """The subcommand `module` with these arguments, parsed by its own parser (so every
    option it has gets its default)."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.main(parser.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for JSON and PNG")
    p.add_argument("-S", type=int, default=1024, help="sequence length of the accuracy runs")


def main(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print("environment:", json.dumps(env))
    device = "cuda" if env["cuda"] else "cpu"
    shape = ["-B", "1", "-H", "4", "-S", str(args.S), "-D", "128", "--device", device]
    records = run_cli(accuracy, shape + ["--json", str(args.out / "accuracy.json")])
    plotted = plot_accuracy(records, args.out / "accuracy.png")  # False without matplotlib
    print()
    run_cli(accuracy, shape + ["--backward", "--causal", "--json", str(args.out / "backward.json")])
    print()
    run_cli(codes, shape + ["--json", str(args.out / "directp.json")])
    if env["cuda"] and env["capability"].startswith("9."):
        print("\nHopper kernels vs SDPA (one shape; `fp4attn bench` runs the full grid):")
        run_cli(bench, ["--shapes", "8,16,4096,128", "--causal", "no", "--json", str(args.out / "bench.json")])
        print("\nTraining kernels vs SDPA (one shape; `fp4attn bench --backward` runs the full grid):")
        run_cli(bench, ["--backward", "--shapes", "4,16,4096,128", "--json", str(args.out / "bench-train.json")])
    write_json(args.out / "environment.json", env)
    wrote = ["accuracy.json", *(["accuracy.png"] if plotted else []), "backward.json", "directp.json",
             "environment.json"]
    print(f"\nwrote {args.out}/{', '.join(wrote)}")
