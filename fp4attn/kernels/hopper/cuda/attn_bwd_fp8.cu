// FP8 attention backward for Hopper (sm_90a), FlashAttention-3's structure in CUDA C++ with
// inline PTX, compiled at first use by NVRTC (fp4attn/kernels/hopper/backward_cuda.py).
//
// Numerics: the training recipes' backward with per-token FP8 Q/K (`train-fp8`; P mode 0,
// FP8 P from exp2), as reference/backward.py defines it and the Triton kernels
// (backward_triton._dkdv_tile, _dq_tile with ROW_SCALES) compute it, operation for operation
// up to float32 summation order and two fused multiply-adds (marked):
//   t    = (s * (qs * scale * log2 e)) * ks       s = K Q^T on the bf16 tensor cores (exact e4m3 values)
//   P    = exp2(t - lse2),  lse2 = lse * log2 e (+inf for a row that saw no key)
//   dV  += (e4m3(P * 2**8)^T dO_c) * dO_c's channel scale             (P_r times 2**8, as the forward)
//   dP^T = (V_t dO_t^T * V's token scale) * dO's token scale
//   dS   = P (dP - delta)                        (dP's dO scale and the subtraction in one FMA)
//   dK  += ((e4m3 dS^T, one scale per key and 64 queries) Q_c * that scale) * Q_c's channel scale
//   dQ  += (e4m3 dS, one scale per query and 64 keys) K_c * that scale  (the two key blocks' sum in
//          one FMA; times K_c's channel scale
//          and the softmax scale after the last tile, with dK's softmax scale)
// Each gradient product runs on the FP8 tensor cores on a fresh accumulator, scaled and added in
// float32 (the FP8 tensor cores' own sums keep fewer bits than float32).
//
// Schedule: a CTA owns 128 keys of one K/V head (two consumer warpgroups of 64 keys each, wgmma's
// M) and walks every 64-query tile of every query head of its group that sees them (causal: the
// tiles from the diagonal on); dK and dV stay in registers across the walk (GQA sums the group's
// heads there). Warpgroup 0 is the producer (setmaxnreg down to 24): warp 0 issues the TMA copies
// of K, V and K_c once and of each tile's Q, dO_t, dO_c, Q_c and per-query numbers into a
// STAGES-deep ring. Per tile each consumer issues S^T = K Q^T and dP^T = V dO_t^T together, builds
// P, P_r and dS in registers, the FP8 views of dS for dK (in registers) and for dQ (in shared
// memory, transposed), then the dV and dK products, and then its half of the head dim of dQ's
// partial product over the CTA's 128 keys, which it adds to a float32 workspace by a bulk
// reduce-add (FlashAttention-3's dQ accumulation: one pass, no second recomputation of S and dP);
// the launcher scales the workspace into dQ after. dQ needs both consumers' dS: consumer 1 takes
// the tile it just finished, consumer 0 the one before, each waiting only for the other's arrival
// on that tile's barrier (three dS buffers), so that the two need not meet at every tile and one's
// products can run while the other's softmax work does.
//
// The K-major layouts FP8 wgmma needs: P^T and dS^T (the A operands of dV and dK) stay in
// registers: the S^T accumulator holds query pairs {2q, 2q+1} of every 8 columns where the 8-bit
// A fragment wants queries {4q .. 4q+3}, so Q's and dO_t's rows are loaded permuted (two 4D TMA
// boxes, as the forward loads K): shared-memory row 32h + 8a + 2q + b holds query 16a + 4q + 2h + b,
// and the accumulator's columns come out in the A fragment's order. The B operands of dV and dK are
// the per-channel views of dO and Q, stored (D, Sq) by their quantizers (queries contiguous); dQ's
// are K_c (D, Sk) and the dS tile written transposed to shared memory.
//
// Compile-time parameters (NVRTC -D): HEAD_DIM 64 or 128, CAUSAL.

#include "ptx.cuh"
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif

#define STAGES 2
#define BLOCK_N 128  // keys per CTA: two consumer warpgroups of 64
#define BLOCK_M 64   // queries per tile: part of the recipe (dS's per-64 scales)
#define THREADS 384
#define CONSUMER_REGS 240
#define PRODUCER_REGS 24
#define LOG2E_F 1.4426950408889634f
#define FP8_MIN_AMAX 1.925929944387236e-34f  // 2**-112 (formats/constants.py)

