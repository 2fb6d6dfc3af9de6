// The Hopper CUDA forward's main loop (FlashAttention-3's CollectiveMainloop): the
// producer warpgroup's loads (producer_load: the TMA copies of Q, K and V^T;
// producer_load_key_scales: the key scales and bias) and a consumer warpgroup's products and
// softmax over one work unit (consumer_mma). The tiles pass through STAGES-deep rings of
// shared memory guarded by full/empty mbarriers; the consumers take turns on the tensor
// cores (named_barrier.cuh). consumer_mma calls softmax_tile<MASKED>(...) of the softmax
// header its translation unit includes before this one (softmax_fwd.cuh).
#pragma once
#include "kernel_traits_fwd.cuh"
#include "named_barrier.cuh"
#include "p_build.cuh"
#include "params_fwd.cuh"
#include "tile_scheduler_fwd.cuh"
#include "wgmma.cuh"

// QK^T: m64n128k32 (e4m3) or m64n128k16 (bf16, with its transpose immediates: both
// K-major) from shared memory (A = Q, B = K); FRESH: d = A B, else d += A B
#if QK_BF16
#define WGMMA_QK_OP "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"
#define WGMMA_QK_TRANS ", 0, 0"
#else
#define WGMMA_QK_OP "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
#define WGMMA_QK_TRANS ""
#endif
template <bool FRESH>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#define WGMMA_SS_N128 "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
    WGMMA_QK_OP " {" WGMMA_R64 "}, %64, %65, p, 1, 1" WGMMA_QK_TRANS ";\n}\n"
    if constexpr (FRESH)
        asm volatile(WGMMA_SS_N128 : WGMMA_D64(WGMMA_WO) : "l"(desc_a), "l"(desc_b), "r"(0));
    else
        asm volatile(WGMMA_SS_N128 : WGMMA_D64(WGMMA_RW) : "l"(desc_a), "l"(desc_b), "r"(1));
#undef WGMMA_SS_N128
}


#if HEAD_DIM == 128 && ROWSUM_BY_PV
#define wgmma_pv wgmma_rs_n136
#elif HEAD_DIM == 128
#define wgmma_pv wgmma_rs_n128
#elif ROWSUM_BY_PV
#define wgmma_pv wgmma_rs_n72
#else
#define wgmma_pv wgmma_rs_n64
#endif

__device__ __forceinline__ void issue_qk(float (&s)[64], uint64_t q_desc, uint32_t k_tile) {
    const uint64_t k_desc = smem_desc(k_tile, QK_SWIZZLE_LAYOUT, QK_ROW_BYTES);
    wgmma_ss_n128<true>(s, q_desc, k_desc);  // a fresh S: its last tile's values are dead
    // K-step c: 32 bytes into its chunk's rows (descriptor addresses count 16 bytes)
#pragma unroll
    for (int c = 1; c < QK_STEPS; ++c)
        wgmma_ss_n128<false>(s, q_desc + (c / 4) * (Q_CHUNK_BYTES >> 4) + 2 * (c % 4),
                             k_desc + (c / 4) * (K_CHUNK_BYTES >> 4) + 2 * (c % 4));
}

__device__ __forceinline__ void issue_pv(float (&pv)[PV_N / 2], const uint32_t (&pa)[4][4], uint32_t v_tile) {
    const uint64_t v_desc = smem_desc(v_tile, 1, BLOCK_N);
    wgmma_pv<true>(pv, pa[0], v_desc);  // a fresh product per tile (added to O in fp32)
#pragma unroll
    for (int c = 1; c < 4; ++c) wgmma_pv<false>(pv, pa[c], v_desc + 2 * c);
}

__device__ __forceinline__ void add_pv(float (&o)[HEAD_DIM / 2], const float (&pv)[PV_N / 2],
                                       const float (&alpha)[2], float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < HEAD_DIM / 2; ++r) o[r] = o[r] * alpha[(r >> 1) & 1] + pv[r];
