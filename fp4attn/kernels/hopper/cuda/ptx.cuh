// PTX wrappers shared by the Hopper (sm_90a) CUDA kernels: shared-memory addresses and
// accesses, mbarriers, TMA and bulk copies, fences, named barriers, setmaxnreg, rounded float32
// operations and the e4m3 / bf16 conversions.
#pragma once

typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned short uint16_t;

struct __align__(64) TensorMap {
    uint64_t opaque[16];
};

// -------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    uint32_t a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Spins until the barrier's phase `parity` has completed. (No trap on a wait that never
// ends: a __trap() on this path made ptxas allocate the consumers' registers at the
// kernel's entry cap of 168 instead of setmaxnreg's 240, serializing every wgmma, C7512.)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

// a bulk copy (no tensor map) of `bytes`, a multiple of 16, from global into shared memory,
// completing on the mbarrier as a TMA copy does
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// global float32 += shared float32, `bytes` of them, as one bulk group (FlashAttention-3's dQ
// accumulation by TMA reduce-add)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// this thread's bulk groups have read their shared memory (it may be written again) / are done
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// shared-memory writes of the generic proxy (st.shared) made visible to the async proxy (TMA
// copies, wgmma operands)
__device__ __forceinline__ void fence_view_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// the mbarriers' initialization made visible before any thread waits on them
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// setmaxnreg: a warpgroup's registers per thread moved down to N (the producer, handing them
// to the consumers) or up to N
template <uint32_t N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <uint32_t N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// named barriers: the id an immediate (named_sync<ID>), or a register (named_sync(id, ...))
template <uint32_t ID>
__device__ __forceinline__ void named_sync(uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "r"(threads) : "memory");
}

template <uint32_t ID>
__device__ __forceinline__ void named_arrive(uint32_t threads) {
    asm volatile("bar.arrive %0, %1;" ::"n"(ID), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ftz: the non-ftz form adds a range test and two fix-up multiplies per element; it
// differs only where 2**x is below 2**-126, which P's e4m3 rounding takes to 0 anyway
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// a float2 from shared memory by its shared-window address (a generic pointer took two
// registers and a generic load, which waited on the long scoreboard)
__device__ __forceinline__ float2 lds_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

// shared-memory accesses by address, each also a compiler memory barrier ("memory" clobbered,
// which lds_f2 is not)
__device__ __forceinline__ float lds_f32(uint32_t addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}

__device__ __forceinline__ void sts_u8(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void sts_f32(uint32_t addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(x) : "memory");
}

__device__ __forceinline__ void sts_f2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// float32 operations the compiler must neither fuse nor reorder (each rounds as the
// reference does): products and sums rounded to nearest, a sum rounded down (AFFINE_MX's
// floor), a maximum that keeps NaN (AFFINE_MX's block and row maxima)
#define F32_OP(NAME, OP)                                                   \
    __device__ __forceinline__ float NAME(float a, float b) {              \
        float y;                                                           \
        asm(OP " %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));                 \
        return y;                                                          \
    }
F32_OP(fmul_rn, "mul.rn.f32")
F32_OP(fadd_rn, "add.rn.f32")
F32_OP(fadd_rm, "add.rm.f32")
F32_OP(fmax_nan, "max.NaN.f32")
#undef F32_OP

// (lo, hi) -> e4m3x2 (lo in the low byte), round to nearest even, saturating; and the two
// represented values back as float32 (exact: e4m3 -> f16 -> f32)
__device__ __forceinline__ uint32_t to_e4m3x2(float lo, float hi, float& vlo, float& vhi) {
    uint32_t packed;
    asm("{ .reg .b16 e, l16, h16; .reg .b32 h2;\n"
        "cvt.rn.satfinite.e4m3x2.f32 e, %4, %3;\n"
        "cvt.rn.f16x2.e4m3x2 h2, e;\n"
        "mov.b32 {l16, h16}, h2;\n"
        "cvt.f32.f16 %1, l16;\n"
        "cvt.f32.f16 %2, h16;\n"
        "cvt.u32.u16 %0, e; }"
        : "=r"(packed), "=f"(vlo), "=f"(vhi) : "f"(lo), "f"(hi));
    return packed;
}

// the recipe's P codes of two exp2 results (no row-sum values: ROWSUM_INT sums the codes)
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    uint32_t packed;
    asm("{ .reg .b16 e;\n"
        "cvt.rn.satfinite.e4m3x2.f32 e, %2, %1;\n"
        "cvt.u32.u16 %0, e; }"
        : "=r"(packed) : "f"(lo), "f"(hi));
    return packed;
}

__device__ __forceinline__ uint32_t prmt_lo_halves(uint32_t lo, uint32_t hi) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(lo), "r"(hi));
    return r;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

