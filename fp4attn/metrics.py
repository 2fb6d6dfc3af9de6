"""Error metrics against a high-precision reference, computed in float64."""

from __future__ import annotations

import torch

ROW_PERCENTILE = 0.01  # the per-row cosine reported beside the means: its 1st percentile


def row_cosines(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float64 cosine of each output row (the last dim) of `out` against `ref`, over the
    rows where `rows` (bool, broadcastable to out.shape[:-1]) is True and the reference
    row is not zero (a row that sees no key has nothing to compare). A row of `out`
    holding NaN or Inf has cosine NaN."""
    o, r = out.detach().double(), ref.detach().double()
    keep = r.norm(dim=-1) > 0
    if rows is not None:
        keep = keep & rows.expand(keep.shape)
    o, r = o[keep], r[keep]
    cos = (o * r).sum(-1) / (o.norm(dim=-1) * r.norm(dim=-1)).clamp_min(1e-300)
    return torch.where(torch.isfinite(o).all(-1), cos, torch.full_like(cos, float("nan")))


def error_metrics(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> dict[str, float]:
    """Cosine similarity, relative L2 error, max absolute error of `out` vs `ref`, and
    the 1st percentile of the per-row cosine (`row_cosines`) as "cos_p1".

    `rows` (bool, broadcastable to out.shape[:-1]) restricts every metric to those rows
    (e.g. the real tokens of a padded batch). NaN or Inf anywhere in the compared part of
    `out` gives NaN metrics (so no threshold test can pass).
    """
    if rows is not None:
        keep = rows.expand(out.shape[:-1])
        out, ref = out[keep], ref[keep]
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    if not bool(torch.isfinite(o).all()):
        nan = float("nan")
        return {"cos": nan, "rel_l2": nan, "max_abs": nan, "cos_p1": nan}
    cos = float(torch.dot(o, r) / (o.norm() * r.norm()).clamp_min(1e-300))
    per_row = row_cosines(out, ref)
    return {
        "cos": cos,
        "rel_l2": float((o - r).norm() / r.norm().clamp_min(1e-300)),
        "max_abs": float((o - r).abs().max()),
        "cos_p1": float(torch.quantile(per_row, ROW_PERCENTILE)) if per_row.numel() else float("nan"),
    }
