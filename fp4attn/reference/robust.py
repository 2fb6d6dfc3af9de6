"""Outlier-robust operand transforms, exact in real arithmetic (`Recipe.smooth_k`,
`Recipe.rotate_qk`, `Recipe.smooth_v`), and the per-(batch, head) choice of the Q/K
format (`Recipe.qk_fallback`).

Each transform changes what is quantized, never the attention it computes:

- K smoothing: k_j - mu for every key j of a (batch, head) shifts each query's scores
  by the constant q . mu, which the softmax removes. mu is K's mean over the keys,
  rounded to bf16 (`key_mean`): any mu is exact, this one removes a shared offset.
- Hadamard rotation: q' = H (s * q), k' = H (s * k) with H the unnormalized
  Walsh-Hadamard matrix of order D (entries +-1, H H^T = D I) and s a fixed random
  sign vector, so q' . k' = D (q . k): the softmax scale is divided by D, a power of
  two (exact). It spreads a few large channels over all of them (incoherence
  processing, as QuaRot and FlashAttention-3). H is applied as the butterfly of
  `hadamard`, whose float32 adds are exact for bf16 and fp16 inputs whose row spans
  fewer than about 2**16 in magnitude, and in a fixed order (the kernels repeat it)
  otherwise. A head dim that is not a power of two is rotated in blocks of its largest
  power-of-two divisor (block-diagonal H, still orthogonal up to that block size).
- V smoothing: V's mean over the keys per (batch, head, channel), mu_v, is subtracted
  before quantizing and added to the output: with consistent normalization (the row
  sum taken from the same represented P that multiplies V) sum_j p_j (v_j - mu_v) /
  sum_j p_j + mu_v = sum_j p_j v_j / sum_j p_j. Rows that see no key stay 0.

The means are float64 sums of the inputs (exact, so that any order gives the same sum,
for bf16 inputs whose channel spans less than 2**(45 - log2 S) in magnitude), divided by
the key count and rounded to bf16, then subtracted in float32 (one rounding).

Every statistic here (means, sums of squares) counts a NaN or an Inf as 0: a non-finite
value then reaches only the scores and rows that read it (a key's NaN stays in its own
key after the mean is subtracted), never its whole channel or head.

The Q/K fallback's statistic of smoothed K (`smoothed_sum_sq`) is made from the same
pass's float64 per-channel sums of k and k**2, sum_t (k - m)**2 = sum k**2 - 2 m sum k +
S m**2, not from the squares of the float32 values k - m: the kernels then read K once for
its mean, its smoothed maximum and this statistic. It is a decision heuristic; the two
forms differ by the float32 rounding of k - m (about 1e-8 relative) and the float64
cancellation (about 1e-16 times sum k**2 / sum (k - m)**2).
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("hadamard",)
SIGN_SEED = 20261201  # the fixed random sign vector's seed: part of the recipe's numerics


@functools.cache
def _signs_cpu(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).float()


def hadamard_signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed random +-1 float32 sign vector of length d applied before the rotation."""
    return _signs_cpu(d).to(device)


def hadamard_block(d: int) -> int:
    """Size of the Walsh-Hadamard blocks of head dim d: its largest power-of-two divisor."""
    if d <= 0:
        raise ValueError(f"head dim must be positive, got {d}")
    return d & -d


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of x's last dim in blocks of
    `hadamard_block(D)`, as the butterfly: for h = 1, 2, 4, ..., each pair (i, i + h)
    with bit h of i clear becomes (a + b, a - b), float32 adds."""
    x = x.float()
    d = x.shape[-1]
    n = hadamard_block(d)
    y = x.reshape(*x.shape[:-1], d // n, n)
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], d // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H (s * x) along the last dim (float32); `unrotate` is its adjoint."""
    return hadamard(x.float() * hadamard_signs(x.shape[-1], x.device))