#if ROWSUM_BY_PV
    // columns D .. D + 7 of the product are V^T's rows of ones: each the row sum of P
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + pv[HEAD_DIM / 2 + 2 * i];
#endif
}
// ------------------------------------------------------------------------------ producer
// Warp 0's one thread: each unit's Q (two buffers, taking turns from unit to unit) and its
// key tiles' K (permuted rows: two 4D boxes per chunk, kernel_fwd.cuh) and V^T into the
// rings.
__device__ __forceinline__ void producer_load(const Params& p, const Smem& sm, const SeqlenInfo& seqlen) {
    const int Sq = seqlen.Sq;
    int unit = 0, tile0 = 0;
    for (int u = blockIdx.x; u < p.units; u += gridDim.x, ++unit) {
        const WorkTile work = get_work_tile(p, u);
        const int bhk = work.bhk, n_tiles = work.n_tiles;
        // Q's buffer is free once the consumers' last QK^T of the unit two before has run
        const int qb = unit & 1;
        mbar_wait(sm.q_empty + 8 * qb, ((unit >> 1) & 1) ^ 1);  // a fresh barrier passes at once
        mbar_expect_tx(sm.q_full + 8 * qb, Q_BYTES);
#pragma unroll
        for (int c = 0; c < QK_CHUNKS; ++c)
            tma_load_2d(sm.q + qb * Q_BYTES + c * Q_CHUNK_BYTES, &p.q_map, c * QK_ROW_BYTES,
                        work.bh * Sq + work.start_m * BLOCK_M, sm.q_full + 8 * qb);
        const int group0 = bhk * (p.k_rows_per_head / 16);
        for (int j = 0; j < n_tiles; ++j) {
            const int g = tile0 + j, st = g % STAGES;
            const uint32_t free_parity = ((g / STAGES) & 1) ^ 1;  // a fresh barrier passes at once
            mbar_wait(sm.k_empty + 8 * st, free_parity);
            mbar_expect_tx(sm.k_full + 8 * st, K_BYTES);
            const uint32_t k_tile = sm.k + st * K_BYTES;
#pragma unroll
            for (int c = 0; c < QK_CHUNKS; ++c) {
                tma_load_4d(k_tile + c * K_CHUNK_BYTES, &p.k_map0, c * QK_ROW_BYTES, 0, 0,
                            group0 + j * (BLOCK_N / 16), sm.k_full + 8 * st);
                tma_load_4d(k_tile + c * K_CHUNK_BYTES + K_HALF_BYTES, &p.k_map1, c * QK_ROW_BYTES, 0, 0,
                            group0 + j * (BLOCK_N / 16), sm.k_full + 8 * st);
            }
            mbar_wait(sm.v_empty + 8 * st, free_parity);
            mbar_expect_tx(sm.v_full + 8 * st, V_BYTES);
            tma_load_2d(sm.v + st * V_STAGE_BYTES, &p.v_map, j * BLOCK_N, bhk * HEAD_DIM, sm.v_full + 8 * st);
        }
        tile0 += n_tiles;
    }
}

// Key scales (warp 1) and key bias (warp 2) of tile j into the stage whose V^T has been
// read: the consumers read them in the softmax, before that tile's PV. One warp each: in
// the producer's 24 registers one loop holding both spilled.
__device__ __forceinline__ void producer_load_key_scales(const Params& p, const Smem& sm, const SeqlenInfo& seqlen,
                                                         int warp, int lane) {
    const int Sk = seqlen.Sk;
    const bool bias = KEY_BIAS && warp == 2;
    float* dst = bias ? sm.bias : sm.ks;
    int tile0 = 0;
    for (int u = blockIdx.x; u < p.units; u += gridDim.x) {
        const WorkTile work = get_work_tile(p, u);
        const int n_tiles = work.n_tiles;
        const float* src = bias ? p.key_bias + (long long)(work.bh / p.H) * Sk : p.ks + (long long)work.bhk * Sk;
        for (int j = 0; j < n_tiles; ++j) {
            const int g = tile0 + j, st = g % STAGES;
            mbar_wait(sm.v_empty + 8 * st, ((g / STAGES) & 1) ^ 1);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kk = lane * 4 + e, key = j * BLOCK_N + kk;
                // MX_SUBNORMAL: K's scales times 2**-100 (exact; p_build.cuh says why)
                dst[st * BLOCK_N + kk] = key < Sk ? (MX_SUBNORMAL && !bias ? src[key] * MX_KS_SCALE : src[key]) : 0.0f;
            }
            mbar_arrive(sm.ks_full + 8 * st);
        }
        tile0 += n_tiles;
    }
}

