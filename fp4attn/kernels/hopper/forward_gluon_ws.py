"""Attention forward for Hopper (sm_90) in Gluon: the Triton kernel's numerics
(`forward.py`, same P builders from `kernels/common.py`) in two kernels that schedule
the tensor cores and the loads themselves.

`attn_fwd_ws_kernel` (routed by `forward_op.launch_forward` for FP8 P at D=128): warp
specialization, a producer warp that keeps K/V^T rings full by TMA and consumer
warpgroups that wait only on mbarriers; bit-identical to the Triton kernel's `pv_add`
path, 7-9% faster than it on the H200 (docs/notes/hopper-forward.md, "Warp
specialization in Gluon").

`attn_fwd_pipelined_kernel` (not routed): Triton 3.6 serializes each tile: QK^T, wait,
softmax, PV, wait (it does not warp-specialize on sm_90), so the per-element work of the
exact recipes (scale multiplies, e4m3 rounding, Direct-P's classifier) adds to the
products' time. Here one warpgroup of 4 warps owns BLOCK_M = 64 query rows and orders
the asynchronous wgmmas itself, in one of two schedules (SCHEDULE):

    0: QK^T one tile ahead; iteration j (S_j in registers, PV_{j-1} in flight):
      1. TMA: K_{j+2} into the K stage QK_j has finished reading
      2. issue QK_{j+1}                               tensor cores: PV_{j-1}, QK_{j+1}
      3. softmax of S_j -> P_j (e4m3 values), alpha    ALU/MUFU, overlapping both
      4. wait for PV_{j-1}; TMA: V_{j+1} into its freed stage
      5. O *= alpha; issue PV_j (P from registers)     tensor cores: QK_{j+1}, PV_j
      6. wait for QK_{j+1}

    1: FlashAttention-3's intra-warpgroup order; iteration j (P_{j-1} in registers):
      issue QK_j; O *= alpha_{j-1}; issue PV_{j-1}; wait for QK_j; softmax of S_j
      (overlapping PV_{j-1}); wait for PV_{j-1}. One S tile is live instead of two.

On the H200 neither is faster than the Triton kernel (docs/notes/hopper-forward.md):
ptxas serializes schedule 0's wgmmas (for registers with fp8 Q/K, whose promotion needs
a second S accumulator; for a register read inside a wgmma stage with bf16 Q/K), and
schedule 1, which ptxas pipelines with bf16 Q/K, only hides PV_{j-1} behind the softmax
(`fp8` at (8,16,4096,128): 0.51x of cuDNN bf16 against the Triton kernel's 0.75x).

K and V^T tiles arrive by TMA into two-stage rings (mbarriers), Q once. Two programs
share an SM (64 rows, 4 warps each), so one program's waits hide behind the other's
work as well.

Operands are the forward's (`KernelOperands`): Q/K e4m3 or bf16 grid values with
per-token scales, V^T e4m3 (B, Hkv, D, Sk) with per-channel scales. TMA needs Sk to be a
multiple of 16 (V^T's row stride in bytes); the launcher reads the fused quantizers'
V^T as stored (rows padded with zero keys to whole tiles) and pads other V^T itself.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from fp4attn.kernels.common import P_OFFSET_LOG2, log2_scores, online_softmax_p
from fp4attn.kernels.hopper.gluon_common import barriers, tma_descriptor, wgmma_layout
from fp4attn.kernels.hopper.operands import BLOCK_N, padded_vt_rows, tma_loadable

BLOCK_M = 64  # one warpgroup's wgmma rows; BLOCK_N is the recipes' key tile


def ws_launch(partitions: int) -> tuple[int, int, int]:
    """(rows per program, num_warps, maxnreg) of the warp-specialized kernel for its
    partition layout (`attn_fwd_ws_kernel`'s PARTITIONS). Registers are handed out per
    warpgroup (setmaxnreg) from the program's pool, maxnreg x its warps rounded up to
    warpgroups: 0 and 1 run 12 warps at 168 (64512 of the SM's 65536: two consumer
    warpgroups at 240, the producer's at 24), 2 runs 8 warps at 128 so that two
    programs share an SM (a consumer at 232, the producer at 24)."""
    launches = {0: (128, 8, 168), 1: (128, 4, 168), 2: (64, 4, 128)}
    if partitions not in launches:
        raise ValueError(f"warp-specialized forward: partitions={partitions!r}; the layouts are {sorted(launches)}")
    return launches[partitions]


NUM_STAGES = gl.constexpr(2)  # K and V^T rings: 64-row programs fit two per SM (bf16 K: 112 KB each)


@gluon.constexpr_function
def _s_layout(warps, block_n, qk_fp8):
    """S in the QK^T accumulator layout: wgmma rows of 16 per warp, K of 32 (e4m3) or 16 (bf16)."""
    return wgmma_layout(warps, block_n, 32 if qk_fp8 else 16)


@gluon.constexpr_function
def _o_layout(warps, head_dim):
    """O (and PV) in the PV accumulator layout; P enters PV as its register A operand."""
    return wgmma_layout(warps, head_dim, 32)


@gluon.jit
def _softmax_state(QS, KS, off_bh, bhk, Sq, Sk, block, qk_scale, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """The rows of query block `block` (in units of BLOCK_M), the key offsets of a tile,
    the rows' scale a (q_scale * softmax_scale * log2 e), the key scales' base pointer,
    and the online softmax's initial running max (-inf) and row sum (0)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    a_i = gl.load(QS + off_bh * Sq + rows, mask=rows < Sq, other=0.0) * qk_scale
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    return rows, offs_n, a_i, KS + bhk * Sk, m_i, l_i


@gluon.jit
def _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                  s_layout: gl.constexpr, p_layout: gl.constexpr, P_MODE: gl.constexpr, P_HW_CVT: gl.constexpr,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile j's P (e4m3, times 2**8) as PV's register operand, the rescale factor and
    the new running max and row sum: `forward._tile`'s arithmetic, operation for
    operation. b_j: the tile's key scales (any value past Sk: those keys are masked)."""
    cols = j * BLOCK_N + offs_n
    masked = j * BLOCK_N >= full
    t = log2_scores(s, gl.expand_dims(a_i, 1), gl.expand_dims(b_j, 0))
    if masked:  # diagonal and tail tiles only (a runtime branch: no cost elsewhere)
        visible = gl.expand_dims(cols < Sk, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + causal_offset)
        t = gl.where(visible, t, -float("inf"))
    key_block = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)) // 32, 0)
    p, alpha, m_new, l_i = online_softmax_p(t, m_i, l_i, P_MODE, P_HW_CVT, True, key_block)
    return gl.convert_layout(p.to(gl.float8e4nv), p_layout), alpha, m_new, l_i


