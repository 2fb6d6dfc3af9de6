// FP8 attention forward for Hopper (sm_90a): FlashAttention-3's schedule in CUDA C++
// with inline PTX, compiled at first use by NVRTC (fp4attn/kernels/hopper/forward_cuda.py).
//
// Numerics: FlashAttention-3's per-score work on the Gluon kernel's operands
// (forward_gluon_ws.attn_fwd_ws_kernel), Q/K multiplied on the FP8 tensor cores (the
// `fast_accum` recipes; with QK_BF16, Q/K in bf16 on the bf16 tensor cores: the exact
// recipes, whose float32 sums differ in order only):
//   w   = s * b_key                      one rounded product (a key bias: t = fma(w, a_row, bias))
//   m   = max(m, a_row * rowmax w);  alpha = exp2(m_old - m)
//   P   = e4m3(exp2(fma(w, a_row, 8 - m)))   packed cvt.rn.satfinite, P times 2**8; or the
//                                        affine map's FP8 or MXFP4 codes (AFFINE_P, AFFINE_MX)
//   l   = l * alpha + rowsum(P as represented)   from the PV product (softmax_fwd.cuh)
//   O   = O * alpha + P V                each tile's PV on a fresh accumulator, added in fp32
//   out = O / l * vs,  lse = (m + log2 l - 8) * ln 2
// P codes equal the recipe's arithmetic on 99.986% of entries (a quarter of the exp2s by a
// polynomial, EXP_POLY); a checking build of the recipe's arithmetic operation for operation
// (dev/cuda/attn_fwd_fp8_check.cu) is bit-identical to the Gluon kernel.
//
// Files by role, beside this one: kernel_fwd.cuh (the kernel body: roles and schedule),
// mainloop_fwd.cuh (the producer's loads, a consumer's products and softmax per unit),
// softmax_fwd.cuh (the online softmax's tile step), p_build.cuh (the P builders and row
// statistics), epilogue_fwd.cuh (O / l and the LSE out), kernel_traits_fwd.cuh (tile sizes
// and shared memory), params_fwd.cuh (the kernel parameter), tile_scheduler_fwd.cuh (work
// units), named_barrier.cuh (the consumers' turns), and the PTX wrappers and wgmma pieces
// shared with the backward (ptx.cuh, wgmma.cuh).
//
// Compile-time parameters (NVRTC -D, from forward_cuda.Variant's fields): HEAD_DIM 64 or
// 128, CAUSAL, KEY_BIAS, STAGES (the K/V^T ring's depth), CONSUMERS (consumer warpgroups,
// 2 or 3: 128 or 192 query rows per CTA), EXP_POLY, AFFINE_P, AFFINE_MX, LAZY_RESCALE,
// KEY_TILE_SCALE, QK_BF16.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef KEY_BIAS
#define KEY_BIAS 0
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef EXP_POLY
#define EXP_POLY 0  // of the 16 column groups (4 scores each), how many take exp2 from ex2_poly
#endif
#ifndef AFFINE_P
#define AFFINE_P 0  // 1: FP8 P by the affine map, no exp2 (p_build.cuh)
#endif
#ifndef AFFINE_MX
#define AFFINE_MX 0  // AFFINE_P only: 1, MXFP4 P by the affine map (P mode 5; p_build.cuh)
#endif
#ifndef LAZY_RESCALE
// AFFINE_P only: 1, Recipe.rescale="lazy" (reference/affine.lazy_reference_point): P built
// from the row's point without waiting for the tile's maximum; the rows move only when a byte
// would not fit (softmax_fwd.cuh)
#define LAZY_RESCALE 0
#endif
#ifndef KEY_TILE_SCALE
// 1: the key scales are one value per key tile (Recipe.k_scale="tile"): folded into each
// row's factor once per tile, no product per score
#define KEY_TILE_SCALE 0
#endif
#ifndef QK_BF16
// 1: Q and K in bf16, QK^T on the bf16 tensor cores (float32 sums of exact products: the
// exact recipes, whose e4m3 or NVFP4 values bf16 holds exactly); 0: e4m3, the fast_accum recipes
#define QK_BF16 0
#endif
#ifndef CONSUMERS
#define CONSUMERS 2  // consumer warpgroups of 64 query rows; 3 fits the registers at HEAD_DIM 64 only
#endif

// The kernel's form: the row sums of P from the PV product, and MXFP4 P's codes read off
// subnormal FMA results wherever K is scaled per key with no key bias (p_build.cuh)
#define ROWSUM_BY_PV 1
#define MX_SUBNORMAL (AFFINE_MX && !KEY_BIAS && !KEY_TILE_SCALE)

#include "softmax_fwd.cuh"
#include "kernel_fwd.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_fwd_fp8(const __grid_constant__ Params p) {
    attn_fwd<NoChecks>(p);
}