// Q and K in bf16: rows of 2 D bytes in chunks of one 128-byte swizzle span
#define QK_ROW_BYTES (2 * HEAD_DIM)
#define QK_CHUNKS (QK_ROW_BYTES / 128)
#define QK_STEPS (QK_ROW_BYTES / 32)  // S^T's k16 steps
#define Q_CHUNK_BYTES (BLOCK_M * 128)
#define K_CHUNK_BYTES (BLOCK_N * 128)
#define Q_BYTES (BLOCK_M * QK_ROW_BYTES)
#define K_BYTES (BLOCK_N * QK_ROW_BYTES)
// e4m3 token-major tiles (V, dO_t): rows of D bytes, swizzled by 128 (D = 128) or 64 (D = 64)
#define E_ROW_BYTES HEAD_DIM
#define E_LAYOUT (HEAD_DIM == 128 ? 1 : 2)  // wgmma descriptor: 1 = 128B, 2 = 64B swizzle
#define E_STEPS (HEAD_DIM / 32)
#define V_BYTES (BLOCK_N * HEAD_DIM)
#define DOT_BYTES (BLOCK_M * HEAD_DIM)
// channel-major tiles: dO_c, Q_c (D rows of 64 query bytes, 64B swizzle); K_c (D rows of 128 key bytes)
#define DOC_BYTES (HEAD_DIM * BLOCK_M)
#define KC_BYTES (HEAD_DIM * BLOCK_N)
// per-tile numbers: lse, delta, qs, dO's token scales (64 each), dO_c's and Q_c's channel scales (D each)
#define NUM_FLOATS (4 * BLOCK_M + 2 * HEAD_DIM)
#define NUM_BYTES (((NUM_FLOATS * 4) + 1023) / 1024 * 1024)
#define STAGE_BYTES (Q_BYTES + DOT_BYTES + 2 * DOC_BYTES + NUM_BYTES)
#define DS_BYTES (BLOCK_M * BLOCK_N)  // dS (64 queries x 128 keys, e4m3, 128B swizzle)
// dS tiles in flight: consumer 0 reads tile g's while both write g + 1's and consumer 1 may still read g - 1's
#define DS_BUFS 3
#define DS_BAR 4  // named barriers DS_BAR + DS_BUFS c + buffer: consumer c's dS of a tile is written
#define DQ_N (HEAD_DIM / 2)            // dQ's columns per consumer
// a consumer's staged float32 dQ partial: rows of DQ_N floats and 4 of padding, so that the 8 rows
// a warp's float2 stores touch fall in distinct banks (the workspace keeps the padding: one bulk copy)
#define DQS_ROW (DQ_N + 4)
#define DQS_BYTES (BLOCK_M * DQS_ROW * 4)
#define SMEM_BYTES (1024 + K_BYTES + V_BYTES + KC_BYTES + STAGES * STAGE_BYTES + DS_BUFS * DS_BYTES + 2 * DQS_BYTES \
                    + 2 * 2 * 4 * 64 * 4 + DS_BUFS * 2 * 64 * 4 + 64)

struct Params {
    TensorMap q_map0, q_map1;      // Q bf16 (row bytes, 2, 4, rows / 16) from rows 0 and 2: the permuted halves
    TensorMap dot_map0, dot_map1;  // dO_t e4m3, likewise
    TensorMap doc_map;             // dO_c (B*H*D rows, Sq) e4m3, boxes (64 queries, D)
    TensorMap qc_map;              // Q_c likewise
    TensorMap k_map;               // K bf16 (B*Hkv*Sk rows, 2 D bytes), boxes (128 bytes, 128 keys)
    TensorMap v_map;               // V_t e4m3 (B*Hkv*Sk rows, D), boxes (D, 128 keys)
    TensorMap kc_map;              // K_c (B*Hkv*D rows, Sk) e4m3, boxes (128 keys, D)
    const float* lse;              // (B, H, Sq), natural log
    const float* delta;            // (B, H, Sq)
    const float* qs;               // (B, H, Sq) Q's token scales
    const float* dots;             // (B, H, Sq) dO_t's token scales
    const float* docs;             // (B, H, D) dO_c's channel scales
    const float* qcs;              // (B, H, D) Q_c's channel scales
    const float* ks;               // (B, Hkv, Sk) K's token scales
    const float* vts;              // (B, Hkv, Sk) V_t's token scales
    float* dq_accum;               // (B*H, Sq / 64, 2, 64, D / 2 + 4) float32, zeroed
    float* dk;                     // (B, Hkv, Sk, D) float32
    float* dv;                     // (B, Hkv, Sk, D) float32
    int H, group, Sq, Sk, causal_offset;
    float qk_scale;                // softmax scale * log2 e
    float sm_scale;
};
// backward_cuda._Params fills these bytes from Python (it asserts the same size)
static_assert(sizeof(Params) == 1280, "Params changed: update backward_cuda._Params to the same layout");

