"""P built by one affine map of the log-score: the paper's fast Direct-P, and its FP8 form.

Building P is the per-score work between QK^T and PV. The exact builders (`directp.py`)
compute the codes of round-to-nearest of the real exponential: seven threshold tests
per score (MXFP4), or an exp2 and a rounding (FP8). The affine builders instead read the
code straight off a rounded linear function of the score t (log2 units), because both
formats are (nearly) log-linear in their codes:

- an e4m3 byte 8e + u (exponent field e >= 1, mantissa u) is the value
  2**(e - 7) * (1 + u / 8), and log2(1 + u / 8) ~ u / 8: the byte is about
  8 * log2(value) + 56, so the FP8 P byte of 2**x * 2**8 is about 8 * x + 120;
- an E2M1 code c >= 2 (exponent field c // 2, mantissa c % 2) is the value
  2**(c // 2 - 1) * (1 + (c % 2) / 2): the code is about 2 * log2(value) + 2, so the
  code of y = x - e_b (Direct-P's block exponent, as `directp.py`) is about 2 * y + 2.

One rounding to an integer, a clamp into the format's codes, and no exponential at all.

The arithmetic, pinned to float32 so that a kernel reproduces every code
--------------------------------------------------------------------------
A kernel rounds by the magic-number addition: MAGIC = 1.5 * 2**23 lies where float32 has
an ulp of 1, so fl(z + MAGIC) = MAGIC + RNE(z) for |z| < 2**22, and the integer sits in
the low mantissa bits, the e4m3 byte in the low byte. With the row's reference point
folded into the addend C, the code is one FMA, fl(a * t + C), whose product a * t is
exact (a = 8 or 2, a power of two): the reference computes the same float32 sum
`(a * t) + C`, which rounds once, exactly as the FMA.

C must itself be a float32 near MAGIC, so an integer: the row's reference point m~
(what x~ = t - m~ is measured from) is the running maximum m snapped to the map's grid:

    FP8:    c = fl(fl(K_FP8 - 8 m) + MAGIC)         m~ = (K_FP8 - (c - MAGIC)) / 8
            byte = clamp(fl(8 t + c) - MAGIC, 0, 126)     (= RNE(8 (t - m~) + K_FP8))
    MXFP4:  m~ = ceil(2 m) / 2;  per 32-key block  e_b = floor(fl(max t - m~)) - 2
            c = (2 - 2 m~ - 2 e_b) + MAGIC
            code = clamp(fl(2 t + c) - MAGIC, 0, 7)      (= RNE(2 (t - m~ - e_b) + 2))

m~ is within 1/16 (FP8) or 1/2 (MXFP4) of m; it is the point the online softmax
rescales by (alpha = 2**(m~_old - m~_new)) and reports in the LSE, so every tile of a
row is measured from one consistent reference and nothing is approximated twice. The
snapping is idempotent, so the running value carried from tile to tile is m~ itself.
x~ <= 1/16 keeps every FP8 byte at or below 120 (P <= 1, the format's 2**8 offset as
`encoding.py`); MXFP4 blocks keep Direct-P's e_b <= -2 and its P_EMIN window.

The FP8 map sends x~ < -15 - K_FP8 / 8 + 15 (about 2**-15 of the row maximum) to byte 0
(the clamp) and the bytes 1..7 to e4m3 subnormals, a few percent of one code's value off
the log-linear line there: those are values, defined here, not errors of a kernel. The
float32 definitions hold for |m| < 2**21 (log2 units); beyond that C's rounding moves
the reference point, the same in the kernels, and the codes stay those of this float32
arithmetic. Masked keys (t = -inf) give code 0, a NaN score gives NaN in P.

The constants (K_FP8 and the MXFP4 offset 2: RNE(2 y + 2) = floor(2 y + 2.5) up to ties)
were chosen by measurement, docs/notes/affine-p.md.
"""

