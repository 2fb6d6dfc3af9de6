"""The `fp4attn` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import logging

from fp4attn.cli import accuracy, bench, codes, eval, report, study

COMMANDS = {
    "report": (report, "the main job: accuracy of every recipe and the Direct-P study"),
    "accuracy": (accuracy, "Gaussian and hard-case accuracy of each recipe vs float64 attention"),
    "bench": (bench, "forward speed of the kernels vs SDPA cuDNN/flash bf16 (GPU)"),
    "eval": (eval, "embedding fidelity of every recipe on a real model (all-MiniLM-L6-v2)"),
    "study": (study, "train a small GPT with each attention recipe and compare the loss curves"),
    "codes": (codes, "Direct-P codes vs exp2 rounding, and the accuracy of the P choices"),
}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fp4attn", description="FP4 FlashAttention tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    args = parser.parse_args(argv)
    COMMANDS[args.command][0].main(args)


if __name__ == "__main__":
    main()
