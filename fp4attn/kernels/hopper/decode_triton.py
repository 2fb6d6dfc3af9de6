"""Decode attention over a quantized KV cache on Hopper (sm_90), in Triton: the split
kernel (flash-decoding) and its combine.

One program holds every query row of one (sequence, KV head): the GQA group's query
heads times the Sq new tokens (`BLOCK_M` rows, zero-padded), so the cache is read
once per step. It walks its split of the keys in tiles of BLOCK_N tokens: each tile's
bytes are loaded (the next tile's while this one is worked on), dequantized in
registers into bf16 operands, and fed to two tensor-core products per tile:

    S   = q_lo k_lo^T + q_hi k_hi^T            (the head dim in two halves of D / 2)
    acc = alpha * acc + bf16(P * v_factor) [v_lo | v_hi]

Why halves: a byte of 4-bit codes holds two channels, and the dequantizing asm turns 4
bytes into 8 bf16 values in two registers of four; rather than interleaving them back
into channel order, each half is an operand of its own and q (and the output) are read
(and written) in the matching channel order (`_channels`): the product is the same sum
in another order. The 8-bit and bf16 formats use the same two-halves form.

Every format's block values come out exact in bf16 (`reference.kvcache`); the token's
factor (its float32 scale, times the power of two the bf16 form was shifted by) scales
the scores of K and the P column of V. Scale tables:

    nvfp4   value = E2M1 x (e4m3 scale x 2**-7),  factor = S_dec x 2**7
    mxfp4   value = E2M1 x 2**(e - e_token),      factor = 2**e_token (e_token: the
            token's largest finite block exponent)
    fp8     value = e4m3,                         factor = amax / 448
    bf16    value = bf16,                         factor = 1

The dequantization (GPU, `ASM`): E2M1 codes go to bf16 by bit placement (the code's
exponent and mantissa bits into bf16's lowest exponent and top mantissa bits, the sign
bit to bit 15: the value times 2**-126, codes 0 and 0.5 as subnormals), then one
`mul.rn.bf16x2` by the block's multiplier restores the scale: about 2.4 instructions
per value. e4m3 goes to bf16 the same way (times 2**-120) with a multiply by 2**120.
Under the interpreter (no inline PTX) the same values are made by float arithmetic, the
halves in plain channel order.

The softmax is the reference's: an integer running maximum, so that rescales and the
combine are powers of two (`reference.decode`), q rounded to f16 at its row's scale
(which leaves it exact in bf16), and for FP8 values P in f16 with the second maximum
(`p_half`: the product then takes f16 operands, e4m3 being exact in f16). Tiles that a mask cuts (the first
tile after `key_start`, the last tile of a sequence, the causal diagonal of Sq > 1)
take the masked path, which also keeps a NaN value away from the rows that cannot see
it; every other tile runs unmasked.
"""

import triton
import triton.language as tl

from fp4attn.kernels.quantize.elements import _e2m1_magnitude, _pow2, _round_bf16

# format codes (the K_FMT / V_FMT constexprs), as `decode_op.FORMAT_CODES`
BF16: tl.constexpr = tl.constexpr(0)
FP8: tl.constexpr = tl.constexpr(1)
NVFP4: tl.constexpr = tl.constexpr(2)
MXFP4: tl.constexpr = tl.constexpr(3)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
P_HALF_SHIFT: tl.constexpr = tl.constexpr(13.0)  # reference.decode.P_HALF_SHIFT
P_HALF_SCALE: tl.constexpr = tl.constexpr(8192.0)  # 2**P_HALF_SHIFT