from __future__ import annotations

import math

import torch

from fp4attn.formats import decode_e2m1
from fp4attn.formats.constants import E2M1_EMAX, MX_BLOCK
from fp4attn.formats.minifloat import decode_ue4m3, pow2
from fp4attn.reference.encoding import P_EMIN, P_OFFSET_LOG2

MAGIC = 12582912.0  # 1.5 * 2**23, float32 ulp 1 in [2**23, 2**24); low byte 0x00
# FP8 P: byte = RNE(8 x~ + K_FP8); 120 is the byte of 2**0 * 2**8 (P's offset), the
# fraction centres the log-linear line on the e4m3 grid (docs/notes/affine-p.md)
K_FP8 = 119.5
FP8_MAX_BYTE = 126  # 0x7E = 448, e4m3's largest finite byte (0x7F is NaN)
E2M1_MAX_CODE = 7


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


K_FP8_F32 = _f32(K_FP8)
# Recipe.rescale="lazy": the FP8 map's offset with room above the reference point. A row's
# point moves only when some byte of a tile would exceed 126, so the offset trades the
# bytes' room above the point (how often a row must move it) against the normal bytes below
# it (docs/notes/affine-p.md, chosen by measurement)
K_FP8_LAZY = 95.5
K_FP8_LAZY_F32 = _f32(K_FP8_LAZY)
# its bytes stand for P times 2**5: the byte of x~ = 0 is 95.5 - 119.5 = -24 codes, three
# binades, below the exact form's, so P (relative to 2**m~) keeps its value and the LSE its
# formula, a kernel's LSE subtracting 5 where it subtracts 8
P_OFFSET_LOG2_LAZY = P_OFFSET_LOG2 - int((K_FP8 - K_FP8_LAZY) / 8)
assert (K_FP8 - K_FP8_LAZY) % 8 == 0


def snap_max(m: torch.Tensor, p_format: str, trained: bool = False, k: float = K_FP8_F32) -> torch.Tensor:
    """The reference point m~ of rows whose (finite, or NaN) running maximum is m, for
    the affine builder of `p_format` ("fp8" or "mxfp4"); float32, as a kernel computes it.
    trained (a recipe with a backward, FP8 P): the integer ceil(m), from which the
    backward rebuilds the forward's codes given only the LSE (an integer shift of m~ moves
    every byte by 8, a power of two: `reference.backward`). k: the FP8 map's offset."""
    m = m.float()
    if p_format == "fp8" and trained:
        return torch.ceil(m)
    if p_format == "fp8":
        c = (k - 8.0 * m) + MAGIC
        return (k - (c - MAGIC)) * 0.125
    if p_format == "mxfp4":
        return torch.ceil(2.0 * m) * 0.5
    raise ValueError(f"affine P builds 'fp8' or 'mxfp4' P, got {p_format!r}")


def _fp8_field(t: torch.Tensor, m_ref: torch.Tensor, k: float) -> torch.Tensor:
    """fl(8 t + C) - MAGIC, the unclamped byte of each score (float32; NaN for NaN)."""
    c = (k - 8.0 * m_ref.float().unsqueeze(-1)) + MAGIC  # = the kernel's C, exactly
    return ((8.0 * t.float()) + c) - MAGIC


def affine_fp8_bytes(t: torch.Tensor, m_ref: torch.Tensor, k: float = K_FP8_F32) -> torch.Tensor:
    """e4m3 bytes (uint8, 0..126) of FP8 P times 2**8 for log2 scores t (..., N) of rows
    with reference point m_ref (..., ) = `snap_max(m, "fp8", k=k)`. NaN scores: byte 0
    here, the caller makes them NaN (`build_p_affine`)."""
    code = _fp8_field(t, m_ref, k).clamp(0, FP8_MAX_BYTE)
    return torch.nan_to_num(code, nan=0.0).to(torch.uint8)


