"""Scaling records of `fp4attn study train` runs at several world sizes, one JSON file
(`benchmarks/results/h200-multigpu.json` style) and a plot.

Each input is the `train-study.json` of one run (`--out DIR` of `fp4attn study train`,
same model, seq, per-rank batch, steps and attentions at every world size), e.g.:

    for n in 1 2 4; do
      torchrun --nproc-per-node $n -m fp4attn.cli.main study train --attn sdpa,train \\
        --layers 20 --dim 2048 --heads 16 --seq 4096 --batch 1 --steps 200 --lr 3e-4 \\
        --parallel fsdp --activation-checkpointing --eval-every 50 --out results/scale-$n
    done
    python tools/multigpu_scale.py results/scale-*/train-study.json --json benchmarks/results/h200-multigpu.json

Records: world_size, attention, tokens_per_s, efficiency (tokens/s per GPU against the
same attention on one GPU), speedup_vs_sdpa (same world size), peak_gib, loss (final
train loss), val_loss, ranks_agree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def scale_records(runs: list[dict]) -> list[dict]:
    """Flatten `train-study.json` summaries into one record per (world size, attention)."""
    flat = [r for summary in runs for r in summary["runs"]]
    single = {r["recipe"]: r["tokens_per_second"] for r in flat if r["world_size"] == 1}
    sdpa = {r["world_size"]: r["tokens_per_second"] for r in flat if r["recipe"] == "sdpa"}
    out = []
    for r in sorted(flat, key=lambda r: (r["world_size"], r["recipe"])):
        n, tps = r["world_size"], r["tokens_per_second"]
        out.append({"world_size": n, "attention": r["recipe"], "params": r["params"], "steps": r["steps"],
                    "seq": r.get("seq"), "batch_per_rank": r.get("batch_per_rank"), "tokens_per_s": tps,
                    "efficiency": round(tps / (n * single[r["recipe"]]), 3) if r["recipe"] in single else None,
                    "speedup_vs_sdpa": round(tps / sdpa[n], 3) if n in sdpa else None,
                    "peak_gib": r.get("peak_gib"), "loss": r["final_train_loss"], "val_loss": r["final_val_loss"],
                    "ranks_agree": r["ranks_agree"]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="train-study.json files")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    records = scale_records([json.loads(p.read_text()) for p in args.runs])
    args.json.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(r)


if __name__ == "__main__":
    main()
