"""Attention forward for Hopper (sm_90) in Gluon, warp-specialized: the Triton kernel's
numerics (`forward_triton.py`, the same P builders from `kernels/common.py`) with a
producer warp that keeps K/V^T rings full by TMA and a consumer warpgroup that waits
only on mbarriers and its own wgmmas.

Routed by `forward_op.launch_forward` for FP8 P at D=128 (`routing.FORWARD_LAUNCH`,
`warp_specialized`); bit-identical to the Triton kernel's `pv_add` path and 7-9% faster
than it on the H200. A program is 64 query rows: one consumer warpgroup (the default
partition) and the producer warp, two programs per SM. Layouts with two consumer
warpgroups per program, and a one-warpgroup kernel without warp specialization, were
measured slower and removed (docs/notes/hopper-forward.md, "A Gluon forward with
asynchronous wgmma" and "Warp specialization in Gluon").

Operands are the forward's (`KernelOperands`): Q/K e4m3 or bf16 grid values with
per-token scales, V^T e4m3 (B, Hkv, D, Sk) with per-channel scales. TMA needs Sk to be a
multiple of 16 (V^T's row stride in bytes); the launcher reads the fused quantizers'
V^T as stored (rows padded with zero keys to whole tiles) and pads other V^T itself.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4attn.kernels.common import (
    P_MODE_FP8_AFFINE_LAZY,
    P_OFFSET_LOG2,
    P_OFFSET_LOG2_LAZY,
    log2_scores,
    online_softmax_p,
)
from fp4attn.kernels.hopper.gluon_common import (
    barriers,
    barriers_ready,
    invalidate,
    tma_descriptor,
    wgmma_layout,
)
from fp4attn.kernels.hopper.operands import BLOCK_N, padded_vt_rows, tma_loadable
from fp4attn.routing import WSOverlap

BLOCK_M = 64  # one warpgroup's wgmma rows; BLOCK_N is the recipes' key tile
# Registers are handed out per warpgroup (setmaxnreg) from the program's pool, maxnreg x
# its warps rounded up to warpgroups: 4 warps at 128 leave room for two programs per SM
# (the consumer at 232, the producer warp at 24)
WS_WARPS = 4
WS_MAXNREG = 128
# `attn_fwd_ws_kernel`'s OVERLAP: where the next tile's QK^T is issued (`routing.WSOverlap`)
OVERLAP_BEFORE_SOFTMAX = gl.constexpr(WSOverlap.BEFORE_SOFTMAX.value)


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
              BLOCK_M: gl.constexpr, P_MODE: gl.constexpr):
    """forward.py's epilogue: V's per-channel scale and 1/l on O, the LSE in natural log
    (P's offset, 2**8 or P mode 7's 2**5, subtracted)."""
    p_offset: gl.constexpr = P_OFFSET_LOG2_LAZY if P_MODE == P_MODE_FP8_AFFINE_LAZY else P_OFFSET_LOG2
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    seen = l_o != 0.0  # 0 only for a row that saw no key; NaN (a NaN row) stays NaN
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    vs = gl.load(VS + bhk * HEAD_DIM + offs_d)
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_o, 1.0), 0.0)
    out = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(vs, 0)
    lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0)) - p_offset) * 0.6931471805599453,
                   -float("inf"))
    rows_o = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    row_ok = rows_o < Sq
    o_ptrs = O + (off_bh * Sq + gl.expand_dims(rows_o, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, out.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 1))
    gl.store(LSE + off_bh * Sq + rows_o, lse, mask=row_ok)


# -- warp-specialized: a producer warp and a consumer warpgroup (FlashAttention-3's split)


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
def _issue_scores(q_tile, k_smem, k_ready, s_zero, ks_ptr, offs_ks, j, Sk, BLOCK_N: gl.constexpr):
    """Once K_j has arrived: QK_j issued (its token) and tile j's key scales loaded, one
    per thread, to arrive while the product runs. e4m3 QK^T takes the tensor core's own
    accumulation over all of K (the `fast_accum` recipes' sums, Triton's sm_90 default)."""
    stage = j % k_smem.type.shape[0]
    mbarrier.wait(k_ready.index(stage), (j // k_smem.type.shape[0]) & 1)
    s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s_tok, _key_scales(ks_ptr, j, offs_ks, Sk, BLOCK_N)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                 off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QK_FP8: gl.constexpr,
                 P_MODE: gl.constexpr, CAUSAL: gl.constexpr, P_HW_CVT: gl.constexpr, OVERLAP: gl.constexpr):
    """The program's BLOCK_M query rows on BLOCK_M // 16 warps: per tile QK^T, the
    softmax, PV on a fresh accumulator added to O in float32 (the Triton kernel's
    `PV_ADD` arithmetic), then the epilogue. OVERLAP BESIDE_PV: QK^T of tile j+1 is issued
    right after PV_j and one wait retires both, so the tensor cores run them back to back
    (S_{j+1}, PV_j and O live together, 192 registers, no softmax temporaries);
    BEFORE_SOFTMAX: QK^T of tile j+1 is issued before tile j's softmax (S_j, S_{j+1} and O live together through
    the softmax) and one wait after PV_j retires both. Waiting for PV_j alone instead makes
    ptxas serialize every wgmma of the kernel (C7514; docs/notes/hopper-forward.md, "The
    next QK^T beside PV").
    Gluon syncs the partition's warps before each mbarrier arrive (one thread arrives
    for all), and around the key scales' trip through shared memory."""
    stages: gl.constexpr = k_smem.type.shape[0]
    warps: gl.constexpr = BLOCK_M // 16
    s_layout: gl.constexpr = _s_layout(warps, BLOCK_N, QK_FP8)
    o_layout: gl.constexpr = _o_layout(warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    rows, offs_n, a_i, ks_ptr, m_i, l_i = _softmax_state(QS, KS, off_bh, bhk, Sq, Sk, start_m, qk_scale, s_layout,
                                                         BLOCK_M, BLOCK_N)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    # the key scales of a tile are loaded while its QK^T runs: issued right after the
    # wgmma, one per thread (the softmax's layout holds 32 per thread, each its own
    # 64-bit address: live across the wait they spilled 400 bytes), they arrive during
    # its latency and are spread to the softmax's layout through shared memory after it
    ks_layout: gl.constexpr = gl.BlockedLayout([1], [32], [warps], [0])
    offs_ks = gl.arange(0, BLOCK_N, layout=ks_layout)
    mbarrier.wait(q_bar, 0)
    s_tok, kb = _issue_scores(q_smem, k_smem, k_ready, s_zero, ks_ptr, offs_ks, 0, Sk, BLOCK_N)
    for j in range(n_tiles):
        stage = j % stages
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(stage), count=1)  # QK_j has read K_j
        b_j = gl.convert_layout(kb, col_s)
        if OVERLAP == OVERLAP_BEFORE_SOFTMAX:
            # QK^T of the next tile runs during this tile's softmax; issued on every tile
            # (the last one repeats its own, unused): under a branch, the token's merge
            # made ptxas wait for it before the softmax (C7517)
            s_tok, kb = _issue_scores(q_smem, k_smem, k_ready, s_zero, ks_ptr, offs_ks, gl.minimum(j + 1, n_tiles - 1),
                                      Sk, BLOCK_N)
        p8, alpha, m_i, l_i = _softmax_tile(s, j, m_i, l_i, a_i, b_j, offs_n, rows, Sk, causal_offset, full,
                                            s_layout, p_layout, P_MODE, P_HW_CVT, CAUSAL, BLOCK_N)
        mbarrier.wait(v_ready.index(stage), (j // stages) & 1)
        pv_tok = warpgroup_mma(p8, v_smem.index(stage).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        if OVERLAP == OVERLAP_BEFORE_SOFTMAX:
            pv = warpgroup_mma_wait(0, deps=[pv_tok])  # and QK_{j+1}, issued before it
        else:
            if j + 1 < n_tiles:
                s_tok, kb = _issue_scores(q_smem, k_smem, k_ready, s_zero, ks_ptr, offs_ks, j + 1, Sk, BLOCK_N)
            pv = warpgroup_mma_wait(0, deps=[pv_tok])  # and QK_{j+1}, issued after it
        mbarrier.arrive(v_empty.index(stage), count=1)  # PV_j has read V_j
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1) + pv
    _epilogue(acc, m_i, l_i, VS, O, LSE, off_bh, bhk, start_m, Sq, o_layout, HEAD_DIM, BLOCK_M, P_MODE)


@gluon.jit
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, QS, KS, VS, O, LSE, call,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    QK_FP8: gl.constexpr, P_MODE: gl.constexpr, CAUSAL: gl.constexpr, P_HW_CVT: gl.constexpr,
    STAGES: gl.constexpr = 2, OVERLAP: gl.constexpr = WSOverlap.BESIDE_PV.value,
):
    """Warp-specialized forward: a producer warp keeps `STAGES`-deep K and V^T rings
    full; the consumer warpgroup (the default partition, BLOCK_M = 64 rows) never issues a
    copy or waits at a CTA barrier. `call`: the Triton forward's per-call scalars
    (`kernel_args.CALL`)."""
    H, GROUP, Sq, Sk, causal_offset, qk_scale = call
    gl.static_assert(BLOCK_M == 64)  # one consumer warpgroup, wgmma's 64 rows
    gl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    gl.static_assert(gl.num_warps() == BLOCK_M // 16)
    start_m, off_bh, bhk, q_row, k_row, v_row = _program_rows(Sq, Sk, H, GROUP, HEAD_DIM, BLOCK_M)
    full, n_tiles = _key_tiles(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem, k_smem, v_smem = _operand_rings(q_desc, k_desc, v_desc, STAGES, HEAD_DIM, BLOCK_N)
    q_bars = barriers(1, 1)
    q_bar = q_bars.index(0)
    k_ready = barriers(STAGES, 1)
    k_empty = barriers(STAGES, 1)
    v_ready = barriers(STAGES, 1)
    v_empty = barriers(STAGES, 1)
    barriers_ready()

    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, QS, KS, VS, O, LSE,
                        off_bh, bhk, start_m, Sq, Sk, causal_offset, qk_scale, n_tiles, full,
                        HEAD_DIM, BLOCK_M, BLOCK_N, QK_FP8, P_MODE, CAUSAL, P_HW_CVT, OVERLAP)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                        q_row, k_row, v_row, n_tiles, BLOCK_N)),
    ], [1], [24])
    # both partitions are done with the barriers (every copy was waited for): their
    # shared memory is invalidated before the program ends, as PTX requires of memory
    # that held an mbarrier before it is used otherwise
    invalidate(q_bars, 1)
    invalidate(k_ready, STAGES)
    invalidate(k_empty, STAGES)
    invalidate(v_ready, STAGES)
    invalidate(v_empty, STAGES)