# ----------------------------------------------------------------------------- dequantization
@triton.jit
def _fp4_asm(u, mult):
    """E2M1 codes, four to a uint16 (nibble k holds code k), and each element's bf16
    multiplier (pre-shifted by 2**126) -> four bf16 tensors, codes 0, 1, 2, 3 of each
    element. Elementwise, two elements an instance (one register of eight codes): codes
    16 bits apart go to one bf16x2 register, by a mask of the nibble pair, one integer
    multiply by 2**a + 2**b (two copies: the magnitude bits at 6-8 and the sign at 15 of
    each half), a mask, and one bf16x2 multiply by the multipliers (the placed bits are
    the value times 2**-126, codes 0.5 as subnormals)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 v, x;
        and.b32 x, $4, 0x000F000F;
        mul.lo.u32 x, x, 0x1040;
        and.b32 x, x, 0x81C081C0;
        mul.rn.bf16x2 $0, x, $5;
        and.b32 x, $4, 0x00F000F0;
        mul.lo.u32 x, x, 0x104;
        and.b32 x, x, 0x81C081C0;
        mul.rn.bf16x2 $1, x, $5;
        shr.b32 v, $4, 8;
        and.b32 x, v, 0x000F000F;
        mul.lo.u32 x, x, 0x1040;
        and.b32 x, x, 0x81C081C0;
        mul.rn.bf16x2 $2, x, $5;
        and.b32 x, v, 0x00F000F0;
        mul.lo.u32 x, x, 0x104;
        and.b32 x, x, 0x81C081C0;
        mul.rn.bf16x2 $3, x, $5;
        }""",
        "=r,=r,=r,=r,r,r", [u, mult], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)


@triton.jit
def _fp8_asm(u):
    """e4m3 bytes, two to a uint16 -> two bf16 tensors, bytes 0 and 1 of each element.
    Elementwise, two elements an instance: bytes 16 bits apart into one bf16x2
    register, exponent and mantissa shifted into bf16's lowest exponent and top
    mantissa bits (the value times 2**-120, e4m3 subnormals as bf16 subnormals), the
    sign to bit 15 of each half, then times 2**120."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u, c;
        mov.b32 c, 0x7B807B80;
        shl.b32 t, $2, 4;
        and.b32 t, t, 0x07F007F0;
        shl.b32 u, $2, 8;
        and.b32 u, u, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 $0, t, c;
        shr.b32 t, $2, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 u, $2, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 $1, t, c;
        }""",
        "=r,=r,r", [u], dtype=(tl.bfloat16,) * 2, is_pure=True, pack=2)


@triton.jit
def _code(u, k: tl.constexpr, mult):
    """E2M1 code k (nibble k) of uint16 elements u (as int32), times mult, float32."""
    c = (u >> (4 * k)) & 15
    mag = _e2m1_magnitude(c & 7)
    return tl.where(c >= 8, -mag, mag) * mult


