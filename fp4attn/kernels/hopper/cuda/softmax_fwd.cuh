// The online softmax's step of one key tile in the Hopper CUDA forward (FlashAttention-3's
// softmax.h), composed from the P builders of p_build.cuh. FlashAttention-3's per-score
// work: w = s * b_key (one rounded product), m = max(m, a_row * rowmax w), and P from one
// FMA per score: exp2 FP8 P = e4m3(exp2(fma(w, a_row, 8 - m))), or the affine map's bytes
// (AFFINE_P, AFFINE_MX). The row sums of P come from the tensor cores (ROWSUM_BY_PV): V^T's
// shared tile carries 8 more rows of e4m3 ones, so the PV product (n = D + 8) returns each
// row's sum of the represented P beside P V (consistent normalization, the tensor core's
// FP8 accumulation as for P V itself: the fast_accum recipes' sums). P codes equal the
// recipe's arithmetic (forward_gluon_ws.attn_fwd_ws_kernel, operation for operation) up to
// rounding. Variants measured and removed (an OVERLAP that ran the softmax over the
// warpgroup's own PV, EXP_FOLD; exp2 in f16x2; O summed across key tiles by the PV
// products, which the FP8 tensor cores' accumulation loses) are in
// docs/notes/hopper-forward.md.
//
// LAZY_RESCALE (with AFFINE_P): the row's point moves only when some byte of the tile,
// measured from the point it has, would exceed 126 (the map's offset K_LAZY leaves three
// log2 units of room above it). The bytes are built from the old point straight away, with
// no wait for the tile's maximum, and each thread keeps the largest clamped value of its
// rows as an integer (two per three-input VIMNMX3): a NaN (0x7FFFFFFF), +inf and every byte
// above 126 compare above MAGIC + 126. Where a warp holds a row that must move (and on a
// row's first key), it takes the exact path for the tile: the row maxima, the moved points,
// the bytes again (those of the rows that stay come out the same). A warp that moved within
// its last LAZY_QUIET_TILES tiles takes the maxima first instead (the same choice, from the
// byte of each row's largest score), so that climbing rows do not pay both paths.
#pragma once
#include "kernel_traits_fwd.cuh"
#include "p_build.cuh"

#if !ROWSUM_BY_PV
#error "softmax_fwd.cuh leaves the row sums to the PV product (ROWSUM_BY_PV)"
#endif

// The online-softmax step of one tile on the QK^T accumulator s (64 rows x 128 keys, the
// thread's rows g and g + 8 as i = 0, 1): scores, mask, running max (the rows' state in
// `rows`), P packed as the PV product's A fragments (pa). Register s[4n + 2i + b] is key
// 16 (n % 8) + 4q + 2 (n / 8) + b of the tile (the permuted K rows).
template <bool MASKED>
__device__ __forceinline__ void softmax_tile(float (&s)[64], uint32_t (&pa)[4][4], Softmax& rows, uint32_t ks_tile,
                                             int key0, int lim0, int sk_last, int q) {
    float(&m)[2] = rows.m;
    float(&alpha)[2] = rows.alpha;
    const float(&a)[2] = rows.a;
    int& quiet = rows.quiet;
    // the last key rows g and g + 8 see (limit[0] = lim0); kept as one register across the loop
    const int limit[2] = {lim0, CAUSAL ? min(lim0 + 8, sk_last) : lim0};
    // the max over w scaled once per row; one FMA per score into P; no row sums here (the PV
    // product returns them)
    float f[2];
    scale_scores<MASKED>(s, f, a, ks_tile, key0, limit, q);
    float c[2];
#if AFFINE_P && LAZY_RESCALE
    // the bytes from the rows' points as they are (a row that saw no key yet: from 0, and
    // it moves below), each thread's largest clamped value per row beside them
    float f8[2];
    uint32_t top[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        f8[i] = 8.0f * f[i];
        const float m_use = m[i] == -__int_as_float(0x7f800000) ? 0.0f : m[i];
        c[i] = fadd_rn(fmaf(m_use, -8.0f, AFFINE_K_LAZY), AFFINE_MAGIC);
        alpha[i] = 1.0f;
    }
    if (quiet < LAZY_QUIET_TILES) {
        // the rows' maxima first (a warp that moved a point within its last tiles: rows
        // climbing now likely climb on), the same choice from the byte of each row's
        // largest score (the map is increasing: its byte is the largest byte), the bytes
        // built once
        bool moved = false;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float wmax = quad_row_max(s, i);
            uint32_t top_i = 0u;
            affine_e4m3x2_top(wmax, wmax, f8[i], c[i], top_i);
            if (m[i] == -__int_as_float(0x7f800000) || top_i > AFFINE_TOP_BITS) {
                moved = true;
                affine_move_point(fmaxf(m[i], fmul_rn(wmax, f[i])), AFFINE_K_LAZY, m[i], c[i], alpha[i]);
            }
        }
        affine_tile<false>(s, pa, f8, c, top);
        quiet = __any_sync(0xffffffffu, moved) ? 0 : quiet + 1;
        return;
    }
    affine_tile<true>(s, pa, f8, c, top);
    const bool move0 = m[0] == -__int_as_float(0x7f800000) || top[0] > AFFINE_TOP_BITS;
    const bool move1 = m[1] == -__int_as_float(0x7f800000) || top[1] > AFFINE_TOP_BITS;
    const bool moves = __any_sync(0xffffffffu, move0 || move1);
    quiet = moves ? 0 : LAZY_QUIET_TILES;  // (no count beyond: speculation goes on while quiet)
    if (moves) {
        // the exact path for this tile (warp-uniform: its shuffles need the whole warp): the
        // rows that must move take their snapped maxima, the others keep their points
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float wmax = quad_row_max(s, i);
            int mv = (i == 0 ? move0 : move1) ? 1 : 0;  // the row's four threads decide together
            mv |= __shfl_xor_sync(0xffffffffu, mv, 1);
            mv |= __shfl_xor_sync(0xffffffffu, mv, 2);
            if (mv) affine_move_point(fmaxf(m[i], fmul_rn(wmax, f[i])), AFFINE_K_LAZY, m[i], c[i], alpha[i]);
        }
        affine_tile<false>(s, pa, f8, c, top);
    }
