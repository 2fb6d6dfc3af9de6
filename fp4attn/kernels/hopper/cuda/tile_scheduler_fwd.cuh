// Which work unit a CTA's role runs next, and the key tiles of its query block
// (FlashAttention-3's tile scheduler and n_block bounds). A work unit is one query block
// (BLOCK_M rows) of one head; a CTA takes units u = blockIdx.x, + gridDim.x, ... until
// p.units.
#pragma once
#include "kernel_traits_fwd.cuh"
#include "params_fwd.cuh"

// Work unit u's query block and heads, and the key tiles it sees: [0, full) unmasked,
// n_tiles in all (one masked tile for a block that sees no key), as
// forward_gluon_ws._key_tiles. Units run head by head (u = bh * blocks + x), so that the
// CTAs running at once share their heads' K and V in L2; under a causal mask each head's
// longest query blocks first (they see the most keys). Each role computes it after its
// setmaxnreg: a value live across setmaxnreg is spilled by ptxas.
struct WorkTile {
    int start_m, bh, bhk, full, n_tiles;
};

__device__ __forceinline__ WorkTile get_work_tile(const Params& p, int u) {
    WorkTile b;
    const int blocks = (p.Sq + BLOCK_M - 1) / BLOCK_M, x = u % blocks;
    b.start_m = CAUSAL ? blocks - 1 - x : x;
    b.bh = u / blocks;
    b.bhk = (b.bh / p.H) * (p.H / p.group) + (b.bh % p.H) / p.group;
    int hi = p.Sk;
    b.full = p.Sk / BLOCK_N * BLOCK_N;
#if CAUSAL
    const int last = (b.start_m + 1) * BLOCK_M + p.causal_offset;
    const int first = b.start_m * BLOCK_M + p.causal_offset + 1;
    hi = min(max(last, 0), p.Sk);
    b.full = min(max(first, 0), b.full) / BLOCK_N * BLOCK_N;
#endif
    b.n_tiles = max((hi + BLOCK_N - 1) / BLOCK_N, 1);
    return b;
}
