// The Hopper CUDA forward's kernel body (FlashAttention-3's flash_fwd_kernel_sm90.h): the
// CTA's mbarriers, the producer and consumer warpgroups' roles, unit after unit. A
// translation unit includes its softmax header (softmax_fwd.cuh) and then this one, and
// defines the __global__ entry that calls attn_fwd (attn_fwd_fp8.cu).
//
// Schedule (a work unit = 64 * CONSUMERS query rows of one head; a CTA = a producer and
// CONSUMERS consumer warpgroups, taking units u = blockIdx.x, + gridDim.x, ... until p.units:
// one each where the grid has a CTA per unit, or a persistent grid of one CTA per SM, where
// the producer loads the next unit's Q and first tiles during the last one's final
// products and epilogue, and the consumers' turns run on from unit to unit):
//   warpgroup 0, producer (setmaxnreg down to 24 or 32): warp 0 issues the TMA copies of each
//     unit's Q (two buffers) and of K_j and V^T_j into STAGES-deep rings (full/empty
//     mbarriers); warp 1 copies the tile's key scales, and warp 2 its key bias, into
//     shared memory beside them (mainloop_fwd.cuh: producer_load, producer_load_key_scales);
//   warpgroups 1 .. CONSUMERS, consumers (setmaxnreg up to 240 for two, 160 for three), 64
//     query rows each: per tile QK^T_j and PV_{j-1} issued together, then the softmax of
//     tile j (consumer_mma), then the epilogue (epilogue_fwd.cuh). The consumers take turns
//     on the tensor cores, round robin through named barriers (named_barrier.cuh), so that
//     one's softmax runs while another's products do (FlashAttention-3's ping-pong). The
//     softmax is the longer path and its dependent chains are what bound it: a third
//     consumer (head dim 64, where it fits) gives each scheduler a third warp of it to
//     interleave.
//
// P goes from the QK^T accumulator into the A operand of the PV product in registers. The
// two layouts differ for 8-bit A: a thread's accumulator holds key pairs {2q, 2q+1} and
// {8+2q, 9+2q} of each 16 columns, the A fragment wants keys {4q .. 4q+3}. Instead of
// moving bytes between threads, K's rows are loaded permuted: shared-memory row
// 64h + 8n + 2q + b of a tile holds key 16n + 4q + 2h + b (two 4D TMA boxes, one per h),
// so that the accumulator's columns come out as the keys the A fragment wants; the key
// scales, masks and causal limits use the permuted key index.
#pragma once
#include "epilogue_fwd.cuh"
#include "kernel_traits_fwd.cuh"
#include "mainloop_fwd.cuh"
#include "named_barrier.cuh"
#include "params_fwd.cuh"
#include "tile_scheduler_fwd.cuh"

// What the production kernel reads between the consumers' steps: nothing. A checking
// build (dev/cuda/attn_fwd_fp8_check.cu) passes a type of its own with the same members.
struct NoChecks {
    // after the softmax of key tile j: its P codes as the PV product's A fragments
    static __device__ __forceinline__ void p_tile(const Params&, const uint32_t (&)[4][4], int, int,
                                                  const WorkTile&) {}
    // after the main loop: true leaves the unit's epilogue out
    static __device__ __forceinline__ bool skip_epilogue(const Params&) { return false; }
};

// One consumer warpgroup over one work unit: the main loop, then the epilogue.
template <class Checks>
__device__ __forceinline__ void consumer_unit(const Params& p, const Smem& sm, int tid, int wg, const WorkTile& work,
                                              int tile0, int unit) {
    const SeqlenInfo seqlen{p.Sq, p.Sk};
    float o[HEAD_DIM / 2];
    Softmax rows;
    float2 vsc[HEAD_DIM / 8];
    consumer_mma<Checks>(p, sm, seqlen, tid, wg, work, tile0, unit, o, rows, vsc);
    if (Checks::skip_epilogue(p)) return;
    epilogue_store(p, sm, seqlen, work, o, rows, vsc);
}

template <class Checks>
__device__ __forceinline__ void attn_fwd(const Params& p) {
    extern __shared__ unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const int wg = tid / 128;
    if (tid == 0) {
        const Smem sm = carve(smem_raw);
        for (int b = 0; b < 2; ++b) {
            mbar_init(sm.q_full + 8 * b, 1);
            mbar_init(sm.q_empty + 8 * b, 4 * CONSUMERS);  // one arrival per consumer warp
        }
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(sm.k_full + 8 * st, 1);
            mbar_init(sm.v_full + 8 * st, 1);
            mbar_init(sm.k_empty + 8 * st, 4 * CONSUMERS);  // one arrival per consumer warp
            mbar_init(sm.v_empty + 8 * st, 4 * CONSUMERS);
            mbar_init(sm.ks_full + 8 * st, 32 * (1 + KEY_BIAS));  // each lane of the scales (and bias) warp
        }
        fence_barrier_init();
    }
#if ROWSUM_BY_PV
    {  // the rows of ones after each V^T stage (e4m3 1.0 = 0x38; swizzling moves nothing in
       // a row of equal bytes), made visible to the tensor cores' async proxy
        const Smem sm = carve(smem_raw);
        for (int w = tid; w < STAGES * ONES_BYTES / 4; w += THREADS) {
            const uint32_t addr = sm.v + (w / (ONES_BYTES / 4)) * V_STAGE_BYTES + V_BYTES + 4 * (w % (ONES_BYTES / 4));
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(0x38383838u) : "memory");
        }
        fence_view_async_shared();
    }
#endif
    __syncthreads();

    if (wg == 0) {
        // ---------------------------------------------------------------- producer
        warpgroup_reg_dealloc<PRODUCER_REGS>();
        const Smem sm = carve(smem_raw);
        const SeqlenInfo seqlen{p.Sq, p.Sk};
        const int warp = tid / 32, lane = tid % 32;
        if (warp == 0 && lane == 0)
            producer_load(p, sm, seqlen);
        else if (warp == 1 || (KEY_BIAS && warp == 2))
            producer_load_key_scales(p, sm, seqlen, warp, lane);
    } else {
        // consumers: each role one branch of this if/else with its setmaxnreg (ptxas applies
        // the new register budget only so)
        warpgroup_reg_alloc<CONSUMER_REGS>();
        // turn-taking on the tensor cores: consumer cw issues its products after bar.sync on
        // barrier 1 + cw and hands the turn over by bar.arrive on the next one's
        warp_scheduler_barrier_init<CONSUMERS>(wg);
        // only the unit count is carried from unit to unit (each carried value costs the
        // 160-register builds spills): without a causal mask every unit has the same tiles
#if CAUSAL
        int tile0 = 0;
#endif
        for (int unit = 0; (int)(blockIdx.x + unit * gridDim.x) < p.units; ++unit) {
            const WorkTile work = get_work_tile(p, blockIdx.x + unit * gridDim.x);
#if !CAUSAL
            const int tile0 = unit * work.n_tiles;
#endif
            consumer_unit<Checks>(p, carve(smem_raw), tid, wg, work, tile0, unit);
#if CAUSAL
            tile0 += work.n_tiles;
#endif
        }
    }
}