def unrotate(g: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to x of a gradient g with respect to rotate(x): s * (H g)
    (H is symmetric)."""
    return hadamard(g.float()) * hadamard_signs(g.shape[-1], g.device)


def rotation_scale(d: int) -> float:
    """What the softmax scale is multiplied by for rotated Q and K: 1 / (block size), a
    power of two (q' . k' = block * (q . k))."""
    return 1.0 / hadamard_block(d)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """x with its NaN and +-Inf entries set to 0, as every statistic here counts them."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def key_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the keys (dim -2) of x (B, H, S, D), per (batch, head, channel): float64
    sum / S, rounded to bf16, as float32 (B, H, 1, D). A NaN or Inf counts as 0 (the
    subtraction leaves it in its own key)."""
    s = finite_or_zero(x.float()).sum(dim=-2, keepdim=True, dtype=torch.float64) / x.shape[-2]
    return s.to(torch.bfloat16).float()


def key_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 sums over the keys (dim -2) of x (B, H, S, D) and of its squares, per
    (batch, head, channel): (B, H, D) each. The sums are exact (so the kernels' atomic
    sums in any order give the same bits) for bf16 channels whose nonzero values span
    less than 2**(45 - log2 S) in magnitude, the sums of squares (16 significant bits a
    square) for a span below 2**((37 - log2 S) / 2) (2**12.5 at S = 4096); beyond that
    the last bits of a sum of squares can depend on the order of the adds. A NaN or Inf
    counts as 0."""
    x = finite_or_zero(x.float()).double()
    return x.sum(dim=-2), x.square().sum(dim=-2)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed binary tree: the entries padded with zeros to a
    power of two n, then entry i + entry i + n / 2 for i < n / 2, level by level. Each
    node is one add of two numbers, whose order does not matter, so a kernel repeats
    this sum bit for bit (a reduction's own order is unspecified)."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def smoothed_sum_sq(sums: torch.Tensor, sums_sq: torch.Tensor, mean: torch.Tensor, s: int) -> torch.Tensor:
    """Each head's sum over keys and channels of (k - mean)**2, float64 (B, H), from
    K's per-channel float64 sums and sums of squares (`key_sums`, (B, H, D)) and its
    bf16 mean ((B, H, D) or (B, H, 1, D)) over its s keys: per channel (sum k**2 - (2 m)
    sum k) + (s m) m, each operation rounded once (2 m and s m are exact, and so is (s
    m) m for a bf16 m and s < 2**31), clamped at 0 (NaN kept: the cancellation can leave
    a channel whose keys all equal its mean a few ulps below), then `pairwise_sum` over
    the channels. The statistic the Q/K fallback takes for smoothed K (`logit_std_of_sums`):
    one pass over K gives its inputs with the mean's sums (a NaN or Inf counting as 0)."""
    m = mean.reshape(sums.shape).double()
    t = (sums_sq - (2.0 * m) * sums) + (s * m) * m
    return pairwise_sum(t.clamp_min(0.0))


def smooth(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """x - mean in float32 (one rounding)."""
    return x.float() - mean


def logit_std(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Per (batch, head) estimate of the logits' spread: scale * sqrt(mean |q|^2 *
    mean |k|^2 / D) (the standard deviation of q . k * scale for directions that are
    unrelated), float64 (B, H). The Q/K quantization error of the scores grows with
    it (docs/notes/robust-numerics.md). K at its own heads; GQA heads are expanded by
    the caller. A NaN or Inf counts as 0."""
    sq_q = finite_or_zero(q.float()).double().square().sum(dim=(-2, -1))
    sq_k = finite_or_zero(k.float()).double().square().sum(dim=(-2, -1))
    return logit_std_of_sums(sq_q, sq_k, q.shape[-2], k.shape[-2], q.shape[-1], scale)


def logit_std_of_sums(sq_q: torch.Tensor, sq_k: torch.Tensor, sq: int, sk: int, d: int, scale: float) -> torch.Tensor:
    """`logit_std` from each head's float64 sums of squares of q and k (B, H): the
    squares of float32 values summed in float64 (exact for bf16 inputs in practice, so
    the kernels' atomic sums in any order give the same bits), or for smoothed K
    `smoothed_sum_sq`. Where a sum is not exact (fp32 inputs, channels of a very wide
    span) the kernels' may differ in the last bits, which moves the fallback choice only
    for a spread within about 1e-15 of the threshold."""
    return scale * torch.sqrt((sq_q / sq) * (sq_k / sk) / d)