def lazy_reference_point(t: torch.Tensor, m_ref: torch.Tensor, m_tile: torch.Tensor) -> torch.Tensor:
    """Recipe.rescale="lazy": the reference point rows with point m_ref (-inf: none yet)
    measure the log2 scores t (..., N) of a tile from. A row keeps m_ref while every byte
    of its tile, measured from m_ref, fits (fl(8 t + C) - MAGIC <= 126, no NaN); else it
    takes `snap_max(m_tile)` of its running maximum m_tile (as the exact rescale does).
    The test is on the same float32 values a kernel builds the bytes from, so it decides
    alike; it moves the point up, never down."""
    keeps = (m_ref.float() > -math.inf) & (_fp8_field(t, m_ref, K_FP8_LAZY_F32).amax(dim=-1) <= FP8_MAX_BYTE)
    return torch.where(keeps, m_ref.float(), snap_max(m_tile, "fp8", k=K_FP8_LAZY_F32))


def affine_mxfp4_codes(t: torch.Tensor, m_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes (uint8 0..7) and block exponents (int32, (..., N // 32)) of MXFP4 P for
    log2 scores t (..., N) with reference point m_ref = `snap_max(m, "mxfp4")`; blocks
    empty or below P_EMIN have codes 0 and e_b = P_EMIN - 1, as `directp.directp_classify`."""
    tb = t.float().reshape(*t.shape[:-1], -1, MX_BLOCK)
    m = m_ref.float()[..., None]
    xmax = tb.amax(dim=-1) - m  # fl(max t - m~): the kernel's subtraction
    live = xmax > -math.inf
    e_b = torch.floor(torch.where(live, xmax, torch.zeros_like(xmax))) - E2M1_EMAX
    keep = live & (e_b >= P_EMIN)
    c = ((2.0 - 2.0 * m) - 2.0 * e_b) + MAGIC  # integers: exact in float32
    f = (2.0 * tb) + c.unsqueeze(-1)
    code = (f - MAGIC).clamp(0, E2M1_MAX_CODE)
    code = torch.nan_to_num(code, nan=0.0).masked_fill(~keep.unsqueeze(-1), 0).to(torch.uint8)
    e_b = torch.where(keep, e_b.to(torch.int32), torch.full_like(e_b, P_EMIN - 1, dtype=torch.int32))
    return code.reshape(t.shape), e_b


def fp8_byte_values(byte: torch.Tensor, offset_log2: int = P_OFFSET_LOG2) -> torch.Tensor:
    """P values e4m3(byte) / 2**offset_log2 of FP8 P bytes (2**8; the lazy form's 2**5)."""
    return decode_ue4m3(byte) * 2.0**-offset_log2


def build_p_affine(t: torch.Tensor, m_ref: torch.Tensor, p_format: str, k: float = K_FP8_F32) -> torch.Tensor:
    """Represented P values (what PV consumes, relative to 2**m_ref) of log2 scores t
    (..., N) by the affine builder of `p_format` (k: the FP8 map's offset); NaN scores
    give NaN, and a NaN reference point a NaN row."""
    if p_format == "fp8":
        p = fp8_byte_values(affine_fp8_bytes(t, m_ref, k), P_OFFSET_LOG2_LAZY if k == K_FP8_LAZY_F32 else P_OFFSET_LOG2)
    elif p_format == "mxfp4":
        codes, e_b = affine_mxfp4_codes(t, m_ref)
        v = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, MX_BLOCK)
        p = (v * pow2(e_b).unsqueeze(-1)).reshape(codes.shape)
    else:
        raise ValueError(f"p_build='affine' builds 'fp8' or 'mxfp4' P, got p_format={p_format!r}")
    # a NaN score, or a NaN row (its reference point NaN: every C, and so every code, NaN)
    return p.masked_fill(torch.isnan(t) | torch.isnan(m_ref.float()).unsqueeze(-1), float("nan"))
