"""The Hopper kernels compile for sm_90 on a machine without a GPU, and its machine
code has the structure the design relies on: the products on the FP8/BF16 tensor cores
(QGMMA/HGMMA) and, for Direct-P, no exponential per P element on the MUFU unit."""

import pytest
import torch

pytest.importorskip("triton")

from dev.machine_code import inspect_backward, inspect_forward  # noqa: E402


@pytest.mark.compile
@pytest.mark.parametrize("p_mode,max_ex2", [(0, None), (1, 8)])
def test_fp8_qk_kernel_structure(p_mode, max_ex2):
    r = inspect_forward(True, p_mode, False, 128)
    assert r.count(r"QGMMA") > 0, "QK^T and PV must run on the FP8 tensor cores"
    assert r.count(r"HGMMA") == 0
    ex2 = r.count(r"MUFU\.EX2")
    if max_ex2 is None:
        assert ex2 >= 64  # one exp per score element: 128x128 tile over 256 threads
    else:
        assert ex2 <= max_ex2  # only the per-row rescale and epilogue exps remain


@pytest.mark.compile
def test_tile_loop_instruction_profile():
    """The unmasked tile loop, per score element: one exp2 for FP8 P, none for Direct-P
    (its exps are per block and per row, outside the element work), and a total in the
    range the instruction budget of docs/notes/hopper-forward.md was measured at."""
    from dev.machine_code import per_element

    for p_mode, lo, hi in ((0, 10, 25), (1, 20, 40)):
        n, ops = per_element(inspect_forward(True, p_mode, False, 128).tile_loop(), 64)
        mufu = dict(ops).get("MUFU", 0.0)
        assert lo <= n <= hi, (p_mode, n)
        assert (0.9 <= mufu <= 1.2) if p_mode == 0 else mufu < 0.1, (p_mode, mufu)


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_sink_tiles_leave_the_steady_loop_plain_directp(causal):
    """`Recipe.p_sink_keys` (P_MODE 3 with SINK_TILES 1, directp-robust): the sink tile
    is peeled before the loops, so the unmasked tile loop has plain Direct-P's compares,
    selects and maxima per score (29.33 / causal 29.31 instructions per score against
    29.25 / 29.28, the difference loop bookkeeping; p_sink on every tile: 34.17), and
    nothing spills."""
    from collections import Counter

    from dev.machine_code import per_element

    plain = inspect_forward(False, 1, causal, 128)
    sink = inspect_forward(False, 3, causal, 128, sink_tiles=1)
    assert sink.stack == 0
    a, b = Counter(plain.tile_path()), Counter(sink.tile_path())
    for op in ("FSETP.GE.AND", "FSEL", "FMNMX", "MUFU.EX2", "P2R"):
        assert sum(v for k, v in b.items() if k.startswith(op)) == sum(v for k, v in a.items() if k.startswith(op)), op
    n_plain, n_sink = per_element(plain.tile_path(), 64)[0], per_element(sink.tile_path(), 64)[0]
    assert n_sink - n_plain < 0.2, (n_plain, n_sink)


@pytest.mark.compile
def test_nvfp4_kernel_uses_bf16_qk_and_fp8_pv():
    r = inspect_forward(False, 1, True, 64)
    assert r.count(r"HGMMA") > 0 and r.count(r"QGMMA") > 0


