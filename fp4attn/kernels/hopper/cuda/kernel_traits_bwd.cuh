// The Hopper CUDA backward's compile-time shape (kernel_bwd.cuh): tile sizes, the threads'
// roles and registers, and the shared-memory layout (Smem, a stage's parts, the per-tile
// numbers' offsets). It reads the kernel's compile-time parameters (attn_bwd_fp8.cu:
// HEAD_DIM, CAUSAL).
#pragma once
#include "ptx.cuh"

#define STAGES 2
#define BLOCK_N 128  // keys per CTA: two consumer warpgroups of 64
#define BLOCK_M 64   // queries per tile: part of the recipe (dS's per-64 scales)
#define THREADS 384  // a producer and two consumer warpgroups
#define CONSUMER_REGS 240  // registers a thread after setmaxnreg: the consumers up, the producer down
#define PRODUCER_REGS 24

// Q and K in bf16: rows of 2 D bytes in chunks of one 128-byte swizzle span
#define QK_ROW_BYTES (2 * HEAD_DIM)
#define QK_CHUNKS (QK_ROW_BYTES / 128)
#define QK_STEPS (QK_ROW_BYTES / 32)  // S^T's k16 steps
#define Q_CHUNK_BYTES (BLOCK_M * 128)
#define K_CHUNK_BYTES (BLOCK_N * 128)
#define Q_BYTES (BLOCK_M * QK_ROW_BYTES)
#define K_BYTES (BLOCK_N * QK_ROW_BYTES)
// e4m3 token-major tiles (V, dO_t): rows of D bytes, swizzled by 128 (D = 128) or 64 (D = 64)
#define E_ROW_BYTES HEAD_DIM
#define E_LAYOUT (HEAD_DIM == 128 ? 1 : 2)  // wgmma descriptor: 1 = 128B, 2 = 64B swizzle
#define E_STEPS (HEAD_DIM / 32)
#define V_BYTES (BLOCK_N * HEAD_DIM)
#define DOT_BYTES (BLOCK_M * HEAD_DIM)
// channel-major tiles: dO_c, Q_c (D rows of 64 query bytes, 64B swizzle); K_c (D rows of 128 key bytes)
#define DOC_BYTES (HEAD_DIM * BLOCK_M)
#define KC_BYTES (HEAD_DIM * BLOCK_N)
// per-tile numbers: lse, delta, qs, dO's token scales (64 each), dO_c's and Q_c's channel scales (D each)
#define NUM_FLOATS (4 * BLOCK_M + 2 * HEAD_DIM)
#define NUM_BYTES (((NUM_FLOATS * 4) + 1023) / 1024 * 1024)
#define STAGE_BYTES (Q_BYTES + DOT_BYTES + 2 * DOC_BYTES + NUM_BYTES)
#define DS_BYTES (BLOCK_M * BLOCK_N)  // dS (64 queries x 128 keys, e4m3, 128B swizzle)
// dS tiles in flight: consumer 0 reads tile g's while both write g + 1's and consumer 1 may still read g - 1's
#define DS_BUFS 3
#define DQ_N (HEAD_DIM / 2)            // dQ's columns per consumer
// a consumer's staged float32 dQ partial: rows of DQ_N floats and 4 of padding, so that the 8 rows
// a warp's float2 stores touch fall in distinct banks (the workspace keeps the padding: one bulk copy)
#define DQS_ROW (DQ_N + 4)
#define DQS_BYTES (BLOCK_M * DQS_ROW * 4)
#define SMEM_BYTES (1024 + K_BYTES + V_BYTES + KC_BYTES + STAGES * STAGE_BYTES + DS_BUFS * DS_BYTES + 2 * DQS_BYTES \
                    + 2 * 2 * 4 * 64 * 4 + DS_BUFS * 2 * 64 * 4 + 64)

// The CTA's shared memory (FlashAttention-3's SharedStorage), carved from the dynamic
// allocation (SMEM_BYTES; backward_cuda.Variant.shared_bytes says the same size).
struct Smem {
    uint32_t k, v, kc, stage, ds, dqs;
    uint32_t amax;  // float [parity][consumer][warp][64]: each warp's column maxima of dS (dQ's view)
    uint32_t dsq;   // float [buffer][consumer][64]: dQ's dS scales per query (natural order)
    uint32_t kv_full, full, empty;  // barriers (8 bytes apart)
};

__device__ __forceinline__ Smem carve(unsigned char* raw) {
    unsigned char* base = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
    Smem s;
    s.k = smem_addr(base);
    s.v = s.k + K_BYTES;
    s.kc = s.v + V_BYTES;
    s.stage = s.kc + KC_BYTES;
    s.ds = s.stage + STAGES * STAGE_BYTES;
    s.dqs = s.ds + DS_BUFS * DS_BYTES;
    unsigned char* rest = base + (K_BYTES + V_BYTES + KC_BYTES + STAGES * STAGE_BYTES + DS_BUFS * DS_BYTES + 2 * DQS_BYTES);
    s.amax = smem_addr(rest);
    s.dsq = s.amax + 4 * (2 * 2 * 4 * 64);
    const uint32_t bars = s.dsq + 4 * (DS_BUFS * 2 * 64);
    s.kv_full = bars;
    s.full = bars + 8;
    s.empty = s.full + 8 * STAGES;
    return s;
}

// a stage's parts
#define ST_Q(s, st) ((s).stage + (st) * STAGE_BYTES)
#define ST_DOT(s, st) (ST_Q(s, st) + Q_BYTES)
#define ST_DOC(s, st) (ST_DOT(s, st) + DOT_BYTES)
#define ST_QC(s, st) (ST_DOC(s, st) + DOC_BYTES)
#define ST_NUM(s, st) (ST_QC(s, st) + DOC_BYTES)
// the per-tile numbers' offsets in floats
#define NUM_LSE 0
#define NUM_DELTA 64
#define NUM_QS 128
#define NUM_DOTS 192
#define NUM_DOCS 256
#define NUM_QCS (256 + HEAD_DIM)

