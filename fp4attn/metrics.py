"""Error metrics against a high-precision reference, computed in float64."""

from __future__ import annotations

import torch


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine similarity, relative L2 error and max absolute error of `out` vs `ref`.

    NaN or Inf anywhere in `out` gives cosine NaN (so no threshold test can pass).
    """
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    if not bool(torch.isfinite(o).all()):
        nan = float("nan")
        return {"cos": nan, "rel_l2": nan, "max_abs": nan}
    cos = float(torch.dot(o, r) / (o.norm() * r.norm()).clamp_min(1e-300))
    return {
        "cos": cos,
        "rel_l2": float((o - r).norm() / r.norm().clamp_min(1e-300)),
        "max_abs": float((o - r).abs().max()),
    }
