// The Hopper CUDA forward's epilogue (FlashAttention-3's CollectiveEpilogue::store): a
// consumer warpgroup's 64 output rows O / l * vs as bf16, staged in its shared-memory stage
// and copied out in whole rows, and the rows' LSE.
#pragma once
#include "kernel_traits_fwd.cuh"
#include "named_barrier.cuh"
#include "p_build.cuh"
#include "params_fwd.cuh"
#include "tile_scheduler_fwd.cuh"

// O / l * vs as bf16 into this consumer's stage, then out in whole 16-byte pieces of rows
// (a warp stores 512 contiguous bytes): the fragments' own 4-byte stores, 8 rows of 16
// bytes a warp instruction, cost about 2.4 us a unit at head dim 128 (measured). The LSE:
// (m + log2 l - the P offset) ln 2, -inf for a row that saw no key (whose output is 0), NaN
// for a row that read a NaN score.
__device__ __forceinline__ void epilogue_store(const Params& p, const Smem& sm, const SeqlenInfo& seqlen,
                                               const WorkTile& work, const float (&o)[HEAD_DIM / 2],
                                               const Softmax& rows, const float2 (&vsc)[HEAD_DIM / 8]) {
    const int Sq = seqlen.Sq, start_m = work.start_m, bh = work.bh;
    const float(&m)[2] = rows.m;
    const float(&l)[2] = rows.l;
    // the thread's place from %tid.x read again (no register holds it across the loop)
    int et;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(et));
    const int ecw = et / 128 - 1, el = et % 128, eq = el % 4;
    const uint32_t stage = sm.o + ecw * O_STAGE_BYTES;
    const int r0 = 16 * (el / 32) + (el % 32) / 4;  // the thread's first row in the stage
    // every thread has read the stage of the unit before (its copy-out below)
    asm volatile("bar.sync %0, 128;" ::"r"(EPILOGUE_BARRIER0 + ecw) : "memory");
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float li = l[i];  // the whole row's (reduced over the quad every tile)
        // 0 only for a row that saw no key; a NaN row's l is NaN and stays so (its LSE too)
        const bool seen = li != 0.0f;
        float inv = 0.0f;
        if (seen) asm("rcp.rn.f32 %0, %1;" : "=f"(inv) : "f"(li));
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {
            const float y0 = (o[4 * n + 2 * i] * inv) * vsc[n].x;
            const float y1 = (o[4 * n + 2 * i + 1] * inv) * vsc[n].y;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(stage + (r0 + 8 * i) * O_ROW_BYTES + 2 * (8 * n + 2 * eq)),
                         "r"(pack_bf16x2(y0, y1)) : "memory");
        }
        const int row = start_m * BLOCK_M + ecw * 64 + r0 + 8 * i;
        if (eq == 0 && row < Sq)
            p.lse[(long long)bh * Sq + row] =
                seen ? ((m[i] + lg2(li)) - LSE_P_OFFSET) * 0.6931471805599453f : -__int_as_float(0x7f800000);
    }
    asm volatile("bar.sync %0, 128;" ::"r"(EPILOGUE_BARRIER0 + ecw) : "memory");
    constexpr int PIECES = 2 * HEAD_DIM / 16;  // 16-byte pieces a row
    const int row_base = start_m * BLOCK_M + ecw * 64;
#pragma unroll
    for (int k = 0; k < 64 * PIECES / 128; ++k) {
        const int c = el + 128 * k, r = c / PIECES, col = c % PIECES;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(stage + r * O_ROW_BYTES + 16 * col) : "memory");
        if (row_base + r < Sq)
            *(uint4*)(p.out + ((long long)bh * Sq + row_base + r) * HEAD_DIM + 8 * col) = v;
    }
}