struct Smem {
    uint32_t k, v, kc, stage, ds, dqs;
    uint32_t amax;  // float [parity][consumer][warp][64]: each warp's column maxima of dS (dQ's view)
    uint32_t dsq;   // float [buffer][consumer][64]: dQ's dS scales per query (natural order)
    uint32_t kv_full, full, empty;  // barriers (8 bytes apart)
};

__device__ __forceinline__ Smem carve(unsigned char* raw) {
    unsigned char* base = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
    Smem s;
    s.k = smem_addr(base);
    s.v = s.k + K_BYTES;
    s.kc = s.v + V_BYTES;
    s.stage = s.kc + KC_BYTES;
    s.ds = s.stage + STAGES * STAGE_BYTES;
    s.dqs = s.ds + DS_BUFS * DS_BYTES;
    unsigned char* rest = base + (K_BYTES + V_BYTES + KC_BYTES + STAGES * STAGE_BYTES + DS_BUFS * DS_BYTES + 2 * DQS_BYTES);
    s.amax = smem_addr(rest);
    s.dsq = s.amax + 4 * (2 * 2 * 4 * 64);
    const uint32_t bars = s.dsq + 4 * (DS_BUFS * 2 * 64);
    s.kv_full = bars;
    s.full = bars + 8;
    s.empty = s.full + 8 * STAGES;
    return s;
}

// a stage's parts
#define ST_Q(s, st) ((s).stage + (st) * STAGE_BYTES)
#define ST_DOT(s, st) (ST_Q(s, st) + Q_BYTES)
#define ST_DOC(s, st) (ST_DOT(s, st) + DOT_BYTES)
#define ST_QC(s, st) (ST_DOC(s, st) + DOC_BYTES)
#define ST_NUM(s, st) (ST_QC(s, st) + DOC_BYTES)
// the per-tile numbers' offsets in floats
#define NUM_LSE 0
#define NUM_DELTA 64
#define NUM_QS 128
#define NUM_DOTS 192
#define NUM_DOCS 256
#define NUM_QCS (256 + HEAD_DIM)

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

// acc += (A B) (times ROW_SCALE's per-row scales) times the channel scales at cs: a fresh product
// per 64 columns of D (m64n64k32 twice: the tile's 64 queries), added in float32. A: the 8-bit
// fragments of P^T or dS^T; B: the tile's channel-major view (D rows of 64 query bytes, 64B swizzle).
template <bool ROW_SCALE>
__device__ __forceinline__ void add_fresh_product(float (&acc)[HEAD_DIM / 2], const uint32_t (&a)[2][4], uint64_t desc,
                                                  uint32_t cs, int q4, const float (&row_scale)[2]) {
#pragma unroll
    for (int hh = 0; hh < HEAD_DIM / 64; ++hh) {
        float tmp[32];
        wgmma_fence();
        wgmma_rs_n64<true>(tmp, a[0], desc + hh * ((64 * 64) >> 4));
        wgmma_rs_n64<false>(tmp, a[1], desc + hh * ((64 * 64) >> 4) + 2);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(tmp);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            const float2 c = lds_f2(cs + 4 * (64 * hh + 8 * jj + 2 * q4));
#pragma unroll
            for (int row = 0; row < 2; ++row) {
                const int i = 4 * jj + 2 * row;
                const float x0 = ROW_SCALE ? fmul_rn(tmp[i], row_scale[row]) : tmp[i];
                const float x1 = ROW_SCALE ? fmul_rn(tmp[i + 1], row_scale[row]) : tmp[i + 1];
                acc[32 * hh + i] += x0 * c.x;
                acc[32 * hh + i + 1] += x1 * c.y;
            }
        }
    }
}

