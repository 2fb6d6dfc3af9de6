// The P builders of the Hopper CUDA forward (kernel_fwd.cuh) and the row statistics they
// start from: each score of the QK^T accumulator to its P code, packed as the PV product's
// A fragment (keys 32cc + 16 half + 4q + (0..3) of each word: the permuted K rows of
// kernel_fwd.cuh). softmax_fwd.cuh composes them into the online softmax's tile step.
//
// exp2 FP8 P: P = e4m3(exp2(fma(w, a_row, 8 - m))), exp2 by MUFU or, for EXP_POLY of the
// 16 column groups, by a polynomial on the FMA units (ex2_poly).
//
// Affine FP8 P (AFFINE_P): FP8 P by the affine map of reference/affine.py, no exp2: the
// row's reference point m~ is the max snapped to the map's grid, C = (K - 8 m~) + MAGIC an
// integer in float32 (MAGIC = 1.5 * 2**23, where the ulp is 1), and each score's e4m3 byte
// is the low byte of max.NaN(fma(w, 8 a_row, C), MAGIC): one FMA, one max, and three PRMTs
// per four bytes.
//
// Affine MXFP4 P (AFFINE_MX): MXFP4 P by the affine map of reference/affine.py (P mode 5),
// the same per-score work with a 16-entry lookup in place of the byte: per 32-key block
// (a thread's 8 scores of a row and its quad's) the block maximum, its exponent e_b by one
// round-down addition, and two registers holding the e4m3 bytes of the block's 8 E2M1
// values times 2**(e_b + 8) (normal bytes are 4 c + 8 (e_b + 14): one multiply-add each).
// Each score's code comes out of one FMA as MAGIC + (8 - code) (the map negated: its
// rounding is symmetric, so the integer is 8 - RNE(2 t + C) exactly), one integer
// subtraction leaves 8 - code, and cvt.pack.sat.u4 packs four of them into PRMT's
// selector nibbles, clamped to 0..15: nibbles 0..7 are codes 8 (the map's one overshoot,
// which the clamp takes to 7) down to 1, and 8..15 (codes 0 and below) select PRMT's
// sign-replicate of a byte below 0x80, so 0. A NaN score makes its row's maximum, and so
// the row, NaN (maxima with NaN propagation), as the reference defines.
// MX_SUBNORMAL (K scaled per key, no key bias; the kernel's translation unit defines it):
// the producer stores K's scales times 2**-100 (MX_KS_SCALE), so each score w' = w 2**-100
// is still a normal float (for |w| > 2**-26) and the FMA w' (-2 f 2**-48) + d' lands in the
// subnormals, where the ulp is 2**-149 and the result's bits are the integer 8 - code
// itself: no subtraction (d' = (d - MAGIC) 2**-149, exact; the maxima take f 2**100, so
// every value the reference defines is unchanged).
#pragma once
#include "kernel_traits_fwd.cuh"
#include "ptx.cuh"

#define MX_KS_SCALE 7.888609052210118e-31f  // 2**-100: MX_SUBNORMAL's K scales

// exp2 on the FMA units (EXP_POLY, FlashAttention-4's trick), for x <= 8.5: x = j + f with
// j = rint(x) (the 1.5 * 2**23 addition) and f in [-0.5, 0.5], 2**f by a degree-3 minimax
// polynomial (relative error 7.5e-5), j added to the exponent bits; x below -125 gives
// 2**-125 (e4m3 rounds it to 0, as exp2 of -inf), a NaN stays NaN. About 4 in 10,000 P
// codes differ from MUFU's (numpy, x uniform in [-12, 8]; measured 99.986% on the H200).
__device__ __forceinline__ float ex2_poly(float x) {
    const float xc = x < -125.0f ? -125.0f : x;
    const float j = fadd_rn(xc, 12582912.0f);
    const float f = fadd_rn(xc, -fadd_rn(j, -12582912.0f));
    float p = __fmaf_rn(0.055186375975608826f, f, 0.24261236190795898f);
    p = __fmaf_rn(p, f, 0.6932582855224609f);
    p = __fmaf_rn(p, f, 0.9999279379844666f);
    const float y = __uint_as_float(__float_as_uint(p) + (__float_as_uint(j) << 23));
    return x != x ? x : y;
}

