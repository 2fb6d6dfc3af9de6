// The softmax steps of the Hopper CUDA forward's checking build (attn_fwd_fp8_check.cu), in
// place of the production header softmax_fwd.cuh, with its softmax_tile's signature:
//   FUSED_SOFTMAX=0: the recipe's arithmetic operation for operation (the Gluon kernel's,
//     forward_gluon_ws.attn_fwd_ws_kernel: bit-identical outputs), the row sums added here:
//       t = (s * a_row) * b_key        log2-unit scores, two rounded products
//       m = max(m, rowmax t);  alpha = exp2(m_old - m)
//       P = e4m3(exp2((t - m) + 8))    packed cvt.rn.satfinite, P times 2**8
//       l = l * alpha + rowsum(P as represented in e4m3)
//     only the order of the tile's row sums differs (exact in any order: see below);
//     ROWSUM_INT converts the row sums' e4m3 codes on the integer units (the same results)
//   ABLATE_SOFTMAX: no softmax (P = 1 everywhere, wrong outputs): the ceiling of the loads,
//     products and turn-taking
//   AFFINE_ABLATE (affine FP8 P, exact rescaling): 1, no key-scale product (w = s); 2, also
//     no row maximum (the point stays where the row started); wrong outputs, to place the
//     softmax's cost (docs/notes/affine-p.md)
#pragma once
#include "kernel_traits_fwd.cuh"
#include "p_build.cuh"

#if ABLATE_SOFTMAX + !FUSED_SOFTMAX + (AFFINE_ABLATE > 0) > 1
#error "one checking softmax at a time: ABLATE_SOFTMAX, FUSED_SOFTMAX=0 or AFFINE_ABLATE"
#endif
#if AFFINE_ABLATE && !(AFFINE_P && !LAZY_RESCALE && !AFFINE_MX)
#error "AFFINE_ABLATE ablates the affine FP8 P with exact rescaling (AFFINE_P, no LAZY_RESCALE or AFFINE_MX)"
#endif
// The sum of the four e4m3 codes of a packed word w (all non-negative), as float32 times
// 2**-8, on the integer units: an e4m3 byte b shifted into a half-word, b << 7, is the f16
// of its value / 2**8 (subnormals included: both formats keep the mantissa's top bits and
// the exponent biases differ by 8), so (w << 7) & 0x7F807F80 holds bytes 0 and 2 as f16x2
// and (w >> 1) & 0x7F807F80 bytes 1 and 3. Each f16 pair is added into float32 exactly
// (values / 2**8 are multiples of 2**-17 and at most 1: 19 bits).
__device__ __forceinline__ void sum_e4m3x4(uint32_t w, float& acc0, float& acc1) {
    const uint32_t even = (w << 7) & 0x7F807F80u, odd = (w >> 1) & 0x7F807F80u;
    float e0, e1, o0, o1;
    asm("{ .reg .b16 l16, h16;\n"
        "mov.b32 {l16, h16}, %4;\n"
        "cvt.f32.f16 %0, l16;\n"
        "cvt.f32.f16 %1, h16;\n"
        "mov.b32 {l16, h16}, %5;\n"
        "cvt.f32.f16 %2, l16;\n"
        "cvt.f32.f16 %3, h16; }"
        : "=f"(e0), "=f"(e1), "=f"(o0), "=f"(o1) : "r"(even), "r"(odd));
    acc0 += e0 + e1;
    acc1 += o0 + o1;
}

