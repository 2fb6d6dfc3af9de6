// wgmma (sm_90a) pieces shared by the Hopper CUDA kernels: shared-memory descriptors, the
// fence / commit / wait of a warpgroup's asynchronous products, and the accumulator operand lists.
#pragma once
#include "ptx.cuh"

// wgmma shared-memory descriptor of a K-major tile whose rows are one swizzle span long
// (8-row core matrices 8 * row bytes apart); `layout` 1: 128-byte swizzle, 2: 64-byte
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t layout, uint32_t row_bytes) {
    uint64_t d = (uint64_t)((addr & 0x3FFFF) >> 4);
    d |= (uint64_t)1 << 16;                          // leading offset: unused for swizzled K-major
    d |= (uint64_t)((8 * row_bytes) >> 4) << 32;     // stride between 8-row core matrices
    d |= (uint64_t)layout << 62;
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// keeps the compiler from moving reads or writes of an accumulator across a wgmma
// issue or wait (the tensor core writes it asynchronously)
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// -------------------------------------------------------------------- wgmma
// The accumulator operands, spelled out once: "+f" (read and written: the product is added)
// or "=f" (written only: a fresh product, so that no value of the accumulator's last use is
// kept alive, nor a register shared with what died before it)
#define WGMMA_RW(x) "+f"(x)
#define WGMMA_WO(x) "=f"(x)
#define WGMMA_D8(F, i) F(d[i]), F(d[i + 1]), F(d[i + 2]), F(d[i + 3]), F(d[i + 4]), F(d[i + 5]), F(d[i + 6]), F(d[i + 7])
#define WGMMA_D32(F) WGMMA_D8(F, 0), WGMMA_D8(F, 8), WGMMA_D8(F, 16), WGMMA_D8(F, 24)
#define WGMMA_D64(F) WGMMA_D32(F), WGMMA_D8(F, 32), WGMMA_D8(F, 40), WGMMA_D8(F, 48), WGMMA_D8(F, 56)
#define WGMMA_D36(F) WGMMA_D32(F), F(d[32]), F(d[33]), F(d[34]), F(d[35])
#define WGMMA_D68(F) WGMMA_D64(F), F(d[64]), F(d[65]), F(d[66]), F(d[67])
#define WGMMA_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_R64 WGMMA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// e4m3 m64nNk32 with A from registers (e.g. P) and B from shared memory (e.g. V^T); FRESH: d = A B,
// else d += A B; the
// operand numbers after the N / 2 accumulator registers: A's four, B's descriptor, scale-d
#define WGMMA_RS(NAME, N, REGS, DLIST, A, B, SCALE_D)                                                   \
    template <bool FRESH>                                                                               \
    __device__ __forceinline__ void NAME(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {  \
        if constexpr (FRESH)                                                                            \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                            \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, {" A "}, " B \
                         ", p, 1, 1;\n}\n"                                                              \
                         : DLIST(WGMMA_WO) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0)); \
        else                                                                                            \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                            \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, {" A "}, " B \
                         ", p, 1, 1;\n}\n"                                                              \
                         : DLIST(WGMMA_RW) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)); \
    }
WGMMA_RS(wgmma_rs_n128, 128, WGMMA_R64, WGMMA_D64, "%64, %65, %66, %67", "%68", "%69")
WGMMA_RS(wgmma_rs_n136, 136, WGMMA_R64 ", %64, %65, %66, %67", WGMMA_D68, "%68, %69, %70, %71", "%72", "%73")
WGMMA_RS(wgmma_rs_n64, 64, WGMMA_R32, WGMMA_D32, "%32, %33, %34, %35", "%36", "%37")
WGMMA_RS(wgmma_rs_n72, 72, WGMMA_R32 ", %32, %33, %34, %35", WGMMA_D36, "%36, %37, %38, %39", "%40", "%41")
// (WGMMA_RS stays defined: each kernel instantiates the widths it needs)

// m64nNkK with both operands from shared memory (K-major descriptors); TYPES the instruction's
// shape and types ("m64n64k16.f32.bf16.bf16"), TAIL what follows the scale immediates (bf16's
// transpose immediates ", 0, 0"; none for e4m3); FRESH as above
#define WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_D16(F) WGMMA_D8(F, 0), WGMMA_D8(F, 8)
#define WGMMA_SS(NAME, TYPES, TAIL, N, REGS, DLIST, A, B, SCALE_D)                                        \
    template <bool FRESH>                                                                                 \
    __device__ __forceinline__ void NAME(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {          \
        if constexpr (FRESH)                                                                              \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned." TYPES " {" REGS "}, " A ", " B ", p, 1, 1" TAIL ";\n}\n" \
                         : DLIST(WGMMA_WO) : "l"(desc_a), "l"(desc_b), "r"(0));                          \
        else                                                                                              \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned." TYPES " {" REGS "}, " A ", " B ", p, 1, 1" TAIL ";\n}\n" \
                         : DLIST(WGMMA_RW) : "l"(desc_a), "l"(desc_b), "r"(1));                          \
    }
WGMMA_SS(wgmma_ss_bf16_n64, "m64n64k16.f32.bf16.bf16", ", 0, 0", 64, WGMMA_R32, WGMMA_D32, "%32", "%33", "%34")
WGMMA_SS(wgmma_ss_e4m3_n64, "m64n64k32.f32.e4m3.e4m3", "", 64, WGMMA_R32, WGMMA_D32, "%32", "%33", "%34")
WGMMA_SS(wgmma_ss_e4m3_n32, "m64n32k32.f32.e4m3.e4m3", "", 32, WGMMA_R16, WGMMA_D16, "%16", "%17", "%18")