// dQ's partial of tile g over the CTA's 128 keys, this consumer's half of D (each 64-key block of
// dS on a fresh accumulator, times its scales per query), added to the workspace by a bulk
// reduce-add. Waits until the other consumer's dS of the tile is in shared memory (its arrival
// on its barrier for the tile's buffer).
__device__ __forceinline__ void dq_tile(const Params& p, const Smem& sm, int g, int cw, int r, int q4, int t128,
                                        int n_tiles, int t_lo, int hkv, int b, uint64_t kc_desc) {
    const int h = hkv * p.group + g / (n_tiles - t_lo), t = t_lo + g % (n_tiles - t_lo);
    const int bh = b * p.H + h, buf = g % DS_BUFS;
    named_sync(DS_BAR + DS_BUFS * (1 - cw) + buf, 256);  // the other consumer's dS of tile g
    named_sync(1 + cw, 128);                              // and this consumer's own
    float qa[DQ_N / 2], qb[DQ_N / 2];
    const uint64_t ds_desc = smem_desc(sm.ds + buf * DS_BYTES, 1, 128);
    wgmma_fence();
#if HEAD_DIM == 128
    wgmma_ss_e4m3_n64<true>(qa, ds_desc, kc_desc);
    wgmma_ss_e4m3_n64<false>(qa, ds_desc + 2, kc_desc + 2);
    wgmma_commit();
    wgmma_ss_e4m3_n64<true>(qb, ds_desc + 4, kc_desc + 4);
    wgmma_ss_e4m3_n64<false>(qb, ds_desc + 6, kc_desc + 6);
#else
    wgmma_ss_e4m3_n32<true>(qa, ds_desc, kc_desc);
    wgmma_ss_e4m3_n32<false>(qa, ds_desc + 2, kc_desc + 2);
    wgmma_commit();
    wgmma_ss_e4m3_n32<true>(qb, ds_desc + 4, kc_desc + 4);
    wgmma_ss_e4m3_n32<false>(qb, ds_desc + 6, kc_desc + 6);
#endif
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(qa);
    fence_regs(qb);
    const uint32_t dsq = sm.dsq + 4 * buf * 2 * 64;
    float sa[2], sb[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
        sa[row] = lds_f32(dsq + 4 * (r + 8 * row));
        sb[row] = lds_f32(dsq + 4 * (64 + r + 8 * row));
    }
    // the staging buffer is free once the last bulk reduce has read it
    if (t128 == 0) bulk_wait_read();
    named_sync(1 + cw, 128);
    const uint32_t stage = sm.dqs + cw * DQS_BYTES;
#pragma unroll
    for (int jj = 0; jj < DQ_N / 8; ++jj) {
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const int i = 4 * jj + 2 * row;
            const float x0 = fmaf(qa[i], sa[row], qb[i] * sb[row]);
            const float x1 = fmaf(qa[i + 1], sa[row], qb[i + 1] * sb[row]);
            sts_f2(stage + 4 * ((r + 8 * row) * DQS_ROW + 8 * jj + 2 * q4), x0, x1);
        }
    }
    fence_view_async_shared();
    named_sync(1 + cw, 128);
    if (t128 == 0)
        bulk_reduce_add_f32(p.dq_accum + (((long long)bh * n_tiles + t) * 2 + cw) * (64 * DQS_ROW), stage, DQS_BYTES);
}

// -------------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_bwd_fp8(const __grid_constant__ Params p) {
    extern __shared__ unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int n0 = blockIdx.x * BLOCK_N;       // the CTA's first key
    const int bhk = blockIdx.y;                // b * Hkv + hkv
    const int Hkv = p.H / p.group;
    const int b = bhk / Hkv, hkv = bhk % Hkv;
    const int n_tiles = p.Sq / BLOCK_M;
    // the query tiles that see the CTA's keys: all, or (causal) from the first that reaches key n0
    int t_lo = 0;
#if CAUSAL
    {
        const int first = n0 - p.causal_offset;  // the first query that sees key n0
        t_lo = first <= 0 ? 0 : first / BLOCK_M;
    }
