"""The training recipes' backward for Hopper (sm_90) in Gluon: the Triton kernels'
arithmetic (`backward_triton.py`, operation for operation; the GPU tests hold the gradients to
theirs bit for bit) in two kernels of one warpgroup per program, with the wgmma
layouts, the order of the asynchronous products and the loads written out.

`attn_bwd_dkdv_pipelined_kernel`. Why: at D=128 the Triton dkdv kernel's 8-warp program
lays its (64 keys x 64 queries) S^T and dP^T tiles over warps [8, 1], so both
warpgroups compute the whole tile (and its exp2, P and dS) and each then takes half of
D for the dK and dV products: 1.5x the tile's tensor work and twice its per-element
work, and the layouts that avoid it spill (docs/notes/hopper-train.md, "What the 8-warp
dkdv program does twice"). Here one warpgroup of 4 warps owns BLOCK_N = 64 keys and all
of D: dK and dV live as two halves of D each (2 x 64 registers per thread at D=128),
then per query tile

    1. issue S^T = K Q^T (bf16) and dP^T = V dO_t^T (e4m3), both in flight
    2. wait for S^T: P^T = 2**(t - lse), P_r^T (FP8 P times 2**8, e4m3)
    3. wait for dP^T: dS^T = P^T (dP^T - delta), its e4m3 view per key (one scale per
       key over the tile's 64 queries, the recipe's DS_BLOCK)
    4. dV_j = P_r^T dO_c per half of D on a fresh accumulator, dV += dV_j x dO_c's
       channel scale
    5. dK_j = dS^T Q_c likewise, dK += dK_j x dS's key scale x Q_c's channel scale

(each product on a fresh accumulator added in float32, as the Triton kernel: the fp8
wgmma's own sums across tiles keep fewer mantissa bits). The tiles of one query tile
(Q, dO_t, dO_c, Q_c: 40 KB at D=128) arrive by TMA in a two-stage ring, the next
tile's issued as the current one starts, and its per-query numbers (LSE, dO's scales,
delta) and channel scales load one tile ahead; K and V once. Two programs share an SM
at D=128 (107 KB of shared memory each), three at D=64 (168 registers), so one
program's products run while another works on its elementwise steps. GQA: a program
walks the query tiles of every query head of its K/V head in one loop, so the ring runs
across heads. Causal: query tiles start where the diagonal reaches the program's keys;
those that straddle it are masked (a runtime branch).

`attn_bwd_dq_pipelined_kernel`: 64 queries of one head over their visible key tiles
(the Triton dq kernel's recomputation of S, P, dP and dS), the next key tile's products
issued beside this tile's dQ product.

Q/K scales, as the Triton kernels take them: one tensor scale per head of NVFP4 Q and K
(`train`), or with ROW_SCALES a float32 scale per query and per key of per-token FP8
Q/K (`train-fp8`), multiplied into the scores in the Triton kernels' order,
(S x (q_s x scale x log2 e)) x k_s. dK/dV: the program's key scales load once, a query
tile's scales travel with its other per-query numbers (an eighth number, a tile ahead);
dQ: the program's query scales load once, a key tile's scales a tile ahead as V's do.

Launched by `train_op.launch_backward` where Sq and Sk are whole 64-row tiles (the TMA
path), with the hardware's e4m3 conversion, dK/dV for FP8 P (`train`, `train-fp8`); the
Triton kernels run otherwise. Measurements: docs/notes/hopper-train.md.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4attn.kernels.backward_triton import (
    P_OFFSET,
    causal_query_tiles,
    e4m3_rows,
    lse_log2,
    operand_tile,
    p_r,
)
from fp4attn.kernels.common import log2_scores
from fp4attn.kernels.hopper.gluon_common import (
    barriers,
    barriers_ready,
    invalidate,
    tma_descriptor,
    wgmma_layout,
)
from fp4attn.reference.backward import DS_BLOCK
from fp4attn.routing import DkdvStaged

BLOCK = DS_BLOCK  # keys per program (wgmma's M) and queries per tile (dS's scale block, the recipe's)
STAGES = gl.constexpr(2)
# the dK/dV kernel's STAGED: how a tile's numbers reach its wgmma layouts (`routing.DkdvStaged`)
STAGED_TOGETHER = gl.constexpr(DkdvStaged.TOGETHER.value)
STAGED_ASYNC_AHEAD = gl.constexpr(DkdvStaged.ASYNC_AHEAD.value)


@gluon.constexpr_function
def _operand_layout(grad_layout):
    """P^T, dS^T or dS as the register A operand (e4m3) of a product in `grad_layout`."""
    return gl.DotOperandLayout(operand_index=0, parent=grad_layout, k_width=4)


@gluon.constexpr_function
def _tile_layouts(cols, grad_cols):
    """The wgmma layouts of both kernels' warpgroup of 64 rows (keys for dK/dV, queries
    for dQ): the scores tile, `cols` wide, as bf16 products and as dP's e4m3 products
    (the two share their registers), a gradient product `grad_cols` wide, and P or dS as
    that product's register A operand."""
    grad = wgmma_layout(4, grad_cols, 32)
    return gl.tuple([gl.constexpr(wgmma_layout(4, cols, 16)), gl.constexpr(wgmma_layout(4, cols, 32)),
                     gl.constexpr(grad), gl.constexpr(_operand_layout(grad))])