// The affine map's e4m3 bytes of two scores w (the low one first, in the low two bytes of
// the word): fma(w, f, c) = fl(8 t + C), each clamped at MAGIC by a NaN-propagating max (byte 0 below the map's
// range and for masked keys; a NaN score keeps the canonical NaN 0x7FFFFFFF, whose low
// byte 0xFF is e4m3 NaN), then the low bytes gathered by PRMT; two such words make the
// A fragment's four keys by one more PRMT (three per four scores).
#define AFFINE_MAGIC 12582912.0f  // 1.5 * 2**23 (reference/affine.MAGIC)
#define AFFINE_K 119.5f           // reference/affine.K_FP8
__device__ __forceinline__ uint32_t affine_e4m3x2(float s0, float s1, float f, float c) {
    uint32_t r;
    asm("{ .reg .b32 a, b;\n"
        "fma.rn.f32 a, %1, %3, %4;\n"
        "fma.rn.f32 b, %2, %3, %4;\n"
        "max.NaN.f32 a, a, 0f4B400000;\n"
        "max.NaN.f32 b, b, 0f4B400000;\n"
        "prmt.b32 %0, a, b, 0x0040; }"
        : "=r"(r) : "f"(s0), "f"(s1), "f"(f), "f"(c));
    return r;
}

#define AFFINE_K_LAZY 95.5f           // reference/affine.K_FP8_LAZY
#define AFFINE_TOP_BITS (0x4B400000u + 126u)  // MAGIC + 126 as an integer: the largest byte that fits
// LAZY_RESCALE: a warp speculates (bytes before the maximum) once this many tiles passed
// without a move; a cost model of the move patterns of Gaussian and 2.5x-sharper logits
// put 4 within 0.5% of always speculating on the first and 2% of exact rescaling on the
// second (docs/notes/affine-p.md)
#define LAZY_QUIET_TILES 4
// affine_e4m3x2 keeping the largest of the two clamped values in `top` (as unsigned integers)
__device__ __forceinline__ uint32_t affine_e4m3x2_top(float s0, float s1, float f, float c, uint32_t& top) {
    uint32_t r;
    asm("{ .reg .b32 a, b;\n"
        "fma.rn.f32 a, %2, %4, %5;\n"
        "fma.rn.f32 b, %3, %4, %5;\n"
        "max.NaN.f32 a, a, 0f4B400000;\n"
        "max.NaN.f32 b, b, 0f4B400000;\n"
        "max.u32 %1, %1, a;\n"
        "max.u32 %1, %1, b;\n"
        "prmt.b32 %0, a, b, 0x0040; }"
        : "=r"(r), "+r"(top) : "f"(s0), "f"(s1), "f"(f), "f"(c));
    return r;
}

// Keys past limit[i] (past Sk, and past row + causal_offset under a causal mask) hidden:
// registers s[4n + 2i + b] hold key `key` + b of rows i = 0, 1.
__device__ __forceinline__ void mask_keys(float (&s)[64], int n, int key, const int (&limit)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (key > limit[i]) s[4 * n + 2 * i] = -__int_as_float(0x7f800000);
        if (key + 1 > limit[i]) s[4 * n + 2 * i + 1] = -__int_as_float(0x7f800000);
    }
}

// The tile's scores in place (FlashAttention-3's per-score work): w = s * b_key, one rounded
// product (K scaled per key tile: no product, the tile's scale in the row factor; a key
// bias: t = fma(w, a, bias), and the row factor 1), keys past each row's limit hidden
// (MASKED); f: each row's factor, applied once per row to the maximum and folded into the
// FMA that builds P.
template <bool MASKED>
__device__ __forceinline__ void scale_scores(float (&s)[64], float (&f)[2], const float (&a)[2], uint32_t ks_tile,
                                             int key0, const int (&limit)[2], int q) {
#if KEY_TILE_SCALE
    // one K scale for the whole tile (key 0's: every key of a visited tile holds it), in the
    // rows' factors: t = s * (a * b_tile), the key's product gone from every score
    const float kb_tile = lds_f2(ks_tile).x;
    const float ak[2] = {fmul_rn(a[0], kb_tile), fmul_rn(a[1], kb_tile)};
#endif
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int kk = 16 * (n & 7) + 4 * q + 2 * (n >> 3);
#if KEY_TILE_SCALE && KEY_BIAS
        const float2 bb = lds_f2(ks_tile + 4 * (STAGES * BLOCK_N + kk));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            s[4 * n + 2 * i] = fmaf(s[4 * n + 2 * i], ak[i], bb.x);
            s[4 * n + 2 * i + 1] = fmaf(s[4 * n + 2 * i + 1], ak[i], bb.y);
        }
