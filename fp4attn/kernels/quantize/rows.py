"""What every quantizing pass shares: a program takes blocks of rows of one head of a
(G, S, D) operand (G the product of the leading dims), so per-channel maxima are one
atomic max per channel and program (`_channel_amax_flush`) and a head's last program can
finish what the head's statistics need (`_last_program_of_head`); on the host, the
(G, S, D) view, the grids and the zero-filled work buffers. No numerics of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4attn.kernels.quantize.elements import _abs_bits

INF_BITS = tl.constexpr(0x7F800000)  # +Inf's float32 bits: |x|'s bits at or above it are Inf or NaN


@triton.jit
def _abs_bits_max(run, x, ok):
    """The running elementwise max of |x|'s bits (rows where ok) over a program's row
    blocks: no exchange between threads until `_channel_amax_flush`. Over the finite
    values (bits below +Inf's): a NaN or Inf spoils its own element of the channel view
    that the maxima scale, not the channel (`reference.forward`, "Non-finite values")."""
    bits = _abs_bits(x)
    return tl.maximum(run, tl.where(ok & (bits < INF_BITS), bits, 0))


@triton.jit
def _finite_key(x):
    """An order key of |x| over the finite values, NaN and Inf below every finite one, in
    one instruction an element (the float32 bits shifted out of their sign plus a
    constant, uint32): 2 |x|_bits + 2**24, which wraps below 2**24 for exactly the bits
    at or above +Inf's (`_finite_bits` takes the key's maximum back to |x|'s bits). A
    select an element (bits < Inf's) made `_v_kernel` 1.3x slower (H100, (8, 16, 4096, 128))."""
    return (x.to(tl.float32).to(tl.uint32, bitcast=True) << 1) + 0x01000000


@triton.jit
def _finite_bits(key):
    """|x|'s float32 bits (int32) of the largest `_finite_key`s, 0 where none is finite."""
    return ((tl.maximum(key, 0x01000000) - 0x01000000) >> 1).to(tl.int32, bitcast=True)


@triton.jit
def _finite_channel_max(x, ROWS: tl.constexpr, D: tl.constexpr):
    """Each channel's largest finite |x| of a block of ROWS x D values, as float32 bits
    (int32; NaN and Inf count as 0)."""
    return _finite_bits(tl.max(tl.reshape(_finite_key(x), [ROWS, D]), axis=0))


@triton.jit
def _channel_amax_flush(CAMAX, run, D: tl.constexpr):
    """Atomic max of the running (rows, D) maximum's per-channel max into one head's D
    slots at CAMAX, as float32 bits. Relaxed: a max needs no ordering with the
    program's other memory operations (the default acq_rel put a MEMBAR.ALL.GPU beside
    every atomic); one per channel and program: with a program per 16 rows the dO
    pass's same-address atomics doubled its time."""
    tl.atomic_max(CAMAX + tl.arange(0, D), tl.max(run, axis=0), sem="relaxed")


@triton.jit
def _block_rows(g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr):
    """The positions s in head g (int64) of this program's i-th block of BLOCK_R rows
    (BLOCKS blocks a program, grid (cdiv(S, BLOCK_R * BLOCKS), G)), and their row indices
    g * S + s (int64) in a (G, S, ...) tensor."""
    s = (tl.program_id(0) * BLOCKS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
    return s, g * S + s


@triton.jit
def _row_block(X, g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, D: tl.constexpr):
    """Block i of this program's BLOCKS blocks of BLOCK_R rows of X (G, S, D) in head g,
    as stored, rows past S (and a block i past the last) zero: a program that loads
    block i + 1 before it works on block i keeps twice the bytes in flight (the passes
    here are bound by memory parallelism, not by bandwidth or issue)."""
    s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(X + offs, mask=((s < S) & (i < BLOCKS))[:, None], other=0.0)


@triton.jit
def _last_program_of_head(COUNT, g):
    """Whether this program is the last of head g's programs (axis 0 of the grid) to get
    here, by an acq_rel count at COUNT + g (int32, starting at 0), after a barrier so that
    the count follows every thread's earlier atomics. The last one's acquire then makes
    all the head's atomics visible to it: it reads their results from L2 (`.cg`)."""
    tl.debug_barrier()
    return tl.atomic_add(COUNT + g, 1, sem="acq_rel") == tl.num_programs(0) - 1


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x (..., S, D) as a contiguous (G, S, D), G the product of the leading dims (a
    1-D x is one row)."""
    S = x.shape[-2] if x.dim() > 1 else 1
    return x.contiguous().view(-1, S, x.shape[-1])


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints, `triton.cdiv`'s value without its call wrapper:
    Triton 3.6 wraps it (and `next_power_of_2`) as a constexpr function, about 3 us a
    call on the host, and a robust quantization made 17 such calls."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), `triton.next_power_of_2`'s value
    for n >= 1, without its call wrapper (`_cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def _row_grid(S: int, G: int, blocks: int, most: int = 16) -> tuple[tuple[int, int], int]:
    """Grid and rows per block of a (G, S, D) row kernel whose programs take `blocks`
    blocks of up to `most` rows (fewer for a short head): several where the programs
    end in one atomic per channel."""
    block = min(most, _next_pow2(S))
    return (_cdiv(S, block * blocks), G), block


# row blocks per program of the passes that record maxima: one atomic per channel per 8
# blocks of rows
CHANNEL_BLOCKS = 8


def _zero_views(device: torch.device, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """Zero-filled 1-D tensors of (numel, dtype) each, views of one buffer (one fill for
    all of them), each starting 16-byte aligned (as the JIT specializes pointers)."""
    starts, n = [], 0
    for numel, dtype in parts:
        starts.append(n)
        n += -(-numel * dtype.itemsize // 16) * 16
    buf = torch.zeros(max(n // 8, 2), device=device, dtype=torch.int64).view(torch.uint8)
    return [buf[o:o + numel * dtype.itemsize].view(dtype) for o, (numel, dtype) in zip(starts, parts)]
