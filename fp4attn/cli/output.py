"""What every command writes: GitHub-style tables and JSON records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# the exit status of a command that needs a CUDA GPU and finds none (bench, selftest,
# blackwell-report): nothing ran, as for a bad argument (2)
NO_GPU_STATUS = 2


def exit_no_gpu(command: str, what_instead: str = "") -> None:
    """End `fp4attn <command>` for want of a CUDA GPU: one line on stderr, NO_GPU_STATUS."""
    tail = f" ({what_instead})" if what_instead else ""
    print(f"fp4attn {command}: no CUDA GPU found, nothing ran{tail}", file=sys.stderr)
    raise SystemExit(NO_GPU_STATUS)


def write_json(path: Path | None, obj) -> None:
    """Write `obj` as indented JSON to `path` (its folder created); nothing if None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-style table; cells are printed as given."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
