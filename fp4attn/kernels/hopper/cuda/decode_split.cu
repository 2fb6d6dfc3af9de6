// Decode attention over a quantized KV cache, split kernel (sm_90): one new query row per
// sequence (Sq = 1), the GQA group's query heads (up to 16) as the rows of one mma tile,
// bf16, FP8, NVFP4 or MXFP4 (D = 128) keys and values. The numerics are reference/decode.py's
// and the Triton split kernel's (decode_triton.py), operation for operation: q in f16 at its
// row's power-of-two scale, block values exact in f16 (bf16 for bf16 and MXFP4 keys), float32
// scores times the token factor, an
// integer running maximum, l the float32 sum of the unrounded P = 2**(t - m); P rounded to
// bf16 after the V token factor for NVFP4 values, to f16 with the factor's exponent split
// off (a second integer maximum, `p_half`) for FP8 values.
//
// Why a second kernel: the Triton kernel is latency-bound (docs/notes/decode.md): its
// 4 warps share each key tile, so every tile crosses the warps twice (the row maximum,
// P's layout for the PV product) behind barriers, and at ~200 registers two programs fit
// an SM. Here every warp is a split of its own: it walks its keys 16 at a time with its
// own online softmax and nothing is shared between warps (no barrier). Each warp writes
// its partial (m, l, acc) as a split of the combine (`decode_combine` below), so the
// warps' results merge in the same power-of-two combine as the splits'.
//
// Keeping the memory busy: a warp's key tile is ~2.3 KB (NVFP4, D = 128), and the loads
// of a tile must be in flight long before its arithmetic. STAGES = 0 prefetches the next
// tile into registers (one tile in flight a warp, paid in ~70 registers); STAGES >= 2
// keeps a ring of STAGES tiles a warp in shared memory filled by cp.async, STAGES - 1
// tiles in flight. Every lane copies exactly the bytes it later reads, into a slot of its
// own, so the ring needs no barrier and no __syncwarp: cp.async.wait_group orders a
// thread's copies before its own reads. bf16 keys are the exception: the warp copies each
// key tile together (`copy_key_tile`), and a __syncwarp on either side of its use orders it.
//
// Register layouts (mma.m16n8k16, row-major A, column-major B; lane = 4 g + t):
//   S = q K^T: A = q (rows g, g + 8), B = K of key g of each 8-key n-tile. The
//     contraction order is free, so lane t holds D/4 channels of its key in 16-byte chunks
//     that a warp's load instruction reads contiguously: NVFP4 channels [D/4 t, D/4 t + D/4)
//     (D/8 bytes), FP8 chunk i bytes [16 (4 i + t), + 16) (at D = 128 two chunks 64 bytes
//     apart: contiguous chunks a lane would leave every 32-byte sector half read by each
//     load); the conversion's output order decides which channel each k index is, and q
//     is loaded in that order (q_channel below). bf16 keys: ldmatrix's fragments of the
//     warp's key tile, k index i of step kk channel 16 kk + i.
//   P: the S accumulators of two n-tiles are P's A fragment for 16 keys (FlashAttention-2's
//     register reuse: keys 2t, 2t + 1 and 2t + 8, 2t + 9).
//   O = P V: B = V of keys 2t, 2t + 1 (and + 8) at channel v_channel(o, g) of n-tile o:
//     lane g holds D/8 channels of each of its four keys, contiguous (D/8 g + o) for FP8
//     and NVFP4, two 16-byte chunks D/2 channels apart for bf16.
//
// Dequantization into f16, where the hardware converts two e4m3 bytes in one instruction
// (cvt.rn.f16x2.e4m3x2): FP8 keys and values convert as they are; an E2M1 code's bits are
// placed into an e4m3 byte (its value times 2**-6: two shifts and two masks for four
// codes), converted, and multiplied by the block's e4m3 scale times 2**6 (an f16x2
// multiply, exact: five significant bits at most). NVFP4 values feed a bf16 product (P in
// bf16, as the reference has it): E2M1 by bit placement into bf16 (the value times
// 2**-126) and one bf16x2 multiply by the block's multiplier (as decode_triton's _fp4_asm).
// The f16 products are why q is rounded to f16: at its row's power-of-two scale that is
// exact down to 2**-28 of the row's largest element. bf16 keys and values need no
// conversion: the scores take q's f16 value as two bf16 parts (split_f16_bf16; two
// products, exact), P V takes P in bf16 as for NVFP4 values. MXFP4 blocks (E2M1 x
// 2**(e - top), down to 125 binades below the token's largest: exact in bf16, not in f16)
// go through fp4x8 as NVFP4 values do, keys against q's two bf16 parts as bf16 keys.

#include "ptx.cuh"  // uint16_t, uint32_t; pack_bf16x2, lg2

// NVRTC without the toolkit's headers: the other types it needs
typedef unsigned char uint8_t;
typedef long long int64_t;

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef K_FMT  // 0 bf16, 1 fp8, 2 nvfp4, 3 mxfp4 (decode_op.FORMAT_CODES)
#define K_FMT 2
#endif
#ifndef V_FMT
#define V_FMT 2
#endif
#ifndef HI_ROWS  // 1: more than 8 query rows (rows 8-15 of the mma tile hold queries)
#define HI_ROWS 0
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES  // 0: the next tile prefetched in registers; >= 2: a cp.async ring in shared memory
#define STAGES 0
#endif
#ifndef COMBINE_WARPS
#define COMBINE_WARPS 8
#endif
#ifndef ABLATE_DEQUANT  // timing-only builds (wrong outputs; tools/probe_decode_bound.py): 1, the
#define ABLATE_DEQUANT 0  // loaded words fed to the products unconverted, to place the conversion's cost
#endif

