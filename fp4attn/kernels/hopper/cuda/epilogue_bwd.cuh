// The Hopper CUDA backward's epilogue (FlashAttention-3's CollectiveEpilogueBwd): a consumer
// thread's rows key0 and key0 + 8 of dK (times the softmax scale) and dV (P_r's 2**8 taken
// out), float32, columns 8 j + 2 q4 + {0, 1}.
#pragma once
#include "kernel_traits_bwd.cuh"
#include "params_bwd.cuh"
#include "tile_scheduler_bwd.cuh"

__device__ __forceinline__ void epilogue_store(const Params& p, const WorkTile& work, int key0, int q4,
                                               const float (&dk)[HEAD_DIM / 2], const float (&dv)[HEAD_DIM / 2]) {
    const long long out_row = (long long)work.bhk * p.Sk + key0;
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