@gluon.constexpr_function
def _axes(layout):
    """The layouts of a 2D tile's row indices and column indices."""
    return gl.tuple([gl.constexpr(gl.SliceLayout(1, layout)), gl.constexpr(gl.SliceLayout(0, layout))])


@gluon.jit
def _flat_ptrs(ptr, n: gl.constexpr):
    """The addresses of n floats from ptr, one per thread (coalesced)."""
    return ptr + gl.arange(0, n, layout=gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _flat(ptr, n: gl.constexpr):
    """n floats, one per thread (coalesced): a tile's per-query or per-channel numbers,
    loaded a tile ahead and moved to the wgmma slice layouts (`_spread`) when used; in
    those layouts each thread would load 16-32 scattered elements."""
    return gl.load(_flat_ptrs(ptr, n))


@gluon.jit
def _spread(x, layout: gl.constexpr, axis: gl.constexpr):
    """`_flat` numbers broadcast along `axis` of a wgmma tile (through shared memory)."""
    return gl.expand_dims(gl.convert_layout(x, layout), axis)


@gluon.jit
def _number(staged, layout: gl.constexpr, axis: gl.constexpr):
    """A tile's numbers broadcast along `axis` of a wgmma tile, read from their shared
    memory buffer `staged` (stored together, or copied there a tile ahead: `STAGED`)."""
    return gl.expand_dims(staged.load(layout), axis)


@gluon.jit
def _query_tile(i, n_m, lo, b, hk, H, GROUP, Sq, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Tile i of the program's walk: (first query, that head's first row in the
    token-major (B*H*Sq, D) views, its first row in the channel-major (B*H*D, Sq) views)."""
    g = i // n_m
    start_m = lo + (i - g * n_m) * BLOCK_M
    bh = b * H + hk * GROUP + g
    return start_m, bh * Sq, bh * HEAD_DIM


@gluon.jit
def _query_number_ptrs(i, n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA, DO_CS, Q_CS, QS,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROW_SCALES: gl.constexpr):
    """Where tile i's LSE, dO's token scales and delta (per query), dO_c's and Q_c's
    channel scales (per half of D), and with ROW_SCALES its queries' own scales (an
    eighth number) are, `_flat_ptrs`."""
    start_m, row, hd_row = _query_tile(i, n_m, lo, b, hk, H, GROUP, Sq, HEAD_DIM, BLOCK_M)
    half: gl.constexpr = HEAD_DIM // 2
    ptrs = (_flat_ptrs(LSE + row + start_m, BLOCK_M), _flat_ptrs(DO_TS + row + start_m, BLOCK_M),
            _flat_ptrs(DELTA + row + start_m, BLOCK_M), _flat_ptrs(DO_CS + hd_row, half),
            _flat_ptrs(DO_CS + hd_row + half, half), _flat_ptrs(Q_CS + hd_row, half),
            _flat_ptrs(Q_CS + hd_row + half, half))
    if ROW_SCALES:  # QS (B, H, Sq), as the LSE: the tile's head's scales of its queries
        ptrs = ptrs + (_flat_ptrs(QS + row + start_m, BLOCK_M),)
    return ptrs


@gluon.jit
def _query_numbers(i, n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA, DO_CS, Q_CS, QS,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROW_SCALES: gl.constexpr):
    """Tile i's numbers (`_query_number_ptrs`) loaded into registers."""
    ptrs = _query_number_ptrs(i, n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA, DO_CS, Q_CS, QS, HEAD_DIM, BLOCK_M,
                              ROW_SCALES)
    nums = (gl.load(ptrs[0]), gl.load(ptrs[1]), gl.load(ptrs[2]), gl.load(ptrs[3]), gl.load(ptrs[4]),
            gl.load(ptrs[5]), gl.load(ptrs[6]))
    if ROW_SCALES:
        nums = nums + (gl.load(ptrs[7]),)
    return nums


@gluon.jit
def _copy_query_numbers(i, n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA, DO_CS, Q_CS, QS, bufs, stage,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROW_SCALES: gl.constexpr):
    """Tile i's numbers (`_query_number_ptrs`) copied asynchronously into stage `stage`
    of their seven (ROW_SCALES: eight) buffers, one commit group: no register holds them."""
    ptrs = _query_number_ptrs(i, n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA, DO_CS, Q_CS, QS, HEAD_DIM, BLOCK_M,
                              ROW_SCALES)
    for n in gl.static_range(len(ptrs)):
        async_copy.async_copy_global_to_shared(bufs[n].index(stage), ptrs[n])
    async_copy.commit_group()