constexpr int D = HEAD_DIM;
constexpr int KSTEPS = D / 16;  // k steps of the score product
constexpr int NT_O = D / 8;     // n-tiles of the output
constexpr bool K_NV = K_FMT == 2, V_NV = V_FMT == 2;  // NVFP4: e4m3 scales a block of 16, a float32 token scale
constexpr bool K_MX = K_FMT == 3, V_MX = V_FMT == 3;  // MXFP4: E8M0 scales a block of 32, no token scale
constexpr bool K_FP4 = K_NV || K_MX;  // E2M1 codes, two a byte
constexpr bool V_FP4 = V_NV || V_MX;
constexpr bool K_BF16 = K_FMT == 0;  // bf16 values, no scales (token factor 1)
constexpr bool V_BF16 = V_FMT == 0;
// the scores from bf16 key operands (q as two bf16 parts): bf16 keys, and MXFP4 keys, whose
// blocks reach 125 binades below the token's largest (reference.kvcache.MX_WINDOW): exact in
// bf16, not in f16
constexpr bool K_BF16_OPS = K_BF16 || K_MX;
// u32 words of one key / value row a lane holds (bf16: none, the warp's tiles hold them)
constexpr int KW = K_FP4 ? D / 32 : D / 16, VW = V_FP4 ? D / 64 : D / 32;
constexpr int SW = D / 64;  // u32 words of one token's NVFP4 block scales (D / 16 bytes)
// u32 words of a token's block scales as a lane's slot holds them (MXFP4: D / 32 bytes)
constexpr int KSW = K_MX ? D / 128 : SW, VSW = V_MX ? D / 128 : SW;
static_assert(!(K_MX || V_MX) || D == 128, "MXFP4: D = 128 (a lane's channels one block of 32, a token's scales one word)");
constexpr int TILE = 16;
static_assert(STAGES == 0 || STAGES >= 2, "STAGES: 0 (register prefetch) or a ring of at least 2");
static_assert(!(K_BF16 || V_BF16) || STAGES >= 2, "bf16 keys or values: a ring (the warp shares their tiles)");
#define NEG_INF __int_as_float(0xff800000)

struct Params {
    const uint16_t* q;  // bf16 bits, (B, Hq, 1, D) contiguous
    const uint8_t* ka;  // codes (NVFP4, D/2 bytes a token) or e4m3 bytes (D)
    const uint8_t* ks;  // NVFP4 block scales (e4m3, D/16 a token)
    const float* kt;    // token scales
    const uint8_t* va;
    const uint8_t* vs;
    const float* vt;
    const int* table;  // (B, table_stride) pages
    const int* lens;   // (B,)
    const int* start;  // (B,) first visible key (has_start)
    float* o_acc;      // (splits, B, Hq, 1, D)
    float* o_ml;       // (splits, B, Hq, 1, 2)
    int hkv, page_size, table_stride, hq, group, batch, split_tokens, has_start;
    float qk_scale;
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// 8 E2M1 codes (nibble k) -> bf16x2 {nibble j, nibble j + 4} for j = 0..3, times mult
__device__ __forceinline__ void fp4x8(uint32_t w, uint32_t mult, uint32_t (&o)[4]) {
#if ABLATE_DEQUANT
    o[0] = w, o[1] = w >> 8, o[2] = w >> 16, o[3] = w >> 24;
    return;
#endif
    asm("{\n\t.reg .b32 v, x;\n\t"
        "and.b32 x, %4, 0x000F000F;\n\tmul.lo.u32 x, x, 0x1040;\n\tand.b32 x, x, 0x81C081C0;\n\t"
        "mul.rn.bf16x2 %0, x, %5;\n\t"
        "and.b32 x, %4, 0x00F000F0;\n\tmul.lo.u32 x, x, 0x104;\n\tand.b32 x, x, 0x81C081C0;\n\t"
        "mul.rn.bf16x2 %1, x, %5;\n\t"
        "shr.b32 v, %4, 8;\n\t"
        "and.b32 x, v, 0x000F000F;\n\tmul.lo.u32 x, x, 0x1040;\n\tand.b32 x, x, 0x81C081C0;\n\t"
        "mul.rn.bf16x2 %2, x, %5;\n\t"
        "and.b32 x, v, 0x00F000F0;\n\tmul.lo.u32 x, x, 0x104;\n\tand.b32 x, x, 0x81C081C0;\n\t"
        "mul.rn.bf16x2 %3, x, %5;\n\t}"
        : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3])
        : "r"(w), "r"(mult));
}

__device__ __forceinline__ float e4m3_value(uint32_t byte) {
    // exact, NaN kept: through the hardware e4m3x2 -> f16x2 conversion
    uint32_t h;
    uint16_t b = (uint16_t)byte;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(b));
    float f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, lo;\n\t}" : "=f"(f) : "r"(h));
    return f;
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// two floats rounded to f16 (q's products' precision, reference.decode.half_queries), as bf16x2
// high parts and the bf16x2 of what they leave: hi + lo is the f16 value exactly (11
// significant bits in two bf16 of 8), so two bf16 products with a bf16 key add up to its f16 one
__device__ __forceinline__ void split_f16_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const uint32_t h = pack_f16(x0, x1);
    float f0, f1;
    asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, u;\n\t}"
        : "=f"(f0), "=f"(f1) : "r"(h));
    hi = pack_bf16x2(f0, f1);
    lo = pack_bf16x2(f0 - __uint_as_float(hi << 16), f1 - __uint_as_float(hi & 0xFFFF0000u));
}

// 4 e4m3 bytes -> f16x2 {byte 0, byte 1}, {byte 2, byte 3} (exact, NaN kept)
__device__ __forceinline__ void e4m3x4(uint32_t w, uint32_t (&o)[2]) {
#if ABLATE_DEQUANT
    o[0] = w, o[1] = w >> 16;
    return;
#endif
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(o[0]), "=r"(o[1])
        : "r"(w));
}

// 8 E2M1 codes (nibble k) -> f16x2 {nibble 0, 2}, {4, 6}, {1, 3}, {5, 7}, times mult: each
// code's bits into an e4m3 byte (exponent and mantissa to bits 4..2, the sign to bit 7: the
// value times 2**-6), the bytes converted, then one multiply by the block's scale x 2**6
__device__ __forceinline__ void fp4x8_f16(uint32_t w, uint32_t mult, uint32_t (&o)[4]) {
#if ABLATE_DEQUANT
    o[0] = w, o[1] = w >> 8, o[2] = w >> 16, o[3] = w >> 24;
    return;
#endif
    const uint32_t even = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
    const uint32_t odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
    uint32_t a[2], b[2];
    e4m3x4(even, a), e4m3x4(odd, b);
    asm("mul.rn.f16x2 %0, %0, %4;\n\tmul.rn.f16x2 %1, %1, %4;\n\t"
        "mul.rn.f16x2 %2, %2, %4;\n\tmul.rn.f16x2 %3, %3, %4;"
        : "+r"(a[0]), "+r"(a[1]), "+r"(b[0]), "+r"(b[1])
        : "r"(mult));
    o[0] = a[0], o[1] = a[1], o[2] = b[0], o[3] = b[1];
}

// an NVFP4 key block's f16 multiplier pair {s, s}, s = e4m3 scale x 2**6 (exact, NaN kept)
__device__ __forceinline__ void fp4_mult_f16(uint32_t two_bytes, uint32_t (&m)[2]) {
    uint32_t h[2];
    e4m3x4(two_bytes, h);  // {scale 0, scale 1}
    uint32_t x;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(h[0]), "r"(0x54005400u));  // x {64, 64}
    m[0] = prmt(x, 0, 0x1010), m[1] = prmt(x, 0, 0x3232);
}