#endif
    const int walk = t_lo < n_tiles ? (n_tiles - t_lo) * p.group : 0;  // tiles over the group's heads

    if (tid == 0) {
        const Smem sm = carve(smem_raw);
        mbar_init(sm.kv_full, 1);
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(sm.full + 8 * st, 1);
            mbar_init(sm.empty + 8 * st, 8);  // one arrival per consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------------------------------------------------------- producer
        warpgroup_reg_dealloc<PRODUCER_REGS>();
        if (tid == 0) {
            const Smem sm = carve(smem_raw);
            mbar_expect_tx(sm.kv_full, K_BYTES + V_BYTES + KC_BYTES);
            const int key_row = bhk * p.Sk + n0;
#pragma unroll
            for (int c = 0; c < QK_CHUNKS; ++c) tma_load_2d(sm.k + c * K_CHUNK_BYTES, &p.k_map, c * 128, key_row, sm.kv_full);
            tma_load_2d(sm.v, &p.v_map, 0, key_row, sm.kv_full);
            tma_load_2d(sm.kc, &p.kc_map, n0, bhk * HEAD_DIM, sm.kv_full);
            for (int g = 0; g < walk; ++g) {
                const int h = hkv * p.group + g / (n_tiles - t_lo), t = t_lo + g % (n_tiles - t_lo);
                const int bh = b * p.H + h, row = bh * p.Sq + t * BLOCK_M, st = g % STAGES;
                mbar_wait(sm.empty + 8 * st, ((g / STAGES) & 1) ^ 1);  // a fresh barrier passes at once
                const uint32_t full = sm.full + 8 * st;
                mbar_expect_tx(full, Q_BYTES + DOT_BYTES + 2 * DOC_BYTES + (4 * BLOCK_M + 2 * HEAD_DIM) * 4);
#pragma unroll
                for (int c = 0; c < QK_CHUNKS; ++c) {
                    tma_load_4d(ST_Q(sm, st) + c * Q_CHUNK_BYTES, &p.q_map0, c * 128, 0, 0, row / 16, full);
                    tma_load_4d(ST_Q(sm, st) + c * Q_CHUNK_BYTES + Q_CHUNK_BYTES / 2, &p.q_map1, c * 128, 0, 0, row / 16,
                                full);
                }
                tma_load_4d(ST_DOT(sm, st), &p.dot_map0, 0, 0, 0, row / 16, full);
                tma_load_4d(ST_DOT(sm, st) + DOT_BYTES / 2, &p.dot_map1, 0, 0, 0, row / 16, full);
                tma_load_2d(ST_DOC(sm, st), &p.doc_map, t * BLOCK_M, bh * HEAD_DIM, full);
                tma_load_2d(ST_QC(sm, st), &p.qc_map, t * BLOCK_M, bh * HEAD_DIM, full);
                const uint32_t num = ST_NUM(sm, st);
                bulk_load(num + 4 * NUM_LSE, p.lse + row, 256, full);
                bulk_load(num + 4 * NUM_DELTA, p.delta + row, 256, full);
                bulk_load(num + 4 * NUM_QS, p.qs + row, 256, full);
                bulk_load(num + 4 * NUM_DOTS, p.dots + row, 256, full);
                bulk_load(num + 4 * NUM_DOCS, p.docs + (long long)bh * HEAD_DIM, 4 * HEAD_DIM, full);
                bulk_load(num + 4 * NUM_QCS, p.qcs + (long long)bh * HEAD_DIM, 4 * HEAD_DIM, full);
            }
        }
        return;
    }

    // -------------------------------------------------------------------- consumers
    warpgroup_reg_alloc<CONSUMER_REGS>();
    const Smem sm = carve(smem_raw);
    const int cw = wg - 1;                 // this consumer's 64 keys: n0 + 64 cw ..
    const int t128 = tid % 128, warp = t128 / 32, lane = tid % 32;
    const int q4 = lane & 3;
    const int r = 16 * warp + lane / 4;    // this thread's rows r, r + 8 of the consumer's 64 keys
    const int key0 = n0 + 64 * cw + r;     // the key of row r (row r + 8: key0 + 8)

    float dk[HEAD_DIM / 2], dv[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) dk[i] = dv[i] = 0.0f;
    // K's and V_t's token scales of the thread's two keys
    const long long krow = (long long)bhk * p.Sk + key0;
    const float ks_r[2] = {p.ks[krow], p.ks[krow + 8]};
    const float vs_r[2] = {p.vts[krow], p.vts[krow + 8]};

    const uint64_t k_desc = smem_desc(sm.k + cw * 64 * 128, 1, 128);
    const uint64_t v_desc = smem_desc(sm.v + cw * 64 * E_ROW_BYTES, E_LAYOUT, E_ROW_BYTES);
    const uint64_t kc_desc = smem_desc(sm.kc + cw * DQ_N * 128, 1, 128);  // this consumer's half of D
    mbar_wait(sm.kv_full, 0);

    for (int g = 0; g < walk; ++g) {
        const int t = t_lo + g % (n_tiles - t_lo);
        const int st = g % STAGES, par = g & 1, buf = g % DS_BUFS;
        mbar_wait(sm.full + 8 * st, (g / STAGES) & 1);

        // -- S^T = K Q^T (bf16) and dP^T = V dO_t^T (e4m3), issued together
        float s[32], dp[32];
        const uint64_t q_desc = smem_desc(ST_Q(sm, st), 1, 128);
        const uint64_t dot_desc = smem_desc(ST_DOT(sm, st), E_LAYOUT, E_ROW_BYTES);
        wgmma_fence();
        wgmma_ss_bf16_n64<true>(s, k_desc, q_desc);
#pragma unroll
        for (int c = 1; c < QK_STEPS; ++c)
            wgmma_ss_bf16_n64<false>(s, k_desc + (c / 4) * (K_CHUNK_BYTES >> 4) + 2 * (c % 4),
                                     q_desc + (c / 4) * (Q_CHUNK_BYTES >> 4) + 2 * (c % 4));
        wgmma_commit();
        wgmma_ss_e4m3_n64<true>(dp, v_desc, dot_desc);
#pragma unroll
        for (int c = 1; c < E_STEPS; ++c) wgmma_ss_e4m3_n64<false>(dp, v_desc + 2 * c, dot_desc + 2 * c);
        wgmma_commit();

        // causal: the tiles that reach past the diagonal for some key of the CTA mask
#if CAUSAL
        const bool diag = t * BLOCK_M + p.causal_offset < n0 + BLOCK_N - 1;
#endif
        // the tile's per-query numbers, read where used, a pair of adjacent queries at a time
        const uint32_t num_addr = ST_NUM(sm, st);

        // -- P^T = exp2(t - lse2), then P_r^T (e4m3, times 2**8) as the dV product's A fragments
        wgmma_wait<1>();
        fence_regs(s);
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
        uint32_t pa[2][4];
        {
            float p256[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) p256[i] = s[i] * 256.0f;  // exact
            a_fragments(p256, pa);
        }

        // -- dS^T = P (dP^T - delta)
        wgmma_wait<0>();
        fence_regs(dp);
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

        // -- dK's view: one scale per key (row) over the tile's 64 queries
        float k_scale[2];
        uint32_t dsa[2][4];
        {
            float inv[2];
#pragma unroll
            for (int row = 0; row < 2; ++row) {
                float mx = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    mx = fmax_nan(mx, fmax_nan(fabsf(dp[4 * j + 2 * row]), fabsf(dp[4 * j + 2 * row + 1])));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                fp8_scale_inv(mx, k_scale[row], inv[row]);
            }
            float y[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) y[i] = dp[i] * inv[(i >> 1) & 1];
            a_fragments(y, dsa);
        }

        // -- dQ's view: one scale per query (column) over the consumer's 64 keys; the column
        // maxima by a butterfly over the 8 lanes that share a column set (lane bits 2..4), after
        // which lane holds columns 8 (lane >> 2) + 2 q + {0, 1}; then across the 4 warps
        {
            float cm[16];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int bb = 0; bb < 2; ++bb)
                    cm[2 * j + bb] = fmax_nan(fabsf(dp[4 * j + bb]), fabsf(dp[4 * j + 2 + bb]));
            butterfly_max<8>(cm, lane, 16);
            butterfly_max<4>(cm, lane, 8);
            butterfly_max<2>(cm, lane, 4);
            const int jc = lane >> 2;  // the column pair 8 jc + 2 q + {0, 1}
            const uint32_t amax = sm.amax + 4 * (((par * 2 + cw) * 4) * 64 + 8 * jc + 2 * q4);
            sts_f2(amax + 4 * 64 * warp, cm[0], cm[1]);
            named_sync(1 + cw, 128);
            float m0 = cm[0], m1 = cm[1];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float2 o = lds_f2(amax + 4 * 64 * w);
                m0 = fmax_nan(m0, o.x);
                m1 = fmax_nan(m1, o.y);
            }
            float sc0, sc1, inv0, inv1;
            fp8_scale_inv(m0, sc0, inv0);
            fp8_scale_inv(m1, sc1, inv1);
            if (warp == 0) {  // dQ's scales by natural query, for both consumers' dQ products
                const uint32_t dsq = sm.dsq + 4 * (buf * 2 + cw) * 64;
                sts_f32(dsq + 4 * query_of(jc, q4, 0), sc0);
                sts_f32(dsq + 4 * query_of(jc, q4, 1), sc1);
            }
            // the dS bytes of dQ's view, written transposed: row = query m, 128 keys a row, 128B
            // swizzle (16-byte chunk key / 16 ^ m % 8). The thread's keys are 64 cw + r (+ 8): chunk
            // 4 cw + warp, byte lane / 4 (+ 8); its queries m = 16 (j & 3) + (4 q + 2 (j >> 2) + bb), so
            // each (j >> 2, bb) has one base address and j & 3 and the row move it by constants
            const uint32_t ds_tile = sm.ds + buf * DS_BYTES;
            uint32_t base[2][2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int bb = 0; bb < 2; ++bb) {
                    const int mlo = 4 * q4 + 2 * hh + bb;
                    base[hh][bb] = ds_tile + mlo * 128 + (((4 * cw + warp) ^ (mlo & 7)) << 4) + (lane >> 2);
                }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int src = (j << 2) | q4;
                const float i0 = __shfl_sync(0xffffffffu, inv0, src), i1 = __shfl_sync(0xffffffffu, inv1, src);