@triton.jit
def _e4m3_byte(u, k: tl.constexpr):
    """The e4m3 value of byte k of uint16 elements u (as int32), float32."""
    return ((u >> (8 * k)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _cat(a, b, TRANS: tl.constexpr):
    """[a | b] along the head-dim axis (1, or 0 with TRANS) of two (E, rows) / (rows, E)
    tensors, as a join and a permute (the registers stay where they are)."""
    j = tl.join(a, b)  # (.., .., 2)
    if TRANS:
        out = tl.reshape(tl.permute(j, (2, 0, 1)), [2 * a.shape[0], a.shape[1]])
    else:
        out = tl.reshape(tl.permute(j, (0, 2, 1)), [a.shape[0], 2 * a.shape[1]])
    return out


@triton.jit
def _channels(i, FMT: tl.constexpr, D: tl.constexpr):
    """The head-dim channels (lo, hi) of operand column i (0 .. D/2 - 1) of a format's
    two halves, as its dequantization lays them out, with e = i % (D / 4) a uint16
    element of the row and t = i // (D / 4): 4-bit, channels 4e + t (lo) and 4e + 2 + t
    (hi); fp8, 2e + t and D / 2 + 2e + t; bf16, i and D / 2 + i."""
    e = i % (D // 4)
    t = i // (D // 4)
    if FMT >= NVFP4:
        lo = 4 * e + t
        hi = lo + 2
    elif FMT == FP8:
        lo = 2 * e + t
        hi = lo + D // 2
    else:
        lo = i
        hi = i + D // 2
    return lo, hi


@triton.jit
def _load_raw(DATA, BSC, TSC, row0, rows, ok, FMT: tl.constexpr, D: tl.constexpr, TRANS: tl.constexpr,
              MASKED: tl.constexpr):
    """A tile's stored bytes, as they are: (a, b, block scales, token scales), of pool
    rows row0 + rows (row0 a scalar, int64; rows a vector). 4-bit: a the codes as uint16
    (four a element, (rows, D / 4)), b unused; fp8: a and b the two halves of the head
    dim as uint16 (two bytes a element, (rows, D / 4) each); bf16: the two halves'
    values ((rows, D / 2)). TRANS: the token dim last: K as the score product's right
    operand. MASKED: rows where `ok` is False read as zeros (else every row is read)."""
    n: tl.constexpr = rows.shape[0]
    if TRANS:
        r2 = rows[None, :]
        ok2 = ok[None, :]
    else:
        r2 = rows[:, None]
        ok2 = ok[:, None]
    if FMT >= NVFP4:
        BLK: tl.constexpr = 16 if FMT == NVFP4 else 32
        NB: tl.constexpr = D // BLK
        W: tl.constexpr = D // 4  # uint16 elements a row
        cw = tl.arange(0, W)
        cb = tl.arange(0, NB)
        da = DATA.to(tl.pointer_type(tl.uint16)) + row0 * W
        ds = BSC + row0 * NB
        if TRANS:
            offs = r2 * W + cw[:, None]
            soffs = r2 * NB + cb[:, None]
        else:
            offs = r2 * W + cw[None, :]
            soffs = r2 * NB + cb[None, :]
        if MASKED:
            a = tl.load(da + offs, mask=ok2, other=0)
            sb = tl.load(ds + soffs, mask=ok2, other=0)
        else:
            a = tl.load(da + offs)
            sb = tl.load(ds + soffs)
        b = a
    else:
        if FMT == FP8:
            W: tl.constexpr = D // 2  # uint16 elements a row
            da = DATA.to(tl.pointer_type(tl.uint16)) + row0 * W
        else:
            W: tl.constexpr = D
            da = DATA + row0 * D
        cw = tl.arange(0, W // 2)
        if TRANS:
            offs = r2 * W + cw[:, None]
        else:
            offs = r2 * W + cw[None, :]
        if MASKED:
            a = tl.load(da + offs, mask=ok2, other=0)
            b = tl.load(da + offs + W // 2, mask=ok2, other=0)
        else:
            a = tl.load(da + offs)
            b = tl.load(da + offs + W // 2)
        sb = tl.zeros([n], tl.uint8)
    if FMT == FP8 or FMT == NVFP4:
        if MASKED:
            ts = tl.load(TSC + row0 + rows, mask=ok, other=0.0)
        else:
            ts = tl.load(TSC + row0 + rows)
    else:
        ts = tl.full([n], 1.0, tl.float32)
    return a, b, sb, ts


@triton.jit
def _operands(a, b, sb, ts, FMT: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr, OP: tl.constexpr,
              TRANS: tl.constexpr):
    """(lo, hi, factor): the tile's two operand halves ((rows, D / 2), or (D / 2, rows)
    with TRANS) in the operand dtype OP (bf16 on the GPU; float32 under the
    interpreter, whose bf16 dot is wrong), exact block values scaled as the module
    docstring's table says, and each token's float32 factor."""
    if FMT == BF16:
        lo = a.to(OP)
        hi = b.to(OP)
        fac = ts
    elif FMT == FP8:
        if ASM:
            a0, a1 = _fp8_asm(a)
            b0, b1 = _fp8_asm(b)
        else:
            ai = a.to(tl.int32)
            bi = b.to(tl.int32)
            a0, a1 = _e4m3_byte(ai, 0), _e4m3_byte(ai, 1)
            b0, b1 = _e4m3_byte(bi, 0), _e4m3_byte(bi, 1)
        lo = _cat(a0, a1, TRANS).to(OP)
        hi = _cat(b0, b1, TRANS).to(OP)
        fac = ts
    else:
        BAXIS: tl.constexpr = 0 if TRANS else 1  # the blocks' axis of the scales
        EPB: tl.constexpr = (16 if FMT == NVFP4 else 32) // 4  # uint16 elements a block
        if FMT == NVFP4:
            # block multiplier e4m3 x 2**-7 (exact), factor S_dec x 2**7
            mult = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 0.0078125
            fac = ts * 128.0
        else:
            e = sb.to(tl.int32)  # biased E8M0 exponents, 255 the NaN scale
            nan = e == 255
            e_tok = tl.max(tl.where(nan, 0, e), axis=BAXIS)
            field = tl.maximum(e - tl.expand_dims(e_tok, BAXIS) + 127, 0)  # 2**(e - e_tok) as float32 bits
            mult = tl.where(nan, float("nan"), (field << 23).to(tl.float32, bitcast=True))
            fac = _pow2(e_tok - 127)
        # each element's multiplier: the block's, broadcast over its EPB elements
        if TRANS:
            m = tl.reshape(tl.broadcast_to(mult[:, None, :], [mult.shape[0], EPB, mult.shape[1]]), a.shape)
        else:
            m = tl.reshape(tl.broadcast_to(mult[:, :, None], [mult.shape[0], mult.shape[1], EPB]), a.shape)
        if ASM:
            c0, c1, c2, c3 = _fp4_asm(a, (m * 8.507059173023462e37).to(tl.bfloat16))  # x 2**126
        else:
            ai = a.to(tl.int32)
            c0, c1, c2, c3 = _code(ai, 0, m), _code(ai, 1, m), _code(ai, 2, m), _code(ai, 3, m)
        lo = _cat(c0, c1, TRANS).to(OP)
        hi = _cat(c2, c3, TRANS).to(OP)
    return lo, hi, fac


@triton.jit
def _rows_of(TABLE, b, h, j, ok, HKV, PS, TABLE_STRIDE):
    """Row indices (int64) of tokens j of (sequence b, KV head h) in the (pages, HKV, PS)
    pool, through the block table (a page lookup per token)."""
    page = tl.load(TABLE + b * TABLE_STRIDE + j // PS, mask=ok, other=0)
    return (page.to(tl.int64) * HKV + h) * PS + (j % PS)


@triton.jit
def _tile_rows(TABLE, b, h, t0, ok, HKV, PS, TABLE_STRIDE, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """(row0, rows): the pool rows row0 + rows of tile [t0, t0 + BLOCK_N). ALIGNED (the
    page size a multiple of BLOCK_N, tiles aligned to it): the tile lies in one page,
    so one lookup gives a scalar row0 and rows is 0 .. BLOCK_N - 1 (the loads' offsets
    stay the same from tile to tile); else a lookup per token."""
    if ALIGNED:
        page = tl.load(TABLE + b * TABLE_STRIDE + t0 // PS)
        row0 = (page.to(tl.int64) * HKV + h) * PS + t0 % PS
        rows = tl.arange(0, BLOCK_N)
    else:
        row0 = 0
        rows = _rows_of(TABLE, b, h, t0 + tl.arange(0, BLOCK_N), ok, HKV, PS, TABLE_STRIDE)
    return row0, rows


@triton.jit
def _bf16_round(x, HW: tl.constexpr, OP: tl.constexpr):
    """float32 x rounded to bf16 (nearest even) in the operand dtype."""
    if HW:
        return x.to(tl.bfloat16)
    return _round_bf16(x).to(OP)


@triton.jit
def _field(x):
    """The float32 exponent field of x."""
    return (x.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _half_queries(q_lo, q_hi):
    """q rounded to f16 at its row's power-of-two scale and scaled back
    (`reference.decode.half_queries`), float32."""
    amax = tl.maximum(tl.max(tl.abs(q_lo), axis=1), tl.max(tl.abs(q_hi), axis=1))
    e = tl.minimum(tl.maximum(141 - _field(amax), -126), 100)
    up, down = _pow2(e)[:, None], _pow2(-e)[:, None]
    return ((q_lo * up).to(tl.float16).to(tl.float32) * down,
            (q_hi * up).to(tl.float16).to(tl.float32) * down)


@triton.jit
def _split_scales(vs):
    """(E, mu), vs = mu * 2**E (`reference.decode.split_scales`)."""
    f = _field(vs)
    normal = (f > 0) & (f < 255)
    keep = -2139095041  # 0x807FFFFF: sign and mantissa
    mant = ((vs.to(tl.int32, bitcast=True) & keep) | 0x3F800000).to(tl.float32, bitcast=True)
    return tl.where(normal, f - 127, 0).to(tl.float32), tl.where(normal, mant, vs)


# ----------------------------------------------------------------------------- one tile
@triton.jit
def _tile(acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, t0, KA, KS, KT, VA, VS, VT,
          TABLE, b, h, L, start, seq_row, qk_scale, HKV, PS, TABLE_STRIDE,
          K_FMT: tl.constexpr, V_FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
          SQ, CAUSAL: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr, HW: tl.constexpr,
          OP: tl.constexpr, ALIGNED: tl.constexpr):
    """One key tile [t0, t0 + BLOCK_N) through the online softmax; the bytes are loaded
    here (the masked path: a tile or two per split)."""
    j = t0 + tl.arange(0, BLOCK_N)
    ok = j < L
    row0, rows = _tile_rows(TABLE, b, h, t0, ok, HKV, PS, TABLE_STRIDE, BLOCK_N, ALIGNED)
    ka, kb, ksb, kts = _load_raw(KA, KS, KT, row0, rows, ok, K_FMT, D, True, True)
    va, vb, vsb, vts = _load_raw(VA, VS, VT, row0, rows, ok, V_FMT, D, False, True)
    return _tile_math(acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, j, ka, kb, ksb, kts, va, vb, vsb, vts,
                      L, start, seq_row, qk_scale, K_FMT, V_FMT, D, SQ, CAUSAL, MASKED, ASM, HW, OP)


@triton.jit
def _tile_math(acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, j, ka, kb, ksb, kts, va, vb, vsb, vts,
               L, start, seq_row, qk_scale, K_FMT: tl.constexpr, V_FMT: tl.constexpr, D: tl.constexpr, SQ,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr, HW: tl.constexpr,
               OP: tl.constexpr):
    """The arithmetic of one tile whose bytes are in registers. big_m: the second running
    maximum of FP8 values' f16 P (`reference.decode`, p_half), unused otherwise."""
    k_lo, k_hi, kfac = _operands(ka, kb, ksb, kts, K_FMT, D, ASM, OP, True)
    # -- scores, log2 units --------------------------------------------------------
    s = tl.dot(q_lo, k_lo, input_precision="ieee")
    s = tl.dot(q_hi, k_hi, s, input_precision="ieee")
    t = s * (kfac * qk_scale)[None, :]
    if MASKED:
        vis = (j < L)[None, :] & (j >= start)[None, :]
        if CAUSAL:
            vis = vis & (j[None, :] <= (L - SQ + seq_row)[:, None])
        t = tl.where(vis, t, float("-inf"))
    v_lo, v_hi, vfac = _operands(va, vb, vsb, vts, V_FMT, D, ASM, OP, False)
    if MASKED:
        # a value no row may see must not reach the product as 0 * NaN: cleaned, and its
        # NaNs counted into exactly the (row, channel) entries that can see it
        fnan = vfac != vfac
        vfac = tl.where(fnan, 0.0, vfac)
        bad_lo = (v_lo != v_lo) | fnan[:, None]
        bad_hi = (v_hi != v_hi) | fnan[:, None]
        v_lo = tl.where(bad_lo, 0.0, v_lo)
        v_hi = tl.where(bad_hi, 0.0, v_hi)
    # -- online softmax, integer maximum ---------------------------------------------
    m_new = tl.maximum(m_i, tl.math.ceil(tl.max(t, axis=1)))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    P_HALF: tl.constexpr = V_FMT == FP8
    if P_HALF:
        e_tok, mu = _split_scales(vfac)
        u = t + e_tok[None, :]
        big_new = tl.maximum(big_m, tl.math.ceil(tl.max(u, axis=1)))
        big_use = tl.where(big_new == float("-inf"), 0.0, big_new)
        grew = (m_new > m_i) | (big_new > big_m)
    else:
        big_new = big_m
        grew = m_new > m_i
    # the running sums are rescaled only when some row's (integer) maximum grew, which
    # after the first tiles is rare: the multiply by 2**(m_old - m_new) is skipped
    if tl.max(grew.to(tl.int32), axis=0) > 0:
        l_i = l_i * tl.math.exp2(m_i - m_use)
        if P_HALF:
            beta = tl.math.exp2(big_m - big_use)
        else:
            beta = tl.math.exp2(m_i - m_use)
        acc_lo = acc_lo * beta[:, None]
        acc_hi = acc_hi * beta[:, None]
    p = tl.math.exp2(t - m_use[:, None])
    l_i = l_i + tl.sum(p, axis=1)
    if P_HALF:
        # f16 P (11 bits) times f16 values (e4m3 is exact in f16)
        x = tl.math.exp2(u - big_use[:, None]) * (mu * P_HALF_SCALE)[None, :]
        if HW:
            pv = x.to(tl.float16)
            v_lo = v_lo.to(tl.float16)
            v_hi = v_hi.to(tl.float16)
        else:
            pv = x.to(tl.float16).to(tl.float32)
    else:
        pv = _bf16_round(p * vfac[None, :], HW, OP)
    acc_lo = tl.dot(pv, v_lo, acc_lo, input_precision="ieee")
    acc_hi = tl.dot(pv, v_hi, acc_hi, input_precision="ieee")
    if MASKED:
        # the NaNs this tile's visible values hold, into the rows and channels that read
        # them (NaN stays NaN through every later rescale and sum)
        vis_op = vis.to(OP)
        acc_lo = tl.where(tl.dot(vis_op, bad_lo.to(OP), input_precision="ieee") > 0, float("nan"), acc_lo)
        acc_hi = tl.where(tl.dot(vis_op, bad_hi.to(OP), input_precision="ieee") > 0, float("nan"), acc_hi)
    return acc_lo, acc_hi, m_new, l_i, big_new


# ----------------------------------------------------------------------------- split kernel
@triton.jit
def decode_split_kernel(
    Q, KA, KS, KT, VA, VS, VT, TABLE, LENS, START, O_ACC, O_ML,
    stride_qb, stride_qh, stride_qs, HKV, PS, TABLE_STRIDE, SQ, ROWS, SPLIT_TOKENS, qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_START: tl.constexpr,
    ASM: tl.constexpr, HW: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Partial attention of one split of keys: grid (splits, B * HKV, row blocks).

    Q (B, HKV * GROUP, SQ, D) bf16 (strides given; the last is 1). K and V: the pool
    tensors of their formats (`reference.kvcache`), (pages, HKV, PS, ...) contiguous:
    KA codes or values, KS block scales, KT token scales (V likewise). TABLE (B,
    TABLE_STRIDE) int32 block table; LENS (B,) int32 lengths; START (B,) the first
    visible key (HAS_START). ROWS = GROUP * SQ query rows of the (sequence, KV head),
    BLOCK_M a program (row = g * SQ + r: query head h * GROUP + g, new token r).
    Writes the unnormalized output O_ACC (splits, B, HKV * GROUP, SQ, D) float32 and
    the running (max, sum) O_ML (splits, B, HKV * GROUP, SQ, 2); a split past the
    sequence's end writes max -inf and sum 0."""
    OP: tl.constexpr = tl.bfloat16 if HW else tl.float32
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    row = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row < ROWS
    g = row // SQ
    seq_row = row % SQ
    hq = h * GROUP + g
    L = tl.load(LENS + b)
    start = 0
    if HAS_START:
        start = tl.load(START + b).to(tl.int32)
    # -- queries, read in each format's channel order --------------------------------------
    i = tl.arange(0, D // 2)
    q_base = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh + seq_row.to(tl.int64) * stride_qs
    c_lo, c_hi = _channels(i, K_FMT, D)
    q_lo = tl.load(q_base[:, None] + c_lo[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_base[:, None] + c_hi[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    # an Inf query is NaN (as the reference): a -inf score would silently mask a key
    q_lo = tl.where(tl.abs(q_lo) == float("inf"), float("nan"), q_lo)
    q_hi = tl.where(tl.abs(q_hi) == float("inf"), float("nan"), q_hi)
    q_lo, q_hi = _half_queries(q_lo, q_hi)
    q_lo = q_lo.to(OP)
    q_hi = q_hi.to(OP)
    # -- this split's keys: masked tiles first and last, unmasked between ----------------
    lo = split * SPLIT_TOKENS
    hi = tl.minimum(lo + SPLIT_TOKENS, L)
    if HAS_START:
        lo = tl.maximum(lo, (start // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(lo, tl.cdiv(start, BLOCK_N) * BLOCK_N)
    else:
        full_lo = lo
    if CAUSAL:
        all_see = L - SQ + 1  # keys below it are visible to every row
    else:
        all_see = L
    full_hi = tl.maximum(full_lo, tl.minimum(hi, (all_see // BLOCK_N) * BLOCK_N))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc_lo = tl.zeros([BLOCK_M, D // 2], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, D // 2], tl.float32)
    for t0 in range(lo, tl.minimum(full_lo, hi), BLOCK_N):
        acc_lo, acc_hi, m_i, l_i, big_m = _tile(
            acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, t0, KA, KS, KT, VA, VS, VT, TABLE, b, h, L,
            start, seq_row, qk_scale, HKV, PS, TABLE_STRIDE, K_FMT, V_FMT, D, BLOCK_N, SQ, CAUSAL, True, ASM, HW, OP,
            ALIGNED)
    # unmasked tiles (Triton's pipeliner issues the next tiles' loads ahead, `num_stages`)
    every = tl.full([BLOCK_N], 1, tl.int1)
    for t0 in range(full_lo, full_hi, BLOCK_N):
        row0, rows = _tile_rows(TABLE, b, h, t0, every, HKV, PS, TABLE_STRIDE, BLOCK_N, ALIGNED)
        ka, kb, ksb, kts = _load_raw(KA, KS, KT, row0, rows, every, K_FMT, D, True, False)
        va, vb, vsb, vts = _load_raw(VA, VS, VT, row0, rows, every, V_FMT, D, False, False)
        acc_lo, acc_hi, m_i, l_i, big_m = _tile_math(
            acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, t0 + tl.arange(0, BLOCK_N), ka, kb, ksb, kts,
            va, vb, vsb, vts, L, start, seq_row, qk_scale, K_FMT, V_FMT, D, SQ, CAUSAL, False, ASM, HW, OP)
    for t0 in range(tl.maximum(full_hi, tl.minimum(full_lo, hi)), hi, BLOCK_N):
        acc_lo, acc_hi, m_i, l_i, big_m = _tile(
            acc_lo, acc_hi, m_i, l_i, big_m, q_lo, q_hi, t0, KA, KS, KT, VA, VS, VT, TABLE, b, h, L,
            start, seq_row, qk_scale, HKV, PS, TABLE_STRIDE, K_FMT, V_FMT, D, BLOCK_N, SQ, CAUSAL, True, ASM, HW, OP,
            ALIGNED)
    # a row whose visible keys all scored NaN has l NaN but, as the GPU's max ignores NaN,
    # a running maximum of -inf, which the combine would read as "saw no key" (0): NaN
    m_i = tl.where(l_i != l_i, float("nan"), m_i)
    if V_FMT == FP8:
        # f16 P's frame (2**(big_m - P_HALF_SHIFT) a unit) into the combine's (2**m_i): a power of two
        seen = m_i != float("-inf")
        to_m = tl.math.exp2(tl.where(seen, big_m - P_HALF_SHIFT - m_i, 0.0))
        acc_lo = acc_lo * to_m[:, None]
        acc_hi = acc_hi * to_m[:, None]
    # -- partial results ----------------------------------------------------------------
    n_b = tl.num_programs(1) // HKV
    hq_all = HKV * GROUP
    prow = ((split.to(tl.int64) * n_b + b) * hq_all + hq) * SQ + seq_row  # (split, b, hq, r)
    v_lo, v_hi = _channels(i, V_FMT, D)
    tl.store(O_ACC + prow[:, None] * D + v_lo[None, :], acc_lo, mask=row_ok[:, None])
    tl.store(O_ACC + prow[:, None] * D + v_hi[None, :], acc_hi, mask=row_ok[:, None])
    tl.store(O_ML + prow * 2, m_i, mask=row_ok)
    tl.store(O_ML + prow * 2 + 1, l_i, mask=row_ok)


# ----------------------------------------------------------------------------- combine
@triton.jit
def decode_combine_kernel(O_ACC, O_ML, OUT, LSE, N_ROWS, SPLITS, D: tl.constexpr, SPLITS_P2: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """out = sum_s 2**(m_s - M) acc_s / sum_s 2**(m_s - M) l_s for each of N_ROWS rows
    (B * Hq * Sq, the partials' row order), M the largest m_s: every weight a power of
    two (integer maxima). A row no split saw is 0 with LSE -inf; a NaN anywhere stays."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = r < N_ROWS
    s = tl.arange(0, SPLITS_P2)
    sok = s < SPLITS
    ml = (s[None, :].to(tl.int64) * N_ROWS + r[:, None]) * 2
    m = tl.load(O_ML + ml, mask=rok[:, None] & sok[None, :], other=float("-inf"))
    l = tl.load(O_ML + ml + 1, mask=rok[:, None] & sok[None, :], other=0.0)
    big = tl.max(m, axis=1)
    big = tl.where(tl.max((m != m).to(tl.int32), axis=1) > 0, float("nan"), big)
    seen = big != float("-inf")
    m_use = tl.where(seen, big, 0.0)
    w = tl.math.exp2(m - m_use[:, None])
    l_tot = tl.sum(w * l, axis=1)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for k in range(SPLITS):
        a = tl.load(O_ACC + ((k * N_ROWS + r[:, None]).to(tl.int64)) * D + d[None, :], mask=rok[:, None], other=0.0)
        wk = tl.sum(tl.where(s[None, :] == k, w, 0.0), axis=1)
        acc += a * wk[:, None]
    safe_l = tl.where(seen, l_tot, 1.0)
    out = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
    tl.store(OUT + r[:, None].to(tl.int64) * D + d[None, :], out.to(OUT.dtype.element_ty), mask=rok[:, None])
    tl.store(LSE + r, tl.where(seen, (big + tl.log2(safe_l)) * 0.6931471805599453, float("-inf")), mask=rok)