def launch_forward_ws(ops, *, scale: float, causal_offset, p_mode: int, p_hw_cvt: bool = True, stages: int = 2,
                      overlap: int = WSOverlap.BESIDE_PV):
    """Run `attn_fwd_ws_kernel` on prepared operands (`KernelOperands`, contiguous):
    (out bf16, lse fp32), as `forward_op.launch_forward` without its debug outputs, with
    `stages`-deep K/V rings and its OVERLAP flag `overlap` (a `routing.WSOverlap`). O is
    added in float32 per tile, as the Triton kernel's at D=128 (`pv_add`); e4m3 QK^T is
    not promoted (the `fast_accum` recipes). e4m3 Q/K may also be given as bf16 (exact): their QK^T then
    runs on the bf16 tensor cores."""
    import torch

    from fp4attn.reference.forward import LOG2E

    if overlap not in tuple(WSOverlap):
        raise ValueError(f"warp-specialized forward: overlap={overlap!r}; OVERLAP is 1 or 4 (where the next tile's "
                         "QK^T is issued: routing.WSOverlap)")
    q, k, vt = ops.q, ops.k, ops.vt
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
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
    grid = (triton.cdiv(Sq, BLOCK_M), B * H)
    descs = (tma_descriptor(q2, [BLOCK_M, D]), tma_descriptor(k2, [BLOCK_N, D]), tma_descriptor(v2, [D, BLOCK_N]))
    call = (H, H // Hkv, Sq, Sk, causal_offset or 0, scale * LOG2E)
    attn_fwd_ws_kernel[grid](*descs, ops.qs, ops.ks, ops.vs, out, lse, call, HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             QK_FP8=q.dtype == torch.float8_e4m3fn, P_MODE=int(p_mode),
                             CAUSAL=causal_offset is not None, P_HW_CVT=p_hw_cvt, STAGES=stages,
                             OVERLAP=WSOverlap(overlap).value, num_warps=WS_WARPS,
                             maxnreg=WS_MAXNREG)
    return out, lse