// an NVFP4 block's multiplier, e4m3 x 2**-7 x 2**126 (exact in bf16), NaN kept
__device__ __forceinline__ float fp4_mult(uint32_t byte) { return e4m3_value(byte) * 0x1p119f; }

// MXFP4 (decode_triton's scale table): a block holds E2M1 x 2**(e - top), the token's factor
// is 2**(top - 127), top its largest finite biased E8M0 exponent (0 if none; 255 is NaN).
// `row`: the token's four scale bytes (D = 128)
__device__ __forceinline__ uint32_t mx_top(uint32_t row) {
    uint32_t top = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t e = (row >> (8 * i)) & 0xFF;
        top = e != 255 && e > top ? e : top;
    }
    return top;
}

// a block's multiplier 2**(e - top) x 2**126 as bf16x2 {m, m}: its E2M1 values (fp4x8's bit
// placement, times 2**-126) come out exact; 0 for a block 127 binades or more below the
// token's largest (the cache stores it as zeros), NaN for the NaN scale
__device__ __forceinline__ uint32_t mx_mult(uint32_t e, uint32_t top) {
    if (e == 255) return 0x7FC07FC0u;
    const int field = (int)e - (int)top + 127;
    const uint32_t b = field > 0 ? (uint32_t)(field + 126) << 7 : 0u;
    return b | (b << 16);
}

// 2**(top - 127) (top 0: the subnormal 2**-127)
__device__ __forceinline__ float mx_factor(uint32_t top) {
    return __uint_as_float(top ? top << 23 : 0x00400000u);
}

// 2**x without ptx.cuh's ex2's ftz: a result below 2**-126 stays a subnormal, as the
// reference's float32 exp2 keeps it (P and the combine's weights are summed unrounded)
__device__ __forceinline__ float ex2_noftz(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// m16n8k16, float32 sums: F16 operands in f16, else bf16
template <bool F16 = false>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    if constexpr (F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int N>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t (&w)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            uint4 x = __ldcs(reinterpret_cast<const uint4*>(p) + i);
            w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
        }
    } else if constexpr (N == 2) {
        uint2 x = __ldcs(reinterpret_cast<const uint2*>(p));
        w[0] = x.x, w[1] = x.y;
    } else {
        w[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
    }
}

// cp.async of N words into shared memory (16-byte copies bypass L1: the cache is read once)
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    else if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

template <int N>
__device__ __forceinline__ void copy_words(const uint8_t* p, uint32_t (&w)[N]) {
    constexpr int CHUNK = N % 4 == 0 ? 4 : N;  // words a copy
#pragma unroll
    for (int i = 0; i < N / CHUNK; ++i) cp_async(&w[CHUNK * i], p + 16 * i, 4 * CHUNK);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// q's channel for k step kk and lane t: slot 0, 1, 2, 3 are the k indices 2t, 2t + 1,
// 2t + 8, 2t + 9 (A's a0 low, a0 high, a2 low, a2 high), as the K conversion orders them
__device__ __forceinline__ int q_channel(int kk, int t, int slot) {
    if (K_MX)  // word kk / 2: nibbles {0, 4}, {1, 5} (kk even), {2, 6}, {3, 7} (odd) (fp4x8's bf16 pairs)
        return (D / 4) * t + 8 * (kk / 2) + 2 * (kk % 2) + (slot >> 1) + 4 * (slot & 1);
    if (K_NV)  // word kk / 2: nibbles 0, 2, 4, 6 (kk even), 1, 3, 5, 7 (odd) (fp4x8_f16)
        return (D / 4) * t + 8 * (kk / 2) + (kk % 2) + 2 * slot;
    if (K_BF16)  // ldmatrix's B fragment of k step kk: channels 16 kk + 2t, + 1 and + 8, + 9
        return 16 * kk + 2 * t + (slot & 1) + 8 * (slot >> 1);
    // word kk: chunk kk / 4 of the lane, bytes 0 .. 3 (e4m3x4)
    return 16 * (4 * (kk / 4) + t) + 4 * (kk % 4) + slot;
}

// (bf16 values: ldmatrix.trans's fragments of the warp's value tile, n-tile o channels 8 o ..)
__device__ __forceinline__ int v_channel(int o, int g) { return V_BF16 ? 8 * o + g : (D / 8) * g + o; }

// A lane's bytes of one key tile, as loaded (the block scales as the token's whole row of
// them: cp.async copies 4 bytes at least).
struct alignas(16) Raw {
    uint32_t k[2][K_BF16 ? 2 : KW];  // key g of n-tile nt (bf16: unused, 16 bytes that align v)
    uint32_t v[4][V_BF16 ? 1 : VW];  // keys 2t, 2t + 1, 2t + 8, 2t + 9 (bf16: unused)
    float2 kt[2];       // token scales of keys 8 nt + 2t, + 1
    float2 vt[2];       // token scales of keys 2t, 2t + 1 and 2t + 8, 2t + 9
    uint32_t ksc[K_FP4 ? 2 : 1][KSW];  // the block scales of key g of n-tile nt (NVFP4, MXFP4)
    uint32_t vsc[V_FP4 ? 4 : 1][VSW];
};
// a lane's slot in the ring: an odd number of 16-byte units, so a warp's 16-byte reads of
// its 32 slots hit every bank once a phase
constexpr int SLOT = sizeof(Raw) / 16 % 2 ? sizeof(Raw) : sizeof(Raw) + 16;
#ifdef SLOT_BYTES  // the host's figure, from which it sizes the shared memory (decode_cuda.Variant)
static_assert(SLOT == SLOT_BYTES, "the host's ring slot size is not the kernel's");
#endif

// lane t's two e4m3 scales (D = 128: channels 32 t .. 32 t + 31) or one (D = 64) of key nt
__device__ __forceinline__ uint32_t k_scales(const Raw& r, int nt, int t) {
    return D == 128 ? (r.ksc[nt][t >> 1] >> (16 * (t & 1))) & 0xFFFF : (r.ksc[nt][0] >> (8 * t)) & 0xFF;
}

// lane g's e4m3 scale of value row i (its channels D/8 g .. D/8 g + D/8 - 1)
__device__ __forceinline__ uint32_t v_scale(const Raw& r, int i, int g) {
    return D == 128 ? (r.vsc[i][g >> 2] >> (8 * (g & 3))) & 0xFF : (r.vsc[i][0] >> (8 * (g >> 1))) & 0xFF;
}

// how a lane fetches its bytes of a tile: LOAD from the cache into registers, COPY from
// the cache into its ring slot (cp.async; not committed)
enum Fetch { LOAD, COPY };

template <int MODE, int N>
__device__ __forceinline__ void fetch_words(const uint8_t* p, uint32_t (&w)[N]) {
    if constexpr (MODE == COPY) {
        copy_words<N>(p, w);
    } else {
        load_words<N>(p, w);
    }
}

template <int MODE>
__device__ __forceinline__ void fetch_float2(const float* p, float2& x) {
    if constexpr (MODE == COPY)
        cp_async(&x, p, 8);
    else
        x = __ldg(reinterpret_cast<const float2*>(p));
}

// bf16 keys and values: a tile of either is 16 contiguous rows of 2 D bytes, copied by the
// whole warp (each copy instruction 512 contiguous bytes: whole 128-byte lines, where a
// lane's own 16 bytes of eight rows would request eight half lines) into the warp's tile in
// the ring, chunk c of row r at chunk c ^ (r & 7), so that ldmatrix's eight rows of one
// chunk fall in eight bank groups; read back as B fragments by ldmatrix (keys) and
// ldmatrix.trans (values).
constexpr int BF16_TILE = TILE * 2 * D;
constexpr int KTILE_BYTES = K_BF16 ? BF16_TILE : 0, VTILE_BYTES = V_BF16 ? BF16_TILE : 0;
constexpr int STAGE_TILES = KTILE_BYTES + VTILE_BYTES;  // a warp's tiles of one ring stage
constexpr bool WARP_TILES = STAGE_TILES > 0;

__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) { return row * 2 * D + 16 * (chunk ^ (row & 7)); }

