"""Hopper forward kernels against the reference of the same recipe.

On a Hopper GPU (`gpu`, run on an H200): the kernel's P codes and block exponents (its
e4m3 P bytes) equal the reference's on at least 99.9% of entries, and its output differs
from the reference by much less than the reference differs from exact attention (fp32
summation order and the bf16 output are the only other differences).

Under the Triton interpreter on the CPU (`interpreter`): indexing across batches, heads
and GQA groups, as test_backward.py checks the backward. The output and LSE of a (B=2, 4
query heads, 2 K/V heads) call equal, bit for bit, those of the same operands cut into
one call per batch and K/V head, with K and V^T by pointer loads and by TMA, PV added by
Triton's promotion and in float32, causal and not, lengths that are and are not whole
tiles, and each kind of P. The interpreter's values are not the GPU's (its bf16 dot and
fp8 casts differ), so the numbers are checked by the GPU tests; these run in CI."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.formats import encode_fp8
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.affine import P_OFFSET_LOG2_LAZY
from fp4attn.reference.encoding import P_OFFSET_LOG2
from fp4attn.reference.masks import causal_offset, key_mask
from fp4attn.routing import ForwardLaunch
from tests.interpreter import CALL_SHAPE, KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")


RECIPES = ["fp8-directp", "directp", "nvfp4-fp8", "fp8", "fp8-directp-fastacc", "fp8-fastacc",
           # the affine builders (P modes 4 and 5)
           "fp8-affine", "fp8-affine-fastacc", "directp-fast", "fp8-directp-fast", "fp8-directp-fast-fastacc",
           "fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc"]
EXACT = [r for r in RECIPES if not PRESETS[r].fast_accum]
P_VARIANTS = [PRESETS["fp8-directp"].with_(p_build="exp2", name="fp8-mxfp4-exp2")]


def _qkv(b, hq, hkv, sq, sk, d):
    # seeded by the shape, so that a failure comes back with the same inputs (unseeded, the
    # tiny shapes, where one flipped P code is a large share of a row, failed in one run
    # and not in others, with nothing to rerun)
    g = torch.Generator(device="cuda").manual_seed(hash((b, hq, hkv, sq, sk, d)) % 2**31)

    def mk(h, s):
        return torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk)


def _check(q, k, v, recipe, causal=None, attn_mask=None):
    from fp4attn.kernels.hopper.forward_op import hopper_attention, key_bias_of_mask

    scale = q.shape[-1] ** -0.5
    offset = causal_offset(causal, q.shape[-2], k.shape[-2])
    key_bias = None if attn_mask is None else key_bias_of_mask(attn_mask, q.shape[0], k.shape[-2])
    out, lse, p_bytes = hopper_attention(q, k, v, recipe, scale=scale, causal_offset=offset, write_p=1,
                                         key_bias=key_bias)
    ref = reference_forward(q, k, v, recipe, scale=scale, causal=causal, attn_mask=attn_mask, return_p=True)
    sq = q.shape[-2]
    # the lazy form's bytes stand for P times 2**5 (reference/affine.P_OFFSET_LOG2_LAZY)
    offset = P_OFFSET_LOG2_LAZY if recipe.rescale == "lazy" else P_OFFSET_LOG2
    want = encode_fp8(ref.p * 2.0**offset, "e4m3").view(torch.uint8)
    got = encode_fp8(p_bytes[..., :sq, :], "e4m3").view(torch.uint8)
    identical = (got == want).float().mean().item()
    # fast_accum's scores are the fp8 wgmma's own sums over the head dim, not float32,
    # and FP8 P has a rounding midpoint every 1/8 octave: measured 99.55-99.76% identical
    # for `fp8-fastacc` on sharp scores (99.86-99.89% when promoted every 32 products),
    # 99.96-99.98% for `fp8-directp-fastacc`, >= 99.9% for every other recipe
    # (benchmarks/results/log/h200-forward-fastacc.txt). A tile of a dozen codes cannot show a fraction: there
    # one flipped code is allowed (fp8-fastacc at Sq=1, Sk=3 flipped 1 of 12 in one run)
    # The affine map's MXFP4 codes on fast-accumulation sums: 99.76-99.89% (a threshold every
    # half unit of the log-score; benchmarks/results/log/h200-gpu-tests-affine.log)
    min_identical = 0.99 if recipe.fast_accum and (recipe.p == "fp8" or recipe.p_build == "affine") else 0.999
    flipped = int((got != want).sum())
    assert identical >= min_identical or flipped <= 1, f"{recipe.name}: P bytes identical {identical:.6f}"
    bias = torch.zeros(q.shape[-2], k.shape[-2], device="cuda", dtype=torch.float64)
    if causal is not None:
        bias = bias.masked_fill(~_mask(q.shape[-2], k.shape[-2], offset), float("-inf"))
    if attn_mask is not None:  # SDPA's semantics: False hides a key, a float is added
        bias = bias.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else bias + attn_mask
    exact = F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1),
        v.double().repeat_interleave(q.shape[1] // k.shape[1], 1), attn_mask=bias)
    seen = torch.isfinite(ref.lse)
    ref_err = error_metrics(ref.out[seen], exact[seen])["rel_l2"]
    ker_err = error_metrics(out.float()[seen], ref.out[seen])["rel_l2"]
    # the kernel's error to its reference within a tenth of the reference's own error;
    # fast_accum is not its reference's sums (above), and on a row of three keys one
    # flipped P code moved the output by 0.24 of the format's error (fp8-fastacc, Sq=1,
    # Sk=3, D=128: 8.3e-3 against 3.5e-2)
    share = 0.3 if recipe.fast_accum else 0.1
    assert ker_err <= share * ref_err + 4e-3, (recipe.name, ker_err, ref_err)
    assert torch.equal(torch.isfinite(lse), seen)
    # a flipped P code moves a row's l by up to one E2M1 step of one key: bound the mean
    dl = (lse[seen] - ref.lse[seen]).abs()
    assert dl.mean().item() < 2e-3 and dl.max().item() < 0.25, (dl.mean().item(), dl.max().item())
    assert bool((out.float()[~seen] == 0).all())
    return identical


def _mask(sq, sk, offset):
    return key_mask(offset, torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda"), sk)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 3), (113, 239), (1023, 1023), (256, 4096)])
def test_kernel_matches_reference(recipe, d, sq, sk):
    q, k, v = _qkv(2, 4, 4, sq, sk, d)
    _check(q, k, v, PRESETS[recipe])


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES + P_VARIANTS, ids=str)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk,d", [(1023, 1023, 128), (113, 500, 128), (500, 113, 128), (113, 500, 64)])
def test_kernel_causal_gqa(recipe, causal, sq, sk, d):
    q, k, v = _qkv(1, 6, 2, sq, sk, d)
    r = PRESETS[recipe] if isinstance(recipe, str) else recipe
    _check(q, k, v, r, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", EXACT)
@pytest.mark.parametrize("d", [32, 48, 96])
def test_kernel_padded_head_dims(recipe, d):
    """Head dims below 64 / 128 run zero-padded: as close to the reference at the
    original head dim as the kernel is at its own (padding is exact)."""
    q, k, v = _qkv(2, 4, 2, 300, 300, d)
    for causal in (False, True):
        out, lse = fp4attn.attention(q, k, v, recipe=recipe, causal=causal, enable_gqa=True, return_lse=True,
                                     backend="triton")
        assert out.shape == q.shape
        ref = reference_forward(q, k, v, PRESETS[recipe], scale=d**-0.5, causal="top_left" if causal else None)
        g = q.shape[1] // k.shape[1]
        exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                               v.double().repeat_interleave(g, 1), is_causal=causal)
        ref_err = error_metrics(ref.out, exact)["rel_l2"]
        assert error_metrics(out.float(), ref.out)["rel_l2"] <= 0.1 * ref_err + 4e-3
        assert (lse - ref.lse).abs().mean().item() < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "nvfp4-fp8"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("hw_cvt", [0, 1])
def test_kernel_fp8_p_rounding_variants(recipe, causal, hw_cvt, launch):
    """FP8 P rounded by the packed hardware conversion (p_hw_cvt=1, routed) and by the
    float32 bit arithmetic (0, the formulation the interpreter tests run) both
    reproduce the reference."""
    launch(forward=ForwardLaunch(64, 4, 2, bool(hw_cvt)))
    for sq, sk, d in ((113, 239, 128), (1023, 1023, 64), (256, 4096, 128)):
        q, k, v = _qkv(2, 4, 2, sq, sk, d)
        _check(q, k, v, PRESETS[recipe], causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_kernel_error_does_not_grow_with_row_length(recipe):
    """Each tile's PV is added into O in float32: the distance to the reference stays
    about that of a short row at 32768 keys, and O is not scaled down (accumulated on the
    fp8 tensor cores across tiles instead, the error grew 2-3x by 32768 keys and O came
    out 0.07% small; promoted, the sums inside a tile still leave it about 0.007% small).
    The error's growth is checked where the kernel's codes are the reference's: with
    fast_accum a row's code flips follow its score distribution, which changes with its
    length (`fp8-directp-fastacc` measured 3.8e-3 -> 6.4e-3), so there the O scale is
    the check."""
    # fast_accum's unpromoted QK^T sums bias the scores themselves: O's scale measured
    # 1.0-2.1e-4 from the reference's at every length (fp8-directp-fastacc, whose E2M1
    # steps are coarse, the most), against 7e-4 at 32768 keys for O summed across tiles
    # on the tensor cores, the failure this check exists for
    scale_tol = 4e-4 if PRESETS[recipe].fast_accum else 2e-4
    # the affine E2M1 map on fast-accumulation sums flips more codes (a threshold every half
    # unit of the log-score): O's scale measured 4.9e-4 off at 1024 keys; there the check is
    # that it does not grow with the row (the failure above grows)
    affine_fast = PRESETS[recipe].fast_accum and PRESETS[recipe].p_build == "affine" and PRESETS[recipe].p == "mxfp4"
    errs, scales = [], []
    for sk in (1024, 32768):
        q, k, v = _qkv(1, 2, 2, 256, sk, 128)
        out = fp4attn.attention(q, k, v, recipe=recipe, backend="triton").float()
        ref = fp4attn.attention(q, k, v, recipe=recipe, backend="reference").float()
        errs.append(error_metrics(out, ref)["rel_l2"])
        scales.append(abs((out * ref).sum().item() / (ref * ref).sum().item() - 1))
        assert scales[-1] < (1e-3 if affine_fast else scale_tol), (recipe, sk, scales[-1])
    if affine_fast:
        assert scales[1] <= scales[0] + 2e-4, (recipe, scales)
    # + 5e-4: directp and fp8-directp match their references all but exactly (measured
    # 2e-9 .. 2e-5 at 1024 keys, 3e-5 .. 1.3e-4 at 32768: Direct-P codes flipped by the
    # float32 summation order); the growth this test exists for was 1.8e-3 -> 5.2e-3
    # The affine E2M1 map (a threshold every half unit) flips more: fp8-directp-fast 0 at
    # 1024 keys and 5.1e-4 at 32768 in one run (tests/ at b29a355)
    if not PRESETS[recipe].fast_accum:
        assert errs[1] <= 1.5 * errs[0] + (1e-3 if PRESETS[recipe].p_build == "affine" else 5e-4), (recipe, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_kernel_tma_loads(recipe, causal, launch):
    """K and V^T tiles by TMA (tma_kv): a tail tile's rows past Sk are the next head's
    keys (or zeros past the tensor), which the mask must hide; GQA and both head dims."""
    launch(forward=ForwardLaunch(64, 4, 2, True, tma_kv=True))
    for b, hq, hkv, sq, sk, d in ((2, 4, 2, 113, 239, 128), (1, 6, 2, 1023, 1023, 64), (2, 2, 2, 1, 3, 128),
                                  (1, 2, 1, 256, 4096, 128)):
        q, k, v = _qkv(b, hq, hkv, sq, sk, d)
        _check(q, k, v, PRESETS[recipe], causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", EXACT)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_kernel_key_masks(recipe, kind):
    """Key-padding masks in the kernel: same P codes as the reference with the mask, a
    batch element with no visible key gives 0 and LSE -inf."""
    q, k, v = _qkv(3, 4, 2, 200, 300, 128)
    lengths = torch.tensor([300, 130, 0], device="cuda")
    pad = torch.arange(300, device="cuda")[None, :] < lengths[:, None]
    mask = pad[:, None, None, :]
    if kind == "float":  # additive: padding at -inf, a soft bias elsewhere
        bias = torch.randn(3, 1, 1, 300, device="cuda")
        mask = bias.masked_fill(~mask, float("-inf"))
    for causal in (None, "bottom_right"):
        _check(q, k, v, PRESETS[recipe], causal=causal, attn_mask=mask)


@pytest.mark.gpu
def test_kernel_extreme_logits():
    q, k, v = _qkv(1, 2, 2, 256, 1024, 128)
    q, k = q * 14, k * 14
    k[..., :768, :] *= 0.01
    for name in RECIPES:
        out = fp4attn.attention(q, k, v, recipe=name, backend="triton")
        ref = fp4attn.attention(q, k, v, recipe=name, backend="reference")
        assert bool(torch.isfinite(out).all())
        assert error_metrics(out, ref)["cos"] > 0.999


@pytest.mark.gpu
def test_kernel_nan_propagates():
    q, k, v = _qkv(1, 1, 1, 64, 256, 64)
    v[0, 0, 7, 3] = float("nan")
    for name in RECIPES:
        assert bool(torch.isnan(fp4attn.attention(q, k, v, recipe=name, backend="triton")).any())


@pytest.mark.gpu
def test_auto_backend_uses_kernel_and_dtype():
    q, k, v = _qkv(1, 2, 2, 128, 128, 128)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = fp4attn.attention(q.to(dtype), k.to(dtype), v.to(dtype), recipe="fp8")
        assert out.dtype == dtype
    with pytest.raises(ValueError, match="head_dim 144"):
        big = torch.randn(1, 2, 128, 144, device="cuda", dtype=torch.bfloat16)
        fp4attn.attention(big, big, big, recipe="fp8", backend="triton")
    with pytest.raises(ValueError, match="cannot run recipe 'bf16'"):
        fp4attn.attention(q, k, v, recipe="bf16", backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-directp", "fp8"])  # the Triton kernel, the warp-specialized Gluon one
def test_torch_compile_traces_the_kernel_op(recipe):
    q, k, v = _qkv(1, 2, 2, 256, 256, 128)
    f = torch.compile(lambda a, b, c: fp4attn.attention(a, b, c, recipe=recipe, backend="triton"),
                      fullgraph=False)
    torch.testing.assert_close(f(q, k, v), fp4attn.attention(q, k, v, recipe=recipe, backend="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "fp8", "directp", "fp8-fastacc"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overlap", [1, 4])
def test_warp_specialized_kernel_equals_triton_kernel(recipe, causal, overlap, launch, monkeypatch):
    """The warp-specialized Gluon forward computes the Triton kernel's arithmetic with
    each tile's PV added into O in float32 (pv_add): same outputs and LSE, bit for bit,
    with either OVERLAP, on awkward shapes and GQA, for e4m3 Q/K on the FP8
    tensor cores too (both sum QK^T without promotion); and `launch_forward` routes
    the recipes its launch table marks to it with the same result (the CUDA C++ kernel,
    which takes `fp8-fastacc` from `cuda_from_keys` keys with its own softmax, is held to
    the recipe in tests/kernels/hopper/test_forward_cuda.py)."""
    from fp4attn import routing
    from fp4attn.kernels.hopper.forward_gluon_ws import launch_forward_ws
    from fp4attn.routing import P_MODES

    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: "not here")
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused

    r = PRESETS[recipe]
    for b, hq, hkv, sq, sk, d in ((1, 2, 2, 1, 3, 128), (2, 4, 2, 113, 239, 128), (1, 3, 1, 1023, 1023, 64),
                                  (1, 2, 1, 300, 200, 128), (1, 2, 2, 256, 4096, 128)):
        q, k, v = _qkv(b, hq, hkv, sq, sk, d)
        ops = prepare_operands_fused(q * 2, k * 2, v, r)
        kw = dict(scale=d**-0.5, causal_offset=(sk - sq) if causal else None, p_mode=P_MODES[(r.p, r.p_build)])
        launch(forward=ForwardLaunch(64, 4, 2, True, tma_kv=True, pv_add=True))  # the Triton kernel
        out, lse = launch_forward(ops, **kw)[:2]
        out2, lse2 = launch_forward_ws(ops, **kw, overlap=overlap)
        assert torch.isfinite(out2).all()
        assert torch.equal(out, out2) and torch.equal(lse, lse2), (recipe, sq, sk, d)
        launch.clear()
        if d == 128:  # the default launch: the Gluon kernel where routed, pv_add in either kernel
            out3, lse3 = launch_forward(ops, **kw)[:2]
            assert torch.equal(out, out3) and torch.equal(lse, lse3), (recipe, sq, sk, d)


# Under the Triton interpreter (CPU): each program reads its own batch and heads; the
# recipe's numbers on the interpreter's arithmetic
SCRIPT = KERNEL_PATCHES + CALL_SHAPE + textwrap.dedent('''
    import dataclasses

    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import BLOCK_N, prepare_operands_fused
    from fp4attn.kernels.quantize.v_operand import quantize_v_t
    from fp4attn.recipes import PRESETS
    from fp4attn.routing import P_MODES, ForwardLaunch, override_launch

    # the Triton kernel with pointer loads, and with TMA and PV added in float32 (the
    # formulations the interpreter runs: e4m3 by bit arithmetic, no Gluon), taking turns
    # over the cases so that each meets both head dims and both maskings; the Q/K forms
    # (bf16 values of NVFP4 or FP8, e4m3 for fast accumulation) and P's (FP8, Direct-P)
    LAUNCHES = (ForwardLaunch(64, 4, 2), ForwardLaunch(64, 4, 2, tma_kv=True, pv_add=True))

    for i, (recipe, D, sq, sk, causal) in enumerate((
            ("fp8", 64, 128, 256, True), ("nvfp4-fp8", 128, 100, 200, False), ("directp", 128, 128, 128, True),
            ("fp8-fastacc", 64, 128, 130, True))):
        r = PRESETS[recipe]
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        ops = prepare_operands_fused(q, k, v, r)
        if ops.q.dtype == torch.bfloat16:  # the interpreter's bf16 dot is wrong; float32 holds the same values
            ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())
        for launch in LAUNCHES[i % 2:i % 2 + 1]:
            def run(o):
                with override_launch(forward=launch):
                    return launch_forward(o, scale=D**-0.5, causal_offset=sk - sq if causal else None,
                                          p_mode=P_MODES[(r.p, r.p_build)])[:2]
            out, lse = run(ops)
            assert bool(torch.isfinite(out.float()).all()), (recipe, launch)
            for b in range(B):
                for h in range(HKV):
                    hq = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
                    # V^T quantized per head gives the same values, in rows padded as the kernel reads them
                    vt, vs = quantize_v_t(v[b:b + 1, h:h + 1], r.v, pad_keys_to=BLOCK_N)
                    part = dataclasses.replace(
                        ops, q=ops.q[b:b + 1, hq].contiguous(), qs=ops.qs[b:b + 1, hq].contiguous(),
                        k=ops.k[b:b + 1, h:h + 1].contiguous(), ks=ops.ks[b:b + 1, h:h + 1].contiguous(),
                        vt=vt, vs=vs)
                    assert equal(vt.float(), ops.vt[b:b + 1, h:h + 1].float()), (recipe, "V^T per head")
                    o, l = run(part)
                    assert equal(out[b:b + 1, hq].float(), o.float()), (recipe, launch, "out", b, h)
                    assert equal(lse[b:b + 1, hq], l), (recipe, launch, "lse", b, h)
    print("ok")
''')


@pytest.mark.interpreter
def test_forward_programs_read_their_own_batch_and_heads():
    run_under_interpreter(SCRIPT)


NUMERICS = KERNEL_PATCHES + textwrap.dedent('''
    import dataclasses
    import os
    import torch
    from fp4attn.routing import p_mode as p_mode_of
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import ForwardLaunch, override_launch

    # the Triton kernel with pointer loads, and with TMA and PV added in float32 (the
    # formulations the interpreter runs: e4m3 by bit arithmetic, no Gluon)
    LAUNCHES = (ForwardLaunch(64, 4, 2), ForwardLaunch(64, 4, 2, tma_kv=True, pv_add=True))
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.metrics import error_metrics
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(0)
    for launch in LAUNCHES:
        for name, D, sq, sk, causal in (("fp8", 64, 128, 256, "top_left"), ("nvfp4-fp8", 128, 100, 200, None),
                                        ("fp8-directp", 64, 64, 256, None),
                                        ("directp", 128, 128, 128, "bottom_right"),
                                        ("fp8-fastacc", 64, 128, 130, "top_left"),
                                        # the affine builders (P modes 4 and 5)
                                        ("fp8-affine", 128, 100, 200, "bottom_right"),
                                        ("fp8-ktile-affine-fastacc", 64, 128, 300, None),
                                        ("fp8-ktile-affine-lazy-fastacc", 64, 100, 400, "bottom_right"),
                                        ("directp-fast", 64, 128, 256, None)):
            r = PRESETS[name]
            q = torch.randn(1, 2, sq, D, generator=g).bfloat16()
            k, v = (torch.randn(1, 1, sk, D, generator=g).bfloat16() for _ in range(2))
            # the interpreter sums the e4m3 products in float32: the exact form's numbers
            exact = dataclasses.replace(r, fast_accum=False)
            ref = reference_forward(q, k, v, exact, scale=D**-0.5, causal=causal)
            ops = prepare_operands_fused(q, k, v, r)
            if ops.q.dtype == torch.bfloat16:
                ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())
            with override_launch(forward=launch):
                out, lse = launch_forward(ops, scale=D**-0.5, causal_offset=causal_offset(causal, sq, sk),
                                          p_mode=p_mode_of(r))[:2]
            seen = torch.isfinite(ref.lse)
            assert torch.equal(seen, torch.isfinite(lse)), (launch, name)
            lse_err = (lse[seen] - ref.lse[seen]).abs()
            out_err = error_metrics(out.float(), ref.out)["rel_l2"]
            # measured: every row within 1.4e-6, output 3.3e-3. A score that float32
            # summation order moves across a rounding threshold of P changes one code
            # and its row's LSE by up to about 0.1: a few such rows are allowed
            close = float((lse_err < 1e-5).float().mean())
            worst = float(lse_err.max())
            assert close > 0.99 and worst < 0.2 and out_err < 2e-2, (launch, name, close, worst, out_err)
    print("ok")
''')


@pytest.mark.interpreter
def test_forward_matches_reference_under_the_interpreter():
    """The kernel's LSE and output against the reference forward of the same recipe, on
    the CPU: with FP8 P rounded on the float32 bits (`p_hw_cvt` 0) and the bf16 Q/K
    values handed over as float32, the interpreter computes the recipe's own P, so the
    LSE (the consistent row sums of P) agrees within 1.4e-6 on every row (bounds leave
    room for a code moved by summation order). The output is stored in bf16, which the
    interpreter rounds its own way (3.3e-3 relative to the float32 reference). A wrong
    scale, mask or tile bound shows at once."""
    run_under_interpreter(NUMERICS)
