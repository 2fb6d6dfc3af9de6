// The Hopper CUDA backward's main loop (FlashAttention-3's CollectiveMainloopBwd): the
// producer's loads (producer_load) and a consumer warpgroup's walk over the query tiles
// (consumer_mma): each tile's S^T and dP^T, the softmax gradient between them
// (softmax_bwd.cuh), the dV and dK products added in float32 (add_fresh_product), and dQ's
// partial product over the CTA's keys added to the float32 workspace (dq_tile).
#pragma once
#include "kernel_traits_bwd.cuh"
#include "named_barrier.cuh"
#include "epilogue_bwd.cuh"
#include "params_bwd.cuh"
#include "softmax_bwd.cuh"
#include "tile_scheduler_bwd.cuh"
#include "wgmma.cuh"

// ------------------------------------------------------------------------------ producer
// The producer's one thread (warp 0's lane 0): K, V and K_c of the CTA's keys once, then each
// walk step's Q and dO_t (permuted rows: two 4D boxes each), dO_c, Q_c and per-query numbers
// into the STAGES-deep ring.
__device__ __forceinline__ void producer_load(const Params& p, const Smem& sm, const WorkTile& work) {
    mbar_expect_tx(sm.kv_full, K_BYTES + V_BYTES + KC_BYTES);
    const int key_row = work.bhk * p.Sk + work.n0;
#pragma unroll
    for (int c = 0; c < QK_CHUNKS; ++c) tma_load_2d(sm.k + c * K_CHUNK_BYTES, &p.k_map, c * 128, key_row, sm.kv_full);
    tma_load_2d(sm.v, &p.v_map, 0, key_row, sm.kv_full);
    tma_load_2d(sm.kc, &p.kc_map, work.n0, work.bhk * HEAD_DIM, sm.kv_full);
    for (int g = 0; g < work.walk; ++g) {
        const QueryTile tile = query_tile(p, work, g);
        const int bh = tile.bh, t = tile.t, row = bh * p.Sq + t * BLOCK_M, st = g % STAGES;
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

// ------------------------------------------------------------------------------ consumer
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
__device__ __forceinline__ void dq_tile(const Params& p, const Smem& sm, const WorkTile& work, int g, int cw, int r, int q4,
                                        int t128, uint64_t kc_desc) {
    const QueryTile tile = query_tile(p, work, g);
    const int bh = tile.bh, t = tile.t, buf = g % DS_BUFS;
    named_sync(DS_BARRIER0 + DS_BUFS * (1 - cw) + buf, 256);  // the other consumer's dS of tile g
    named_sync(WARPGROUP_BARRIER0 + cw, 128);                 // and this consumer's own
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
    named_sync(WARPGROUP_BARRIER0 + cw, 128);
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
    named_sync(WARPGROUP_BARRIER0 + cw, 128);
    if (t128 == 0)
        bulk_reduce_add_f32(p.dq_accum + (((long long)bh * work.n_tiles + t) * 2 + cw) * (64 * DQS_ROW), stage, DQS_BYTES);
}

// One consumer warpgroup (wg 1 or 2: keys n0 + 64 cw ..) over the CTA's walk (FlashAttention-3's
// mma): per query tile S^T and dP^T issued together, the softmax gradient (softmax_bwd.cuh), the
// FP8 views of P and dS, the dV and dK products, and dQ's partial product of the tile before
// (consumer 0) or this one (consumer 1); then the epilogue (epilogue_bwd.cuh). dK and dV stay in
// registers across the walk. They are declared here and the views built inline, not in functions
// of their own: so split (dK and dV passed in by reference, the views' temporary arrays in
// callees), the same source compiled to other machine code than the kernel measured.
__device__ __forceinline__ void consumer_mma(const Params& p, const Smem& sm, const WorkTile& work, int tid, int wg) {
    const int cw = wg - 1;
    const int t128 = tid % 128, warp = t128 / 32, lane = tid % 32;
    const int q4 = lane & 3;
    const int r = 16 * warp + lane / 4;    // this thread's rows r, r + 8 of the consumer's 64 keys
    const int key0 = work.n0 + 64 * cw + r;   // the key of row r (row r + 8: key0 + 8)

    float dk[HEAD_DIM / 2], dv[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) dk[i] = dv[i] = 0.0f;
    // K's and V_t's token scales of the thread's two keys
    const long long krow = (long long)work.bhk * p.Sk + key0;
    const float ks_r[2] = {p.ks[krow], p.ks[krow + 8]};
    const float vs_r[2] = {p.vts[krow], p.vts[krow + 8]};

    const uint64_t k_desc = smem_desc(sm.k + cw * 64 * 128, 1, 128);
    const uint64_t v_desc = smem_desc(sm.v + cw * 64 * E_ROW_BYTES, E_LAYOUT, E_ROW_BYTES);
    const uint64_t kc_desc = smem_desc(sm.kc + cw * DQ_N * 128, 1, 128);  // this consumer's half of D
    mbar_wait(sm.kv_full, 0);

    for (int g = 0; g < work.walk; ++g) {
        const int t = tile_of(work, g);
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
        const bool diag = t * BLOCK_M + p.causal_offset < work.n0 + BLOCK_N - 1;
#else
        const bool diag = false;
#endif
        // the tile's per-query numbers, read where used, a pair of adjacent queries at a time
        const uint32_t num_addr = ST_NUM(sm, st);

        // -- P^T = exp2(t - lse2), then P_r^T (e4m3, times 2**8) as the dV product's A fragments
        wgmma_wait<1>();
        fence_regs(s);
        compute_p(s, p, num_addr, ks_r, q4, key0, t, diag);
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
        compute_ds(dp, s, num_addr, vs_r, q4);

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
            named_sync(WARPGROUP_BARRIER0 + cw, 128);
            float m0 = cm[0], m1 = cm[1];
#pragma unroll
            for (int other = 0; other < 4; ++other) {
                const float2 o = lds_f2(amax + 4 * 64 * other);
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
            named_arrive(DS_BARRIER0 + DS_BUFS * cw + buf, 256);  // this consumer's dS of the tile is written
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
        if (g - 1 + cw >= 0) dq_tile(p, sm, work, g - 1 + cw, cw, r, q4, t128, kc_desc);
    }
    // consumer 0 runs each tile's dQ one tile late: the last one after the walk
    if (cw == 0 && work.walk > 0) dq_tile(p, sm, work, work.walk - 1, cw, r, q4, t128, kc_desc);
    if (t128 == 0) bulk_wait_all();
    epilogue_store(p, work, key0, q4, dk, dv);
}