__device__ __forceinline__ void copy_bf16_tile(const uint8_t* src, unsigned char* tile, int lane) {
#pragma unroll
    for (int j = 0; j < BF16_TILE / 512; ++j) {
        const int off = 512 * j + 16 * lane, row = off / (2 * D);
        cp_async(tile + tile_offset(row, off % (2 * D) / 16), src + off, 16);
    }
}

__device__ __forceinline__ void ldmatrix_x4(const unsigned char* at, uint32_t (&b)[4], bool trans) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(at);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a) : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a) : "memory");
}

// the S product's B fragments (b0, b1) of k step kk for the tile's two n-tiles (keys 0-7, 8-15)
__device__ __forceinline__ void key_fragments(const unsigned char* tile, int kk, int lane, uint32_t (&b)[4]) {
    const int m = lane >> 3, row = 8 * (m >> 1) + (lane & 7);
    ldmatrix_x4(tile + tile_offset(row, 2 * kk + (m & 1)), b, false);
}

// the P V product's B fragments (b0: keys 2t, 2t + 1; b1: keys 2t + 8, 2t + 9) of n-tiles
// o and o + 1 (channels 8 o ..)
__device__ __forceinline__ void value_fragments(const unsigned char* tile, int o, int lane, uint32_t (&b)[4]) {
    const int m = lane >> 3, row = 8 * (m & 1) + (lane & 7);
    ldmatrix_x4(tile + tile_offset(row, o + (m >> 1)), b, true);
}

// the bytes of one token row of each array
constexpr int K_ROW = K_FP4 ? D / 2 : K_BF16 ? 2 * D : D, V_ROW = V_FP4 ? D / 2 : V_BF16 ? 2 * D : D;
constexpr int KS_ROW = K_MX ? D / 32 : D / 16, VS_ROW = V_MX ? D / 32 : D / 16;  // block scale bytes

// A key tile's rows of each array in the cache: one page lookup and one 64-bit base an
// array per tile
struct TileRows {
    const uint8_t *ka, *va, *ks, *vs;
    const float *kt, *vt;
};

__device__ __forceinline__ TileRows cache_rows(const Params& p, int b, int h, int tile0) {
    const int page = p.table[(int64_t)b * p.table_stride + tile0 / p.page_size];
    const int64_t row0 = ((int64_t)page * p.hkv + h) * p.page_size + tile0 % p.page_size;
    return {p.ka + row0 * K_ROW, p.va + row0 * V_ROW, p.ks + row0 * KS_ROW, p.vs + row0 * VS_ROW, p.kt + row0,
            p.vt + row0};
}

