// The Hopper CUDA backward's kernel body (FlashAttention-3's flash_bwd_kernel_sm90.h): the CTA's
// mbarriers and its producer and consumer warpgroups' roles (mainloop_bwd.cuh). The translation
// unit defines the __global__ entry that calls attn_bwd (attn_bwd_fp8.cu).
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
#pragma once
#include "kernel_traits_bwd.cuh"
#include "mainloop_bwd.cuh"
#include "params_bwd.cuh"
#include "tile_scheduler_bwd.cuh"

__device__ __forceinline__ void attn_bwd(const Params& p) {
    extern __shared__ unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const WorkTile work = get_work_tile(p);

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
        // producer: its registers to the consumers; one thread issues every copy
        warpgroup_reg_dealloc<PRODUCER_REGS>();
        if (tid == 0) producer_load(p, carve(smem_raw), work);
        return;
    }
    // consumers 1 and 2: 64 keys each
    warpgroup_reg_alloc<CONSUMER_REGS>();
    consumer_mma(p, carve(smem_raw), work, tid, wg);
}
