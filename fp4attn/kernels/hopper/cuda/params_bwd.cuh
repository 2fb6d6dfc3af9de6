// The Hopper CUDA backward's kernel parameter (FlashAttention-3's Flash_bwd_params): one
// struct passed by value, since the TMA descriptors must live in parameter space.
#pragma once
#include "ptx.cuh"

struct Params {
    TensorMap q_map0, q_map1;      // Q bf16 (row bytes, 2, 4, rows / 16) from rows 0 and 2: the permuted halves
    TensorMap dot_map0, dot_map1;  // dO_t e4m3, likewise
    TensorMap doc_map;             // dO_c (B*H*D rows, Sq) e4m3, boxes (64 queries, D)
    TensorMap qc_map;              // Q_c likewise
    TensorMap k_map;               // K bf16 (B*Hkv*Sk rows, 2 D bytes), boxes (128 bytes, 128 keys)
    TensorMap v_map;               // V_t e4m3 (B*Hkv*Sk rows, D), boxes (D, 128 keys)
    TensorMap kc_map;              // K_c (B*Hkv*D rows, Sk) e4m3, boxes (128 keys, D)
    const float* lse;              // (B, H, Sq), natural log
    const float* delta;            // (B, H, Sq)
    const float* qs;               // (B, H, Sq) Q's token scales
    const float* dots;             // (B, H, Sq) dO_t's token scales
    const float* docs;             // (B, H, D) dO_c's channel scales
    const float* qcs;              // (B, H, D) Q_c's channel scales
    const float* ks;               // (B, Hkv, Sk) K's token scales
    const float* vts;              // (B, Hkv, Sk) V_t's token scales
    float* dq_accum;               // (B*H, Sq / 64, 2, 64, D / 2 + 4) float32, zeroed
    float* dk;                     // (B, Hkv, Sk, D) float32
    float* dv;                     // (B, Hkv, Sk, D) float32
    int H, group, Sq, Sk, causal_offset;
    float qk_scale;                // softmax scale * log2 e
    float sm_scale;
};
// backward_cuda._Params fills these bytes from Python (it asserts the same size)
static_assert(sizeof(Params) == 1280, "Params changed: update backward_cuda._Params to the same layout");