// every lane's offset from the tile's first row is a 32-bit constant of (g, t) and of the
// unrolled indices
template <int MODE>
__device__ __forceinline__ void load_tile(const TileRows& x, int g, int t, Raw& r, unsigned char* tiles) {
    // (the ring only: MODE is COPY)
    if constexpr (K_BF16) copy_bf16_tile(x.ka, tiles, 4 * g + t);
    if constexpr (V_BF16) copy_bf16_tile(x.va, tiles + KTILE_BYTES, 4 * g + t);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const int row = 8 * nt + g;
        if constexpr (K_FP4) {
            fetch_words<MODE, KW>(x.ka + row * K_ROW + (D / 8) * t, r.k[nt]);
            fetch_words<MODE, KSW>(x.ks + row * KS_ROW, r.ksc[nt]);
        } else if constexpr (!K_BF16) {
#pragma unroll
            for (int i = 0; i < KW / 4; ++i) {  // chunk i: bytes 16 (4 i + t) .. + 15 of the key (FP8)
                uint32_t(&w)[4] = *reinterpret_cast<uint32_t(*)[4]>(&r.k[nt][4 * i]);
                fetch_words<MODE, 4>(x.ka + row * K_ROW + 16 * (4 * i + t), w);
            }
        }
        if constexpr (!K_BF16 && !K_MX)  // (bf16, MXFP4: no token scales)
            fetch_float2<MODE>(x.kt + 8 * nt + 2 * t, r.kt[nt]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = 2 * t + (i & 1) + 8 * (i >> 1);
        if constexpr (V_FP4) {
            fetch_words<MODE, VW>(x.va + row * V_ROW + (D / 16) * g, r.v[i]);
            fetch_words<MODE, VSW>(x.vs + row * VS_ROW, r.vsc[i]);
        } else if constexpr (!V_BF16) {  // lane g's D / 8 channels: D / 8 bytes (FP8)
            fetch_words<MODE, VW>(x.va + row * V_ROW + (V_ROW / 8) * g, r.v[i]);
        }
    }
    if constexpr (!V_BF16 && !V_MX) {
        fetch_float2<MODE>(x.vt + 2 * t, r.vt[0]);
        fetch_float2<MODE>(x.vt + 8 + 2 * t, r.vt[1]);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_split(const __grid_constant__ Params p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.y / p.hkv, h = blockIdx.y % p.hkv;
    const int split = blockIdx.x * WARPS + warp;
    const int L = p.lens[b];
    const int start = p.has_start ? p.start[b] : 0;
    int lo = split * p.split_tokens;
    const int hi = min(lo + p.split_tokens, L);
    if (p.has_start) lo = max(lo, (start / TILE) * TILE);

    // -- q fragments: an Inf becomes NaN (as the reference), then f16 at the row's scale 2**e
    // (reference.decode.half_queries), 2**-e going into the row's score factor -------------
    uint32_t qa[KSTEPS][2], qb[KSTEPS][2];
    // bf16 and MXFP4 keys: qa / qb hold q's f16 value's bf16 high parts, qa_lo / qb_lo the rest (split_f16_bf16)
    uint32_t qa_lo[K_BF16_OPS ? KSTEPS : 1][2], qb_lo[K_BF16_OPS ? KSTEPS : 1][2];
    float row_down[2];
    {
        const bool ok[2] = {g < p.group, HI_ROWS && g + 8 < p.group};
        const uint16_t* q_row[2];
        q_row[0] = p.q + ((int64_t)b * p.hq + h * p.group + g) * D;
        q_row[1] = q_row[0] + 8 * D;
        auto get = [&](int r, int c) -> float {
            uint32_t x = ok[r] ? q_row[r][c] : 0u;
            x = (x & 0x7FFF) == 0x7F80 ? 0x7FC0u : x;
            return __uint_as_float(x << 16);
        };
        float up[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float amax = 0.0f;
            if (r == 0 || HI_ROWS) {
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
                    for (int sl = 0; sl < 4; ++sl) amax = fmaxf(amax, fabsf(get(r, q_channel(kk, t, sl))));
            }
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 2));
            const int e = min(max(141 - (int)((__float_as_uint(amax) >> 23) & 0xFF), -126), 100);
            up[r] = __uint_as_float((uint32_t)(127 + e) << 23);
            row_down[r] = __uint_as_float((uint32_t)(127 - e) << 23);
        }
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int c0 = q_channel(kk, t, 0), c1 = q_channel(kk, t, 1);
            const int c2 = q_channel(kk, t, 2), c3 = q_channel(kk, t, 3);
            if constexpr (K_BF16_OPS) {
                split_f16_bf16(get(0, c0) * up[0], get(0, c1) * up[0], qa[kk][0], qa_lo[kk][0]);
                split_f16_bf16(get(0, c2) * up[0], get(0, c3) * up[0], qa[kk][1], qa_lo[kk][1]);
                qb[kk][0] = qb[kk][1] = qb_lo[kk][0] = qb_lo[kk][1] = 0u;
                if constexpr (HI_ROWS) {
                    split_f16_bf16(get(1, c0) * up[1], get(1, c1) * up[1], qb[kk][0], qb_lo[kk][0]);
                    split_f16_bf16(get(1, c2) * up[1], get(1, c3) * up[1], qb[kk][1], qb_lo[kk][1]);
                }
            } else {
                qa[kk][0] = pack_f16(get(0, c0) * up[0], get(0, c1) * up[0]);
                qa[kk][1] = pack_f16(get(0, c2) * up[0], get(0, c3) * up[0]);
                qb[kk][0] = HI_ROWS ? pack_f16(get(1, c0) * up[1], get(1, c1) * up[1]) : 0u;
                qb[kk][1] = HI_ROWS ? pack_f16(get(1, c2) * up[1], get(1, c3) * up[1]) : 0u;
            }
        }
    }

    float acc[NT_O][4];