@pytest.mark.compile
@pytest.mark.parametrize("part", ["dkdv", "dq"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("row_scales", [False, True])
def test_backward_kernel_structure(part, causal, row_scales):
    """S is rebuilt by a bf16 product (exact NVFP4 or FP8 Q/K values, as the forward),
    and the gradient products run on the FP8 tensor cores. With per-token FP8 scales
    (ROW_SCALES, `train-fp8`) the same products, the tile loop longer only by the scale
    loads and products (measured at D=128, instructions per thread and full tile: dK/dV
    1,063 against 1,019, causal 1,038 against 997; dQ 712 against 678, causal 720
    against 679), and no more spill."""
    r = inspect_backward(part, 0, causal, 128, row_scales=row_scales)
    assert r.count(r"HGMMA") > 0, "S^T = K Q^T must be the forward's bf16 product"
    assert r.count(r"QGMMA") > 0, "dV, dP, dK / dQ must run on the FP8 tensor cores"
    if row_scales:
        head = inspect_backward(part, 0, causal, 128)
        assert (r.count(r"HGMMA"), r.count(r"QGMMA")) == (head.count(r"HGMMA"), head.count(r"QGMMA"))
        assert r.stack <= head.stack, (r.stack, head.stack)
        assert len(head.tile_path()) < len(r.tile_path()) <= len(head.tile_path()) * 1.08


@pytest.mark.compile
def test_key_bias_forward_compiles_and_adds_one_load_per_key():
    """The key-mask path compiles for sm_90 with the products still on the tensor cores."""
    plain, masked = inspect_forward(False, 0, False, 128), inspect_forward(False, 0, False, 128, key_bias=True)
    assert masked.count("HGMMA") == plain.count("HGMMA") > 0 and masked.count("QGMMA") == plain.count("QGMMA")


@pytest.mark.compile
@pytest.mark.parametrize("qk_fp8,p_mode,causal,head_dim", [(False, 1, True, 128), (True, 1, True, 64)])
def test_gluon_forward_builds_every_p_mode_and_head_dim(qk_fp8, p_mode, causal, head_dim):
    """The warp-specialized Gluon forward also builds for sm_90 where it is not routed
    (Direct-P, D=64): wgmma on the tensor cores, TMA loads into shared memory, and the
    same P builder (no exp per element for Direct-P)."""
    from dev.machine_code import inspect_forward_ws

    r = inspect_forward_ws(qk_fp8, p_mode, causal, head_dim)
    assert r.count(r"QGMMA") > 0 and (qk_fp8 or r.count(r"HGMMA") > 0)
    assert r.count(r"UTMALDG") > 0, "K and V^T tiles must arrive by TMA"
    if p_mode == 1:
        assert r.count(r"MUFU\.EX2") <= 8


@pytest.mark.compile
@pytest.mark.parametrize("p_mode", [0, 1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_qk_forward_chains_its_wgmmas(p_mode, causal):
    """At D=128 the bf16-QK^T forward adds each tile's PV into O itself (pv_add): with
    Triton's max_num_imprecise_acc promotion instead, ptxas serialized every wgmma of
    the kernel (C7514), each of QK^T's eight waiting for the one before."""
    from dev.machine_code import compile_forward, inspect, ptxas_messages

    kernel = compile_forward(False, p_mode, causal, 128)
    assert "C7514" not in ptxas_messages(kernel)
    loop = inspect(kernel).tile_loop()
    assert loop.count("WARPGROUP.DEPBAR.LE") == 2, "one wait per product: QK^T, then PV"
    assert "C7514" in ptxas_messages(compile_forward(False, p_mode, causal, 128, pv_add=False))


@pytest.mark.compile
@pytest.mark.parametrize("qk_fp8,p_mode,causal", [(False, 0, False), (False, 0, True), (False, 1, True),
                                                 (True, 0, False), (True, 0, True)])
def test_warp_specialized_forward_chains_its_wgmmas_and_fits_two_programs_per_sm(qk_fp8, p_mode, causal):
    """The routed layout of the warp-specialized Gluon forward at D=128 (one consumer
    warpgroup at 232 registers, a producer warp at 24): ptxas chains each product's
    wgmmas (no C7511/C7514), the consumer never waits at a CTA-wide barrier, and two
    programs' shared memory fits an SM (228 KB, 1 KB reserved per program): with the
    key scales in a TMA ring it did not, by 568 bytes. e4m3 Q/K (`fast_accum`) have
    their QK^T unpromoted: promoted every 32 products it needed a second S accumulator
    and ptxas serialized the wgmmas (C7511)."""
    import re

    from dev.machine_code import compile_forward_ws, inspect, ptxas_messages
    from fp4attn.routing import forward_launch

    kernel = compile_forward_ws(qk_fp8, p_mode, causal, 128, overlap=forward_launch(128, qk_fp8, causal).ws_overlap)
    report = ptxas_messages(kernel)
    assert "C7511" not in report and "C7514" not in report, report
    assert re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])[:3] == ["232", "232", "24"]
    r = inspect(kernel)
    assert r.count(r"UTMALDG") > 0 and r.count(r"QGMMA") > 0
    # QK^T: 8 bf16 k-steps of 16 (twice: the loop and the prologue), or 4 e4m3 ones of 32
    assert (r.count(r"HGMMA"), r.count(r"QGMMA")) == ((0, 12) if qk_fp8 else (16, 4))
    assert r.stack <= 32, r.stack
    assert r.count(r"WARPGROUP\.DEPBAR") <= 3, "one wait per product or pair of products (and the prologue's)"
    # the partition's own barriers (before each mbarrier wait and arrive) span its
    # warpgroup, 128 threads (two consumer warpgroups in one partition were coupled by them)
    assert set(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x\w+, (0x\w+)", r.sass)) == {"0x80"}
    assert 2 * (kernel.metadata.shared + 1024) <= 228 * 1024


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("row_scales", [False, True])
def test_gluon_backward_kernels_chain_their_wgmmas_and_share_an_sm(head_dim, causal, row_scales):
    """The routed Gluon backward kernels, for NVFP4 Q/K (a scale per head) and per-token
    FP8 Q/K (ROW_SCALES, `train-fp8`). dK/dV: each tile's S^T and dP^T are computed
    once (the Triton kernel's two warpgroups each computed them whole at D=128, 16 HGMMA
    and 8 QGMMA per tile each). Both: wgmmas chained (no C7511/C7514), little spill
    (the first dK/dV version had 208 bytes of stack at D=128, before dK and dV were
    halved), and as many programs per SM as registers and shared memory were meant to
    allow: two at up to 255 registers, three at D=64 (168); dQ's causal tiles off the
    diagonal without the mask's instructions. ROW_SCALES: the query scales are an eighth
    number of a dK/dV tile (copied with the others), the key scales of a dQ tile reach
    their layout with V's (no barrier more), and the full tile's path no more than 3%
    longer than the NVFP4 build's (measured: dK/dV 1.6-6.4% shorter, its query-head select
    gone; dQ 2.1-2.4% longer); stack 0-40 bytes against NVFP4's 0-64
    (docs/notes/hopper-train.md, "`train-fp8` on the Gluon backward")."""
    from dev.machine_code import compile_backward_gluon, inspect, ptxas_messages
    from fp4attn.routing import BACKWARD_LAUNCH

    cfg = BACKWARD_LAUNCH[head_dim]
    assert cfg.dkdv_gluon and cfg.dq_gluon and cfg.tma
    def build(part, maxnreg, causal, row_scales=row_scales):
        return compile_backward_gluon(causal, head_dim, cfg.dkdv_in_flight, part=part, maxnreg=maxnreg,
                                          staged=cfg.dkdv_staged, row_scales=row_scales)

    for part, maxnreg in (("dkdv", cfg.dkdv_maxnreg), ("dq", cfg.dq_maxnreg)):
        kernel = build(part, maxnreg, causal)
        report = ptxas_messages(kernel)
        assert "C7511" not in report and "C7514" not in report, (part, report)
        r = inspect(kernel)
        loop = r.tile_loop()
        if row_scales:
            nvfp4 = inspect(build(part, maxnreg, causal, False))
            assert len(r.tile_path()) <= len(nvfp4.tile_path()) * 1.03, (part, len(r.tile_path()))
        # S: D/16 bf16 k-steps; dP: D/32 e4m3 k-steps; dV and dK: 2 halves x 2 k-steps
        # each (dkdv); dQ: 2 k-steps (dq)
        assert sum(op.startswith("HGMMA") for op in loop) == head_dim // 16, part
        assert sum(op.startswith("QGMMA") for op in loop) == head_dim // 32 + (8 if part == "dkdv" else 2), part
        assert r.count("UTMALDG") > 0
        assert r.stack <= 96, (part, r.stack)
        if causal:
            # the tiles off the causal diagonal issue no mask: ptxas leaves the mask in a
            # region they branch around (not predicated into every tile), so their path
            # is the non-causal one's (docs/notes/hopper-train.md, "The masks are branched
            # around")
            full, plain = r.tile_path(), inspect(build(part, maxnreg, False)).tile_path()
            assert len(full) <= len(plain) + 24, (part, len(full), len(plain))
            assert len(loop) - len(full) >= 64, (part, len(loop), len(full))  # the mask's compares and selects
        # CTA barriers per tile: the TMA issue's and one pair for all of a dK/dV tile's
        # numbers (STAGED; 18 when each moved through shared memory by itself)
        bars = sum(op.startswith("BAR") for op in loop)
        assert bars <= 6, (part, bars)
        if part == "dkdv" and cfg.dkdv_staged == 2:
            # the seven numbers of the next tile (eight with the query scales) by
            # asynchronous copies, no register holding them: loaded into registers ptxas
            # spilled them right after their loads (docs/notes/hopper-train.md), and
            # nothing else in the loop is a load from global memory
            assert sum(op.startswith("LDGSTS") for op in loop) == 7 + row_scales, part
            assert not any(op.startswith("LDG.") for op in loop), part
        programs = 65536 // (128 * r.registers)
        assert programs == (3 if maxnreg == 168 else 2), (part, r.registers)
        assert programs * (kernel.metadata.shared + 1024) <= 228 * 1024, (part, kernel.metadata.shared)


def test_gluon_dkdv_launch_rejects_unknown_in_flight():
    """IN_FLIGHT other than 1 or 2, or STAGED other than 1 or 2, is a ValueError
    naming the accepted values, raised before anything is built or launched."""
    from fp4attn.kernels.hopper.backward_gluon import launch_dkdv_gluon

    with pytest.raises(ValueError, match="IN_FLIGHT is 1 or 2"):
        launch_dkdv_gluon({}, *[None] * 10, 0, True, 0.1, in_flight=3)
    for staged in (0, 3):
        with pytest.raises(ValueError, match="STAGED is 1 or 2"):
            launch_dkdv_gluon({}, *[None] * 10, 0, True, 0.1, staged=staged)


def test_warp_specialized_forward_launch_rejects_unknown_overlap():
    """An OVERLAP the warp-specialized forward does not have (it has 1 and 4) is a
    ValueError naming them, raised before anything is built or launched."""
    from fp4attn.kernels.hopper.forward_gluon_ws import launch_forward_ws
    from fp4attn.kernels.hopper.operands import KernelOperands

    ops = KernelOperands(*(torch.zeros(1, 1, 1, 1) for _ in range(6)))
    for overlap in (0, 2, 3):
        with pytest.raises(ValueError, match=f"overlap={overlap}; OVERLAP is 1 or 4"):
            launch_forward_ws(ops, scale=0.1, causal_offset=None, p_mode=0, overlap=overlap)


@pytest.mark.parametrize("qk", ["nvfp4", "fp8"])
def test_training_forward_keeps_the_quantized_qk(qk):
    """What the training forward keeps for the backward, as its fake implementation
    (what torch.compile traces) declares it. NVFP4 (`train`): Q/K as packed NVFP4 (two
    E2M1 codes a byte, an e4m3 scale per 16 elements, the tensor scales, the channels'
    maxima); per-token FP8 (`train-fp8`): Q/K as e4m3 bytes (not their bf16 values) with
    a float32 scale per token and the channels' maxima. Both: V's per-token e4m3 view,
    bf16 output, float32 LSE: about 4.2 (NVFP4) and 5.1 (FP8) bytes per element of
    Q/K/V/O, against 8 for bf16 copies; and the backward's gradients in the shapes of q
    and k/v (GQA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fp4attn.kernels.hopper.train_op  # noqa: F401  (registers the ops)

    ops = torch.ops.fp4attn
    forward, backward = ((ops.hopper_train_forward, ops.hopper_train_backward) if qk == "nvfp4" else
                         (ops.hopper_train_forward_fp8, ops.hopper_train_backward_fp8))
    B, H, Hkv, S, D = 2, 8, 8, 512, 128
    e4m3 = torch.float8_e4m3fn
    with FakeTensorMode():
        q, k, v = (torch.empty(B, h, S, D, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
        saved = forward(q, k, v, qk, "fp8", "exp2", "fp8", 0, True, D**-0.5)
        out, lse, *qk_saved, q_amax, k_amax, v_t, v_ts = saved
        if qk == "nvfp4":
            q_codes, q_bscale, k_codes, k_bscale, qs, ks = qk_saved
            assert (q_codes.dtype, q_codes.shape) == (torch.uint8, (B, H, S, D // 2))
            assert (k_bscale.dtype, k_bscale.shape) == (e4m3, (B, Hkv, S, D // 16))
            assert (qs.shape, ks.shape) == ((B, H), (B, Hkv))
            # 4.125 + the LSE and V's per-token scales (4 / D each) + the channel maxima (4 / S each)
            lo, hi = 4.1, 4.21
        else:
            q8, qs, k8, ks = qk_saved
            assert (q8.dtype, q8.shape, qs.dtype, qs.shape) == (e4m3, (B, H, S, D), torch.float32, (B, H, S))
            assert (k8.dtype, k8.shape, ks.shape) == (e4m3, (B, Hkv, S, D), (B, Hkv, S))
            # 5 + the LSE and the per-token scales of Q, K and V (4 / D each) + the channel maxima (4 / S each)
            lo, hi = 5.1, 5.15
        assert (q_amax.dtype, q_amax.shape, k_amax.shape) == (torch.int32, (B, H, D), (B, Hkv, D))
        assert (v_t.dtype, v_t.shape, v_ts.shape) == (e4m3, (B, Hkv, S, D), (B, Hkv, S))
        per_element = sum(t.numel() * t.element_size() for t in saved) / q.numel()
        assert lo < per_element < hi, per_element
        dtypes = [torch.bfloat16, torch.float16, torch.float32]
        grads = backward(out, *saved, "fp8", "exp2", 0, True, D**-0.5, *dtypes)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert [g.dtype for g in grads] == dtypes


def test_packed_nvfp4_entry_points_reject_bad_input():
    """The payload decode names the shapes and dtypes it takes; each training forward op
    names the Q/K format it trains and the op that trains the other; the FP8 Q/K views
    pass names what it takes. All before any kernel runs."""
    import fp4attn.kernels.hopper.train_op  # noqa: F401  (registers the ops)
    from fp4attn.kernels.quantize.nvfp4 import decode_nvfp4_rows

    codes = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"codes \(\.\.\., D/2\) uint8 and block scales"):
        decode_nvfp4_rows(codes, torch.zeros(4, 4, dtype=torch.float8_e4m3fn))  # 4 scales for D = 128: want 8
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        decode_nvfp4_rows(codes, torch.zeros(4, 8, dtype=torch.uint8))
    bscale = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype bfloat16 or float32, got torch.float16"):
        decode_nvfp4_rows(codes, bscale, torch.float16)
    with pytest.raises(ValueError, match="channels_scale and channel_amax go together"):
        decode_nvfp4_rows(codes, bscale, channels_scale=torch.ones(1))
    q = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Q/K format 'fp8'.*'nvfp4'.*hopper_train_forward_fp8"):
        torch.ops.fp4attn.hopper_train_forward(q, q, q, "fp8", "fp8", "exp2", "fp8", 0, True, 0.125)
    # and the FP8 Q/K ops and their views name theirs
    from fp4attn.kernels.quantize.fp8_train import fp8_qk_views

    with pytest.raises(ValueError, match="Q/K format 'nvfp4'.*per-token 'fp8'.*hopper_train_forward\\)"):
        torch.ops.fp4attn.hopper_train_forward_fp8(q, q, q, "nvfp4", "fp8", "exp2", "fp8", 0, True, 0.125)
    e4m3 = q.to(torch.float8_e4m3fn)
    scales, amax = torch.ones(1, 1, 16), torch.zeros(1, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="saved float8_e4m3fn bytes, got torch.bfloat16"):
        fp8_qk_views(q, scales, amax)
    with pytest.raises(ValueError, match="dtype bfloat16 or float32, got torch.float16"):
        fp8_qk_views(e4m3, scales, amax, torch.float16)
    with pytest.raises(ValueError, match=r"row scales \(\.\.\., S\) and channel maxima \(\.\.\., D\), got "
                                         r"\(1, 1, 16, 64\), \(1, 1, 64\)"):
        fp8_qk_views(e4m3, amax.float(), amax)


def test_exact_fp8_recipes_give_the_kernel_bf16_qk_with_the_e4m3_values():
    """`fp8` / `fp8-directp` hand the kernel their e4m3 Q/K as bf16 (QK^T on the bf16
    tensor cores, float32 sums, as the reference); the `-fastacc` forms hand it the same
    values as e4m3 bytes (the FP8 tensor cores). Not one value differs, and the other
    operands are the same."""
    from fp4attn.kernels.hopper.operands import prepare_operands
    from fp4attn.recipes import PRESETS

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 64, generator=g).bfloat16() * 3 for _ in range(3))
    for exact, fast in (("fp8", "fp8-fastacc"), ("fp8-directp", "fp8-directp-fastacc")):
        ops, ops8 = prepare_operands(q, k, v, PRESETS[exact]), prepare_operands(q, k, v, PRESETS[fast])
        assert ops.q.dtype == ops.k.dtype == torch.bfloat16
        assert ops8.q.dtype == ops8.k.dtype == torch.float8_e4m3fn
        assert torch.equal(ops.q.float(), ops8.q.float()) and torch.equal(ops.k.float(), ops8.k.float())
        for a, b in ((ops.qs, ops8.qs), (ops.ks, ops8.ks), (ops.vt, ops8.vt), (ops.vs, ops8.vs)):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_tma_descriptors_cover_each_head_and_need_padded_vt():
    """K as (B*Hkv*Sk, D) rows and V^T as (B*Hkv*D, padded keys) rows, tiles of the key
    tile; None (the pointer loads) where V^T is not padded to whole tiles or K is not
    contiguous."""
    import dataclasses

    from fp4attn.kernels.hopper.forward_op import tma_descriptors
    from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands

    B, H, Sk, D = 2, 3, 200, 64
    k = torch.zeros(B, H, Sk, D, dtype=torch.bfloat16)
    rows = torch.zeros(B, H, D, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vt = rows[..., :Sk]  # a view of rows padded to 256 keys, as the fused quantizers give it
    s = torch.ones(B, H, Sk)
    ops = KernelOperands(k, k, s, s, vt, torch.ones(B, H, D), vt_keys_padded=True)
    kd, vd = tma_descriptors(ops)
    assert list(kd.shape) == [B * H * Sk, D] and kd.block_shape == [BLOCK_N, D]
    assert list(vd.shape) == [B * H * D, 256] and vd.block_shape == [D, BLOCK_N] and vd.strides == [256, 1]
    assert tma_descriptors(dataclasses.replace(ops, vt_keys_padded=False)) is None
    assert tma_descriptors(dataclasses.replace(ops, k=k.transpose(1, 2).contiguous().transpose(1, 2))) is None


def test_backward_descriptors_read_whole_tiles_of_one_head():
    """Token-major operands as (B*heads*S, D) rows in (DS_BLOCK, D) tiles, channel-major
    ones as (B*heads*D, S) rows in (D, DS_BLOCK) tiles; None (pointer loads) when a
    length is not a whole number of tiles or an operand is not contiguous."""
    from fp4attn.kernels.hopper.train_op import backward_descriptors
    from fp4attn.reference.backward import DS_BLOCK

    def operands(B, H, Hkv, Sq, Sk, D):
        e4m3 = torch.float8_e4m3fn
        q, do_t = torch.zeros(B, H, Sq, D, dtype=torch.bfloat16), torch.zeros(B, H, Sq, D).to(e4m3)
        do_c, q_c = (torch.zeros(B, H, D, Sq).to(e4m3) for _ in range(2))
        k, v_t, k_c = torch.zeros(B, Hkv, Sk, D, dtype=torch.bfloat16), torch.zeros(B, Hkv, Sk, D).to(e4m3), \
            torch.zeros(B, Hkv, D, Sk).to(e4m3)
        return q, do_t, do_c, q_c, k, v_t, k_c

    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 192, 320, 64
    d = backward_descriptors(*operands(B, H, Hkv, Sq, Sk, D))
    assert list(d["Q"].shape) == [B * H * Sq, D] and d["Q"].block_shape == [DS_BLOCK, D]
    assert list(d["DO_T"].shape) == [B * H * Sq, D] and d["DO_T"].block_shape == [DS_BLOCK, D]
    for name, heads, length in (("DO_C", H, Sq), ("Q_C", H, Sq), ("K_C", Hkv, Sk)):
        assert list(d[name].shape) == [B * heads * D, length] and d[name].block_shape == [D, DS_BLOCK]
        assert d[name].strides == [length, 1]
    assert list(d["K"].shape) == [B * Hkv * Sk, D] and list(d["V_T"].shape) == [B * Hkv * Sk, D]
    assert backward_descriptors(*operands(B, H, Hkv, Sq + 1, Sk, D)) is None
    assert backward_descriptors(*operands(B, H, Hkv, Sq, Sk - 16, D)) is None
    ops = list(operands(B, H, Hkv, Sq, Sk, D))
    ops[0] = ops[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert backward_descriptors(*ops) is None


@pytest.mark.compile
@pytest.mark.parametrize("name,consts", [
    ("_abs_max_kernel", dict(BLOCK_S=32, BLOCKS=8, PER_CHANNEL=True)),
    ("_fp8_rows_kernel", dict(BLOCK_R=16, BLOCKS=8, WITH_DOT=True, CHANNEL_AMAX=True, HW_CVT=True)),
    ("_nvfp4_rows_kernel", dict(BLOCK_R=16, BLOCKS=8, PACKED=True, CHANNEL_AMAX=True)),
    ("_nvfp4_decode_kernel", dict(BLOCK_S=16, CHANNELS=True, HW_CVT=True)),
    ("_v_kernel", dict(BLOCK_S=32, MXFP4=False, HAS_SCALE=False, TOKENS=True, HW_CVT=True, STATS=True, QUANT=True)),
    ("_fp8_rows_kernel", dict(BLOCK_R=16, BLOCKS=8, WITH_DOT=False, CHANNEL_AMAX=True, HW_CVT=True, SAVED=True)),
    ("_fp8_views_kernel", dict(BLOCK_S=16, HW_CVT=True)),
])
def test_quantizer_builds_keep_their_measured_form(name, consts):
    """The training step's quantizers as their launchers build them (sm_90, D=128): the
    maxima by relaxed reductions (`REDG`; the default acq_rel compiled to an `ATOMG`
    with a `MEMBAR.ALL.GPU` and made the passes slower than the ones they replaced), no
    spill, at most 128 registers (four programs of 4 warps per SM; 32- and 64-row tiles
    took up to 167), and e4m3 by the packed conversion (`F2FP`) where they round to it
    (the bit arithmetic made the V pass instruction-bound). docs/notes/hopper-train.md,
    "Quantizers of the training step"."""
    from dev.machine_code import compile_quantizer, inspect

    r = inspect(compile_quantizer(name, **consts))
    assert r.stack == 0, (name, r.stack)
    assert r.registers <= 128, (name, r.registers)
    if consts.get("STATS") and consts.get("QUANT"):
        # V read once (`_v_kernel`): one ticket (ATOMG) and one release of the head's count
        # (MEMBAR before its REDG); the maxima stay relaxed
        assert r.count(r"MEMBAR") == 1 and r.count(r"\bATOMG\b") == 1, name
        assert r.count(r"\bREDG\.E\.MAX") > 0, name
    else:
        assert r.count(r"MEMBAR") == 0 and r.count(r"\bATOMG\b") == 0, name
    if consts.get("CHANNEL_AMAX") or name == "_abs_max_kernel":
        assert r.count(r"\bREDG\.E\.MAX") > 0, name
    if consts.get("HW_CVT"):
        assert r.count(r"F2FP\.SATFINITE\.E4M3") > 0, name


@pytest.mark.compile
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_v_read_once_builds(fmt, d):
    """The forward's V quantizer as `quantize_v_t` launches it (`V_PROGRAM`), V read once:
    no spill, one ticket (ATOMG), one release of the head's count (MEMBAR before its
    REDG), the head's statistic by relaxed reductions, e4m3 by the packed conversion,
    and (FP8) the instruction count of the pass that matched a copy of V."""
    from dev.machine_code import compile_quantizer, inspect
    from fp4attn.kernels.quantize.v_operand import V_PROGRAM

    keys, warps = V_PROGRAM[d]
    r = inspect(compile_quantizer("_v_kernel", num_warps=warps, D=d, BLOCK_S=keys, MXFP4=fmt == "mxfp4",
                                  HAS_SCALE=False, TOKENS=False, HW_CVT=True, STATS=True, QUANT=True))
    assert r.stack == 0, r.stack
    assert r.count(r"MEMBAR") == 1 and r.count(r"\bATOMG\b") == 1
    assert r.count(r"\bREDG\.E\.MAX") > 0
    assert r.count(r"F2FP\.SATFINITE\.E4M3") > 0
    if fmt == "fp8":
        # the maxima over the finite values cost no compare and select an element
        # (`rows._finite_key`): with them this build had 1424 / 2256 instructions (D = 64 /
        # 128) and ran 1.3x slower on an H100 at D = 128; 1240 / 1864 with the key (Triton 3.6)
        assert len(r.instructions()) <= {64: 1300, 128: 1960}[d], len(r.instructions())


def test_tile_path_drops_only_the_arithmetic_a_full_tile_branches_around():
    """`KernelReport.path`: a loop's forward branch around compares and selects (a
    mask) is left out of a full tile's path; one around a tensor-core instruction (the
    next tile's product, issued on every tile but the last) is kept, as is the loop."""
    from dev.machine_code import KernelReport

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/              @P0 BRA 0x60 ;
        /*0030*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*0040*/                   FSEL R4, R4, -INF , P1 ;
        /*0050*/                   ISETP.GE.AND P2, PT, R2, R5, PT ;
        /*0060*/                   FADD R6, R4, R7 ;
        /*0070*/              @P3 BRA 0x90 ;
        /*0080*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR8], RZ ;
        /*0090*/                   MUFU.EX2 R8, R6 ;
        /*00a0*/              @P4 BRA 0x10 ;
        /*00b0*/                   EXIT ;
    """
    r = KernelReport(registers=32, stack=0, sass=sass)
    assert r.loop_spans() == [(1, 10)]
    assert r.tile_loop()[0].startswith("HGMMA") and len(r.tile_loop()) == 10
    assert [op.split(".")[0] for op in r.tile_path()] == ["HGMMA", "BRA", "FADD", "BRA", "HGMMA", "MUFU", "BRA"]


def test_gluon_tma_descriptors_share_cached_layouts():
    """`gluon_common.tma_descriptor`: the tensor's own shape and strides (a padded view's
    row stride kept), the tile asked for, and the NVMMA shared layout Gluon would build
    for it, built once per tile shape and dtype (the backward's seven descriptors took
    0.16 ms of host time a call when each built its own)."""
    from triton.experimental.gluon import language as gl

    from fp4attn.kernels.hopper.gluon_common import shared_layout, tma_descriptor

    t = torch.zeros(256, 128, dtype=torch.bfloat16)
    d = tma_descriptor(t, [64, 128])
    assert (d.shape, d.strides, d.block_shape) == ([256, 128], [128, 1], [64, 128])
    assert d.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    e = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)[:, :200]  # V^T rows padded to whole key tiles
    d8 = tma_descriptor(e, [128, 64])
    assert (d8.shape, d8.strides) == ([128, 200], [256, 1])
    assert d8.layout == gl.NVMMASharedLayout.get_default_for([128, 64], gl.float8e4nv)
    assert d8.layout is shared_layout((128, 64), torch.float8_e4m3fn) is tma_descriptor(e, [128, 64]).layout
    with pytest.raises(ValueError, match="float16.*Gluon kernels load"):
        tma_descriptor(torch.zeros(64, 64, dtype=torch.float16), [64, 64])


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["forward_ws", "dkdv", "dq", "dkdv_row_scales", "dq_row_scales"])
def test_gluon_kernels_publish_their_mbarriers_before_using_them(kernel):
    """One thread initializes a Gluon kernel's mbarriers, and other threads (and the TMA
    unit) use them: between the last `mbarrier.init` and the first wait, arrival or copy
    on one, the PTX has the proxy fence and a barrier of the program's threads
    (`gluon_common.barriers_ready`); the warp-specialized forward's only sync there was
    its partitions' start (racecheck on the H200: 12 shared-memory hazards between its
    inits and its first waits). Every mbarrier is invalidated before the program ends."""
    import re

    from dev.machine_code import compile_backward_gluon, compile_forward_ws
    from fp4attn.routing import BACKWARD_LAUNCH, forward_launch

    if kernel == "forward_ws":
        ptx = compile_forward_ws(False, 0, True, 128, overlap=forward_launch(128, False, True).ws_overlap).asm["ptx"]
    else:
        cfg = BACKWARD_LAUNCH[128]
        part, _, row_scales = kernel.partition("_")  # (per-token FP8 Q/K scales: ROW_SCALES)
        ptx = compile_backward_gluon(True, 128, cfg.dkdv_in_flight, part=part, staged=cfg.dkdv_staged,
                                     row_scales=bool(row_scales)).asm["ptx"]
    lines = ptx.splitlines()
    inits = [i for i, s in enumerate(lines) if "mbarrier.init" in s]
    uses = [i for i, s in enumerate(lines) if re.search(r"mbarrier\.(try_wait|arrive)|cp\.async\.bulk", s)]
    assert inits and uses and inits[-1] < uses[0]
    between = lines[inits[-1]:uses[0]]
    fence = next(i for i, s in enumerate(between) if "fence.proxy.async.shared::cta" in s)
    assert any(re.match(r"\s*bar\.sync\s+0\b", s) for s in between[fence:]), "\n".join(between)
    assert sum("mbarrier.inval" in s for s in lines) == len(inits)
