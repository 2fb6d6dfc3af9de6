// The Hopper CUDA backward's softmax gradient, in a consumer's registers (mainloop_bwd.cuh):
// P recomputed from the scores and the forward's LSE (compute_p), dS = P (dP - delta)
// (compute_ds), and what the FP8 views of P and dS are built from: the e4m3 scales of a block's
// maximum, the column maxima's butterfly, the A fragments of the dV and dK products.
#pragma once
#include "kernel_traits_bwd.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"

#define LOG2E_F 1.4426950408889634f
#define FP8_MIN_AMAX 1.925929944387236e-34f  // 2**-112 (formats/constants.py)

// e4m3 view scales as formats.fp8.fp8_scales: amax / 448 and 448 / amax (correctly rounded);
// 1 and 1 below FP8_MIN_AMAX; NaN stays NaN
__device__ __forceinline__ void fp8_scale_inv(float amax, float& scale, float& inv) {
    const bool zero = amax < FP8_MIN_AMAX;
    scale = zero ? 1.0f : __fdiv_rn(amax, 448.0f);
    inv = zero ? 1.0f : __fdiv_rn(448.0f, amax);
}

// The forward's LSE in log2 units (rounded alone), +inf for a row that saw no key (LSE -inf), so
// that its P is 0 with no test per score (backward_triton.lse_log2)
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == -__int_as_float(0x7f800000) ? __int_as_float(0x7f800000) : fmul_rn(lse, LOG2E_F);
}

// The query (0..63, natural order) of accumulator column 8 j + 2 q + b of a permuted tile
__device__ __forceinline__ int query_of(int j, int q, int b) { return 16 * (j & 3) + 4 * q + 2 * (j >> 2) + b; }

// One step of the column maxima's butterfly: of cm[0 .. 2W), a lane with `bit` set keeps the
// upper half and sends the lower to its partner (lane ^ bit), which keeps the lower; each ends
// with the maxima of its half in cm[0 .. W). (W a template argument: with the steps in a loop of
// a run-time W, the compiler kept cm in local memory.)
template <int W>
__device__ __forceinline__ void butterfly_max(float (&cm)[16], int lane, int bit) {
    const bool upper = lane & bit;
#pragma unroll
    for (int k = 0; k < W; ++k) {
        const float keep = upper ? cm[k + W] : cm[k];
        const float send = upper ? cm[k] : cm[k + W];
        cm[k] = fmax_nan(keep, __shfl_xor_sync(0xffffffffu, send, bit));
    }
}

// The 8-bit A fragments (P^T or dS^T, m64k32 twice) of values v (an m64n64 accumulator of the
// permuted tile, each already scaled) rounded to e4m3: fragment kk's registers hold queries
// 32 kk + 4 q .. 4 q + 3 (rows r, r + 8) and 32 kk + 16 + 4 q .. (rows r, r + 8)
__device__ __forceinline__ void a_fragments(const float (&v)[32], uint32_t (&a)[2][4]) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int j_lo = 2 * kk + half, j_hi = j_lo + 4;  // h = 0: queries +0, +1; h = 1: +2, +3
#pragma unroll
            for (int i = 0; i < 2; ++i)  // rows r, r + 8
                a[kk][2 * half + i] = prmt_lo_halves(e4m3x2(v[4 * j_lo + 2 * i], v[4 * j_lo + 2 * i + 1]),
                                                     e4m3x2(v[4 * j_hi + 2 * i], v[4 * j_hi + 2 * i + 1]));
        }
    }
}

// P^T = exp2(t - lse2) in place of the scores S^T (t the score times Q's and K's scales; causal:
// -inf past the diagonal, tested in a tile that crosses it, diag), of query tile t and the
// thread's keys key0 and key0 + 8 (K's token scales ks_r); the tile's per-query numbers at num_addr
__device__ __forceinline__ void compute_p(float (&s)[32], const Params& p, uint32_t num_addr, const float (&ks_r)[2],
                                          int q4, int key0, int t, bool diag) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int m = query_of(j, q4, 0);
        const float2 l = lds_f2(num_addr + 4 * (NUM_LSE + m));
        const float2 qq = lds_f2(num_addr + 4 * (NUM_QS + m));
        const float lse2[2] = {lse_log2(l.x), lse_log2(l.y)};
        const float qsc[2] = {fmul_rn(qq.x, p.qk_scale), fmul_rn(qq.y, p.qk_scale)};
#pragma unroll
        for (int row = 0; row < 2; ++row) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const int i = 4 * j + 2 * row + bb;
                float x = fmul_rn(fmul_rn(s[i], qsc[bb]), ks_r[row]);
#if CAUSAL
                if (diag && key0 + 8 * row > t * BLOCK_M + m + bb + p.causal_offset) x = -__int_as_float(0x7f800000);
#endif
                s[i] = ex2(fadd_rn(x, -lse2[bb]));  // P
            }
        }
    }
}

// dS^T = P (dP^T - delta) in place of dP^T, P^T in s (V_t's token scales of the thread's keys
// vs_r; the tile's per-query numbers at num_addr)
__device__ __forceinline__ void compute_ds(float (&dp)[32], const float (&s)[32], uint32_t num_addr,
                                           const float (&vs_r)[2], int q4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int m = query_of(j, q4, 0);
        const float2 d = lds_f2(num_addr + 4 * (NUM_DELTA + m));
        const float2 o = lds_f2(num_addr + 4 * (NUM_DOTS + m));
#pragma unroll
        for (int row = 0; row < 2; ++row) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const int i = 4 * j + 2 * row + bb;
                // dP^T's second scale and the subtraction of delta in one FMA (one rounding fewer
                // than the Triton kernels' two operations: float32 rounding, not the recipe)
                const float dpt = fmaf(fmul_rn(dp[i], vs_r[row]), bb ? o.y : o.x, -(bb ? d.y : d.x));
                dp[i] = fmul_rn(s[i], dpt);  // dS
            }
        }
    }
}
