"""Attention forward for datacenter Blackwell (sm_100a) in Gluon, with FlashAttention-4's
structure: explicit partitions (`gl.warp_specialize`) around tensor memory, two 128-row
query tiles a CTA whose softmax warpgroups take turns on the tensor cores.

Compiled and modelled on a CPU machine (`machine_code_sm100.compile_forward_gluon`,
`python -m dev.cost_report_sm100`); not routed, never run on a GPU, so it lives in the
development area, not the package (docs/notes/archive/blackwell.md, "A Gluon pipeline
with FA4's structure").

A CTA holds 256 query rows of one head (two tiles of BLOCK_M = 128) and walks the key
tiles (BLOCK_N = 128) once. Partitions, per key tile j:

    load        1 warp: Q once (both tiles), then K_j and V_j by TMA into a STAGES-deep
                ring (`cp.async.bulk.tensor`), released by the MMA's completion.
    mma         1 warp: S = Q_t K_j^T for t = 0, 1 and O_t += P_t V_j (causal: tile 0's
                only up to its own last key tile), each a tcgen05 instruction sequence
                with completion on mbarriers; a fresh S
                and the first PV take the MMA's own `use_acc=False` (no zero tile).
                NVFP4 Q/K: `tcgen05_mma_scaled` (kind::mxf4nvf4, e4m3 scales per 16);
                MXFP4 P.V: `tcgen05_mma_scaled` (kind::mxf4, E8M0 per 32); FP8 and bf16
                products: `tcgen05_mma`.
    softmax_t   4 warps for each query tile t (the default partition is tile 0): S_t
                from tensor memory (one row a thread), the scores, the running max, P and
                its row sum, P and its E8M0 scales into tensor memory (the PV product's A
                operand, as FA4 keeps P), alpha to the correction. The full key tiles
                (every row sees every key) run in a loop with no mask; the others (the
                tail past Sk; causal, the diagonal) in a second loop with the mask.
    correction  4 warps: the block scales of Q (once), K_j and V_j into tensor memory
                (TensorMemoryScalesLayout, from global memory: their rows are narrower
                than a TMA box's 16 bytes), O_t *= alpha in tensor memory between PV_t's
                of consecutive tiles (two columns a `mul.rn.f32x2`), and the epilogue
                (O / l, bf16, stored).

Tensor memory (512 columns): one S buffer of 128 columns shared by the two query tiles
(QK^T of one tile starts once the other tile's softmax has read S into registers: P has
columns of its own, so S is free as soon as it is read), O_0 and O_1 of 128 columns
each, P_0 and P_1 (16 columns each as MXFP4 codes, 32 as e4m3, 64 as bf16) and the
scale tiles (Q: 2 columns a tile; K: 2 a stage; V and P: 1 each). Two S buffers and the
two O's would fill all 512 columns and leave none for P and the scales. Gluon 3.6 has
no multi-buffered scale tiles ("Scales don't currently support multibuffering"): each
slot is an allocation of its own, the K/V ring's chosen by a branch.

Numerics: every non-MMA arithmetic step is the Triton kernel's own code, called from
this kernel (`forward_triton`: `_log2_scores_x2`, `_affine_block_constants`, the group
asm `_affine_group_x2` and the dp4a `_byte_lane_sum`, `_affine_x2_row_sum`,
`_running_point`, `_carry`; the epilogue's `_final_scales` restates its four operations),
or a two-wide form of the Triton kernel's
scalar float32 operations (the correction's `mul.rn.f32x2`, FP8 P's exponent by
`sub.rn.f32x2` and `add.rn.f32x2`: each lane rounds as the scalar instruction), or FP8
P's rounding by `round_e4m3_cvt`'s conversions with the e4m3 bytes kept (its row sum
then adds four keys a group, then the groups: float32 sums in another order, as the
recipes allow). FP8 P's exp2 is the GPU's approximate ex2, as in the Triton kernel. Under the interpreter
the Triton kernel runs that code against the reference, and
`tests/kernels/blackwell/test_kernels.py` its inline PTX through an emulator bit for bit
against the interpreter path; `tests/dev/test_forward_gluon_sm100.py` checks that this
kernel's inline-PTX arithmetic is those blocks and no other. The rest is data movement,
layout conversions within a thread's row, and the tensor cores' products (float32 sums
in the tensor core's order, as the pipelined Triton kernel's).

Operands (contiguous, `operands.prepare_operands`'s layouts): Q (B, H, Sq, D/2) NVFP4
codes, QSC (B, H, Sq, D/16) e4m3; K, KSC likewise at Hkv heads; QS (B, H, Sq), KS (B,
Hkv, Sk) float32 tensor scales; V (B, Hkv, D, Skp/2) MXFP4 codes packed along the keys
with VSC (B, Hkv, D, Skp/32) E8M0, or V^T (B, Hkv, D, Skp) e4m3 with VS (B, Hkv, D);
bf16: Q, K (B, H, S, D), V^T (B, Hkv, D, Skp). The TMA descriptors cover 2-D views: Q
(B*H*Sq, D/2 or D), K (B*Hkv*Sk, D/2 or D), V (B*Hkv*D, Skp/2 or Skp).
"""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    TensorMemoryScalesLayout,
    allocate_tensor_memory,
    fence_async_shared,
    get_tmem_reg_layout,
    mbarrier,
    tcgen05_mma,
    tcgen05_mma_scaled,
    tma,
)

