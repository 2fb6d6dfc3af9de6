"""How often Recipe.rescale="lazy" moves a row's point, and what the CUDA forward's policy
costs for it (docs/notes/affine-p.md), on the CPU: the accuracy families' exact log2
scores at (1, 4, 4096, 128), the lazy rule per row and 128-key tile for map offsets
K = 119.5 - 8 H (H log2 units of room above the point), the fraction of (row, tile) and of
(16-row warp, tile) pairs that move (a warp takes the exact path if any of its rows
moves), and a cost model of the kernel's choice per warp and tile: the maximum first
(cost of the exact rescale, 1.06 against 1.0 for a speculative tile that keeps, measured
on the H200: 1.34x against 1.43x of cuDNN bf16 at (8,16,4096,128)), or speculative
bytes, which a move rebuilds (1.0 + 0.8 x 1.06), the maximum first while fewer than N
tiles passed since the warp's last move.

    python tools/lazy_rescale_moves.py
"""

from __future__ import annotations

import torch

from fp4attn.cli.accuracy import make_inputs
from fp4attn.reference.affine import MAGIC

EXACT, KEEP, MISS = 1.06, 1.0, 1.0 + 0.8 * 1.06  # per warp-tile, relative to a speculative tile that keeps


def snap(m: torch.Tensor, k: float) -> torch.Tensor:
    c = (k - 8 * m) + MAGIC
    return (k - (c - MAGIC)) * 0.125


def moves(tmax: torch.Tensor, k: float) -> torch.Tensor:
    """(B, H, S, tiles) bool: the rows whose point moves at each tile (always at the first)."""
    m = snap(tmax[..., 0], k)
    out = torch.zeros_like(tmax, dtype=torch.bool)
    out[..., 0] = True
    for j in range(1, tmax.shape[-1]):
        move = torch.round(8 * tmax[..., j] + (k - 8 * m)) > 126
        out[..., j] = move
        m = torch.where(move, snap(torch.maximum(m, tmax[..., j]), k), m)
    return out


def policy_cost(warp_moves: torch.Tensor, quiet: int) -> float:
    """Mean cost per warp-tile of taking the maximum first until `quiet` tiles passed
    without a move, speculative bytes after."""
    total = 0.0
    for seq in warp_moves.reshape(-1, warp_moves.shape[-1]).tolist():
        since = 0
        for j, moved in enumerate(seq):
            total += EXACT if j == 0 or since < quiet else (MISS if moved else KEEP)
            since = 0 if moved else since + 1
    return total / warp_moves.numel()


def main() -> None:
    torch.set_num_threads(2)
    print("| inputs | H (K) | rows moving a tile | warps moving a tile | policy cost N=1 / 2 / 4 / 8 (exact 1.06) |")
    print("|---|---|---|---|---|")
    for case in ("gaussian", "hard", "sharp", "channels", "offset"):
        q, k, _ = make_inputs(case, (1, 4, 4096, 128), 0, "cpu")
        t = (q @ k.transpose(-1, -2)) * 128**-0.5 * 1.4426950408889634
        tmax = t.reshape(1, 4, 4096, 32, 128).amax(-1)
        for room in (3, 6):
            kk = 119.5 - 8 * room
            mv = moves(tmax, kk)
            warp = mv.reshape(4, 256, 16, 32).any(2)
            costs = " / ".join(f"{policy_cost(warp, n):.3f}" for n in (1, 2, 4, 8)) if room == 3 else ""
            print(f"| {case} | {room} ({kk}) | {mv[..., 1:].float().mean():.3f} | {warp[..., 1:].float().mean():.3f} "
                  f"| {costs} |", flush=True)


if __name__ == "__main__":
    main()