@gluon.jit
def _key_scales(ks_ptr, j, offs_n, Sk, BLOCK_N: gl.constexpr):
    cols = j * BLOCK_N + offs_n
    return gl.load(ks_ptr + cols, mask=cols < Sk, other=0.0)


@gluon.jit
def _program_rows(Sq, Sk, H, GROUP, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """This program's query block, (batch, head) and (batch, K/V head) indices, and its
    first rows in the 2D views the TMA descriptors cover: Q (B*H*Sq, D), K (B*Hkv*Sk, D),
    V^T (B*Hkv*D, keys)."""
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    bhk = (off_bh // H) * (H // GROUP) + (off_bh % H) // GROUP
    return start_m, off_bh, bhk, off_bh * Sq + start_m * BLOCK_M, bhk * Sk, bhk * HEAD_DIM


@gluon.jit
def _operand_rings(q_desc, k_desc, v_desc, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Shared memory for the program's Q block and STAGES-deep K and V^T rings."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    return q_smem, k_smem, v_smem


@gluon.jit
def _key_tiles(start_m, Sk, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which key tiles the query block start_m sees (as forward.py): (full, n_tiles),
    keys [0, full) need no mask."""
    hi = Sk
    full = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        last = (start_m + 1) * BLOCK_M + causal_offset
        first = start_m * BLOCK_M + causal_offset + 1
        hi = gl.minimum(gl.maximum(last, 0), Sk)
        full = gl.minimum(gl.maximum(first, 0), full) // BLOCK_N * BLOCK_N
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)  # a block that sees no key runs one masked tile
    return full, n_tiles


@gluon.jit
def _epilogue(acc, m_i, l_i, VS, O, LSE, off_bh, bhk, start_m, Sq, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr):
    """forward.py's epilogue: V's per-channel scale and 1/l on O, the LSE in natural log."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    seen = l_o > 0.0
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    vs = gl.load(VS + bhk * HEAD_DIM + offs_d)
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_o, 1.0), 0.0)
    out = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(vs, 0)
    lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0)) - P_OFFSET_LOG2) * 0.6931471805599453,
                   -float("inf"))
    rows_o = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    row_ok = rows_o < Sq
    o_ptrs = O + (off_bh * Sq + gl.expand_dims(rows_o, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, out.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 1))
    gl.store(LSE + off_bh * Sq + rows_o, lse, mask=row_ok)