from fp4attn.kernels.blackwell.forward_triton import (
    _affine_block_constants,
    _affine_group_x2,
    _affine_x2_row_sum,
    _byte_lane_sum,
    _carry,
    _hide_keys,
    _log2_scores_x2,
    _running_point,
    _split_eight,
)
from fp4attn.kernels.common import (
    P_OFFSET_LOG2,
    key_tile_bounds,
    log2_scores,
    max_propagating_nan,
)

BLOCK_M = gl.constexpr(128)  # one softmax warpgroup's query tile (tcgen05's M); a CTA holds two
BLOCK_N = gl.constexpr(128)  # key tile
# P builders (constexpr P_KIND)
P_AFFINE_MXFP4 = gl.constexpr(0)  # `directp-fast`: NVFP4 Q/K, affine MXFP4 P, MXFP4 V
P_EXP2_FP8 = gl.constexpr(1)  # `nvfp4-fp8`: NVFP4 Q/K, FP8 P by exp2 (times 2**8), FP8 V
P_BF16 = gl.constexpr(2)  # the bf16 calibration build: bf16 Q, K, V, P = exp2 rounded to bf16
# the launch's warps: the default partition (softmax of tile 0); the workers' warps and
# registers are in `gl.warp_specialize`'s call (softmax of tile 1, correction, MMA, loads)
NUM_WARPS = 4


@gluon.constexpr_function
def _s_tmem_layout():
    return TensorMemoryLayout((BLOCK_M, BLOCK_N), col_stride=1)


@gluon.constexpr_function
def _o_tmem_layout(head_dim):
    return TensorMemoryLayout((BLOCK_M, head_dim), col_stride=1)


@gluon.constexpr_function
def _p_dtype(p_kind):
    return {0: gl.uint8, 1: gl.float8e4nv, 2: gl.bfloat16}[p_kind]


@gluon.constexpr_function
def _p_cols(p_kind):
    """P's elements a row: MXFP4 codes packed two a byte."""
    return BLOCK_N // 2 if p_kind == 0 else BLOCK_N


@gluon.constexpr_function
def _p_tmem_layout(p_kind):
    """P in tensor memory, packed (four bytes or two bf16 a 32-bit column)."""
    return TensorMemoryLayout((BLOCK_M, _p_cols(p_kind)), col_stride=1)