#pragma unroll
                for (int bb = 0; bb < 2; ++bb) {
                    const float iv = bb ? i1 : i0;
                    const uint32_t two = e4m3x2(dp[4 * j + bb] * iv, dp[4 * j + 2 + bb] * iv);  // rows r, r + 8
                    const uint32_t addr = base[j >> 2][bb] + 2048 * (j & 3);
                    sts_u8(addr, two & 0xFF);
                    sts_u8(addr + 8, (two >> 8) & 0xFF);
                }
            }
            fence_view_async_shared();
            named_arrive(DS_BAR + DS_BUFS * cw + buf, 256);  // this consumer's dS of the tile is written
        }

        // -- dV += (P_r^T dO_c) * dO_c's channel scales, dK += ((dS_g^T Q_c) * k_scale) * Q_c's
        // channel scales: a fresh product per 64 columns of D, added in float32
        const uint64_t doc_desc = smem_desc(ST_DOC(sm, st), 2, 64);
        const uint64_t qc_desc = smem_desc(ST_QC(sm, st), 2, 64);
        add_fresh_product<false>(dv, pa, doc_desc, ST_NUM(sm, st) + 4 * NUM_DOCS, q4, k_scale);
        add_fresh_product<true>(dk, dsa, qc_desc, ST_NUM(sm, st) + 4 * NUM_QCS, q4, k_scale);
        // the stage is read (Q, dO_t, dO_c, Q_c, the numbers): hand it back
        __syncwarp();
        if (lane == 0) mbar_arrive(sm.empty + 8 * st);

        // dQ: consumer 1 of this tile, consumer 0 of the last one, so that the two need not meet
        // at every tile (each waits only for the other's dS of the tile it multiplies)
        if (g - 1 + cw >= 0) dq_tile(p, sm, g - 1 + cw, cw, r, q4, t128, n_tiles, t_lo, hkv, b, kc_desc);
    }
    // consumer 0 runs each tile's dQ one tile late: the last one after the walk
    if (cw == 0 && walk > 0) dq_tile(p, sm, walk - 1, cw, r, q4, t128, n_tiles, t_lo, hkv, b, kc_desc);
    if (t128 == 0) bulk_wait_all();

    // -- dK (times the softmax scale) and dV out, float32
    const long long out_row = (long long)bhk * p.Sk + key0;
#pragma unroll
    for (int jj = 0; jj < HEAD_DIM / 8; ++jj) {
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const long long o = (out_row + 8 * row) * HEAD_DIM + 8 * jj + 2 * q4;
            const int i = 4 * jj + 2 * row;
            *(float2*)(p.dk + o) = make_float2(dk[i] * p.sm_scale, dk[i + 1] * p.sm_scale);
            *(float2*)(p.dv + o) = make_float2(dv[i] * (1.0f / 256.0f), dv[i + 1] * (1.0f / 256.0f));  // P_r's 2**8
        }
    }
}