@gluon.jit
def attn_fwd_pipelined_kernel(
    q_desc, k_desc, v_desc, QS, KS, VS, O, LSE,
    H, GROUP, Sq, Sk, causal_offset, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    QK_FP8: gl.constexpr, P_MODE: gl.constexpr, CAUSAL: gl.constexpr, P_HW_CVT: gl.constexpr,
    SCHEDULE: gl.constexpr = 0,
):
    gl.static_assert(BLOCK_M == 64)  # one warpgroup, wgmma's M
    gl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    s_layout: gl.constexpr = _s_layout(4, BLOCK_N, QK_FP8)
    o_layout: gl.constexpr = _o_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    start_m, off_bh, bhk, q_row, k_row, v_row = _program_rows(Sq, Sk, H, GROUP, HEAD_DIM, BLOCK_M)
    full, n_tiles = _key_tiles(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)

    # -- shared memory and barriers
    q_smem, k_smem, v_smem = _operand_rings(q_desc, k_desc, v_desc, NUM_STAGES, HEAD_DIM, BLOCK_N)
    q_bar = barriers(1, 1).index(0)
    k_bar = barriers(NUM_STAGES, 1)
    v_bar = barriers(NUM_STAGES, 1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_STAGES):
        pred = i < n_tiles
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [k_row + i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i), pred=pred)
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [v_row, i * BLOCK_N], v_bar.index(i), v_smem.index(i), pred=pred)

    rows, offs_n, a_i, ks_ptr, m_i, l_i = _softmax_state(QS, KS, off_bh, bhk, Sq, Sk, start_m, qk_scale, s_layout,
                                                         BLOCK_M, BLOCK_N)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    imprecise: gl.constexpr = 32 if QK_FP8 else 0  # promotion every 32 products (a diagnostic kernel)

    # -- S_0
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      max_num_imprecise_acc=imprecise, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])

    if SCHEDULE == 0:
        for j in range(n_tiles - 1):
            stage = j % NUM_STAGES
            nxt = (j + 1) % NUM_STAGES
            # 1. K_{j+2} into the stage QK_j read (finished: waited at the end of j-1)
            pred = j + 2 < n_tiles
            mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(k_desc, [k_row + (j + 2) * BLOCK_N, 0], k_bar.index(stage),
                                            k_smem.index(stage), pred=pred)
            # 2. QK_{j+1}
            mbarrier.wait(k_bar.index(nxt), ((j + 1) // NUM_STAGES) & 1)
            s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                                   max_num_imprecise_acc=imprecise, is_async=True)
            # 3. softmax of S_j
            b_j = _key_scales(ks_ptr, j, offs_n, Sk, BLOCK_N)
            p8, alpha, m_i, l_i = _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                                                s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
            # 4. PV_{j-1} done: its V stage takes V_{j+1} (V_1 came with the prologue)
            acc = warpgroup_mma_wait(1, deps=[acc])
            pred = (j >= 1) & (j + 1 < n_tiles)
            mbarrier.expect(v_bar.index(nxt), v_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(v_desc, [v_row, (j + 1) * BLOCK_N], v_bar.index(nxt), v_smem.index(nxt),
                                            pred=pred)
            # 5. PV_j
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(v_bar.index(stage), (j // NUM_STAGES) & 1)
            acc = warpgroup_mma(p8, v_smem.index(stage).permute((1, 0)), acc, is_async=True)
            # 6. S_{j+1}
            s = warpgroup_mma_wait(1, deps=[s_next])

        # -- the last tile
        j = n_tiles - 1
        stage = j % NUM_STAGES
        b_j = _key_scales(ks_ptr, j, offs_n, Sk, BLOCK_N)
        p8, alpha, m_i, l_i = _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                                            s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
        acc = warpgroup_mma_wait(0, deps=[acc])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_bar.index(stage), (j // NUM_STAGES) & 1)
        acc = warpgroup_mma(p8, v_smem.index(stage).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        # FA3's order: QK_j overlaps only O's rescale, the softmax of S_j overlaps PV_{j-1};
        # one S tile in registers instead of two. QK_0 has read K_0: its stage takes
        # K_2 (iteration j refills K_j's stage with K_{j+2} from j = 1 on)
        pred = NUM_STAGES < n_tiles
        mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [k_row + NUM_STAGES * BLOCK_N, 0], k_bar.index(0), k_smem.index(0),
                                        pred=pred)
        b_j = _key_scales(ks_ptr, 0, offs_n, Sk, BLOCK_N)
        p8, alpha, m_i, l_i = _softmax_tile(s, 0, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                                            s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
        o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        for j in range(1, n_tiles):
            stage = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            mbarrier.wait(k_bar.index(stage), (j // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                  max_num_imprecise_acc=imprecise, is_async=True)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(v_bar.index(prev), ((j - 1) // NUM_STAGES) & 1)
            o_tok = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            # K_j is read: its stage takes K_{j+2}
            pred = j + 2 < n_tiles
            mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(k_desc, [k_row + (j + 2) * BLOCK_N, 0], k_bar.index(stage),
                                            k_smem.index(stage), pred=pred)
            b_j = _key_scales(ks_ptr, j, offs_n, Sk, BLOCK_N)
            p8_next, alpha, m_i, l_i = _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset,
                                                     full, s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
            o = warpgroup_mma_wait(0, deps=[o_tok])  # (an e4m3 operand cannot be a dep: Triton 3.6)
            p8 = p8_next
            # V_{j-1} is read: its stage takes V_{j+1}
            pred = j + 1 < n_tiles
            mbarrier.expect(v_bar.index(prev), v_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(v_desc, [v_row, (j + 1) * BLOCK_N], v_bar.index(prev),
                                            v_smem.index(prev), pred=pred)
        j = n_tiles - 1
        o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_bar.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
        acc = warpgroup_mma(p8, v_smem.index(j % NUM_STAGES).permute((1, 0)), o, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    _epilogue(acc, m_i, l_i, VS, O, LSE, off_bh, bhk, start_m, Sq, o_layout, HEAD_DIM, BLOCK_M)


# -- warp-specialized: a producer warp and consumer warpgroups (FlashAttention-3's split)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 q_row, k_row, v_row, n_tiles, BLOCK_N: gl.constexpr):
    """Q once, then K_j and V^T_j into the rings as their stages come free (one thread
    issues each TMA copy). A fresh mbarrier counts as having completed the phase before
    its first, so the first pass over each stage does not wait."""
    stages: gl.constexpr = k_smem.type.shape[0]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for j in range(n_tiles):
        stage = j % stages
        free = ((j // stages) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), free)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row, j * BLOCK_N], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, j, Sk, imprecise: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Once K_j has arrived: QK_j issued (its token) and tile j's key scales loaded, one
    per thread, to arrive while the product runs."""
    stage = j % k_smem.type.shape[0]
    mbarrier.wait(k_ready.index(stage), (j // k_smem.type.shape[0]) & 1)
    if imprecise > 0:
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                              max_num_imprecise_acc=imprecise, is_async=True)
    else:  # e4m3: Triton's sm_90 default, the tensor core's own accumulation over all of K
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s_tok, _key_scales(ks_ptr, j, offs_ks, Sk, BLOCK_N)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                 off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                 WG: gl.constexpr, WGS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, QK_FP8: gl.constexpr, P_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                 P_HW_CVT: gl.constexpr, OVERLAP: gl.constexpr, QK_PROMOTE: gl.constexpr):
    """BLOCK_M query rows (rows WG * BLOCK_M ... of the program's block, which WGS such
    partitions share) on BLOCK_M // 16 warps: per tile QK^T, the softmax, PV on a fresh
    accumulator added to O in float32 (the Triton kernel's `PV_ADD` arithmetic), then
    the epilogue. OVERLAP 0: QK^T of tile j+1 is issued after O's update, so S_{j+1} is
    never live with PV_j's accumulator; 1: it is issued right after PV_j and one wait
    retires both, so the tensor cores run them back to back (S_{j+1}, PV_j and O live
    together, 192 registers, no softmax temporaries). ptxas chains each product's wgmmas
    either way; 2, the same order with a wait for PV_j alone (QK^T still in flight),
    makes it serialize every wgmma (C7514) and is kept only to show that; 4: QK^T of
    tile j+1 is issued before tile j's softmax (S_j, S_{j+1} and O live together through
    the softmax) and one wait after PV_j retires both.
    Gluon syncs a partition's warps before each mbarrier arrive (one thread arrives for
    all), and around the key scales' trip through shared memory, so warpgroups that share
    a partition move in step at those points (one sync fewer per tile measured no faster:
    docs/notes/hopper-forward.md)."""
    stages: gl.constexpr = k_smem.type.shape[0]
    warps: gl.constexpr = BLOCK_M // 16
    s_layout: gl.constexpr = _s_layout(warps, BLOCK_N, QK_FP8)
    o_layout: gl.constexpr = _o_layout(warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    imprecise: gl.constexpr = QK_PROMOTE if QK_FP8 else 0

    block = start_m * WGS + WG  # in units of BLOCK_M rows
    rows, offs_n, a_i, ks_ptr, m_i, l_i = _softmax_state(QS, KS, off_bh, bhk, Sq, Sk, block, qk_scale, s_layout,
                                                         BLOCK_M, BLOCK_N)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    q_tile = q_smem.slice(WG * BLOCK_M, BLOCK_M)  # this partition's rows of the program's Q block

    # the key scales of a tile are loaded while its QK^T runs: issued right after the
    # wgmma, one per thread (the softmax's layout holds 32 per thread, each its own
    # 64-bit address: live across the wait they spilled 400 bytes), they arrive during
    # its latency and are spread to the softmax's layout through shared memory after it
    ks_layout: gl.constexpr = gl.BlockedLayout([1], [32], [warps], [0])
    offs_ks = gl.arange(0, BLOCK_N, layout=ks_layout)
    mbarrier.wait(q_bar, 0)
    s_tok, kb = _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, 0, Sk, imprecise, BLOCK_N)
    for j in range(n_tiles):
        stage = j % stages
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(stage), count=1)  # QK_j has read K_j
        b_j = gl.convert_layout(kb, col_s)
        if OVERLAP == 4:
            # QK^T of the next tile runs during this tile's softmax; issued on every tile
            # (the last one repeats its own, unused): under a branch, the token's merge
            # made ptxas wait for it before the softmax (C7517)
            s_tok, kb = _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, gl.minimum(j + 1, n_tiles - 1),
                                      Sk, imprecise, BLOCK_N)
        p8, alpha, m_i, l_i = _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                                            s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
        mbarrier.wait(v_ready.index(stage), (j // stages) & 1)
        pv_tok = warpgroup_mma(p8, v_smem.index(stage).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        if OVERLAP == 4:
            pv = warpgroup_mma_wait(0, deps=[pv_tok])  # and QK_{j+1}, issued before it
        elif OVERLAP > 0:
            if j + 1 < n_tiles:
                s_tok, kb = _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, j + 1, Sk, imprecise,
                                          BLOCK_N)
            pv = warpgroup_mma_wait(OVERLAP - 1, deps=[pv_tok])
        else:
            pv = warpgroup_mma_wait(0, deps=[pv_tok])
        mbarrier.arrive(v_empty.index(stage), count=1)  # PV_j has read V_j
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1) + pv
        if OVERLAP == 0:
            if j + 1 < n_tiles:
                s_tok, kb = _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, j + 1, Sk, imprecise,
                                          BLOCK_N)
    _epilogue(acc, m_i, l_i, VS, O, LSE, off_bh, bhk, block, Sq, o_layout, HEAD_DIM, BLOCK_M)


@gluon.jit
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, QS, KS, VS, O, LSE,
    H, GROUP, Sq, Sk, causal_offset, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    QK_FP8: gl.constexpr, P_MODE: gl.constexpr, CAUSAL: gl.constexpr, P_HW_CVT: gl.constexpr,
    STAGES: gl.constexpr = 2, PARTITIONS: gl.constexpr = 0, OVERLAP: gl.constexpr = 0,
    QK_PROMOTE: gl.constexpr = 0,
):
    """Warp-specialized forward: a producer warp keeps `STAGES`-deep K and V^T rings
    full; the consumers never issue a copy or wait at a CTA barrier. PARTITIONS
    (`ws_launch` gives each one's launch):
      0: 128 rows, both consumer warpgroups in the default partition (8 warps), the
         producer a worker warp;
      1: 128 rows, each consumer warpgroup a worker partition of its own, the producer
         the default partition (4 warps, one issues);
      2: 64 rows, one consumer warpgroup (default) and the producer warp, two programs
         per SM."""
    gl.static_assert(BLOCK_M == (64 if PARTITIONS == 2 else 128))  # consumer warpgroups of wgmma's 64 rows
    gl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    start_m, off_bh, bhk, q_row, k_row, v_row = _program_rows(Sq, Sk, H, GROUP, HEAD_DIM, BLOCK_M)
    full, n_tiles = _key_tiles(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem, k_smem, v_smem = _operand_rings(q_desc, k_desc, v_desc, STAGES, HEAD_DIM, BLOCK_N)
    consumers: gl.constexpr = 2 if PARTITIONS == 1 else 1  # arrivals that free a stage
    q_bar = barriers(1, 1).index(0)
    k_ready = barriers(STAGES, 1)
    k_empty = barriers(STAGES, consumers)
    v_ready = barriers(STAGES, 1)
    v_empty = barriers(STAGES, consumers)
    fence_async_shared()

    if PARTITIONS == 1:
        gl.static_assert(gl.num_warps() == 4)
        HALF: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                            q_row, k_row, v_row, n_tiles, BLOCK_N)),
            (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                            off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                            0, 2, HEAD_DIM, HALF, BLOCK_N, QK_FP8, P_MODE, CAUSAL, P_HW_CVT, OVERLAP, QK_PROMOTE)),
            (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                            off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                            1, 2, HEAD_DIM, HALF, BLOCK_N, QK_FP8, P_MODE, CAUSAL, P_HW_CVT, OVERLAP, QK_PROMOTE)),
        ], [4, 4], [240, 240])
    else:
        gl.static_assert(gl.num_warps() == BLOCK_M // 16)
        gl.warp_specialize([
            (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                            off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                            0, 1, HEAD_DIM, BLOCK_M, BLOCK_N, QK_FP8, P_MODE, CAUSAL, P_HW_CVT, OVERLAP, QK_PROMOTE)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                            q_row, k_row, v_row, n_tiles, BLOCK_N)),
        ], [1], [24])


def launch_forward_ws(ops, *, scale: float, causal_offset, p_mode: int, p_hw_cvt: bool = True,
                             schedule: int = 0, warp_specialized: bool = False, partitions: int = 0,
                             stages: int = 2, overlap: int = 0, qk_promote: int = 0):
    """Run a Gluon kernel on prepared operands (`KernelOperands`, contiguous):
    (out bf16, lse fp32), as `forward_op.launch_forward` without its debug outputs.

    `attn_fwd_pipelined_kernel` (one warpgroup per program), schedule 0: QK^T of the
    next tile issued before the softmax (two S tiles live); 1: FA3's order (the softmax
    overlaps PV, one S tile live). Its PV accumulates O on the tensor cores.

    `warp_specialized`: `attn_fwd_ws_kernel` in the partition layout `partitions`
    (`ws_launch`) with `stages`-deep K/V rings and its OVERLAP flag `overlap`; its O is added in float32 per tile, as
    the Triton kernel's at D=128 (`pv_add`); e4m3 QK^T is promoted into float32 every
    `qk_promote` products (0: never, the `fast_accum` recipes; the pipelined kernel
    always promotes every 32). e4m3 Q/K may also be given as bf16 (exact):
    their QK^T then runs on the bf16 tensor cores, without the fp8 accumulation's
    promotion."""
    import torch

    from fp4attn.reference.forward import LOG2E

    q, k, vt = ops.q, ops.k, ops.vt
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_m, block_n = BLOCK_M, BLOCK_N
    if warp_specialized:
        block_m, num_warps, maxnreg = ws_launch(partitions)
        if overlap not in (0, 1, 2, 4):
            raise ValueError(f"warp-specialized forward: overlap={overlap!r}; OVERLAP is 0, 1, 2 or 4")
    q2, k2 = q.reshape(B * H * Sq, D), k.reshape(B * Hkv * Sk, D)
    if tma_loadable(ops):  # rows padded with zero keys to whole tiles: read as they are stored
        v2 = padded_vt_rows(ops)
    else:
        if Sk % 16:  # TMA: V^T's row stride must be a multiple of 16 bytes
            pad = torch.zeros((B, Hkv, D, 16 - Sk % 16), dtype=vt.dtype, device=vt.device)
            vt = torch.cat([vt, pad], dim=-1)
        v2 = vt.reshape(B * Hkv * D, vt.shape[-1])
        v2 = v2[:, :Sk] if v2.shape[1] != Sk else v2  # a view: the padded stride, the true extent

    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Sq, block_m), B * H)
    descs = (tma_descriptor(q2, [block_m, D]), tma_descriptor(k2, [block_n, D]), tma_descriptor(v2, [D, block_n]))
    args = (*descs, ops.qs, ops.ks, ops.vs, out, lse, H, H // Hkv, Sq, Sk, causal_offset or 0, scale * LOG2E)
    flags = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, QK_FP8=q.dtype == torch.float8_e4m3fn, P_MODE=p_mode,
                 CAUSAL=causal_offset is not None, P_HW_CVT=p_hw_cvt)
    if warp_specialized:
        attn_fwd_ws_kernel[grid](*args, **flags, STAGES=stages, PARTITIONS=partitions, OVERLAP=overlap,
                                 QK_PROMOTE=qk_promote, num_warps=num_warps, maxnreg=maxnreg)
    else:
        attn_fwd_pipelined_kernel[grid](*args, **flags, SCHEDULE=schedule, num_warps=4)
    return out, lse
