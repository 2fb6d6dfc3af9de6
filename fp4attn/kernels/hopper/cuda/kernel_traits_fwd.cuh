// The Hopper CUDA forward's compile-time shape (kernel_fwd.cuh): tile sizes, the threads'
// roles and registers, and the shared-memory layout (Smem). It reads the kernel's
// compile-time parameters (attn_fwd_fp8.cu: HEAD_DIM, CAUSAL, KEY_BIAS, STAGES,
// CONSUMERS, QK_BF16, AFFINE_P, LAZY_RESCALE, ...) and the form the translation unit fixes:
// ROWSUM_BY_PV (1: the row sums of P from the PV product, softmax_fwd.cuh) and
// MX_SUBNORMAL (p_build.cuh).
#pragma once
#include "ptx.cuh"

#if !defined(ROWSUM_BY_PV) || !defined(MX_SUBNORMAL)
#error "the kernel's translation unit fixes ROWSUM_BY_PV and MX_SUBNORMAL before including the forward's headers"
#endif
#if AFFINE_MX && !(AFFINE_P && ROWSUM_BY_PV)
#error "AFFINE_MX is a form of the affine P: it needs AFFINE_P and the row sums from the PV product"
#endif

#define BLOCK_M (64 * CONSUMERS)  // query rows per CTA: one consumer warpgroup per 64 rows (wgmma's M)
#define BLOCK_N 128  // keys per tile: part of the recipes' numerics (the online softmax's steps)
#define THREADS (128 * (CONSUMERS + 1))
// registers per consumer thread after setmaxnreg, and what the producer keeps: the CTA's
// launch allocation (168 a thread for two consumers, 128 for three: __launch_bounds__) is
// all there is to move between them (a consumer's setmaxnreg.inc waits until the producer's
// .dec has freed enough)
#define CONSUMER_REGS (CONSUMERS == 2 ? 240 : 160)
#define PRODUCER_REGS (CONSUMERS == 2 ? 24 : 32)
#if CONSUMERS == 3 && HEAD_DIM == 128
#error "three consumers do not fit 160 registers at head dim 128"
#endif
#define P_OFFSET 8.0f  // P is stored times 2**8 (reference/encoding.P_OFFSET_LOG2)
// LAZY_RESCALE's bytes stand for P times 2**5 (reference/affine.P_OFFSET_LOG2_LAZY)
#define LSE_P_OFFSET (AFFINE_P && LAZY_RESCALE ? 5.0f : P_OFFSET)

// Shared memory: Q and K (e4m3, or bf16 with QK_BF16) in column chunks of one swizzle span
// (128 bytes; 64 for e4m3 at head dim 64), one chunk for e4m3, two for bf16 at head dim 128,
// each chunk's rows one after another; V^T rows of BLOCK_N = 128 key bytes swizzled by 128.
#define QK_ELEM_BYTES (QK_BF16 ? 2 : 1)
#define QK_GLOBAL_ROW_BYTES (HEAD_DIM * QK_ELEM_BYTES)
#define QK_ROW_BYTES (QK_GLOBAL_ROW_BYTES < 128 ? QK_GLOBAL_ROW_BYTES : 128)
#define QK_CHUNKS (QK_GLOBAL_ROW_BYTES / QK_ROW_BYTES)
#define QK_SWIZZLE_LAYOUT (QK_ROW_BYTES == 128 ? 1 : 2)  // wgmma descriptor: 1 = 128B, 2 = 64B swizzle
#define QK_STEPS (QK_GLOBAL_ROW_BYTES / 32)  // QK^T's 32-byte K-steps (k32 e4m3, k16 bf16)
#define Q_BYTES (BLOCK_M * QK_GLOBAL_ROW_BYTES)
#define K_BYTES (BLOCK_N * QK_GLOBAL_ROW_BYTES)
#define Q_CHUNK_BYTES (BLOCK_M * QK_ROW_BYTES)
#define K_CHUNK_BYTES (BLOCK_N * QK_ROW_BYTES)
#define V_BYTES (HEAD_DIM * BLOCK_N)
#define K_HALF_BYTES (K_CHUNK_BYTES / 2)  // a chunk's rows 64 .. 127: the second permuted box
// ROWSUM_BY_PV: each V^T stage is followed by 8 rows of e4m3 ones (written once), the
// PV product's extra 8 columns; every one of them is the row sum of P
#define ONES_BYTES (ROWSUM_BY_PV ? 8 * BLOCK_N : 0)
#define V_STAGE_BYTES (V_BYTES + ONES_BYTES)
#define PV_N (HEAD_DIM + (ROWSUM_BY_PV ? 8 : 0))
// the epilogue stages each consumer's 64 output rows in shared memory, rows padded by 16
// bytes (the fragment writes then hit 32 distinct banks), and copies them out in whole rows
#define O_ROW_BYTES (2 * HEAD_DIM + 16)
#define O_STAGE_BYTES (64 * O_ROW_BYTES)

// The CTA's shared memory (FlashAttention-3's SharedStorage), carved from the dynamic
// allocation (forward_cuda.Variant.shared_bytes says its size).
struct Smem {
    uint32_t q, k, v;  // tile bases (shared-memory addresses, 1024-byte aligned): two Q buffers
    uint32_t o;        // the consumers' output stages (CONSUMERS x O_STAGE_BYTES)
    float* ks;         // STAGES x BLOCK_N key scales
    float* bias;       // STAGES x BLOCK_N key bias (KEY_BIAS)
    uint32_t q_full, q_empty, k_full, k_empty, v_full, v_empty, ks_full;  // barrier arrays (8 bytes apart)
};

__device__ __forceinline__ Smem carve(unsigned char* raw) {
    unsigned char* base = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
    Smem s;
    s.q = smem_addr(base);
    s.k = s.q + 2 * Q_BYTES;  // two Q buffers
    s.v = s.k + STAGES * K_BYTES;
    s.o = s.v + STAGES * V_STAGE_BYTES;
    unsigned char* rest = base + 2 * Q_BYTES + STAGES * (K_BYTES + V_STAGE_BYTES) + CONSUMERS * O_STAGE_BYTES;
    s.ks = (float*)rest;
    s.bias = s.ks + STAGES * BLOCK_N;
    uint32_t bars = smem_addr(s.bias + STAGES * BLOCK_N);
    s.q_full = bars;  // two each
    s.q_empty = bars + 16;
    s.k_full = bars + 32;
    s.k_empty = s.k_full + 8 * STAGES;
    s.v_full = s.k_empty + 8 * STAGES;
    s.v_empty = s.v_full + 8 * STAGES;
    s.ks_full = s.v_empty + 8 * STAGES;
    return s;
}
