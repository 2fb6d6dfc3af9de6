// The named barriers of the Hopper CUDA kernels (FlashAttention-3's FwdNamedBarriers and
// BwdNamedBarriers); 0 is __syncthreads.
// The forward: 1 .. CONSUMERS the consumers' turns on the tensor cores (the warp scheduler
// barriers: FlashAttention-3's ping-pong); 8 .. 8 + CONSUMERS - 1 each consumer's epilogue
// (epilogue_fwd.cuh).
// The backward (mainloop_bwd.cuh): 1 and 2 each consumer warpgroup's own (its dS column maxima,
// its dQ staging); 4 .. 9 each consumer's dS tile of each of the DS_BUFS buffers, written.
#pragma once
#include "ptx.cuh"

#define EPILOGUE_BARRIER0 8  // the forward's consumer c's epilogue barrier: EPILOGUE_BARRIER0 + c
#define WARPGROUP_BARRIER0 1  // the backward's consumer c's own 128 threads: WARPGROUP_BARRIER0 + c
// the backward's consumer c has written its dS of the tile in buffer b (256 threads: it arrives,
// the other consumer syncs before its dQ product): DS_BARRIER0 + DS_BUFS c + b
#define DS_BARRIER0 4

// The consumers take turns on the tensor cores, round robin: barrier 1 + c for consumer c
// (threads 128 (c + 1) ..): tid / 128 is one's own, tid / 128 % CONSUMERS + 1 the next
// one's. The id is derived from %tid.x inside the asm, so no register holds it across the
// loop (held in a register, ptxas spilled it; a template per consumer instead doubled the
// code, which ran 1.5x slower causal, by instruction-cache misses as far as measured).
__device__ __forceinline__ void warp_scheduler_barrier_sync() {
    asm volatile("{ .reg .u32 t; mov.u32 t, %%tid.x; shr.u32 t, t, 7; bar.sync t, %0; }" ::"n"(256) : "memory");
}

template <int CONSUMER_WARPGROUPS>
__device__ __forceinline__ void warp_scheduler_barrier_arrive() {
    asm volatile("{ .reg .u32 t; mov.u32 t, %%tid.x; shr.u32 t, t, 7; rem.u32 t, t, %1; add.u32 t, t, 1; bar.arrive t, %0; }"
                 ::"n"(256), "n"(CONSUMER_WARPGROUPS) : "memory");
}

// consumer 0 goes first: the last consumer (warpgroup CONSUMER_WARPGROUPS) hands it the
// first turn; the turns then run on across the CTA's units
template <int CONSUMER_WARPGROUPS>
__device__ __forceinline__ void warp_scheduler_barrier_init(int wg) {
    if (wg == CONSUMER_WARPGROUPS) named_arrive<1>(256);
}