// ------------------------------------------------------------------------------ consumer
// One consumer warpgroup (1 .. CONSUMERS) over one work unit (FlashAttention-3's mma): rows
// 64 (wg - 1) .. of the unit's query block, every key tile of it; per tile QK^T_j and
// PV_{j-1} issued together in the consumer's turn, then the softmax of tile j. Leaves O
// (not yet divided by l), the rows' softmax state and V's channel scales of the thread's
// output columns for the epilogue. tile0: the key tiles of the CTA's earlier units (the
// rings' stages and parities run on across units), unit: how many units came before (Q's
// parity). Checks: what a checking build reads between the steps (kernel_fwd.cuh's
// NoChecks: nothing).
template <class Checks>
__device__ __forceinline__ void consumer_mma(const Params& p, const Smem& sm, const SeqlenInfo& seqlen, int tid, int wg,
                                             const WorkTile& work, int tile0, int unit, float (&o)[HEAD_DIM / 2],
                                             Softmax& rows, float2 (&vsc)[HEAD_DIM / 8]) {
    const int start_m = work.start_m, bhk = work.bhk, full = work.full, n_tiles = work.n_tiles;
    const int Sq = seqlen.Sq, Sk = seqlen.Sk;
    const int cw = wg - 1;
    const int t = tid - 128 * wg, warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
    const int row0 = start_m * BLOCK_M + cw * 64 + 16 * warp + g;
    const int lim0 = CAUSAL ? min(Sk - 1, row0 + p.causal_offset) : Sk - 1;  // the last key row0 sees
#pragma unroll
    // rows past Sq (never stored) take the smallest normal scale: every score of theirs is
    // then 2**-126-small and a masked one still -inf (0 would make -inf * 0 a NaN P code)
    for (int i = 0; i < 2; ++i)
        rows.a[i] = row0 + 8 * i < Sq ? p.qs[(long long)work.bh * Sq + row0 + 8 * i] * p.qk_scale : 1.17549435e-38f;

    float s[64], pv[PV_N / 2];
    uint32_t pa[4][4];  // P of the last softmax, PV's A operand
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        rows.m[i] = -__int_as_float(0x7f800000);
        rows.l[i] = 0.0f;
    }
    // LAZY_RESCALE: the tiles since this warp last moved a row's point (every row moves on
    // its first key); below LAZY_QUIET_TILES it takes the next tile maximum first
    rows.quiet = 0;
