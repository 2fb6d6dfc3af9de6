// Which keys a CTA of the Hopper CUDA backward owns and which query tiles it walks
// (FlashAttention-3's tile scheduler and m_block bounds). A CTA owns BLOCK_N keys of one K/V
// head (blockIdx.x the key block, blockIdx.y b * Hkv + hkv) and walks the query tiles that
// see them, for each query head of its group in turn: walk step g is tile
// t_lo + g % (n_tiles - t_lo) of the group's head g / (n_tiles - t_lo).
#pragma once
#include "kernel_traits_bwd.cuh"
#include "params_bwd.cuh"

struct WorkTile {
    int n0;       // the CTA's first key
    int bhk;      // b * Hkv + hkv
    int b, hkv;
    int n_tiles;  // a head's query tiles
    int t_lo;     // the first that sees the CTA's keys: 0, or (causal) the one that reaches key n0
    int walk;     // the steps: tiles over the group's heads
};

__device__ __forceinline__ WorkTile get_work_tile(const Params& p) {
    WorkTile work;
    work.n0 = blockIdx.x * BLOCK_N;
    work.bhk = blockIdx.y;
    const int Hkv = p.H / p.group;
    work.b = work.bhk / Hkv, work.hkv = work.bhk % Hkv;
    work.n_tiles = p.Sq / BLOCK_M;
    work.t_lo = 0;
#if CAUSAL
    {
        const int first = work.n0 - p.causal_offset;  // the first query that sees key n0
        work.t_lo = first <= 0 ? 0 : first / BLOCK_M;
    }
#endif
    work.walk = work.t_lo < work.n_tiles ? (work.n_tiles - work.t_lo) * p.group : 0;
    return work;
}

// walk step g's query tile t, and its query head bh = b * H + h
__device__ __forceinline__ int tile_of(const WorkTile& work, int g) {
    return work.t_lo + g % (work.n_tiles - work.t_lo);
}

struct QueryTile {
    int bh, t;
};

// (h, then t, then bh: in another order the same values compiled to other machine code)
__device__ __forceinline__ QueryTile query_tile(const Params& p, const WorkTile& work, int g) {
    const int h = work.hkv * p.group + g / (work.n_tiles - work.t_lo), t = tile_of(work, g);
    return {work.b * p.H + h, t};
}