@gluon.jit
def _number_buffers(STAGED: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, ROW_SCALES: gl.constexpr):
    """The seven number buffers (per query: LSE, dO token scales, delta; per channel:
    dO_c's and Q_c's scales by half of D), and with ROW_SCALES an eighth (the queries'
    own scales): one each (STAGED TOGETHER), or a two-stage ring each that asynchronous
    copies fill a tile ahead (ASYNC_AHEAD)."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # (of each stage)
    stages: gl.constexpr = STAGES if STAGED == STAGED_ASYNC_AHEAD else 1
    bufs = (_float_buffer(stages, BLOCK_M, layout), _float_buffer(stages, BLOCK_M, layout),
            _float_buffer(stages, BLOCK_M, layout), _float_buffer(stages, HALF, layout),
            _float_buffer(stages, HALF, layout), _float_buffer(stages, HALF, layout),
            _float_buffer(stages, HALF, layout))
    if ROW_SCALES:
        bufs = bufs + (_float_buffer(stages, BLOCK_M, layout),)
    return bufs


@gluon.jit
def _float_buffer(stages: gl.constexpr, n: gl.constexpr, layout: gl.constexpr):
    """n floats in shared memory, or a ring of `stages` such rows (stages > 1)."""
    if stages > 1:
        buf = gl.allocate_shared_memory(gl.float32, [stages, n], layout)
    else:
        buf = gl.allocate_shared_memory(gl.float32, [n], layout)
    return buf


@gluon.jit
def _load_query_tile(i, n_m, lo, b, hk, H, GROUP, Sq, q_desc, do_t_desc, do_c_desc, q_c_desc,
                     q_smem, do_t_smem, do_c_smem, q_c_smem, ready, pred,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """TMA of tile i's Q, dO_t, dO_c and Q_c into its ring stage, one mbarrier for all four."""
    stage = i % STAGES
    start_m, row, hd_row = _query_tile(i, n_m, lo, b, hk, H, GROUP, Sq, HEAD_DIM, BLOCK_M)
    bar = ready.index(stage)
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_t_desc.block_type.nbytes + do_c_desc.block_type.nbytes
                            + q_c_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [row + start_m, 0], bar, q_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_t_desc, [row + start_m, 0], bar, do_t_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_c_desc, [hd_row, start_m], bar, do_c_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(q_c_desc, [hd_row, start_m], bar, q_c_smem.index(stage), pred=pred)


@gluon.jit
def _ring(desc, stages: gl.constexpr):
    return gl.allocate_shared_memory(desc.dtype, [stages] + desc.block_type.shape, desc.layout)


@gluon.jit
def _barriers_and_fixed_tiles(a_desc, b_desc, row, a_smem, b_smem):
    """A program's mbarriers, initialized: one for the two tiles it loads once (dK/dV: K
    and V; dQ: Q and dO_t), whose TMA copies at `row` are issued on it, and one per ring
    stage. Returns (the first, the ring's)."""
    fixed = barriers(1, 1)
    ready = barriers(STAGES, 1)
    barriers_ready()
    mbarrier.expect(fixed.index(0), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, 0], fixed.index(0), a_smem)
    tma.async_copy_global_to_shared(b_desc, [row, 0], fixed.index(0), b_smem)
    return fixed, ready