#elif AFFINE_MX
    // the blocks' maxima (the row's is theirs), the rows' points, then P block by block
    float bmax[2][4], m_ref[2], fmax_t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) bmax[i][cc] = quad_block_max(s, i, cc);
        const float row_w = fmax_nan(fmax_nan(bmax[i][0], bmax[i][1]), fmax_nan(bmax[i][2], bmax[i][3]));
        fmax_t[i] = MX_SUBNORMAL ? f[i] * 1.2676506002282294e30f : f[i];  // the w' maxima times 2**100
        m_ref[i] = affine_mx_move_point(fmax_nan(m[i], fmul_rn(row_w, fmax_t[i])), m[i], alpha[i]);
    }
    affine_mx_tile(s, pa, bmax, f, fmax_t, m_ref);
#else
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float row_max = fmaxf(m[i], fmul_rn(quad_row_max(s, i), f[i]));
#if AFFINE_P
        affine_move_point(row_max, AFFINE_K, m[i], c[i], alpha[i]);
        f[i] = 8.0f * f[i];
#else
        const float m_use = row_max == -__int_as_float(0x7f800000) ? 0.0f : row_max;
        alpha[i] = ex2(m[i] - m_use);
        m[i] = row_max;
        c[i] = fadd_rn(P_OFFSET, -m_use);
#endif
    }
#if AFFINE_P
    uint32_t unused[2];
    affine_tile<false>(s, pa, f, c, unused);
#else
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // keys 32cc + 16 half + 4q + (0..3)
            const int n_lo = 2 * cc + half, n_hi = n_lo + 8;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float x0 = fmaf(s[4 * n_lo + 2 * i], f[i], c[i]), x1 = fmaf(s[4 * n_lo + 2 * i + 1], f[i], c[i]);
                const float x2 = fmaf(s[4 * n_hi + 2 * i], f[i], c[i]), x3 = fmaf(s[4 * n_hi + 2 * i + 1], f[i], c[i]);
                const bool poly_lo = n_lo < EXP_POLY, poly_hi = n_hi < EXP_POLY;  // unrolled: constants
                const uint32_t lo = e4m3x2(poly_lo ? ex2_poly(x0) : ex2(x0), poly_lo ? ex2_poly(x1) : ex2(x1));
                const uint32_t hi = e4m3x2(poly_hi ? ex2_poly(x2) : ex2(x2), poly_hi ? ex2_poly(x3) : ex2(x3));
                pa[cc][2 * half + i] = lo | (hi << 16);
            }
        }
    }
#endif  // AFFINE_P
#endif  // AFFINE_P && LAZY_RESCALE
}
