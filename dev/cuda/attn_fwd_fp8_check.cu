// The Hopper CUDA forward's checking build: the production kernel's headers
// (fp4attn/kernels/hopper/cuda/, on the include path) with what only checks and
// measurements need, none of it in the production source (attn_fwd_fp8.cu). Built and
// launched by dev/forward_cuda_check.py (CheckVariant); tests/kernels/hopper/test_forward_cuda.py compiles
// it on the CPU and runs it against the Triton/Gluon kernels on a GPU.
//   FUSED_SOFTMAX=0: the recipe's arithmetic operation for operation, bit-identical to the
//     Gluon kernel, with the row sums from the softmax (ROWSUM_BY_PV 0: V^T's stages carry
//     no rows of ones); ROWSUM_INT its row sums' conversion on the integer units
//   DUMP_P: every key tile's P codes, as each consumer thread holds them, into p_dump
//   MX_SUBNORMAL_OK=0: affine MXFP4 P with the subtraction in every build (measured beside)
//   ABLATE_SOFTMAX, AFFINE_ABLATE (softmax_check.cuh), ABLATE_EPILOGUE (no epilogue, O
//     kept live): timing builds, wrong outputs
// The production kernel's compile-time parameters come from the launcher as for it
// (CheckVariant.defines passes every one).

#if !defined(HEAD_DIM) || !defined(CAUSAL) || !defined(KEY_BIAS) || !defined(STAGES) || !defined(EXP_POLY) || \
    !defined(AFFINE_P) || !defined(AFFINE_MX) || !defined(LAZY_RESCALE) || !defined(KEY_TILE_SCALE) ||         \
    !defined(QK_BF16) || !defined(CONSUMERS) || !defined(FUSED_SOFTMAX) || !defined(ROWSUM_INT) ||            \
    !defined(ABLATE_SOFTMAX) || !defined(AFFINE_ABLATE) || !defined(ABLATE_EPILOGUE) || !defined(DUMP_P) ||  \
    !defined(MX_SUBNORMAL_OK)
#error "the checking build takes every compile-time parameter from forward_cuda_check.CheckVariant.defines"
#endif

#define ROWSUM_BY_PV FUSED_SOFTMAX
#define MX_SUBNORMAL (AFFINE_MX && MX_SUBNORMAL_OK && !KEY_BIAS && !KEY_TILE_SCALE)

#if FUSED_SOFTMAX && !ABLATE_SOFTMAX && !AFFINE_ABLATE
#include "softmax_fwd.cuh"
#else
#include "softmax_check.cuh"
#endif
#include "kernel_fwd.cuh"

// the production parameter and the P dump's address after it
struct CheckParams {
    Params fwd;
    unsigned char* p_dump;  // DUMP_P: (B*H, blocks, key tiles, consumer threads, 64) P codes as the PV A operand
};
// forward_cuda_check._CheckParams fills these bytes from Python (it asserts the same size)
static_assert(sizeof(CheckParams) == 704, "CheckParams changed: update forward_cuda_check._CheckParams");

struct Checks {
    // the P codes of key tile j as this thread holds them (the PV product's A fragments), at
    // ((bh * blocks + block) * key tiles + j) * (consumer threads) + consumer thread, 64
    // bytes each, block in launch order (get_work_tile)
    static __device__ __forceinline__ void p_tile(const Params& p, const uint32_t (&pa)[4][4], int j, int tid,
                                                  const WorkTile& work) {
#if DUMP_P
        const CheckParams& cp = reinterpret_cast<const CheckParams&>(p);  // p is cp.fwd
        const int tiles = (p.Sk + BLOCK_N - 1) / BLOCK_N, blocks = (p.Sq + BLOCK_M - 1) / BLOCK_M;
        const int block = CAUSAL ? blocks - 1 - work.start_m : work.start_m;
        const long long slot = ((long long)(work.bh * blocks + block) * tiles + j) * (128 * CONSUMERS) + (tid - 128);
        uint4* dst = (uint4*)(cp.p_dump + slot * 64);
#pragma unroll
        for (int c = 0; c < 4; ++c) dst[c] = make_uint4(pa[c][0], pa[c][1], pa[c][2], pa[c][3]);
#endif
    }

    // ABLATE_EPILOGUE: true for every real launch (no causal offset is INT_MIN), which the
    // compiler cannot know: the epilogue is skipped and O still computed to the end
    static __device__ __forceinline__ bool skip_epilogue(const Params& p) {
        return ABLATE_EPILOGUE && p.causal_offset != -2147483647 - 1;
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_fwd_fp8(const __grid_constant__ CheckParams cp) {
    attn_fwd<Checks>(cp.fwd);
}
