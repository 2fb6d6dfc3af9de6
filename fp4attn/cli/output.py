"""What every command writes: GitHub-style tables and JSON records."""

from __future__ import annotations

import json
from pathlib import Path


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