@gluon.jit
def _product(a, b_smem, zero):
    """a @ b on a fresh accumulator (b_smem (N, K), K contiguous), issued."""
    return warpgroup_mma(a, b_smem.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def attn_bwd_dkdv_pipelined_kernel(
    q_desc, k_desc, do_t_desc, do_c_desc, v_desc, q_c_desc,
    QS, KS, LSE, DELTA, DO_TS, DO_CS, V_TS, Q_CS, DK, DV, call,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    IN_FLIGHT: gl.constexpr = 1, STAGED: gl.constexpr = DkdvStaged.TOGETHER.value,
    ROW_SCALES: gl.constexpr = False,
):
    """Operands as `backward.attn_bwd_dkdv_kernel` reads them, the tiles by TMA:
    q_desc (B*H*Sq, D) bf16 and do_t_desc (B*H*Sq, D) e4m3 in (BLOCK_M, D) tiles,
    do_c_desc and q_c_desc (B*H*D, Sq) e4m3 in (D, BLOCK_M) tiles, k_desc (B*Hkv*Sk,
    D) bf16 and v_desc (B*Hkv*Sk, D) e4m3 (V per token) in (BLOCK_N, D) tiles. Sq and
    Sk are multiples of the tiles. FP8 P, e4m3 by the hardware's conversion.

    dK and dV are held as two halves of D each, and each tile's four half products
    (dV's two, then dK's) run on fresh accumulators: IN_FLIGHT 1 waits for each before
    the next is issued (one temporary of 64 x D/2); 2 keeps the next one in flight
    while the previous is added (two temporaries).

    A tile's per-query numbers (log2 LSE, dO's token scales, delta) and channel scales
    reach the wgmma layouts through shared memory: STAGED TOGETHER loads them into
    registers a tile ahead and stores all seven together at the top of the tile (two CTA
    barriers per tile, where a layout change each took fourteen). ASYNC_AHEAD copies them
    asynchronously (cp.async) into two-stage buffers a tile ahead instead: with the registers at their
    limit, ptxas spilled the loaded numbers right after their loads, and each spill store
    waited out the global load (docs/notes/hopper-train.md, "A tile's numbers staged
    together" and the ncu profile after it).

    QS (B, H) / KS (B, Hkv): the tensor scales of NVFP4 Q and K per head; with
    ROW_SCALES QS (B, H, Sq) / KS (B, Hkv, Sk), per-token FP8 Q/K's scales (the Triton
    kernel's ROW_SCALES): the program's key scales are loaded once, in the layout of
    S^T's rows, and a tile's query scales are an eighth per-query number, a tile ahead
    (TOGETHER stores them times scale * log2 e with the others, ASYNC_AHEAD copies them and
    multiplies after the read: the same rounded product)."""
    H, GROUP, Sq, Sk, causal_offset, qk_scale, sm_scale = call  # `kernel_args.BACKWARD_CALL`
    gl.static_assert(BLOCK_N == 64)  # one warpgroup's wgmma rows
    gl.static_assert(BLOCK_M == 64)  # dS's scale block along the queries (DS_BLOCK)
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(IN_FLIGHT == 1 or IN_FLIGHT == 2)
    gl.static_assert(STAGED == STAGED_TOGETHER or STAGED == STAGED_ASYNC_AHEAD)
    HALF: gl.constexpr = HEAD_DIM // 2
    # S^T (bf16 products) and dP^T (e4m3) share their registers, keys x queries; dK and
    # dV halves (and each tile's products) keys x D/2
    t_layout, dp_layout, g_layout, a_layout = _tile_layouts(BLOCK_M, HALF)
    keys_t, queries_t = _axes(t_layout)
    keys_g, dims_g = _axes(g_layout)

    start_n = gl.program_id(0) * BLOCK_N
    off_bh = gl.program_id(1)  # (b, kv head)
    Hkv = H // GROUP
    b = off_bh // Hkv
    hk = off_bh % Hkv
    kv_row = off_bh * Sk + start_n

    # query tiles from lo: [lo, mid) straddle the causal diagonal (masked), [mid, Sq) see
    # every key of this block
    lo, mid = causal_query_tiles(start_n, Sq, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    n_m = gl.maximum(Sq - lo, 0) // BLOCK_M
    n_tiles = GROUP * n_m

    # -- shared memory: K and V once, the query tiles' operands in a ring
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = _ring(q_desc, STAGES)
    do_t_smem = _ring(do_t_desc, STAGES)
    do_c_smem = _ring(do_c_desc, STAGES)
    q_c_smem = _ring(q_c_desc, STAGES)
    bufs = _number_buffers(STAGED, BLOCK_M, HALF, ROW_SCALES)
    lse_s, do_s_s, delta_s, do_cs0_s, do_cs1_s, q_cs0_s, q_cs1_s = bufs[0:7]
    if ROW_SCALES:
        qs_s = bufs[7]
    kv_bar, ready = _barriers_and_fixed_tiles(k_desc, v_desc, kv_row, k_smem, v_smem)
    _load_query_tile(0, n_m, lo, b, hk, H, GROUP, Sq, q_desc, do_t_desc, do_c_desc, q_c_desc,
                     q_smem, do_t_smem, do_c_smem, q_c_smem, ready, n_tiles > 0, HEAD_DIM, BLOCK_M)
    # tile 0's numbers (a program without tiles reads the last query tile's, unused)
    if STAGED == STAGED_ASYNC_AHEAD:
        _copy_query_numbers(0, gl.maximum(n_m, 1), gl.minimum(lo, Sq - BLOCK_M), b, hk, H, GROUP, Sq, LSE, DO_TS,
                            DELTA, DO_CS, Q_CS, QS, bufs, 0, HEAD_DIM, BLOCK_M, ROW_SCALES)
    else:
        nums = _query_numbers(0, gl.maximum(n_m, 1), gl.minimum(lo, Sq - BLOCK_M), b, hk, H, GROUP, Sq, LSE, DO_TS,
                              DELTA, DO_CS, Q_CS, QS, HEAD_DIM, BLOCK_M, ROW_SCALES)
        lse, do_s, delta, do_cs0, do_cs1, q_cs0, q_cs1 = nums[0:7]
        if ROW_SCALES:
            qsc = nums[7]

    if ROW_SCALES:
        # the program's keys' own scales (the Triton kernel's, times 1.0: exact), loaded
        # once into shared memory and read in S^T's row layout where used (held in
        # registers across the loop, ptxas spilled more: docs/notes/hopper-train.md)
        ks_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        ks_s.store(_flat(KS + kv_row, BLOCK_N))
    else:
        k_scale = gl.load(KS + off_bh)  # the K head's tensor scale
        # the tensor scales of the group's query heads (GROUP <= BLOCK_M), held in registers:
        # each tile picks its head's by a select and a warp reduction, no load in the loop
        group_t = gl.arange(0, BLOCK_M, layout=queries_t)
        q_scales = gl.load(QS + b * H + hk * GROUP + group_t, mask=group_t < GROUP, other=0.0)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=keys_t)
    offs_mb = gl.arange(0, BLOCK_M, layout=queries_t)
    v_s = _spread(_flat(V_TS + kv_row, BLOCK_N), keys_t, 1)
    t_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_layout)
    dp_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=dp_layout)
    g_zero = gl.zeros([BLOCK_N, HALF], gl.float32, layout=g_layout)
    dk0 = gl.zeros([BLOCK_N, HALF], gl.float32, layout=g_layout)
    dk1 = gl.zeros([BLOCK_N, HALF], gl.float32, layout=g_layout)
    dv0 = gl.zeros([BLOCK_N, HALF], gl.float32, layout=g_layout)
    dv1 = gl.zeros([BLOCK_N, HALF], gl.float32, layout=g_layout)
    mbarrier.wait(kv_bar.index(0), 0)

    for i in range(n_tiles):
        stage = i % STAGES
        start_m = _query_tile(i, n_m, lo, b, hk, H, GROUP, Sq, HEAD_DIM, BLOCK_M)[0]
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        # 1. S^T and dP^T in flight; the next tile into the other stage (tile i-1's, whose
        # products were waited for) and its numbers into registers
        st_tok = _product(k_smem, q_smem.index(stage), t_zero)
        dpt_tok = _product(v_smem, do_t_smem.index(stage), dp_zero)
        _load_query_tile(i + 1, n_m, lo, b, hk, H, GROUP, Sq, q_desc, do_t_desc, do_c_desc, q_c_desc,
                         q_smem, do_t_smem, do_c_smem, q_c_smem, ready, i + 1 < n_tiles, HEAD_DIM, BLOCK_M)
        if STAGED == STAGED_ASYNC_AHEAD:
            # tile i+1's numbers into the other stage; tile i's, copied a tile ago, are in
            _copy_query_numbers(gl.minimum(i + 1, n_tiles - 1), n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA,
                                DO_CS, Q_CS, QS, bufs, (i + 1) % STAGES, HEAD_DIM, BLOCK_M, ROW_SCALES)
            async_copy.wait_group(1)
            lse_b, do_s_b, delta_b = lse_s.index(stage), do_s_s.index(stage), delta_s.index(stage)
            do_cs0_b, do_cs1_b = do_cs0_s.index(stage), do_cs1_s.index(stage)
            q_cs0_b, q_cs1_b = q_cs0_s.index(stage), q_cs1_s.index(stage)
            if not ROW_SCALES:  # (ROW_SCALES: read after the scores are scaled)
                lse2 = gl.expand_dims(lse_log2(lse_b.load(queries_t)), 0)
        else:
            lse_b, do_s_b, delta_b, do_cs0_b, do_cs1_b, q_cs0_b, q_cs1_b = bufs[0:7]
            # this tile's numbers, for the layouts below
            lse_s.store(lse_log2(lse))
            do_s_s.store(do_s)
            delta_s.store(delta)
            do_cs0_s.store(do_cs0)
            do_cs1_s.store(do_cs1)
            q_cs0_s.store(q_cs0)
            q_cs1_s.store(q_cs1)
            if ROW_SCALES:
                qs_s.store(qsc * qk_scale)
            nxt = _query_numbers(gl.minimum(i + 1, n_tiles - 1), n_m, lo, b, hk, H, GROUP, Sq, LSE, DO_TS, DELTA,
                                 DO_CS, Q_CS, QS, HEAD_DIM, BLOCK_M, ROW_SCALES)
            # 2. P^T and its FP8 form
            if not ROW_SCALES:
                lse2 = _number(lse_s, queries_t, 0)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        if ROW_SCALES:
            # tile i's queries' own scales times scale * log2 e (the Triton kernel's
            # token_scales(QS, .., q_scale, 1)), one per column of S^T; the keys' per row
            if STAGED == STAGED_ASYNC_AHEAD:
                q_scale = _number(qs_s.index(stage), queries_t, 0) * qk_scale
            else:
                q_scale = _number(qs_s, queries_t, 0)
            k_scale = _number(ks_s, keys_t, 1)
        else:
            q_scale = gl.sum(gl.where(group_t == i // n_m, q_scales, 0.0), axis=0) * qk_scale  # tile i's head's
        tt = log2_scores(st, q_scale, k_scale)
        if start_m < mid:  # a tile on the causal diagonal
            offs_m = start_m + offs_mb
            visible = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0) + causal_offset
            tt = gl.where(visible, tt, -float("inf"))
        if ROW_SCALES:  # the log2 LSE read here: with it read before the scores, ptxas spilled more
            if STAGED == STAGED_ASYNC_AHEAD:
                lse2 = gl.expand_dims(lse_log2(lse_b.load(queries_t)), 0)
            else:
                lse2 = _number(lse_s, queries_t, 0)
        xt = tt - lse2
        pt = gl.exp2(xt)
        pr = gl.convert_layout(p_r(xt, pt, 0, True), a_layout)
        # 3. dS^T and its e4m3 view per key
        dpt = gl.convert_layout(warpgroup_mma_wait(0, deps=[dpt_tok]), t_layout)
        dpt = dpt * v_s * _number(do_s_b, queries_t, 0)
        dst = pt * (dpt - _number(delta_b, queries_t, 0))
        ds_g, ds_s = e4m3_rows(dst, 1, True)
        ds_g = gl.convert_layout(ds_g, a_layout)
        ds_s = gl.expand_dims(gl.convert_layout(ds_s, keys_g), 1)
        # 4. dV += P_r^T dO_c (dO_c's channel scale differs per query head), then
        # 5. dK += dS^T Q_c, dS^T with one scale per key over this query tile
        do_c_tile = do_c_smem.index(stage)
        q_c_tile = q_c_smem.index(stage)
        tok = _product(pr, do_c_tile.slice(0, HALF), g_zero)
        if IN_FLIGHT == 2:
            tok1 = _product(pr, do_c_tile.slice(HALF, HALF), g_zero)
            dv0 += warpgroup_mma_wait(1, deps=[tok]) * _number(do_cs0_b, dims_g, 0)
            tok = _product(ds_g, q_c_tile.slice(0, HALF), g_zero)
            dv1 += warpgroup_mma_wait(1, deps=[tok1]) * _number(do_cs1_b, dims_g, 0)
            tok1 = _product(ds_g, q_c_tile.slice(HALF, HALF), g_zero)
            dk0 += warpgroup_mma_wait(1, deps=[tok]) * ds_s * _number(q_cs0_b, dims_g, 0)
            dk1 += warpgroup_mma_wait(0, deps=[tok1]) * ds_s * _number(q_cs1_b, dims_g, 0)
        else:
            dv0 += warpgroup_mma_wait(0, deps=[tok]) * _number(do_cs0_b, dims_g, 0)
            tok = _product(pr, do_c_tile.slice(HALF, HALF), g_zero)
            dv1 += warpgroup_mma_wait(0, deps=[tok]) * _number(do_cs1_b, dims_g, 0)
            tok = _product(ds_g, q_c_tile.slice(0, HALF), g_zero)
            dk0 += warpgroup_mma_wait(0, deps=[tok]) * ds_s * _number(q_cs0_b, dims_g, 0)
            tok = _product(ds_g, q_c_tile.slice(HALF, HALF), g_zero)
            dk1 += warpgroup_mma_wait(0, deps=[tok]) * ds_s * _number(q_cs1_b, dims_g, 0)
        if STAGED != STAGED_ASYNC_AHEAD:
            lse, do_s, delta, do_cs0, do_cs1, q_cs0, q_cs1 = nxt[0:7]
            if ROW_SCALES:
                qsc = nxt[7]

    if STAGED == STAGED_ASYNC_AHEAD:
        async_copy.wait_group(0)  # the last copy (a repeat of the last tile's numbers)
    invalidate(kv_bar, 1)
    invalidate(ready, STAGES)

    rows = start_n + gl.arange(0, BLOCK_N, layout=keys_g)
    offs_d = gl.arange(0, HALF, layout=dims_g)
    out = (off_bh * Sk + gl.expand_dims(rows, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(offs_d, 0)
    dty: gl.constexpr = DK.dtype.element_ty
    gl.store(DK + out, (dk0 * sm_scale).to(dty))
    gl.store(DK + out + HALF, (dk1 * sm_scale).to(dty))
    gl.store(DV + out, (dv0 * (1.0 / P_OFFSET)).to(DV.dtype.element_ty))
    gl.store(DV + out + HALF, (dv1 * (1.0 / P_OFFSET)).to(DV.dtype.element_ty))


@gluon.jit
def _load_key_tile(j, kv_row, kd_row, k_desc, v_desc, k_c_desc, k_smem, v_smem, k_c_smem, ready, pred,
                   BLOCK_N: gl.constexpr):
    """TMA of key tile j's K, V (per token) and K_c into its ring stage, one mbarrier."""
    stage = j % STAGES
    bar = ready.index(stage)
    nbytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes + k_c_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], bar, k_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], bar, v_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(k_c_desc, [kd_row, j * BLOCK_N], bar, k_c_smem.index(stage), pred=pred)


@gluon.jit
def _issue_scores(j, q_smem, do_t_smem, k_smem, v_smem, ready, s_zero, dp_zero):
    """Once key tile j has arrived: S = Q K^T and dP = dO_t V^T issued (their tokens)."""
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    return _product(q_smem, k_smem.index(stage), s_zero), _product(do_t_smem, v_smem.index(stage), dp_zero)


@gluon.jit
def attn_bwd_dq_pipelined_kernel(
    q_desc, k_desc, do_t_desc, v_desc, k_c_desc,
    QS, KS, LSE, DELTA, DO_TS, V_TS, K_CS, DQ, call,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    ROW_SCALES: gl.constexpr = False,
):
    """dQ of BLOCK_M queries of one head over its visible key tiles, the Triton dq
    kernel's arithmetic (`backward._dq_tile`) operation for operation: q_desc (B*H*Sq,
    D) bf16 and do_t_desc (B*H*Sq, D) e4m3 in (BLOCK_M, D) tiles, loaded once; k_desc
    (B*Hkv*Sk, D) bf16, v_desc (B*Hkv*Sk, D) e4m3 in (BLOCK_N, D) tiles and k_c_desc
    (B*Hkv*D, Sk) e4m3 in (D, BLOCK_N) tiles, a two-stage ring. Sq and Sk are multiples
    of the tiles. Per key tile j (S_j and dP_j issued in the iteration before):

        wait for S_j and dP_j; P, dS and dS's e4m3 view per query (the recipe's 64 keys)
        issue S_{j+1} and dP_{j+1}, then dQ_j = dS K_c on a fresh accumulator
        wait for all three; dQ += dQ_j x dS's query scale; K_c_j's stage takes tile j+2

    so the products of the next tile run while this one's dQ product does. ROW_SCALES
    (per-token FP8 Q/K, QS (B, H, Sq) and KS (B, Hkv, Sk)): the program's query scales,
    times scale * log2 e, are loaded once, and each key tile's scales a tile ahead, as
    V's, where NVFP4 has the heads' two tensor scales (the Triton kernel's ROW_SCALES)."""
    H, GROUP, Sq, Sk, causal_offset, qk_scale, sm_scale = call  # `kernel_args.BACKWARD_CALL`
    gl.static_assert(BLOCK_M == 64)  # one warpgroup's wgmma rows
    gl.static_assert(BLOCK_N == 64)  # dS's scale block along the keys (DS_BLOCK)
    gl.static_assert(gl.num_warps() == 4)
    # S (bf16 products) and dP (e4m3) share their registers, queries x keys; dQ queries x D
    s_layout, dp_layout, g_layout, a_layout = _tile_layouts(BLOCK_N, HEAD_DIM)
    rows_s, keys_s = _axes(s_layout)
    rows_g, dims_g = _axes(g_layout)

    start_m = gl.program_id(0) * BLOCK_M
    off_bh = gl.program_id(1)  # (b, h)
    bhk = (off_bh // H) * (H // GROUP) + (off_bh % H) // GROUP
    q_row = off_bh * Sq + start_m
    kv_row = bhk * Sk
    kd_row = bhk * HEAD_DIM
    # key tiles [0, full) are visible to every row of this block, [full, hi) are masked
    # (as the Triton kernel; rows that see no key have P = 0 through their log2 LSE of +inf)
    hi = Sk
    full = Sk
    if CAUSAL:
        hi = gl.maximum(gl.minimum(start_m + BLOCK_M + causal_offset, Sk), 0)
        full = gl.minimum(gl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N, Sk)
    n_tiles = gl.cdiv(hi, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    do_t_smem = gl.allocate_shared_memory(do_t_desc.dtype, do_t_desc.block_type.shape, do_t_desc.layout)
    k_smem = _ring(k_desc, STAGES)
    v_smem = _ring(v_desc, STAGES)
    k_c_smem = _ring(k_c_desc, STAGES)
    q_bar, ready = _barriers_and_fixed_tiles(q_desc, do_t_desc, q_row, q_smem, do_t_smem)
    # key tile 0 always (it exists: a block that sees no key still issues its products
    # once, unused, so that the loop's first wait has them)
    for j in gl.static_range(STAGES):
        _load_key_tile(j, kv_row, kd_row, k_desc, v_desc, k_c_desc, k_smem, v_smem, k_c_smem, ready,
                       (j < n_tiles) | (j == 0), BLOCK_N)

    if not ROW_SCALES:
        q_scale = gl.load(QS + off_bh) * qk_scale  # the heads' tensor scales, Q's times scale * log2 e
        k_scale = gl.load(KS + bhk)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows_s)
    if ROW_SCALES:
        # the program's queries' own scales times scale * log2 e, once; each key tile's
        # keys' scales a tile ahead, as V's (key tile 0's here)
        q_scale = gl.expand_dims(gl.load(QS + off_bh * Sq + offs_m) * qk_scale, 1)
        k_s = _flat(KS + kv_row, BLOCK_N)
        # a key tile's K and V scales reach the S layout together (one barrier pair per
        # tile, as V's alone by a layout change)
        ks_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        vs_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    offs_nb = gl.arange(0, BLOCK_N, layout=keys_s)
    lse2 = gl.expand_dims(lse_log2(gl.load(LSE + off_bh * Sq + offs_m)), 1)
    delta = gl.expand_dims(gl.load(DELTA + off_bh * Sq + offs_m), 1)
    do_s = gl.expand_dims(gl.load(DO_TS + off_bh * Sq + offs_m), 1)
    v_s = _flat(V_TS + kv_row, BLOCK_N)  # key tile 0's V scales (a tile ahead from here on)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dp_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=dp_layout)
    g_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)

    mbarrier.wait(q_bar.index(0), 0)
    s_tok, dp_tok = _issue_scores(0, q_smem, do_t_smem, k_smem, v_smem, ready, s_zero, dp_zero)
    for j in range(n_tiles):
        stage = j % STAGES
        if ROW_SCALES:
            ks_s.store(k_s)
            vs_s.store(v_s)
        v_s_next = _flat(V_TS + kv_row + gl.minimum(j + 1, n_tiles - 1) * BLOCK_N, BLOCK_N)
        if ROW_SCALES:
            k_s_next = _flat(KS + kv_row + gl.minimum(j + 1, n_tiles - 1) * BLOCK_N, BLOCK_N)
        # P and dS of tile j
        scores = warpgroup_mma_wait(1, deps=[s_tok])
        if ROW_SCALES:  # tile j's keys' own scales (the Triton kernel's, times 1.0: exact)
            k_scale = _number(ks_s, keys_s, 0)
        t = log2_scores(scores, q_scale, k_scale)
        if j * BLOCK_N >= full:  # a tile on the causal diagonal
            cols = j * BLOCK_N + offs_nb
            visible = gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m, 1) + causal_offset
            t = gl.where(visible, t, -float("inf"))
        p = gl.exp2(t - lse2)
        dp = gl.convert_layout(warpgroup_mma_wait(0, deps=[dp_tok]), s_layout)
        if ROW_SCALES:
            dp = dp * do_s * _number(vs_s, keys_s, 0)
        else:
            dp = dp * do_s * _spread(v_s, keys_s, 0)
        ds = p * (dp - delta)
        ds_g, ds_s = e4m3_rows(ds, 1, True)
        ds_g = gl.convert_layout(ds_g, a_layout)
        # the next tile's products, then dQ_j, one wait for the three
        if j + 1 < n_tiles:
            s_tok, dp_tok = _issue_scores(j + 1, q_smem, do_t_smem, k_smem, v_smem, ready, s_zero, dp_zero)
        dq_tok = _product(ds_g, k_c_smem.index(stage), g_zero)
        dq += warpgroup_mma_wait(0, deps=[dq_tok]) * gl.expand_dims(gl.convert_layout(ds_s, rows_g), 1)
        # tile j is read: its stage takes tile j + 2
        _load_key_tile(j + STAGES, kv_row, kd_row, k_desc, v_desc, k_c_desc, k_smem, v_smem, k_c_smem, ready,
                       j + STAGES < n_tiles, BLOCK_N)
        v_s = v_s_next
        if ROW_SCALES:
            k_s = k_s_next

    warpgroup_mma_wait(0, deps=[s_tok, dp_tok])  # (only a block without keys has them pending)
    invalidate(q_bar, 1)
    invalidate(ready, STAGES)

    offs_d = gl.arange(0, HEAD_DIM, layout=dims_g)
    k_cs = gl.load(K_CS + kd_row + offs_d)
    dq = dq * gl.expand_dims(k_cs, 0) * sm_scale
    rows = start_m + gl.arange(0, BLOCK_M, layout=rows_g)
    out = (off_bh * Sq + gl.expand_dims(rows, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(offs_d, 0)
    gl.store(DQ + out, dq.to(DQ.dtype.element_ty))


CHANNEL_MAJOR = ("do_c", "q_c", "k_c")  # (.., D, S) operands; q, k, do_t, v_t are (.., S, D)


def descriptors(**operands) -> dict:
    """Gluon TMA descriptors of the kernels' operands by name (q, k, do_t, v_t
    token-major in (BLOCK, D) tiles; do_c, q_c, k_c channel-major in (D, BLOCK) tiles),
    contiguous: built once for both kernels, which share q, k, do_t and v_t."""
    return {name: tma_descriptor(*operand_tile(t, name in CHANNEL_MAJOR)) for name, t in operands.items()}


def launch_dkdv_gluon(descs, qs, ks, lse, delta, do_ts, do_cs, v_ts, q_cs, dk, dv, causal_offset: int,
                          causal: bool, scale: float, in_flight: int = 1, maxnreg: int | None = None,
                          staged: int = DkdvStaged.TOGETHER, row_scales: bool = False):
    """Run the dK/dV kernel into dk, dv (B, Hkv, Sk, D) from `train_op.backward_operands`'s
    views, their tiles by `descs` (`descriptors` of q, k, do_t, do_c, v_t, q_c); Sq and Sk
    multiples of BLOCK. `row_scales`: qs (B, H, Sq) and ks (B, Hkv, Sk) are per-token FP8
    Q/K's scales (ROW_SCALES), else the heads' tensor scales (B, H), (B, Hkv)."""
    from fp4attn.reference.forward import LOG2E

    if in_flight not in (1, 2):
        raise ValueError(f"Gluon dK/dV kernel: in_flight={in_flight!r}; IN_FLIGHT is 1 or 2 (half products in flight)")
    if staged not in tuple(DkdvStaged):
        raise ValueError(f"Gluon dK/dV kernel: staged={staged!r}; STAGED is 1 or 2 (how a tile's numbers reach "
                         "its layouts: routing.DkdvStaged)")
    B, Hkv, Sk, D = dk.shape
    H, Sq = lse.shape[1], lse.shape[2]
    attn_bwd_dkdv_pipelined_kernel[(triton.cdiv(Sk, BLOCK), B * Hkv)](
        *(descs[n] for n in ("q", "k", "do_t", "do_c", "v_t", "q_c")), qs, ks, lse, delta, do_ts, do_cs, v_ts, q_cs,
        dk, dv, (H, H // Hkv, Sq, Sk, causal_offset, scale * LOG2E, scale), HEAD_DIM=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK,
        CAUSAL=causal, IN_FLIGHT=in_flight, STAGED=DkdvStaged(staged).value, ROW_SCALES=row_scales, num_warps=4,
        maxnreg=maxnreg)


def launch_dq_gluon(descs, qs, ks, lse, delta, do_ts, v_ts, k_cs, dq, causal_offset: int, causal: bool,
                        scale: float, maxnreg: int | None = None, row_scales: bool = False):
    """Run the dQ kernel into dq (B, H, Sq, D), its tiles by `descs` (`descriptors` of q,
    k, do_t, v_t, k_c), as `launch_dkdv_gluon` (`row_scales` likewise)."""
    from fp4attn.reference.forward import LOG2E

    B, H, Sq, D = dq.shape
    Hkv, Sk = v_ts.shape[1], v_ts.shape[2]
    attn_bwd_dq_pipelined_kernel[(triton.cdiv(Sq, BLOCK), B * H)](
        *(descs[n] for n in ("q", "k", "do_t", "v_t", "k_c")), qs, ks, lse, delta, do_ts, v_ts, k_cs, dq,
        (H, H // Hkv, Sq, Sk, causal_offset, scale * LOG2E, scale), HEAD_DIM=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK,
        CAUSAL=causal, ROW_SCALES=row_scales, num_warps=4, maxnreg=maxnreg)
