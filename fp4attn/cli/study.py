"""`fp4attn study train`: does low-precision attention change how a GPT trains?

A small GPT is trained on the Shakespeare corpus (bytes, `fp4attn.study.data`) once per
attention: PyTorch SDPA ("sdpa", the bf16 baseline on a GPU), `train` (NVFP4 Q/K, FP8
P/V) and `train-mxfp4pv` (NVFP4 Q/K, MXFP4 P/V, which diverged in the paper). Every
run starts from the same initial weights and sees the same batches in the same order.
Held-out loss is measured on fixed validation batches. A run stops at the first
non-finite loss (its step is recorded). Checkpoints allow resuming across runs.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from fp4attn.cli.output import markdown_table, write_json
from fp4attn.study import distributed
from fp4attn.study.data import batch, load_splits
from fp4attn.study.gpt import GPT, GPTConfig


def _lr(step: int, base: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def _val_loss(model, val, batches, device) -> float:
    model.eval()
    losses = [model(x, y).item() for x, y in batches]
    model.train()
    return distributed.mean(sum(losses) / len(losses), device)


def train_one(attn: str, cfg: GPTConfig, args, train, val, out: Path) -> dict:
    rank, world, device = distributed.init(args.device)
    ckpt = out / f"ckpt-{attn}.pt"
    torch.manual_seed(args.seed)  # same initial weights on every rank and for every attention
    base = GPT(cfg, attn).to(device)
    n_params = base.num_params()
    model = distributed.wrap(base, args.parallel, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + 1 + 1000 * rank)  # each rank its own batches
    val_gen = torch.Generator().manual_seed(args.seed + 2 + 1000 * rank)
    val_batches = [tuple(t.to(device) for t in batch(val, args.batch, cfg.seq, val_gen)) for _ in range(args.val_batches)]
    state = {"attn": attn, "params": n_params, "history": [], "nan_step": None, "nan_where": None, "step": 0,
             "seconds": 0.0}
    if args.resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        gen.set_state(saved["gen"])
        state = saved["state"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(range(state["step"], args.steps), desc=attn, unit="step", initial=state["step"], total=args.steps,
               disable=rank != 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for step in bar:
        if state["nan_step"] is not None:
            break
        x, y = (t.to(device) for t in batch(train, args.batch, cfg.seq, gen))
        for g in opt.param_groups:
            g["lr"] = _lr(step, args.lr, args.warmup, args.steps)
        with autocast:
            loss = model(x, y)
        if not math.isfinite(distributed.mean(loss.item(), device)):  # every rank stops together
            state["nan_step"], state["nan_where"] = step, "loss"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not math.isfinite(distributed.mean(float(grad_norm), device)):  # before it reaches the weights
            state["nan_step"], state["nan_where"] = step, "gradient"
            break
        opt.step()
        state["step"] = step + 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with autocast:
                v = _val_loss(model, val, val_batches, device)
            state["history"].append([step + 1, distributed.mean(loss.item(), device), v])
            bar.set_postfix(train=f"{loss.item():.3f}", val=f"{v:.3f}")
            if not math.isfinite(v):
                state["nan_step"], state["nan_where"] = step + 1, "validation loss"
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            state["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "state": state}, ckpt)
    state["seconds"] += time.perf_counter() - t0
    last = state["history"][-1] if state["history"] else [0, float("nan"), float("nan")]
    tokens = (state["step"] * args.batch * cfg.seq * world)
    return {"recipe": attn, "params": state["params"], "steps": state["step"], "final_train_loss": last[1],
            "final_val_loss": last[2], "nan_step": state["nan_step"], "nan_where": state.get("nan_where"),
            "seconds": round(state["seconds"], 1),
            "tokens_per_second": round(tokens / max(state["seconds"], 1e-9)), "world_size": world,
            "parallel": args.parallel, "ranks_agree": distributed.params_agree(model, device),
            "peak_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None),
            "seq": cfg.seq, "batch_per_rank": args.batch,
            "history": state["history"]}


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in records:
        h = r["history"]
        ax.plot([s for s, _, _ in h], [v for _, _, v in h], label=f"{r['recipe']}"
                + (f" (non-finite at {r['nan_step']})" if r["nan_step"] is not None else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["train", "decode"],
                   help="train: the loss curves; decode: a trained checkpoint's held-out loss through a quantized "
                   "KV cache (fp4attn/cli/study_decode.py)")
    p.add_argument("--attn", default="sdpa,train,train-mxfp4pv", help="'sdpa' and/or fp4attn training recipes")
    p.add_argument("--steps", type=int, default=2000, help="training steps per attention (default 2000)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per training sequence (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--dim", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps (default 100)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (default 100)")
    p.add_argument("--val-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints in --out (default 0: none)")
    p.add_argument("--parallel", choices=distributed.PARALLEL, default="none",
                   help="data parallelism under torchrun: DDP or FSDP2 (fully_shard)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in the backward")
    p.add_argument("--resume", action="store_true", help="continue each run from its checkpoint in --out")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data order (default 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the inputs and kernels run: cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--out", type=Path, default=Path("results/study"),
                   help="folder of the results, plots and checkpoints (default results/study)")
    p.add_argument("--checkpoint", type=Path, help="decode: the ckpt-<attention>.pt to evaluate")
    p.add_argument("--formats", help="decode: K/V format pairs, 'nvfp4/fp8,mxfp4,...' (default: study_decode.PAIRS)")
    p.add_argument("--decode-seq", type=int, help="decode: tokens per held-out window (default: the model's seq)")


def main(args: argparse.Namespace) -> list[dict]:
    if args.what == "decode":
        from fp4attn.cli import study_decode

        return study_decode.main(args)
    if args.parallel != "none" and (args.checkpoint_every or args.resume):
        raise SystemExit("checkpoints are single-process for now: drop --checkpoint-every/--resume with --parallel")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    cfg = GPTConfig(seq=args.seq, layers=args.layers, dim=args.dim, heads=args.heads,
                    activation_checkpointing=args.activation_checkpointing)
    args.out.mkdir(parents=True, exist_ok=True)
    train, val = load_splits()
    records = [train_one(a, cfg, args, train, val, args.out) for a in args.attn.split(",")]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    distributed.finish()
    if rank != 0:
        distributed.exit_worker()
        return records
    summary = {"config": asdict(cfg), "batch": args.batch, "lr": args.lr, "device": args.device, "runs": records}
    write_json(args.out / "train-study.json", summary)
    title = (f"GPT {records[0]['params'] / 1e6:.1f}M params, seq {cfg.seq}, batch {args.batch}, "
             f"Shakespeare bytes, {args.device}")
    plot(records, args.out / "train-study.png", title)
    print(title)
    print(markdown_table(["attention", "steps", "final train loss", "final val loss", "non-finite at"],
                         [[r["recipe"], r["steps"], f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}",
                           "" if r["nan_step"] is None else f"{r['nan_step']} ({r['nan_where']})"]
                          for r in records]))
    distributed.exit_worker()
    return records