#pragma unroll
    for (int o = 0; o < NT_O; ++o) acc[o][0] = acc[o][1] = acc[o][2] = acc[o][3] = 0.0f;
    // m_row: the scores' integer running maximum (l's frame); big_row: the second one of f16
    // P (u = t + E of the value scale), acc's frame, for FP8 values (V_HALF)
    float m_row[2] = {NEG_INF, NEG_INF}, l_row[2] = {0.0f, 0.0f}, big_row[2] = {NEG_INF, NEG_INF};
    constexpr bool V_HALF = V_FMT == 1;  // FP8 values: reference.decode.P_HALF_FORMATS
    constexpr float P_HALF_SHIFT = 13.0f, P_HALF_SCALE = 8192.0f;  // reference.decode.P_HALF_SHIFT, its power
    const float v_fac_shift = V_NV ? 128.0f : 1.0f;
    const float qk[2] = {p.qk_scale * row_down[0], p.qk_scale * row_down[1]};

    // one key tile's scores, softmax and P V from its bytes (in registers or in the ring);
    // MASKED: a tile that a sequence's end or start cuts (`run` calls it with a constant at
    // each site, so the inlined copies are the masked and the plain tile)
    auto work = [&](const Raw& cur, const unsigned char* tiles, const int tile0, const bool MASKED) {
        // keys 8 nt + 2t (+ 1) of the tile visible (MASKED tiles only)
        bool vis[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int j = tile0 + 8 * nt + 2 * t;
            vis[nt][0] = j < L && j >= start, vis[nt][1] = j + 1 < L && j + 1 >= start;
        }
        // -- scores, log2 units ----------------------------------------------------------------
        float s[2][4] = {};
        uint32_t k_top[2] = {0u, 0u};  // MXFP4 keys: key g of n-tile nt's largest block exponent
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            if constexpr (K_MX) {
                // E2M1 x 2**(e - top) in bf16 (exact) against q's two bf16 parts, two accumulators
                k_top[nt] = mx_top(cur.ksc[nt][0]);
                const uint32_t mult = mx_mult((cur.ksc[nt][0] >> (8 * t)) & 0xFF, k_top[nt]);  // block t: lane t's channels
                float lo[4] = {};
#pragma unroll
                for (int i = 0; i < KW; ++i) {
                    uint32_t o[4];
                    fp4x8(cur.k[nt][i], mult, o);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int kk = 2 * i + h;
                        mma(s[nt], qa[kk][0], qb[kk][0], qa[kk][1], qb[kk][1], o[2 * h], o[2 * h + 1]);
                        mma(lo, qa_lo[kk][0], qb_lo[kk][0], qa_lo[kk][1], qb_lo[kk][1], o[2 * h], o[2 * h + 1]);
                    }
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) s[nt][j] += lo[j];
            } else if constexpr (K_NV) {
                uint32_t mult[2];
                fp4_mult_f16(k_scales(cur, nt, t), mult);
#pragma unroll
                for (int i = 0; i < KW; ++i) {
                    uint32_t o[4];
                    fp4x8_f16(cur.k[nt][i], D == 128 && i >= KW / 2 ? mult[1] : mult[0], o);
                    mma<true>(s[nt], qa[2 * i][0], qb[2 * i][0], qa[2 * i][1], qb[2 * i][1], o[0], o[1]);
                    mma<true>(s[nt], qa[2 * i + 1][0], qb[2 * i + 1][0], qa[2 * i + 1][1], qb[2 * i + 1][1], o[2],
                              o[3]);
                }
            } else if constexpr (K_BF16) {
                if (nt == 0) {
                    // both n-tiles at once from the warp's tile; q's high and low parts, one product
                    // each, into four accumulators (four chains of KSTEPS products, not two of 2 KSTEPS)
                    float lo[2][4] = {};
#pragma unroll
                    for (int kk = 0; kk < KSTEPS; ++kk) {
                        uint32_t kb[4];
                        key_fragments(tiles, kk, 4 * g + t, kb);
#pragma unroll
                        for (int n = 0; n < 2; ++n) {
                            mma(s[n], qa[kk][0], qb[kk][0], qa[kk][1], qb[kk][1], kb[2 * n], kb[2 * n + 1]);
                            mma(lo[n], qa_lo[kk][0], qb_lo[kk][0], qa_lo[kk][1], qb_lo[kk][1], kb[2 * n],
                                kb[2 * n + 1]);
                        }
                    }
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int j = 0; j < 4; ++j) s[n][j] += lo[n][j];
                }
            } else {
#pragma unroll
                for (int i = 0; i < KW; ++i) {
                    uint32_t o[2];
                    e4m3x4(cur.k[nt][i], o);
                    mma<true>(s[nt], qa[i][0], qb[i][0], qa[i][1], qb[i][1], o[0], o[1]);
                }
            }
            // token factors of keys 8 nt + 2t, + 1 (MXFP4: from the lanes that hold those keys' scales)
            float f0, f1;
            if constexpr (K_MX) {
                f0 = mx_factor(__shfl_sync(0xffffffff, k_top[nt], 8 * t));
                f1 = mx_factor(__shfl_sync(0xffffffff, k_top[nt], 8 * t + 4));
            } else {
                f0 = K_BF16 ? 1.0f : cur.kt[nt].x, f1 = K_BF16 ? 1.0f : cur.kt[nt].y;
            }
            s[nt][0] *= f0 * qk[0], s[nt][1] *= f1 * qk[0], s[nt][2] *= f0 * qk[1], s[nt][3] *= f1 * qk[1];
            if (MASKED) {
                if (!vis[nt][0]) s[nt][0] = s[nt][2] = NEG_INF;
                if (!vis[nt][1]) s[nt][1] = s[nt][3] = NEG_INF;
            }
        }
        // -- the value token factors (an invisible key's is 0: 0 * NaN must not reach a row) ---
        float2 vf[2];
        uint32_t v_top[4];  // MXFP4 values: value rows 2t, 2t + 1, 2t + 8, 2t + 9's largest block exponents
        if constexpr (V_MX) {
#pragma unroll
            for (int i = 0; i < 4; ++i) v_top[i] = mx_top(cur.vsc[i][0]);
            vf[0] = make_float2(mx_factor(v_top[0]), mx_factor(v_top[1]));
            vf[1] = make_float2(mx_factor(v_top[2]), mx_factor(v_top[3]));
        } else {
            vf[0] = V_BF16 ? make_float2(1.0f, 1.0f) : cur.vt[0], vf[1] = V_BF16 ? make_float2(1.0f, 1.0f) : cur.vt[1];
        }
        uint32_t keep[2] = {0xFFFFFFFFu, 0xFFFFFFFFu};  // a value no row may see is zeroed (0 * NaN)
        if (MASKED) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const bool v0 = vis[nt][0], v1 = vis[nt][1];
                vf[nt].x = v0 ? vf[nt].x : 0.0f;
                vf[nt].y = v1 ? vf[nt].y : 0.0f;
                keep[nt] = (v0 ? 0x0000FFFFu : 0u) | (v1 ? 0xFFFF0000u : 0u);
            }
        }
        // V_HALF: u = t + E, vf = mu 2**E (reference.decode.split_scales)
        float u[2][4], mu[2][2];
        if constexpr (V_HALF) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const float x = k ? vf[nt].y : vf[nt].x;
                    const uint32_t bits = __float_as_uint(x), field = (bits >> 23) & 0xFF;
                    const bool normal = field > 0 && field < 255;
                    const float e = normal ? (float)((int)field - 127) : 0.0f;
                    mu[nt][k] = (normal ? __uint_as_float((bits & 0x807FFFFFu) | 0x3F800000u) : x) * P_HALF_SCALE;
                    u[nt][k] = s[nt][k] + e, u[nt][k + 2] = s[nt][k + 2] + e;
                }
        }
        // -- online softmax, integer maxima (rows g and g + 8) ------------------------------------
        float m_new[2], big_new[2];
        bool grew = false;
