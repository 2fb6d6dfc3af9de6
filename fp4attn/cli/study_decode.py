"""`fp4attn study decode`: the study GPT's held-out loss evaluated token by token through
a quantized KV cache, per format, against a bf16 cache (`fp4attn/study/cache_eval.py`).

The checkpoint is one `fp4attn study train` wrote (`ckpt-<attention>.pt`); the model's
config is read from the `train-study.json` beside it. The same held-out batches (the
study's validation windows, by seed) are evaluated with the model's own forward (SDPA,
all tokens at once) and through the cache path in each K/V format pair.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fp4attn.cli.output import markdown_table, write_json
from fp4attn.study.cache_eval import cached_loss
from fp4attn.study.data import batch, load_splits
from fp4attn.study.gpt import GPT, GPTConfig

# (K format, V format): the bf16 baseline first
PAIRS = [("bf16", "bf16"), ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("nvfp4", "fp8"),
         ("fp8", "nvfp4")]


def load_model(checkpoint: Path, device: str) -> GPT:
    info = checkpoint.parent / "train-study.json"
    if not info.exists():
        raise ValueError(f"study decode: {info} is missing; the model's config is read from the train-study.json "
                         "that `fp4attn study train` writes beside its checkpoints")
    cfg = GPTConfig(**json.loads(info.read_text())["config"])
    model = GPT(cfg)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["model"])
    return model.to(device).eval()


def main(args) -> list[dict]:
    if args.checkpoint is None:
        raise ValueError("study decode needs --checkpoint (a ckpt-<attention>.pt of `fp4attn study train`)")
    model = load_model(args.checkpoint, args.device)
    _, val = load_splits()
    gen = torch.Generator().manual_seed(args.seed + 2)  # the study's validation windows
    seq = args.decode_seq or model.cfg.seq
    batches = [tuple(t.to(args.device) for t in batch(val, args.batch, seq, gen)) for _ in range(args.val_batches)]
    with torch.no_grad():
        plain = sum(float(model(x, y)) for x, y in batches) / len(batches)
    records = [{"k_format": "model forward (SDPA)", "v_format": "", "loss": plain}]
    pairs = PAIRS if not args.formats else [tuple(p.split("/")) if "/" in p else (p, p) for p in args.formats.split(",")]
    for kf, vf in pairs:
        t0 = time.perf_counter()
        loss = sum(cached_loss(model, x, y, kf, vf) for x, y in batches) / len(batches)
        records.append({"k_format": kf, "v_format": vf, "loss": loss, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{kf}/{vf}: {loss:.4f}")
    base = next((r["loss"] for r in records if r["k_format"] == "bf16" and r["v_format"] == "bf16"), plain)
    for r in records:
        r["delta_vs_bf16_cache"] = r["loss"] - base
    summary = {"checkpoint": str(args.checkpoint), "config": model.cfg.__dict__, "batch": args.batch, "seq": seq,
               "val_batches": args.val_batches, "device": args.device, "records": records}
    write_json(args.out / "decode-study.json", summary)
    print(markdown_table(["K", "V", "held-out loss (nats/byte)", "vs bf16 cache"],
                         [[r["k_format"], r["v_format"], f"{r['loss']:.4f}", f"{r['delta_vs_bf16_cache']:+.4f}"]
                          for r in records]))
    return records
