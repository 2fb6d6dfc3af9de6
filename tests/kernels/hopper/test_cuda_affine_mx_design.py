"""The CUDA forward's affine MXFP4 P (`AFFINE_MX`: its builder in fp4attn/kernels/hopper/cuda/p_build.cuh),
its integer design replayed on the CPU against the reference's codes, bit for bit.

The kernel does not build P's bytes the way reference/affine.py states them: per score it
reads 8 - code off one FMA, packs four such integers clamped to 0..15 into a PRMT selector
(`cvt.pack.sat.u4.s32`), and looks the e4m3 byte up in two registers built per 32-key block
(normal bytes 4 c + 8 (e_b + 14) by a multiply-add; a branch for the blocks whose small codes
are e4m3 subnormals; zeros for dead, NaN or too-low blocks), where selector nibbles 8..15
replicate the sign of a byte under 0x80 (so 0). This test replays that arithmetic in exact
integers with the lookup constants read from the kernel's source, and holds every byte to
the reference's e4m3(E2M1(code) x 2**(e_b + 8)) on scores built to hit the edges: codes at
their rounding ties, the map's overshoot to 8, blocks from the row's top down past P_EMIN,
masked keys, NaN. The PTX instructions themselves run on the GPU test
(tests/kernels/hopper/test_forward_cuda.py::test_p_codes_match_triton_kernel)."""

import math
import re
from pathlib import Path

import torch

from fp4attn.formats.minifloat import decode_e2m1
from fp4attn.reference.affine import affine_mxfp4_codes, snap_max

SOURCE = Path(__file__).parents[3] / "fp4attn/kernels/hopper/cuda/p_build.cuh"  # the P builders' header
MAGIC = 12582912.0


def _lookup_constants() -> tuple[int, int]:
    """The fast lookup's byte offsets (codes 7, 7, 6, 5 and 4, 3, 2, 1), from the kernel."""
    src = SOURCE.read_text()
    ta = re.search(r"ta = k \* 0x01010101u \+ (0x[0-9A-Fa-f]+)u;", src)
    tb = re.search(r"tb = k \* 0x01010101u \+ (0x[0-9A-Fa-f]+)u;", src)
    assert ta and tb, "the lookup's constants moved in the kernel's source"
    return int(ta.group(1), 16), int(tb.group(1), 16)


def _e4m3_byte(x: float) -> int:
    return int(torch.tensor([x]).to(torch.float8_e4m3fn).view(torch.uint8))


def _block_lookup(bmax: float, m_ref: float) -> tuple[int, int, int]:
    """(d_int, ta, tb) of one block as affine_mx_block computes them: d_int the integer
    8 - c of the negated map (c the reference's addend less MAGIC)."""
    ca, cb = _lookup_constants()
    xmax = float(torch.tensor(bmax, dtype=torch.float32) - torch.tensor(m_ref, dtype=torch.float32))
    if math.isnan(xmax) or xmax == -math.inf:
        floor = None
    else:
        floor = math.floor(xmax)
    d_int = None if floor is None else int(2 + 2 * m_ref + 2 * floor)
    if floor is not None and floor >= -11:
        k = 8 * (floor + 12)
        return d_int, (k * 0x01010101 + ca) % 2**32, (k * 0x01010101 + cb) % 2**32
    if floor is not None and floor >= -14:
        u = 2.0 ** (floor + 6)
        b = [_e4m3_byte(x * u) for x in (6, 6, 4, 3, 2, 1.5, 1, 0.5)]
        return d_int, b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24
    return d_int, *((0xFFFFFFFF, 0xFFFFFFFF) if math.isnan(xmax) else (0, 0))


def _prmt(ta: int, tb: int, nibble: int) -> int:
    table = ta | tb << 32
    byte = (table >> (8 * (nibble & 7))) & 0xFF
    return byte if nibble < 8 else (0xFF if byte & 0x80 else 0)