#elif KEY_TILE_SCALE
#elif KEY_BIAS
        const float2 kb = lds_f2(ks_tile + 4 * kk);
        const float2 bb = lds_f2(ks_tile + 4 * (STAGES * BLOCK_N + kk));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            s[4 * n + 2 * i] = fmaf(fmul_rn(s[4 * n + 2 * i], kb.x), a[i], bb.x);
            s[4 * n + 2 * i + 1] = fmaf(fmul_rn(s[4 * n + 2 * i + 1], kb.y), a[i], bb.y);
        }
#else
        const float2 kb = lds_f2(ks_tile + 4 * kk);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            s[4 * n + 2 * i] = fmul_rn(s[4 * n + 2 * i], kb.x);
            s[4 * n + 2 * i + 1] = fmul_rn(s[4 * n + 2 * i + 1], kb.y);
        }
#endif
        if (MASKED) mask_keys(s, n, key0 + kk, limit);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#if KEY_TILE_SCALE
        f[i] = KEY_BIAS ? 1.0f : ak[i];
#else
        f[i] = KEY_BIAS ? 1.0f : a[i];
#endif
    }
}

// The largest of the 32 scores this thread holds of row i: a tree, not a chain of 32
// dependent maxima (the quad's other threads hold the row's other keys).
__device__ __forceinline__ float thread_row_max(const float (&s)[64], int i) {
    float mx[8];
#pragma unroll
    for (int n = 0; n < 8; ++n)
        mx[n] = fmaxf(fmaxf(s[4 * n + 2 * i], s[4 * n + 2 * i + 1]),
                      fmaxf(s[4 * (n + 8) + 2 * i], s[4 * (n + 8) + 2 * i + 1]));
#pragma unroll
    for (int w = 4; w > 0; w /= 2)
#pragma unroll
        for (int n = 0; n < w; ++n) mx[n] = fmaxf(mx[n], mx[n + w]);
    return mx[0];
}

// The row i's maximum of w over the quad's four threads (the row's 128 keys).
__device__ __forceinline__ float quad_row_max(const float (&s)[64], int i) {
    const float tmax = thread_row_max(s, i);
    const float wmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    return fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, 2));
}

// AFFINE_P: a row's point moved to its snapped running maximum (reference/affine.snap_max
// with offset K): C = (K - 8 m) + MAGIC, rounded twice (an integer plus MAGIC), m~ =
// (K - (C - MAGIC)) / 8; alpha rescales what the row holds, and later tiles are measured
// from m~ (a row that saw no key stays at -inf).
__device__ __forceinline__ void affine_move_point(float row_max, float k, float& m, float& c, float& alpha) {
    const float m_use = row_max == -__int_as_float(0x7f800000) ? 0.0f : row_max;
    c = fadd_rn(fmaf(m_use, -8.0f, k), AFFINE_MAGIC);
    const float m_ref = fmul_rn(fadd_rn(k, -fadd_rn(c, -AFFINE_MAGIC)), 0.125f);
    alpha = ex2(m - m_ref);
    m = row_max == -__int_as_float(0x7f800000) ? row_max : m_ref;
}

// AFFINE_P: the tile's bytes as the PV product's A fragments, keys 32cc + 16 half + 4q +
// (0..3) of each word, from the rows' factors f8 and constants c; TOP: each thread's largest
// clamped value per row in top (LAZY_RESCALE's test)
template <bool TOP>
__device__ __forceinline__ void affine_tile(const float (&s)[64], uint32_t (&pa)[4][4], const float (&f8)[2],
                                            const float (&c)[2], uint32_t (&top)[2]) {
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int n_lo = 2 * cc + half, n_hi = n_lo + 8;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float *lo_s = &s[4 * n_lo + 2 * i], *hi_s = &s[4 * n_hi + 2 * i];
                const uint32_t lo = TOP ? affine_e4m3x2_top(lo_s[0], lo_s[1], f8[i], c[i], top[i])
                                        : affine_e4m3x2(lo_s[0], lo_s[1], f8[i], c[i]);
                const uint32_t hi = TOP ? affine_e4m3x2_top(hi_s[0], hi_s[1], f8[i], c[i], top[i])
                                        : affine_e4m3x2(hi_s[0], hi_s[1], f8[i], c[i]);
                pa[cc][2 * half + i] = prmt_lo_halves(lo, hi);
            }
        }
    }
}

