"""The "fp4attn" logger and its once-per-message form (the reference-backend notices of
`fp4attn.attention` and `fp4attn.decode`)."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("fp4attn")


@functools.lru_cache(maxsize=64)
def log_once(message: str) -> None:
    """Log `message` at INFO level, once per distinct message (the last 64 remembered)."""
    log.info(message)
