// The Hopper CUDA forward's kernel parameter (FlashAttention-3's Flash_fwd_params): one
// struct passed by value, since the TMA descriptors must live in parameter space.
// forward_cuda.Params fills the same bytes from Python.
#pragma once
#include "ptx.cuh"

struct Params {
    TensorMap q_map;   // Q as (B*H*Sq rows, row bytes), boxes of (BLOCK_M rows, one chunk)
    TensorMap k_map0;  // K as (row bytes, 2, 4, rows / 16), boxes of one chunk: keys 16n + 4q + b of each 16
    TensorMap k_map1;  // the same from row 2: keys 16n + 4q + 2 + b
    TensorMap v_map;   // V^T as (B*Hkv*D rows, Sk keys), boxes of (D rows, 128 keys)
    const float* qs;   // (B, H, Sq) per-token scales of Q
    const float* ks;   // (B, Hkv, Sk) per-token scales of K
    const float* vs;   // (B, Hkv, D) per-channel scales of V
    const float* key_bias;  // (B, Sk) log2-unit bias, read only with KEY_BIAS
    unsigned short* out;    // (B, H, Sq, D) bf16
    float* lse;             // (B, H, Sq)
    int H, group, Sq, Sk, causal_offset, k_rows_per_head;  // k_rows_per_head: Sk rounded up to 16
    float qk_scale;         // softmax scale * log2 e
    int units;              // work units: B * H * query blocks (tile_scheduler_fwd.cuh)
};
static_assert(sizeof(Params) == 640, "Params changed: update forward_cuda.Params to the same layout");

// The sequence lengths, read from the parameter once where a role starts (FlashAttention-4's
// SeqlenInfo): a read after an asm statement that clobbers memory is a load of its own
struct SeqlenInfo {
    int Sq, Sk;
};