// -------------------------------------------------------------------- AFFINE_MX

// The largest w of row i in MX block cc (keys 32cc .. 32cc + 31: this thread's registers
// n = 2cc, 2cc + 1, 2cc + 8, 2cc + 9, the quad's other threads the rest), NaN if any is.
__device__ __forceinline__ float quad_block_max(const float (&s)[64], int i, int cc) {
    const int n0 = 2 * cc, n1 = n0 + 1, n2 = n0 + 8, n3 = n0 + 9;
    const float x = fmax_nan(fmax_nan(s[4 * n0 + 2 * i], s[4 * n0 + 2 * i + 1]),
                             fmax_nan(s[4 * n1 + 2 * i], s[4 * n1 + 2 * i + 1]));
    const float y = fmax_nan(fmax_nan(s[4 * n2 + 2 * i], s[4 * n2 + 2 * i + 1]),
                             fmax_nan(s[4 * n3 + 2 * i], s[4 * n3 + 2 * i + 1]));
    float mx = fmax_nan(x, y);
    mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

// A row's point moved to its snapped running maximum (reference/affine.snap_max for MXFP4:
// m~ = ceil(2 m) / 2; a row that saw no key stays at -inf, measured from 0)
__device__ __forceinline__ float affine_mx_move_point(float row_max, float& m, float& alpha) {
    const float m_use = row_max == -__int_as_float(0x7f800000) ? 0.0f : row_max;
    const float m_ref = ceilf(2.0f * m_use) * 0.5f;
    alpha = ex2(m - m_ref);
    m = row_max == -__int_as_float(0x7f800000) ? row_max : m_ref;
    return m_ref;
}

// One block of a row: from its largest w (times the row factor f, from the point m~) the
// block's exponent e_b = floor(max t - m~) - 2 (reference/affine.affine_mxfp4_codes), the
// FMA addend d = MAGIC + 8 - c of the negated map, and the lookup (ta: the bytes of codes
// 7, 7, 6, 5; tb: of 4, 3, 2, 1). Blocks below P_EMIN or dead (every key hidden) get an
// all-zero lookup, a NaN block an all-NaN one. Bit for bit the reference's codes while
// the row's point is below 2**21 log2 units (reference/affine.py's range for its float32
// definitions): d is formed from m~ and floor(xmax) in an order of its own, which beyond
// it rounds where the reference's C does not.
__device__ __forceinline__ void affine_mx_block(float bmax_w, float f, float m_ref, float rrow, float& d,
                                                uint32_t& ta, uint32_t& tb) {
    const float xmax = fadd_rn(fmul_rn(bmax_w, f), -m_ref);  // fl(max t - m~), as the reference
    const float fl = fadd_rm(xmax, AFFINE_MAGIC);  // MAGIC + floor(xmax), exactly
#if MX_SUBNORMAL
    // (2 + 2 m~ + 2 floor(xmax)) 2**-149: rrow is (2 + 2 m~) 2**-149, exact subnormal sums
    asm("{ .reg .f32 e;\n"
        "add.f32 e, %1, 0fCB400000;\n"
        "fma.rn.f32 %0, e, 0f00000002, %2; }" : "=f"(d) : "f"(fl), "f"(rrow));
#else
    d = fmaf(fl, 2.0f, rrow);  // MAGIC + 2 + 2 m~ + 2 floor(xmax): integers, exact
#endif
    if (fl >= AFFINE_MAGIC - 11.0f) {
        // e_b >= -13: every code's byte is normal, 4 c + K (code 1: K) with K = 8 (e_b + 14)
        const uint32_t k = 8u * (__float_as_uint(fl) - 0x4B400000u + 12u);
        ta = k * 0x01010101u + 0x14181C1Cu;
        tb = k * 0x01010101u + 0x00080C10u;
    } else if (fl >= AFFINE_MAGIC - 14.0f) {
        // e_b in -16 .. -14 (blocks 2**-11 below the row's point and lower): the small
        // codes' bytes are e4m3 subnormals, rounded exactly by the conversion
        const int e8 = (int)__float_as_uint(fl) - 0x4B400000 + 6;  // e_b + 8
        const float u = __int_as_float((e8 + 127) << 23);
        ta = e4m3x2(6.0f * u, 6.0f * u) | (e4m3x2(4.0f * u, 3.0f * u) << 16);
        tb = e4m3x2(2.0f * u, 1.5f * u) | (e4m3x2(u, 0.5f * u) << 16);
    } else {
        // dead blocks (every key hidden: xmax = -inf) and blocks below P_EMIN hold no code;
        // a NaN xmax (a +inf score: inf - inf; or a NaN one) makes every byte e4m3 NaN
        // (0xFF, whose sign bit the selector's nibbles 8..15 replicate too), so the row is NaN
        // as the reference's is
        ta = tb = fl != fl ? 0xFFFFFFFFu : 0u;
    }
}

// Four scores' bytes of the A fragment (keys in the order of affine_tile's words): each
// 8 - code from one FMA and a subtraction, four packed as PRMT's selector, clamped by the
// packing's saturation (the header says why nibbles 0..15 are all the cases)
__device__ __forceinline__ uint32_t affine_mx_word(float s0, float s1, float s2, float s3, float fneg2, float d,
                                                   uint32_t ta, uint32_t tb) {
    uint32_t r;
    asm("{ .reg .b32 a, b, c, e, w;\n"
        "fma.rn.f32 a, %1, %5, %6;\n"
        "fma.rn.f32 b, %2, %5, %6;\n"
        "fma.rn.f32 c, %3, %5, %6;\n"
        "fma.rn.f32 e, %4, %5, %6;\n"
#if !MX_SUBNORMAL
        "sub.s32 a, a, 0x4B400000;\n"
        "sub.s32 b, b, 0x4B400000;\n"
        "sub.s32 c, c, 0x4B400000;\n"
        "sub.s32 e, e, 0x4B400000;\n"
#endif
        "cvt.pack.sat.u4.s32.b32 w, e, c, 0;\n"
        "cvt.pack.sat.u4.s32.b32 w, b, a, w;\n"
        "prmt.b32 %0, %7, %8, w; }"
        : "=r"(r) : "f"(s0), "f"(s1), "f"(s2), "f"(s3), "f"(fneg2), "f"(d), "r"(ta), "r"(tb));
    return r;
}

// AFFINE_MX: the tile's P as the PV product's A fragments (the rows' points m~ set), block
// by block: a block's lookup is built just before its words, so few registers hold it
__device__ __forceinline__ void affine_mx_tile(const float (&s)[64], uint32_t (&pa)[4][4], const float (&bmax)[2][4],
                                               const float (&f)[2], const float (&fmax_t)[2], const float (&m_ref)[2]) {
    float rrow[2], fneg2[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#if MX_SUBNORMAL
        // (2 + 2 m~) 2**-149 (an integer below 2**23 in the subnormals: exact) and -2 f 2**-148
        const float r = fmaf(m_ref[i], 2.0f, 2.0f);
        asm("mul.rn.f32 %0, %1, 0f00000001;" : "=f"(rrow[i]) : "f"(r));
        fneg2[i] = f[i] * -3.552713678800501e-15f;  // -2**-48
#else
        rrow[i] = fadd_rn(fmaf(m_ref[i], 2.0f, 2.0f), -AFFINE_MAGIC);  // 2 + 2 m~ - MAGIC, exact
        fneg2[i] = -2.0f * f[i];
#endif
    }
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float d;
            uint32_t ta, tb;
            affine_mx_block(bmax[i][cc], fmax_t[i], m_ref[i], rrow[i], d, ta, tb);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int n_lo = 2 * cc + half, n_hi = n_lo + 8;
                pa[cc][2 * half + i] = affine_mx_word(s[4 * n_lo + 2 * i], s[4 * n_lo + 2 * i + 1], s[4 * n_hi + 2 * i],
                                                      s[4 * n_hi + 2 * i + 1], fneg2[i], d, ta, tb);
            }
        }
    }
}

// The online-softmax step of one tile on the QK^T accumulator s (64 rows x 128 keys, the

// A consumer thread's online-softmax state of its two rows (g and g + 8 of its warp's 16;
// FlashAttention-3's Softmax: row_max, row_sum), carried from key tile to key tile.
struct Softmax {
    float m[2];      // the running maximum in log2 units (AFFINE_P: the row's reference point m~)
    float l[2];      // the running sum of P as represented (the PV product's ones columns)
    float alpha[2];  // the last tile's rescale of O and l: exp2(m_old - m)
    float a[2];      // the rows' factors: Q's per-token scale times softmax scale * log2 e
    int quiet;       // LAZY_RESCALE: tiles since this warp last moved a row's point
};