#pragma unroll
    for (int r = 0; r < HEAD_DIM / 2; ++r) o[r] = 0.0f;

    // Q's two buffers take turns from unit to unit (the producer loads the next unit's Q
    // while this one's is still read)
    const int qb = unit & 1;
    const uint64_t q_desc = smem_desc(sm.q + qb * Q_BYTES + cw * 64 * QK_ROW_BYTES, QK_SWIZZLE_LAYOUT, QK_ROW_BYTES);
    mbar_wait(sm.q_full + 8 * qb, (unit >> 1) & 1);

    // tile 0: QK^T alone
    {
        const int st = tile0 % STAGES;
        const uint32_t parity = (tile0 / STAGES) & 1;
        mbar_wait(sm.k_full + 8 * st, parity);
        warp_scheduler_barrier_sync();
        wgmma_fence();
        issue_qk(s, q_desc, sm.k + st * K_BYTES);
        wgmma_commit();
        warp_scheduler_barrier_arrive<CONSUMERS>();
        wgmma_wait<0>();
        fence_regs(s);
        if (lane == 0) {
            mbar_arrive(sm.k_empty + 8 * st);
            if (n_tiles == 1) mbar_arrive(sm.q_empty + 8 * qb);  // Q is read by no more products
        }
        mbar_wait(sm.ks_full + 8 * st, parity);
        const uint32_t ks_tile = smem_addr(sm.ks + st * BLOCK_N);
        if (0 >= full)
            softmax_tile<true>(s, pa, rows, ks_tile, 0, lim0, p.Sk - 1, q);
        else
            softmax_tile<false>(s, pa, rows, ks_tile, 0, lim0, p.Sk - 1, q);
        Checks::p_tile(p, pa, 0, tid, work);
    }

    // tile j >= 1: QK^T_j and PV_{j-1} in one turn, both waited for, O updated, then the
    // softmax of tile j (the other consumer's products run meanwhile)
    for (int j = 1; j < n_tiles; ++j) {
        const int g = tile0 + j, st = g % STAGES, prev = (g - 1) % STAGES;
        const uint32_t parity = (g / STAGES) & 1, prev_parity = ((g - 1) / STAGES) & 1;
        mbar_wait(sm.k_full + 8 * st, parity);
        mbar_wait(sm.v_full + 8 * prev, prev_parity);
        warp_scheduler_barrier_sync();
        wgmma_fence();  // (S and the PV accumulator are written fresh: no fence keeps their old values)
        issue_pv(pv, pa, sm.v + prev * V_STAGE_BYTES);
        issue_qk(s, q_desc, sm.k + st * K_BYTES);
        wgmma_commit();
        warp_scheduler_barrier_arrive<CONSUMERS>();
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(pv);
        if (lane == 0) {
            mbar_arrive(sm.k_empty + 8 * st);
            mbar_arrive(sm.v_empty + 8 * prev);
            if (j == n_tiles - 1) mbar_arrive(sm.q_empty + 8 * qb);
        }
        add_pv(o, pv, rows.alpha, rows.l);
        mbar_wait(sm.ks_full + 8 * st, parity);
        const uint32_t ks_tile = smem_addr(sm.ks + st * BLOCK_N);
        if (j * BLOCK_N >= full)
            softmax_tile<true>(s, pa, rows, ks_tile, j * BLOCK_N, lim0, p.Sk - 1, q);
        else
            softmax_tile<false>(s, pa, rows, ks_tile, j * BLOCK_N, lim0, p.Sk - 1, q);
        Checks::p_tile(p, pa, j, tid, work);
    }

    // the last tile's PV; while it runs, V's channel scales of this thread's output columns
    // are loaded, all at once: in the epilogue's loop each load waited behind the store
    // before it (the compiler cannot move a load above a store that may alias it), which
    // cost about 4 us a unit at head dim 128, a seventh of a 4k-key row's time (measured)
    {
        const int g = tile0 + n_tiles - 1, st = g % STAGES;
        mbar_wait(sm.v_full + 8 * st, (g / STAGES) & 1);
        warp_scheduler_barrier_sync();
        wgmma_fence();
        issue_pv(pv, pa, sm.v + st * V_STAGE_BYTES);
        wgmma_commit();
        // the CTA's very last turn (the last consumer's of its last unit) goes to no one
        if (cw != CONSUMERS - 1 || (int)(blockIdx.x + (unit + 1) * gridDim.x) < p.units)
            warp_scheduler_barrier_arrive<CONSUMERS>();
        const float* vs = p.vs + (long long)bhk * HEAD_DIM + 2 * q;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(vsc[n].x), "=f"(vsc[n].y) : "l"(vs + 8 * n));
        wgmma_wait<0>();
        fence_regs(pv);
        if (lane == 0) mbar_arrive(sm.v_empty + 8 * st);
        add_pv(o, pv, rows.alpha, rows.l);
    }
}