# ------------------------------------------------------------------------------- load
@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, q_row, k_row, v_row,
                    start_m, Sk, causal_offset, CAUSAL: gl.constexpr, V_COLS: gl.constexpr):
    """Q's two tiles once, then K_j and V_j into ring slot j % STAGES once the MMA has
    released it (kv_empty, committed after the slot's last product)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    n_full, n_tiles = _key_tiles(start_m, 1, Sk, causal_offset, CAUSAL)  # tile 1 sees the most keys
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], kv_ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [v_row, j * V_COLS], kv_ready.index(s), v_smem.index(s))


# -------------------------------------------------------------------------------- MMA
@gluon.jit
def _qk(t: gl.constexpr, s, q_smem, k_smem, s_tmem, qsc_tmem, ksc_tmem, s_ready, P_KIND: gl.constexpr):
    """S = Q_t K^T into the one S buffer, on a fresh accumulator (use_acc=False);
    completion arrives at s_ready[t]."""
    kt = k_smem.index(s).permute((1, 0))
    if P_KIND == P_BF16:
        tcgen05_mma(q_smem.index(t), kt, s_tmem, use_acc=False, mbarriers=[s_ready.index(t)])
    else:
        # the K scales' two slots are separate allocations (Gluon 3.6 has no multi-buffered
        # scale tiles): the slot by a branch
        if s == 0:
            tcgen05_mma_scaled(q_smem.index(t), kt, s_tmem, qsc_tmem[t], ksc_tmem[0], "e2m1", "e2m1",
                               use_acc=False, mbarriers=[s_ready.index(t)])
        else:
            tcgen05_mma_scaled(q_smem.index(t), kt, s_tmem, qsc_tmem[t], ksc_tmem[1], "e2m1", "e2m1",
                               use_acc=False, mbarriers=[s_ready.index(t)])


@gluon.jit
def _pv(t: gl.constexpr, j, p_tmem, v_smem, o_tmem, psc_tmem, vsc_tmem, p_ready, o_ready, pv_done, kv_empty,
        RELEASE: gl.constexpr, P_KIND: gl.constexpr):
    """O_t += P_t V_j once P_t is built (p_ready) and, past the first tile, O_t rescaled
    (o_ready); the first tile's product starts O_t (use_acc=False). Completion arrives at
    pv_done[t] and, for the second tile (RELEASE), frees K/V ring slot j % STAGES."""
    STAGES: gl.constexpr = v_smem.shape[0]
    s = j % STAGES
    mbarrier.wait(p_ready.index(t), j & 1)
    mbarrier.wait(o_ready.index(t), (j - 1) & 1, pred=j > 0)
    v = v_smem.index(s).permute((1, 0))
    if RELEASE:
        bars = [pv_done.index(t), kv_empty.index(s)]
    else:
        bars = [pv_done.index(t)]
    if P_KIND == P_AFFINE_MXFP4:
        if s == 0:
            tcgen05_mma_scaled(p_tmem.index(t), v, o_tmem.index(t), psc_tmem[t], vsc_tmem[0], "e2m1", "e2m1",
                               use_acc=j > 0, mbarriers=bars)
        else:
            tcgen05_mma_scaled(p_tmem.index(t), v, o_tmem.index(t), psc_tmem[t], vsc_tmem[1], "e2m1", "e2m1",
                               use_acc=j > 0, mbarriers=bars)
    else:
        tcgen05_mma(p_tmem.index(t), v, o_tmem.index(t), use_acc=j > 0, mbarriers=bars)


@gluon.jit
def _mma_partition(q_smem, k_smem, v_smem, p_tmem, s_tmem, o_tmem, qsc_tmem, ksc_tmem, vsc_tmem, psc_tmem, q_bar,
                   kv_ready, kv_empty, sc_ready, s_ready, s_free, p_ready, o_ready, pv_done, start_m, Sk,
                   causal_offset, CAUSAL: gl.constexpr, P_KIND: gl.constexpr):
    """Per key tile j: QK_0(j), PV_1(j - 1), QK_1(j), PV_0(j), so that each tile's
    product runs while the other tile's softmax builds P; tile 0's products only below
    its n_tiles0 (causal: its last visible key comes 128 rows before tile 1's). Each
    QK^T after the first waits until the previous one's softmax has read the S buffer
    (s_free, one arrival per read)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    n_full0, n_tiles0 = _key_tiles(start_m, 0, Sk, causal_offset, CAUSAL)
    n_full1, n_tiles = _key_tiles(start_m, 1, Sk, causal_offset, CAUSAL)
    mbarrier.wait(q_bar, 0)
    issued = 0  # QK^T products issued: the S buffer's readers so far
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
        if P_KIND != P_BF16:  # (the bf16 build has no scale tiles)
            mbarrier.wait(sc_ready.index(s), (j // STAGES) & 1)
        if j < n_tiles0:
            mbarrier.wait(s_free, (issued + 1) & 1, pred=issued > 0)
            _qk(0, s, q_smem, k_smem, s_tmem, qsc_tmem, ksc_tmem, s_ready, P_KIND)
            issued += 1
        if j > 0:
            _pv(1, j - 1, p_tmem, v_smem, o_tmem, psc_tmem, vsc_tmem, p_ready, o_ready, pv_done, kv_empty, True,
                P_KIND)
        mbarrier.wait(s_free, (issued + 1) & 1, pred=issued > 0)
        _qk(1, s, q_smem, k_smem, s_tmem, qsc_tmem, ksc_tmem, s_ready, P_KIND)
        issued += 1
        if j < n_tiles0:
            _pv(0, j, p_tmem, v_smem, o_tmem, psc_tmem, vsc_tmem, p_ready, o_ready, pv_done, kv_empty, False, P_KIND)
    if n_tiles > 0:
        _pv(1, n_tiles - 1, p_tmem, v_smem, o_tmem, psc_tmem, vsc_tmem, p_ready, o_ready, pv_done, kv_empty, True,
            P_KIND)


@gluon.jit
def _final_scales(m_i, l_i, LSE_OFFSET: gl.constexpr):
    """The epilogue's (1 / l, LSE in natural log) of rows with running max m_i and sum
    l_i; LSE_OFFSET (log2 units) is FP8 P's 2**8, which cancels in O / l. NaN rows stay
    NaN; only rows that saw no key get 1 / l = 0 and LSE -inf. `forward_triton`'s
    epilogue, operation for operation (not shared: as a function there it changed the
    Triton build's FP8-P tile loop by 20 instructions)."""
    seen = m_i != -float("inf")
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    lse2 = m_i + gl.log2(gl.where(seen, l_i, 1.0)) - LSE_OFFSET
    return inv_l, gl.where(seen, lse2 * 0.6931471805599453, -float("inf"))


@gluon.jit
def _key_tiles(start_m, t: gl.constexpr, Sk, causal_offset, CAUSAL: gl.constexpr):
    """(full key tiles, key tiles) of the CTA's query tile t (`kernels.common.
    key_tile_bounds` of its 128 rows): keys below the first bound are visible to every
    row, those up to the second to some."""
    full, hi = key_tile_bounds(2 * start_m + t, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    return full // BLOCK_N, gl.cdiv(gl.maximum(hi, 0), BLOCK_N)


# ---------------------------------------------------------------------------- softmax
@gluon.jit
def _affine_mxfp4_x2(t2, bmax, m_ref):
    """`forward_triton._affine_mxfp4_tile`'s X2 path on a (BLOCK_M, BLOCK_N) tile of log2
    scores t2 with its 32-key block maxima bmax and reference points m_ref: (int32 words
    of the packed E2M1 codes (BLOCK_M, BLOCK_N / 8), byte k of word g keys 8 g + 2 k and
    8 g + 2 k + 1, low nibble first; E8M0 scales (BLOCK_M, blocks); consistent row sums).
    The arithmetic is that function's helpers (`_affine_block_constants`, the group asm
    `_affine_group_x2`, the dp4a `_byte_lane_sum`, `_affine_x2_row_sum`); what is added
    here are layout conversions Gluon asks for where Triton infers them (each a
    relabelling of one thread's registers: a thread holds whole rows)."""
    G: gl.constexpr = BLOCK_N // 8  # groups of eight keys, four to a block
    NB: gl.constexpr = BLOCK_N // 32
    e_b, keep, c = _affine_block_constants(bmax, m_ref)
    k0, k1, k2, k3, k4, k5, k6, k7 = _split_eight(t2, G)
    c_g = gl.convert_layout(gl.reshape(tl.broadcast_to(gl.expand_dims(c, 2), [BLOCK_M, NB, 4]), [BLOCK_M, G]),
                            k0.type.layout)
    words, lanes = _affine_group_x2(k0, k1, k2, k3, k4, k5, k6, k7, c_g)
    twice = _byte_lane_sum(gl.sum(gl.reshape(lanes, [BLOCK_M, NB, 4]), axis=2))
    row_sum, scale = _affine_x2_row_sum(gl.convert_layout(twice, e_b.type.layout), e_b, keep)
    return words, scale, row_sum


@gluon.jit
def _softmax_tile(t: gl.constexpr, j, m_i, l_i, a_i, ks, KS_ROW, Sk, s_tmem, p_tmem, psc_tmem, alpha_smem, s_ready,
                  s_free, p_ready, alpha_ready, pv_done, MASKED: gl.constexpr, P_KIND: gl.constexpr, rows,
                  causal_offset, CAUSAL: gl.constexpr):
    """Tile j of query tile t: `forward_triton._tile`'s softmax, operation for operation
    (the pipelined form, without the mask unless MASKED)."""
    s_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], _s_tmem_layout(), 4)
    mbarrier.wait(s_ready.index(t), j & 1)
    s = s_tmem.load(s_layout)
    mbarrier.arrive(s_free, count=1)  # the S buffer may take the other tile's QK^T
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if P_KIND != P_BF16:  # (s a) b two keys at a time, each lane rounded as `log2_scores`'s mul_rn
        t2 = _log2_scores_x2(s, gl.expand_dims(a_i, 1), ks)
    else:  # the calibration build: one key scale (FA4's forward has none per key)
        t2 = log2_scores(s, gl.expand_dims(a_i, 1), ks)
    if MASKED:  # keys past Sk (causal: past each row's last key) to -inf
        t2 = _hide_keys(t2, cols < Sk, cols, j * BLOCK_N, rows, causal_offset, Sk, CAUSAL, P_KIND == P_AFFINE_MXFP4)
    if P_KIND == P_AFFINE_MXFP4:  # the row max from the 32-key block maxima P needs anyway
        tb = gl.reshape(t2, [BLOCK_M, BLOCK_N // 32, 32])
        bmax = gl.reduce(tb, 2, max_propagating_nan)
        # (the same rows, one a thread, in the 3-D tile's slice layout: a trivial conversion)
        row_max = gl.convert_layout(gl.reduce(bmax, 1, max_propagating_nan), m_i.type.layout)
        m_new = gl.maximum(m_i, row_max, propagate_nan=tl.PropagateNan.ALL)
    else:
        m_new = gl.maximum(m_i, gl.reduce(t2, 1, max_propagating_nan), propagate_nan=tl.PropagateNan.ALL)
    m_use, alpha = _running_point(m_i, m_new, True, P_KIND == P_AFFINE_MXFP4, P_KIND == P_AFFINE_MXFP4)
    if P_KIND == P_AFFINE_MXFP4:
        p, p_sc, p_sum = _affine_mxfp4_x2(t2, bmax, gl.convert_layout(m_use, gl.SliceLayout(1, bmax.type.layout)))
        p_sum = gl.convert_layout(p_sum, m_i.type.layout)
    elif P_KIND == P_EXP2_FP8:
        p, p_sum = _e4m3_p(gl.exp2(_sub_add_x2(t2, gl.broadcast(t2, gl.expand_dims(m_use, 1))[1])))
        p_sum = gl.convert_layout(p_sum, m_i.type.layout)
    else:
        p32 = gl.exp2(t2 - gl.expand_dims(m_use, 1))
        p_sum = gl.sum(p32, axis=1)
        p = p32.to(gl.bfloat16)
    # P_t's buffer (and scale columns) are free once PV_t(j - 1) has read them
    mbarrier.wait(pv_done.index(t), (j - 1) & 1, pred=j > 0)
    if P_KIND != P_BF16:  # the P words are its 32-bit columns (MXFP4: byte k keys 2k, 2k + 1; e4m3: key k)
        WORDS: gl.constexpr = BLOCK_N // 8 if P_KIND == P_AFFINE_MXFP4 else BLOCK_N // 4
        words_tl: gl.constexpr = TensorMemoryLayout((BLOCK_M, WORDS), col_stride=1)
        p_words = p_tmem.index(t)._reinterpret(gl.int32, [BLOCK_M, WORDS], words_tl)
        p_words.store(gl.convert_layout(p, get_tmem_reg_layout(gl.int32, [BLOCK_M, WORDS], words_tl, 4)))
    else:
        p_tmem.index(t).store(gl.convert_layout(p, get_tmem_reg_layout(p.dtype, [BLOCK_M, BLOCK_N],
                                                                         _p_tmem_layout(P_KIND), 4)))
    if P_KIND == P_AFFINE_MXFP4:
        sc_layout: gl.constexpr = get_tmem_reg_layout(gl.uint8, [BLOCK_M, BLOCK_N // 32], TensorMemoryScalesLayout(), 4)
        psc_tmem[t].store(gl.convert_layout(p_sc, sc_layout))
    mbarrier.arrive(p_ready.index(t), count=1)
    alpha_smem.index(t).store(alpha)
    mbarrier.arrive(alpha_ready.index(t), count=1)
    l_i, m_new = _carry(l_i, alpha, p_sum, m_new, m_use, P_KIND == P_AFFINE_MXFP4)
    return m_new, l_i


@gluon.jit
def _softmax_partition(t: gl.constexpr, s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free, p_ready,
                       alpha_ready, pv_done, QS, KS, LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset,
                       CAUSAL: gl.constexpr, P_KIND: gl.constexpr):
    """Query tile t's softmax over its key tiles: the full tiles (every row sees every
    key) in a loop without a mask, the others (the tail past Sk; causal: the diagonal)
    in a second loop with it; then the LSE, and l and m for the correction's epilogue."""
    n_full, n_tiles = _key_tiles(start_m, t, Sk, causal_offset, CAUSAL)
    s_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], _s_tmem_layout(), 4)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = start_m * (2 * BLOCK_M) + t * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
    a_i = gl.load(QS + off_bh * Sq + rows, mask=rows < Sq, other=0.0) * qk_scale
    KS_ROW = KS + bhk * Sk
    ks = gl.load(KS_ROW)  # NVFP4: the (batch, head)'s tensor scale, in every key's slot
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_l)
    for j in range(0, n_full):
        m_i, l_i = _softmax_tile(t, j, m_i, l_i, a_i, ks, KS_ROW, Sk, s_tmem, p_tmem, psc_tmem, alpha_smem, s_ready,
                                 s_free, p_ready, alpha_ready, pv_done, False, P_KIND, rows, causal_offset, CAUSAL)
    for j in range(n_full, n_tiles):
        m_i, l_i = _softmax_tile(t, j, m_i, l_i, a_i, ks, KS_ROW, Sk, s_tmem, p_tmem, psc_tmem, alpha_smem, s_ready,
                                 s_free, p_ready, alpha_ready, pv_done, True, P_KIND, rows, causal_offset, CAUSAL)
    # -- LSE in natural log (FP8 P's 2**8 offset subtracted); l and m to the correction
    # once it has taken the last alpha (PV_t of the last tile waited for its rescale)
    if P_KIND == P_EXP2_FP8:
        inv_l, lse = _final_scales(m_i, l_i, P_OFFSET_LOG2)
    else:
        inv_l, lse = _final_scales(m_i, l_i, 0.0)
    gl.store(LSE + off_bh * Sq + rows, lse, mask=rows < Sq)
    mbarrier.wait(pv_done.index(t), (n_tiles - 1) & 1, pred=n_tiles > 0)
    lm_smem.index(2 * t).store(l_i)
    lm_smem.index(2 * t + 1).store(m_i)
    mbarrier.arrive(alpha_ready.index(t), count=1)


@gluon.jit
def _softmax0(s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free, p_ready, alpha_ready, pv_done, QS, KS,
              LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL: gl.constexpr, P_KIND: gl.constexpr):
    _softmax_partition(0, s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free, p_ready, alpha_ready,
                       pv_done, QS, KS, LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL, P_KIND)


@gluon.jit
def _softmax1(s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free, p_ready, alpha_ready, pv_done, QS, KS,
              LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL: gl.constexpr, P_KIND: gl.constexpr):
    _softmax_partition(1, s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free, p_ready, alpha_ready,
                       pv_done, QS, KS, LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL, P_KIND)


# ------------------------------------------------------------------------- correction
@gluon.jit
def _kv_scales_to_tmem(j, ksc_tmem, vsc_tmem, kv_empty, sc_ready, KSC, VSC, bhk, Sk, HEAD_DIM: gl.constexpr,
                       P_KIND: gl.constexpr):
    """Key tile j's K (and MXFP4 V) block scales into tensor-memory slot j % STAGES once
    the slot's products are done (kv_empty: PV_1 of tile j - STAGES); then sc_ready."""
    STAGES: gl.constexpr = kv_empty.shape[0]
    s = j % STAGES
    mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
    k_sc = KSC + (bhk * Sk + j * BLOCK_N) * (HEAD_DIM // 16)
    if s == 0:
        _scales_to_tmem(k_sc, HEAD_DIM // 16, 0, Sk - j * BLOCK_N, ksc_tmem[0], BLOCK_N, HEAD_DIM // 16)
    else:
        _scales_to_tmem(k_sc, HEAD_DIM // 16, 0, Sk - j * BLOCK_N, ksc_tmem[1], BLOCK_N, HEAD_DIM // 16)
    if P_KIND == P_AFFINE_MXFP4:
        skp32 = gl.cdiv(Sk, BLOCK_N) * (BLOCK_N // 32)  # V scale columns (keys padded to whole tiles)
        v_sc = VSC + bhk * HEAD_DIM * skp32
        if s == 0:
            _scales_to_tmem(v_sc, skp32, j * (BLOCK_N // 32), HEAD_DIM, vsc_tmem[0], HEAD_DIM, BLOCK_N // 32)
        else:
            _scales_to_tmem(v_sc, skp32, j * (BLOCK_N // 32), HEAD_DIM, vsc_tmem[1], HEAD_DIM, BLOCK_N // 32)
    mbarrier.arrive(sc_ready.index(s), count=1)


@gluon.jit
def _rescale_step(t: gl.constexpr, j, o_tmem, alpha_smem, alpha_ready, pv_done, o_ready, vec_l: gl.constexpr,
                  HEAD_DIM: gl.constexpr):
    """O_t *= alpha_t(j) once alpha_t(j) is there and PV_t(j - 1) is done; then PV_t(j)
    may start."""
    mbarrier.wait(alpha_ready.index(t), j & 1)
    mbarrier.wait(pv_done.index(t), (j - 1) & 1)
    _rescale_o(o_tmem.index(t), alpha_smem.index(t).load(vec_l), HEAD_DIM)
    mbarrier.arrive(o_ready.index(t), count=1)



@gluon.jit
def _scales_to_tmem(ptr, row_stride, col0, rows_ok, dst, N_ROWS: gl.constexpr, N_COLS: gl.constexpr):
    """A (N_ROWS, N_COLS) block-scale tile from global memory (rows of row_stride bytes,
    columns from col0) into its tensor-memory scale slot, one row a thread."""
    layout: gl.constexpr = get_tmem_reg_layout(dst.dtype, [N_ROWS, N_COLS], TensorMemoryScalesLayout(), 4)
    r = gl.arange(0, N_ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, N_COLS, layout=gl.SliceLayout(0, layout))
    ptrs = ptr + gl.expand_dims(r, 1) * row_stride + col0 + gl.expand_dims(c, 0)
    x = gl.load(ptrs, mask=gl.expand_dims(r < rows_ok, 1), other=0.0)
    dst.store(x)


@gluon.constexpr_function
def _o_part_layout(head_dim):
    """Registers of a quarter of O's row (32 columns, one row a thread)."""
    return get_tmem_reg_layout(gl.float32, [BLOCK_M, head_dim // 4],
                               TensorMemoryLayout((BLOCK_M, head_dim // 4), col_stride=1), 4)


# O's rescale two elements at a time: each lane of `mul.rn.f32x2` (FMUL2) rounds as the
# scalar `mul.f32` (IEEE round to nearest, denormals kept) that the Triton kernel's
# `acc * alpha` compiles to, so the products are the same; half the instructions
MUL_X2_PTX = gl.constexpr("""{
    .reg .b64 x2, a2;
    mov.b64 x2, {$2, $3};
    mov.b64 a2, {$4, $5};
    mul.rn.f32x2 x2, x2, a2;
    mov.b64 {$0, $1}, x2;
    }""")


# FP8 P's exponent (t - m) + 2**8's log2, two keys at a time: `sub.rn.f32x2` and
# `add.rn.f32x2` (FADD2) round each lane as the scalar `sub.f32` and `add.f32` of the
# Triton kernel's `t - m_use + P_OFFSET_LOG2` (IEEE, denormals kept)
SUB_ADD_X2_PTX = gl.constexpr("""{
    .reg .b64 t2, m2, c2;
    mov.b64 t2, {$2, $3};
    mov.b64 m2, {$4, $5};
    mov.b64 c2, 0x4100000041000000;
    sub.rn.f32x2 t2, t2, m2;
    add.rn.f32x2 t2, t2, c2;
    mov.b64 {$0, $1}, t2;
    }""")


# FP8 P of four consecutive keys from their exp2 values ($5-$8): `round_e4m3_cvt`'s
# conversions (e4m3 pairs by cvt.rn.satfinite, RNE as the reference's rounding, and their
# values back through f16x2), the four bytes kept as P's word ($0, key 4g + i in byte i)
# and the four values ($1-$4) for the row sum: P converted to e4m3 once
E4M3_GROUP4_PTX = gl.constexpr("""{
    .reg .b16 p01, p23, f0, f1, f2, f3;
    .reg .b32 h01, h23;
    cvt.rn.satfinite.e4m3x2.f32 p01, $6, $5;
    cvt.rn.satfinite.e4m3x2.f32 p23, $8, $7;
    mov.b32 $0, {p01, p23};
    cvt.rn.f16x2.e4m3x2 h01, p01;
    cvt.rn.f16x2.e4m3x2 h23, p23;
    mov.b32 {f0, f1}, h01;
    mov.b32 {f2, f3}, h23;
    cvt.f32.f16 $1, f0;
    cvt.f32.f16 $2, f1;
    cvt.f32.f16 $3, f2;
    cvt.f32.f16 $4, f3;
    }""")


@gluon.jit
def _e4m3_p(x):
    """FP8 P of a (BLOCK_M, BLOCK_N) tile of exp2 values x (already times 2**8): (int32
    words of four e4m3 bytes, key 4 g + i in byte i of word g; the row sums of the e4m3
    values, float32, added four keys a group then across the groups)."""
    x_e, x_o = gl.split(gl.reshape(x, [BLOCK_M, BLOCK_N // 4, 2, 2]))  # key bit 0
    k0, k2 = gl.split(x_e)  # key bit 1
    k1, k3 = gl.split(x_o)
    w, v0, v1, v2, v3 = gl.inline_asm_elementwise(
        E4M3_GROUP4_PTX, "=r,=r,=r,=r,=r,r,r,r,r", [k0, k1, k2, k3],
        dtype=(gl.int32, gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)
    return w, gl.sum((v0 + v1) + (v2 + v3), axis=1)


@gluon.jit
def _sub_add_x2(t, m):
    """(t - m) + 8 elementwise (float32; 8 = P_OFFSET_LOG2), two lanes a FADD2 each."""
    gl.static_assert(P_OFFSET_LOG2 == 8)
    return gl.inline_asm_elementwise(SUB_ADD_X2_PTX, "=r,=r,r,r,r,r", [t, m], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _mul_x2(x, a):
    """x * a elementwise (float32, a broadcast along x's rows), two lanes a FMUL2."""
    return gl.inline_asm_elementwise(MUL_X2_PTX, "=r,=r,r,r,r,r", [x, a], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _rescale_o(o, alpha, HEAD_DIM: gl.constexpr):
    """O_t *= alpha in tensor memory, a quarter of a row of O at a time (alpha one per
    row), two columns a multiply (`_mul_x2`)."""
    part_l: gl.constexpr = _o_part_layout(HEAD_DIM)
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, part_l)), 1)
    for h in gl.static_range(4):
        part = o.slice(h * (HEAD_DIM // 4), HEAD_DIM // 4)
        x = part.load(part_l)
        part.store(_mul_x2(x, gl.broadcast(x, a)[1]))


@gluon.jit
def _correction_partition(o_tmem, qsc_tmem, ksc_tmem, vsc_tmem, alpha_smem, lm_smem, kv_empty, sc_ready, alpha_ready,
                          o_ready, pv_done, QSC, KSC, VSC, VS, O, off_bh, bhk, start_m, Sq, Sk, causal_offset,
                          CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, P_KIND: gl.constexpr):
    """The scale tiles into tensor memory, O's rescale between tiles, the epilogue."""
    n_full0, n_tiles0 = _key_tiles(start_m, 0, Sk, causal_offset, CAUSAL)
    n_full1, n_tiles = _key_tiles(start_m, 1, Sk, causal_offset, CAUSAL)
    vec_l: gl.constexpr = gl.SliceLayout(1, get_tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], _s_tmem_layout(), 4))
    if P_KIND != P_BF16:  # Q's block scales, once per query tile
        for t in gl.static_range(2):
            q0 = start_m * (2 * BLOCK_M) + t * BLOCK_M
            _scales_to_tmem(QSC + (off_bh * Sq + q0) * (HEAD_DIM // 16), HEAD_DIM // 16, 0, Sq - q0,
                            qsc_tmem[t], BLOCK_M, HEAD_DIM // 16)
    # the scale tiles one key tile ahead of the rescales: the MMA warp's next QK^T never
    # waits on a softmax through this partition
    if P_KIND != P_BF16 and n_tiles > 0:
        _kv_scales_to_tmem(0, ksc_tmem, vsc_tmem, kv_empty, sc_ready, KSC, VSC, bhk, Sk, HEAD_DIM, P_KIND)
    for j in range(n_tiles):
        if P_KIND != P_BF16 and j + 1 < n_tiles:
            _kv_scales_to_tmem(j + 1, ksc_tmem, vsc_tmem, kv_empty, sc_ready, KSC, VSC, bhk, Sk, HEAD_DIM, P_KIND)
        if j > 0:  # O_t *= alpha_t(j) once PV_t(j - 1) is done (tile 0: below its n_tiles0)
            if j < n_tiles0:
                _rescale_step(0, j, o_tmem, alpha_smem, alpha_ready, pv_done, o_ready, vec_l, HEAD_DIM)
            _rescale_step(1, j, o_tmem, alpha_smem, alpha_ready, pv_done, o_ready, vec_l, HEAD_DIM)
    # -- epilogue: O / l (0 for a row that saw no key; NaN rows stay NaN), V's
    # per-channel scale (FP8 V), bf16 out
    half_l: gl.constexpr = _o_part_layout(HEAD_DIM)
    for t in gl.static_range(2):
        if t == 0:
            n_t = n_tiles0
        else:
            n_t = n_tiles
        mbarrier.wait(alpha_ready.index(t), n_t & 1)
        mbarrier.wait(pv_done.index(t), (n_t - 1) & 1, pred=n_t > 0)
        l_i = lm_smem.index(2 * t).load(vec_l)
        m_i = lm_smem.index(2 * t + 1).load(vec_l)
        inv_l, lse = _final_scales(m_i, l_i, 0.0)  # (the softmax stored the LSE)
        inv_l = gl.convert_layout(inv_l, gl.SliceLayout(1, half_l))
        rows = start_m * (2 * BLOCK_M) + t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, half_l))
        for h in gl.static_range(4):
            d = h * (HEAD_DIM // 4) + gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, half_l))
            o = o_tmem.index(t).slice(h * (HEAD_DIM // 4), HEAD_DIM // 4).load(half_l)
            # (a query tile that sees no key has no product in O: its rows are 0)
            out = gl.where(n_t > 0, o, 0.0) * gl.expand_dims(inv_l, 1)
            if P_KIND == P_EXP2_FP8:
                out = out * gl.expand_dims(gl.load(VS + bhk * HEAD_DIM + d), 0)
            ptrs = O + (off_bh * Sq + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(d, 0)
            gl.store(ptrs, out.to(gl.bfloat16), mask=gl.expand_dims(rows < Sq, 1))


# ----------------------------------------------------------------------------- kernel
@gluon.jit
def _barriers(n: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def attn_fwd_sm100_gluon_kernel(q_desc, k_desc, v_desc, QSC, KSC, QS, KS, VSC, VS, O, LSE, H, GROUP, Sq, Sk,
                                causal_offset, qk_scale, HEAD_DIM: gl.constexpr, P_KIND: gl.constexpr,
                                CAUSAL: gl.constexpr = False):
    """One CTA: 2 * BLOCK_M query rows of one (batch, head) against its visible keys (all,
    or causal: query i sees keys j <= i + causal_offset; no key mask). Grid (cdiv(Sq, 2 *
    BLOCK_M), B * H)."""
    gl.static_assert(HEAD_DIM == 128)
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    bhk = (off_bh // H) * (H // GROUP) + (off_bh % H) // GROUP
    q_row = off_bh * Sq + start_m * (2 * BLOCK_M)
    V_COLS: gl.constexpr = v_desc.block_type.shape[1]  # V's columns per key tile (packed FP4: half)

    # -- shared memory: Q's two tiles, the K/V ring, P of each tile, alpha, l and m
    STAGES: gl.constexpr = 2
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_smem)
    lm_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], vec_smem)

    # -- tensor memory: one S, O_0 and O_1, the scale tiles
    s_tmem = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_N], _s_tmem_layout())
    o_tmem = allocate_tensor_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], _o_tmem_layout(HEAD_DIM))
    # P of each query tile, the PV product's A operand from tensor memory (packed: MXFP4
    # codes 16 columns a tile, e4m3 32, bf16 64)
    p_tmem = allocate_tensor_memory(_p_dtype(P_KIND), [2, BLOCK_M, _p_cols(P_KIND)], _p_tmem_layout(P_KIND))
    sc_tl: gl.constexpr = TensorMemoryScalesLayout()
    # (pairs of allocations: Gluon 3.6 has no multi-buffered scale tiles, "Scales don't
    # currently support multibuffering"; K's and V's by ring slot, Q's and P's by tile)
    qsc_tmem = (allocate_tensor_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM // 16], sc_tl),
                allocate_tensor_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM // 16], sc_tl))
    ksc_tmem = (allocate_tensor_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM // 16], sc_tl),
                allocate_tensor_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM // 16], sc_tl))
    vsc_tmem = (allocate_tensor_memory(gl.uint8, [HEAD_DIM, BLOCK_N // 32], sc_tl),
                allocate_tensor_memory(gl.uint8, [HEAD_DIM, BLOCK_N // 32], sc_tl))
    psc_tmem = (allocate_tensor_memory(gl.uint8, [BLOCK_M, BLOCK_N // 32], sc_tl),
                allocate_tensor_memory(gl.uint8, [BLOCK_M, BLOCK_N // 32], sc_tl))

    # -- mbarriers (one arrival completes a phase: a partition's warps arrive through one thread)
    q_bar = _barriers(1)
    kv_ready = _barriers(STAGES)
    kv_empty = _barriers(STAGES)
    sc_ready = _barriers(STAGES)
    s_ready = _barriers(2)
    s_free = _barriers(1)
    p_ready = _barriers(2)
    o_ready = _barriers(2)
    pv_done = _barriers(2)
    alpha_ready = _barriers(2)
    fence_async_shared()
    gl.thread_barrier()

    # registers a thread (setmaxnreg) of the worker partitions: softmax of tile 1 192, the
    # correction 88, the MMA and load warps (one warpgroup) 40; the default partition
    # (softmax of tile 0) gets the rest of the 64K, 512 - 192 - 88 - 40 = 192. What builds
    # every build without a spill (the correction spilled at 72 in the bf16 build and at
    # 80 in the causal directp-fast one; docs/notes/blackwell.md)
    gl.warp_specialize([
        (_softmax0, (s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free.index(0), p_ready, alpha_ready,
                     pv_done, QS, KS, LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL, P_KIND)),
        (_softmax1, (s_tmem, p_tmem, psc_tmem, alpha_smem, lm_smem, s_ready, s_free.index(0), p_ready, alpha_ready,
                     pv_done, QS, KS, LSE, off_bh, bhk, start_m, Sq, Sk, qk_scale, causal_offset, CAUSAL, P_KIND)),
        (_correction_partition, (o_tmem, qsc_tmem, ksc_tmem, vsc_tmem, alpha_smem, lm_smem, kv_empty, sc_ready,
                                 alpha_ready, o_ready, pv_done, QSC, KSC, VSC, VS, O, off_bh, bhk, start_m, Sq, Sk,
                                 causal_offset, CAUSAL, HEAD_DIM, P_KIND)),
        (_mma_partition, (q_smem, k_smem, v_smem, p_tmem, s_tmem, o_tmem, qsc_tmem, ksc_tmem, vsc_tmem, psc_tmem,
                          q_bar.index(0),
                          kv_ready, kv_empty, sc_ready, s_ready, s_free.index(0), p_ready, o_ready, pv_done, start_m,
                          Sk, causal_offset, CAUSAL, P_KIND)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar.index(0), kv_ready, kv_empty, q_row,
                           bhk * Sk, bhk * HEAD_DIM, start_m, Sk, causal_offset, CAUSAL, V_COLS)),
    ], [4, 4, 1, 1], [192, 88, 40, 40])