template <bool MASKED>
__device__ __forceinline__ void softmax_tile(float (&s)[64], uint32_t (&pa)[4][4], Softmax& rows, uint32_t ks_tile,
                                             int key0, int lim0, int sk_last, int q) {
    float(&m)[2] = rows.m;
    float(&alpha)[2] = rows.alpha;
#if !ABLATE_SOFTMAX
    const float(&a)[2] = rows.a;
#endif
    // the last key rows g and g + 8 see (limit[0] = lim0); kept as one register across the loop
    const int limit[2] = {lim0, CAUSAL ? min(lim0 + 8, sk_last) : lim0};
#if ABLATE_SOFTMAX
    float(&l)[2] = rows.l;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[c][r] = 0x38383838u;
    alpha[0] = alpha[1] = 1.0f;
    l[0] = l[1] = 1.0f;
    m[0] = m[1] = 0.0f;
#elif AFFINE_ABLATE
    float f[2];
#if !KEY_BIAS && !KEY_TILE_SCALE
    // no key-scale product: the scores as QK^T left them, masked
#pragma unroll
    for (int n = 0; n < 16; ++n)
        if (MASKED) mask_keys(s, n, key0 + 16 * (n & 7) + 4 * q + 2 * (n >> 3), limit);
#pragma unroll
    for (int i = 0; i < 2; ++i) f[i] = a[i];
#else
    scale_scores<MASKED>(s, f, a, ks_tile, key0, limit, q);  // (a key bias or per-tile scale: no product to leave out)
#endif
    float c[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#if AFFINE_ABLATE >= 2
        const float row_max = fmaxf(m[i], 0.0f);
#else
        const float row_max = fmaxf(m[i], fmul_rn(quad_row_max(s, i), f[i]));
#endif
        affine_move_point(row_max, AFFINE_K, m[i], c[i], alpha[i]);
        f[i] = 8.0f * f[i];
    }
    uint32_t unused[2];
    affine_tile<false>(s, pa, f, c, unused);
#else
    float(&l)[2] = rows.l;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int kk = 16 * (n & 7) + 4 * q + 2 * (n >> 3);
        const float2 kb = lds_f2(ks_tile + 4 * kk);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            s[4 * n + 2 * i] = fmul_rn(fmul_rn(s[4 * n + 2 * i], a[i]), kb.x);
            s[4 * n + 2 * i + 1] = fmul_rn(fmul_rn(s[4 * n + 2 * i + 1], a[i]), kb.y);
        }
#if KEY_BIAS
        const float2 bb = lds_f2(ks_tile + 4 * (STAGES * BLOCK_N + kk));  // the bias (after the scales): added before
        // hiding keys, as the reference does
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            s[4 * n + 2 * i] = fadd_rn(s[4 * n + 2 * i], bb.x);
            s[4 * n + 2 * i + 1] = fadd_rn(s[4 * n + 2 * i + 1], bb.y);
        }
#endif
        if (MASKED) mask_keys(s, n, key0 + kk, limit);
    }
    float m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float row_max = fmaxf(m[i], thread_row_max(s, i));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        m_use[i] = row_max == -__int_as_float(0x7f800000) ? 0.0f : row_max;  // a row that saw no key yet
        alpha[i] = ex2(m[i] - m_use[i]);
        m[i] = row_max;
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int r = 4 * n + 2 * i + b;
                s[r] = ex2(fadd_rn(fadd_rn(s[r], -m_use[i]), P_OFFSET));
            }
        }
    }
    // The tile's row sums of the represented values are exact in any order: e4m3 values
    // <= 2**8 are multiples of 2**-9, and 128 of them sum below 2**15 (24 bits), so two
    // independent partial sums (no long dependent chain) and a quad reduction per tile give
    // exactly the Gluon kernel's tile sums, and l = l * alpha + sum its rounding.
    float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#if ROWSUM_INT
    // P codes first, then their sums from the packed words
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // keys 32c + 16 half + 4q + (0..3)
            const int n_lo = 2 * c + half, n_hi = n_lo + 8;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const uint32_t lo = e4m3x2(s[4 * n_lo + 2 * i], s[4 * n_lo + 2 * i + 1]);
                const uint32_t hi = e4m3x2(s[4 * n_hi + 2 * i], s[4 * n_hi + 2 * i + 1]);
                pa[c][2 * half + i] = lo | (hi << 16);
                sum_e4m3x4(pa[c][2 * half + i], sum[i][0], sum[i][1]);
            }
        }
    }
#else
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // keys 32c + 16 half + 4q + (0..3)
            const int n_lo = 2 * c + half, n_hi = n_lo + 8;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float v0, v1, v2, v3;
                const uint32_t lo = to_e4m3x2(s[4 * n_lo + 2 * i], s[4 * n_lo + 2 * i + 1], v0, v1);
                const uint32_t hi = to_e4m3x2(s[4 * n_hi + 2 * i], s[4 * n_hi + 2 * i + 1], v2, v3);
                pa[c][2 * half + i] = lo | (hi << 16);
                sum[i][0] += v0 + v1;
                sum[i][1] += v2 + v3;
            }
        }
    }
#endif
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#if ROWSUM_INT
        float tile = (sum[i][0] + sum[i][1]) * 256.0f;  // the sums above are of value / 2**8 (exact)
#else
        float tile = sum[i][0] + sum[i][1];
#endif
        tile += __shfl_xor_sync(0xffffffffu, tile, 1);
        tile += __shfl_xor_sync(0xffffffffu, tile, 2);
        l[i] = l[i] * alpha[i] + tile;
    }
#endif
}
