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
// Files by role, beside this one: kernel_bwd.cuh (the kernel body: roles and schedule),
// mainloop_bwd.cuh (the producer's loads, a consumer's walk: its products and dQ's
// accumulation), softmax_bwd.cuh (P, dS and the pieces of their FP8 views), epilogue_bwd.cuh
// (dK and dV out), kernel_traits_bwd.cuh (tile sizes and shared memory), params_bwd.cuh (the
// kernel parameter), tile_scheduler_bwd.cuh (a CTA's keys and query tiles), and what the
// forward shares: named_barrier.cuh, the PTX wrappers and wgmma pieces (ptx.cuh, wgmma.cuh).
//
// Compile-time parameters (NVRTC -D): HEAD_DIM 64 or 128, CAUSAL.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif

#include "kernel_bwd.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_bwd_fp8(const __grid_constant__ Params p) {
    attn_bwd(p);
}