def _kernel_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of P (rows, keys) for log2 scores t of rows that saw no key before, as the
    kernel builds them with a row factor of 1 (a key bias build: t itself in registers)."""
    rows, keys = t.shape
    out = torch.zeros(rows, keys, dtype=torch.uint8)
    row_max = t.amax(dim=-1)  # NaN-propagating, as the kernel's max.NaN
    for r in range(rows):
        m = float(row_max[r])
        m_ref = float(snap_max(torch.tensor(0.0 if m == -math.inf else m), "mxfp4"))
        for blk in range(keys // 32):
            tb_ = t[r, 32 * blk:32 * blk + 32]
            d_int, ta, tb = _block_lookup(float(tb_.amax()), m_ref)
            for j in range(32):
                x = float(tb_[j])
                if d_int is None or math.isnan(x):
                    n = 15  # the FMA's NaN (or -inf + inf): bits 0x7FFFFFFF, saturated
                else:
                    v = d_int - 2.0 * x  # exact in float64: an integer and a float32
                    n = 15 if v == math.inf else min(max(round(v), 0), 15)  # RNE, then cvt.pack.sat.u4
                out[r, 32 * blk + j] = _prmt(ta, tb, n)
    return out


def _reference_bytes(t: torch.Tensor) -> torch.Tensor:
    m = t.amax(dim=-1)
    m_ref = snap_max(torch.where(m == -math.inf, torch.zeros_like(m), m), "mxfp4")
    codes, e_b = affine_mxfp4_codes(t, m_ref)
    v = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, 32) * torch.exp2(e_b.float() + 8).unsqueeze(-1)
    return v.reshape(t.shape).to(torch.float8_e4m3fn).view(torch.uint8)


def test_lookup_bytes_are_the_e2m1_values_times_the_block_scale():
    """The fast lookup holds, for every block exponent it serves (e_b -13 .. -2), the e4m3
    bytes of E2M1 codes 7, 7, 6, 5 | 4, 3, 2, 1 times 2**(e_b + 8), every byte under 0x80."""
    for floor in range(-11, 1):
        _, ta, tb = _block_lookup(float(floor) + 0.25, 0.0)
        u = 2.0 ** (floor + 6)
        want = [_e4m3_byte(float(decode_e2m1(torch.tensor(c))) * u) for c in (7, 7, 6, 5, 4, 3, 2, 1)]
        got = [(ta | tb << 32) >> (8 * i) & 0xFF for i in range(8)]
        assert got == want, floor
        assert max(got) < 0x80


def test_kernel_design_equals_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    rows = []
    # Gaussian rows at three sharpnesses, and rows whose blocks fall from the top down past
    # P_EMIN (block offsets 0, -4, ..., -28 log2 units)
    for spread in (2.0, 8.0, 30.0):
        rows.append(torch.randn(6, 256, generator=g) * spread)
    steps = torch.arange(8).repeat_interleave(32) * -4.0
    rows.append(steps + torch.rand(4, 256, generator=g) * 3.0)
    # scores on the map's rounding ties (2 t + c a half-integer) and on the overshoot to 8
    ties = (torch.randint(-40, 4, (4, 256), generator=g) + 0.5) / 2.0
    rows.append(ties)
    t = torch.cat(rows).float()
    # masked keys, a fully masked block, a fully masked row, a NaN row
    t[0, 5] = -math.inf
    t[1, 100:132] = -math.inf
    t[2, 64:96] = -math.inf
    t[3] = -math.inf
    t[4, 17] = math.nan
    t[5, 40] = math.inf  # a score that overflows: its output row is NaN in the reference
    got, want = _kernel_bytes(t), _reference_bytes(t)
    ok = torch.ones(t.shape[0], dtype=torch.bool)
    ok[4] = False  # a NaN row: its row maximum is NaN, which makes the row NaN through alpha
    ok[5] = False
    assert torch.equal(got[ok], want[ok])
    assert math.isnan(float(t[4].amax())) and not torch.isnan(t[ok].amax(-1)).any()
    # the +inf score's block is all e4m3 NaN (0xFF), which the PV product carries into the
    # row and its sum: the row comes out NaN, as the reference's (whose P is 0 there and whose
    # row sum 0 divides 0); the row's point is +inf, its other blocks hold no code
    assert bool((got[5, 32:64] == 0xFF).all()) and bool((got[5, :32] == 0).all())