#pragma unroll
        for (int r = 0; r < (HI_ROWS ? 2 : 1); ++r) {
            float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            m_new[r] = fmaxf(m_row[r], ceilf(mx));
            grew |= m_new[r] > m_row[r];
            if constexpr (V_HALF) {
                float mu_x = fmaxf(fmaxf(u[0][2 * r], u[0][2 * r + 1]), fmaxf(u[1][2 * r], u[1][2 * r + 1]));
                mu_x = fmaxf(mu_x, __shfl_xor_sync(0xffffffff, mu_x, 1));
                mu_x = fmaxf(mu_x, __shfl_xor_sync(0xffffffff, mu_x, 2));
                big_new[r] = fmaxf(big_row[r], ceilf(mu_x));
                grew |= big_new[r] > big_row[r];
            }
        }
        if (__any_sync(0xffffffff, grew)) {
#pragma unroll
            for (int r = 0; r < (HI_ROWS ? 2 : 1); ++r) {
                const float use = m_new[r] == NEG_INF ? 0.0f : m_new[r];
                const float alpha = ex2_noftz(m_row[r] - use);
                l_row[r] *= alpha;
                float beta = alpha;
                if constexpr (V_HALF) beta = ex2_noftz(big_row[r] - (big_new[r] == NEG_INF ? 0.0f : big_new[r]));
#pragma unroll
                for (int o = 0; o < NT_O; ++o) acc[o][2 * r] *= beta, acc[o][2 * r + 1] *= beta;
            }
        }
        float m_use[2], big_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_row[r] = r == 0 || HI_ROWS ? m_new[r] : NEG_INF;
            m_use[r] = m_row[r] == NEG_INF ? 0.0f : m_row[r];
            if constexpr (V_HALF) {
                big_row[r] = r == 0 || HI_ROWS ? big_new[r] : NEG_INF;
                big_use[r] = big_row[r] == NEG_INF ? 0.0f : big_row[r];
            }
        }
        float pr[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pr[nt][e] = (e < 2 || HI_ROWS) ? ex2_noftz(s[nt][e] - m_use[e / 2]) : 0.0f;
                l_row[e / 2] += pr[nt][e];
            }
        // -- P V -------------------------------------------------------------------------------
        uint32_t pa[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            if constexpr (V_HALF) {
                // f16 P = 2**(u - big) * mu * 2**P_HALF_SHIFT
                const float x0 = ex2_noftz(u[nt][0] - big_use[0]) * mu[nt][0];
                const float x1 = ex2_noftz(u[nt][1] - big_use[0]) * mu[nt][1];
                pa[2 * nt] = pack_f16(x0, x1);
                if constexpr (HI_ROWS) {
                    const float y0 = ex2_noftz(u[nt][2] - big_use[1]) * mu[nt][0];
                    const float y1 = ex2_noftz(u[nt][3] - big_use[1]) * mu[nt][1];
                    pa[2 * nt + 1] = pack_f16(y0, y1);
                } else {
                    pa[2 * nt + 1] = 0u;
                }
            } else {
                const float x = vf[nt].x * v_fac_shift, y = vf[nt].y * v_fac_shift;
                pa[2 * nt] = pack_bf16x2(pr[nt][0] * x, pr[nt][1] * y);
                pa[2 * nt + 1] = HI_ROWS ? pack_bf16x2(pr[nt][2] * x, pr[nt][3] * y) : 0u;
            }
        }
        if constexpr (V_FP4) {
            uint32_t vm[2];  // {row 2 nt's multiplier, row 2 nt + 1's} of lane g's block
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                if constexpr (V_MX) {  // lane g's D / 8 channels: block g / 2
                    const uint32_t m0 = mx_mult((cur.vsc[2 * nt][0] >> (8 * (g >> 1))) & 0xFF, v_top[2 * nt]);
                    const uint32_t m1 = mx_mult((cur.vsc[2 * nt + 1][0] >> (8 * (g >> 1))) & 0xFF, v_top[2 * nt + 1]);
                    vm[nt] = prmt(m0, m1, 0x7610);
                } else {
                    vm[nt] = pack_bf16x2(fp4_mult(v_scale(cur, 2 * nt, g)), fp4_mult(v_scale(cur, 2 * nt + 1, g)));
                }
            }
#pragma unroll
            for (int w = 0; w < VW; ++w) {
                // keys 2t, 2t + 1 (and + 8) side by side: a bf16x2 register pairs two keys of one channel
                const uint32_t x0 = prmt(cur.v[0][w], cur.v[1][w], 0x5410), x1 = prmt(cur.v[0][w], cur.v[1][w], 0x7632);
                const uint32_t y0 = prmt(cur.v[2][w], cur.v[3][w], 0x5410), y1 = prmt(cur.v[2][w], cur.v[3][w], 0x7632);
                uint32_t a[4], c[4], e[4], f[4];
                fp4x8(x0, vm[0], a), fp4x8(x1, vm[0], c), fp4x8(y0, vm[1], e), fp4x8(y1, vm[1], f);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (MASKED) {
                        a[j] &= keep[0], c[j] &= keep[0], e[j] &= keep[1], f[j] &= keep[1];
                    }
                    mma(acc[8 * w + j], pa[0], pa[1], pa[2], pa[3], a[j], e[j]);
                    mma(acc[8 * w + 4 + j], pa[0], pa[1], pa[2], pa[3], c[j], f[j]);
                }
            }
        } else if constexpr (V_BF16) {
            const unsigned char* vtile = tiles + KTILE_BYTES;
#pragma unroll
            for (int o = 0; o < NT_O; o += 2) {
                uint32_t vb[4];  // n-tile o's (b0, b1), then n-tile o + 1's: keys 2t, 2t + 1 (and + 8) in a register
                value_fragments(vtile, o, 4 * g + t, vb);
                if (MASKED) {
                    vb[0] &= keep[0], vb[1] &= keep[1], vb[2] &= keep[0], vb[3] &= keep[1];
                }
                mma(acc[o], pa[0], pa[1], pa[2], pa[3], vb[0], vb[1]);
                mma(acc[o + 1], pa[0], pa[1], pa[2], pa[3], vb[2], vb[3]);
            }
        } else {
#pragma unroll
            for (int w = 0; w < VW; ++w) {
                // bytes of keys 2t, 2t + 1 (and + 8) interleaved: an f16x2 pairs two keys of one channel
                const uint32_t x0 = prmt(cur.v[0][w], cur.v[1][w], 0x5140), x1 = prmt(cur.v[0][w], cur.v[1][w], 0x7362);
                const uint32_t y0 = prmt(cur.v[2][w], cur.v[3][w], 0x5140), y1 = prmt(cur.v[2][w], cur.v[3][w], 0x7362);
                uint32_t a[2], c[2], e[2], f[2];  // channels 4w + {0, 1}, {2, 3} of the lane
                e4m3x4(x0, a), e4m3x4(x1, c), e4m3x4(y0, e), e4m3x4(y1, f);
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (MASKED) {
                        a[j] &= keep[0], c[j] &= keep[0], e[j] &= keep[1], f[j] &= keep[1];
                    }
                    mma<true>(acc[4 * w + j], pa[0], pa[1], pa[2], pa[3], a[j], e[j]);
                    mma<true>(acc[4 * w + 2 + j], pa[0], pa[1], pa[2], pa[3], c[j], f[j]);
                }
            }
        }
    };
    auto run = [&](const Raw& cur, const unsigned char* tiles, const int tile0) {
        if (tile0 < start || tile0 + TILE > L)
            work(cur, tiles, tile0, true);
        else
            work(cur, tiles, tile0, false);
    };

    if constexpr (STAGES == 0) {
        const int last = lo < hi ? lo + ((hi - 1 - lo) / TILE) * TILE : lo;
        Raw cur, nxt;
        if (lo < hi) load_tile<LOAD>(cache_rows(p, b, h, lo), g, t, cur, nullptr);
        for (int tile0 = lo; tile0 < hi; tile0 += TILE) {
            // the next tile's bytes in flight while this one is worked on (the last tile reloads itself)
            load_tile<LOAD>(cache_rows(p, b, h, min(tile0 + TILE, last)), g, t, nxt, nullptr);
            run(cur, nullptr, tile0);
            cur = nxt;
        }
    } else {
        // the ring: tile i lives in stage i % STAGES: each lane's slot, and the warp's key tile
        // (bf16 keys) after all the slots
        extern __shared__ __align__(16) unsigned char smem[];
        unsigned char* mine = smem + (warp * STAGES * 32 + lane) * SLOT;
        unsigned char* bf16_tiles = smem + WARPS * STAGES * 32 * SLOT + warp * STAGES * STAGE_TILES;
        auto ring = [&](int stage) -> Raw& { return *reinterpret_cast<Raw*>(mine + stage * 32 * SLOT); };
        const int tiles = lo < hi ? (hi - lo + TILE - 1) / TILE : 0;  // (the same for the whole warp)
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) {
            if (i < tiles) load_tile<COPY>(cache_rows(p, b, h, lo + i * TILE), g, t, ring(i), bf16_tiles + i * STAGE_TILES);
            cp_async_commit();  // empty groups too: the wait below counts groups
        }
        int use = 0, fill = STAGES - 1;  // the stages of tile i and of tile i + STAGES - 1
        for (int i = 0; i < tiles; ++i) {
            // the stage refilled now was read by the previous tile's work, whose reads have all
            // returned (their values were consumed); the asm's memory clobbers keep the order. A
            // bf16 tile is the warp's: every lane has read it before any lane refills it
            if constexpr (WARP_TILES) __syncwarp();
            if (i + STAGES - 1 < tiles)
                load_tile<COPY>(cache_rows(p, b, h, lo + (i + STAGES - 1) * TILE), g, t, ring(fill),
                                bf16_tiles + fill * STAGE_TILES);
            cp_async_commit();
            cp_async_wait<STAGES - 1>();  // tile i's copies have landed
            if constexpr (WARP_TILES) __syncwarp();  // ... and every lane's copies of the warp's tiles
            run(ring(use), bf16_tiles + use * STAGE_TILES, lo + i * TILE);
            use = use + 1 == STAGES ? 0 : use + 1;
            fill = fill + 1 == STAGES ? 0 : fill + 1;
        }
    }

    // -- this warp's partial, as a split of the combine's --------------------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_row[r] += __shfl_xor_sync(0xffffffff, l_row[r], 1);
        l_row[r] += __shfl_xor_sync(0xffffffff, l_row[r], 2);
        // a row whose visible keys all scored NaN: its max (fmaxf ignores NaN) stayed -inf
        if (l_row[r] != l_row[r]) m_row[r] = __int_as_float(0x7fc00000);
        if constexpr (V_HALF) {
            // f16 P's frame (2**(big - P_HALF_SHIFT) a unit) into the combine's (2**m): a power of two
            const float to_m = m_row[r] == NEG_INF ? 1.0f : ex2_noftz(big_row[r] - P_HALF_SHIFT - m_row[r]);
#pragma unroll
            for (int o = 0; o < NT_O; ++o) acc[o][2 * r] *= to_m, acc[o][2 * r + 1] *= to_m;
        }
    }
