"""Data-parallel training of the study GPT under torch.distributed: DDP or FSDP2
(`fully_shard`, one shard group per transformer block, then the whole model).

Launched by `torchrun`; on a CPU the gloo backend, on GPUs NCCL. fp4attn's attention
is an ordinary autograd op to both wrappers: nothing in it communicates or hooks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

PARALLEL = ("none", "ddp", "fsdp")


def init(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); starts the process group under torchrun
    (once: later calls return the same)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device(device)


def wrap(model: torch.nn.Module, parallel: str, device: torch.device) -> torch.nn.Module:
    if parallel == "none":
        return model
    if not dist.is_initialized():
        raise SystemExit(f"--parallel {parallel} needs torchrun (e.g. torchrun --nproc-per-node 2 -m fp4attn.cli.main ...)")
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def mean(value: float, device: torch.device) -> float:
    """Mean of a float over ranks (the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def params_agree(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every rank holds the same full parameters (sharded ones gathered)."""
    if not dist.is_initialized():
        return True
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        total += full.detach().double().abs().sum() + full.detach().double().sum()
    gathered = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def finish() -> None:
    """Wait for every rank, then tear the process group down (a rank that exits while
    another still has collectives in flight aborted under gloo)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_worker() -> None:
    """End a torchrun worker once its work is written: flush and leave without running
    C++ static destructors. After a clean teardown, gloo workers still died at
    interpreter exit now and then ("terminate called without an active exception",
    SIGABRT), failing a run whose results were complete."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