#pragma unroll
    for (int r = 0; r < (HI_ROWS ? 2 : 1); ++r) {
        const int row = g + 8 * r;
        if (row >= p.group) continue;
        const int64_t prow = ((int64_t)split * p.batch + b) * p.hq + h * p.group + row;
        float* out = p.o_acc + prow * D;
#pragma unroll
        for (int o = 0; o < NT_O; ++o) {
            out[v_channel(o, 2 * t)] = acc[o][2 * r];
            out[v_channel(o, 2 * t + 1)] = acc[o][2 * r + 1];
        }
        if (t == 0) {
            p.o_ml[prow * 2] = m_row[r];
            p.o_ml[prow * 2 + 1] = l_row[r];
        }
    }
}

// The splits' partials merged, a row a CTA: out = sum_s 2**(m_s - M) acc_s / sum_s
// 2**(m_s - M) l_s, M the largest m_s (integer maxima: every weight a power of two), as
// decode_triton's combine; a row no split saw is 0 with LSE -inf, a NaN anywhere stays.
// Its warps take the splits in turn (independent loads in flight: the one-sequence plans
// have a few hundred splits for a few dozen rows). OUT_KIND: 0 float32, 1 bf16, 2 fp16.
extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32)
    decode_combine(const float* __restrict__ o_acc, const float* __restrict__ o_ml, void* out, float* lse, int n_rows,
                   int splits, int out_kind) {
    constexpr int C = D / 32;  // channels a lane
    __shared__ float red[COMBINE_WARPS][D + 2];
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float big = NEG_INF;
    bool nan = false;
    for (int s = threadIdx.x; s < splits; s += COMBINE_WARPS * 32) {
        const float m = o_ml[((int64_t)s * n_rows + r) * 2];
        big = fmaxf(big, m);
        nan |= m != m;
    }
#pragma unroll
    for (int x = 16; x; x >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffff, big, x));
    nan = __any_sync(0xffffffff, nan);
    if (lane == 0) red[warp][0] = nan ? __int_as_float(0x7fc00000) : big;
    __syncthreads();
    big = red[0][0];
    for (int w = 1; w < COMBINE_WARPS; ++w) big = big != big || red[w][0] != red[w][0] ? red[w][0] + big
                                                                                         : fmaxf(big, red[w][0]);
    __syncthreads();
    const bool seen = big != NEG_INF;
    const float m_use = seen ? big : 0.0f;
    float acc[C], l = 0.0f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
#pragma unroll 4
    for (int s = warp; s < splits; s += COMBINE_WARPS) {
        const int64_t row = (int64_t)s * n_rows + r;
        const float2 ml = *reinterpret_cast<const float2*>(o_ml + row * 2);
        const float w = ex2_noftz(ml.x - m_use);
        l += w * ml.y;
        const float* a = o_acc + row * D + C * lane;
        if constexpr (C == 4) {
            const float4 x = *reinterpret_cast<const float4*>(a);
            acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
        } else {
            const float2 x = *reinterpret_cast<const float2*>(a);
            acc[0] += w * x.x, acc[1] += w * x.y;
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) red[warp][C * lane + c] = acc[c];
    if (lane == 0) red[warp][D] = l;
    __syncthreads();
    if (warp) return;
    l = red[0][D];
    for (int w = 1; w < COMBINE_WARPS; ++w) l += red[w][D];
    const float safe_l = seen ? l : 1.0f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
        float x = red[0][C * lane + c];
        for (int w = 1; w < COMBINE_WARPS; ++w) x += red[w][C * lane + c];
        const float o = seen ? x / safe_l : 0.0f;
        const int64_t i = (int64_t)r * D + C * lane + c;
        if (out_kind == 0)
            static_cast<float*>(out)[i] = o;
        else if (out_kind == 1)
            static_cast<uint16_t*>(out)[i] = (uint16_t)(pack_bf16x2(o, 0.0f) & 0xFFFF);
        else {
            uint16_t h;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(o));
            static_cast<uint16_t*>(out)[i] = h;
        }
    }
    if (lane == 0) lse[r] = seen ? (big + lg2(safe_l)) * 0.6931471805599453f : NEG_INF;
}

