"""Hopper training kernels (forward that keeps the quantized operands, backward) against
the reference backward of the same recipe.

On a Hopper GPU (`gpu`, run on an H200): `train` and `train-mxfp4pv` (NVFP4 Q/K),
`train-fp8` (per-token FP8 Q/K) and `train-affine`. With the kernel's own forward output
and LSE fed to the reference backward, the kernel's dQ, dK, dV differ from the
reference's by much less than the reference differs from exact float64 gradients (P
codes at rounding thresholds, fp32 summation order and the FP8 tensor cores'
accumulation are the only differences).

Under the Triton interpreter on the CPU (`interpreter`): indexing across batches, heads
and GQA groups. Each program reads only its own batch, head and rows, so the gradients
of a (B=2, 4 query heads, 2 K/V heads) call equal, bit for bit, those of the same
operands cut into one call per batch and K/V head; a kernel that reads another batch's
or head's rows (as a scale once shadowing the batch index did) breaks that. Run for
pointer loads and TMA descriptors, causal and not, lengths that are and are not whole
tiles, both head dims, FP8 and MXFP4 (Direct-P) P, and NVFP4 (a scale per head) and
per-token FP8 Q/K (a scale per query and per key). The interpreter's values are not the
GPU's (its bf16 dot and fp8 casts differ), so the numbers are checked by the GPU tests;
these run in CI."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.backward import reference_backward
from fp4attn.reference.forward import ForwardResult
from fp4attn.reference.masks import causal_offset, key_mask
from tests.interpreter import CALL_SHAPE, KERNEL_PATCHES, run_under_interpreter
from tests.interpreter_blackwell import BLACKWELL_PATCHES

pytest.importorskip("triton")


# train-fp8: per-token FP8 Q/K, its backward on the kernels' ROW_SCALES form (the Gluon
# kernels where the lengths are whole tiles, as train's: routing.GLUON_BACKWARD_QK)
# train-affine: P by the trained affine map (P mode 6), forward and backward on the Triton kernels
RECIPES = ["train", "train-mxfp4pv", "train-fp8", "train-affine"]


def _inputs(b, hq, hkv, sq, sk, d, dtype=torch.bfloat16):
    def mk(h, s):
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk)


def _exact_grads(q, k, v, dout, causal):
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    sq, sk = q.shape[-2], k.shape[-2]
    mask = None
    if causal is not None:
        mask = key_mask(causal_offset(causal, sq, sk), torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda"),
                        sk)
    out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1), attn_mask=mask)
    # rows that see no key: SDPA gives NaN, fp4attn 0 with zero gradients
    out = torch.nan_to_num(out)
    out.backward(dout.double())
    return [torch.nan_to_num(t.grad) for t in (qd, kd, vd)]


def _check(recipe_name, b, hq, hkv, sq, sk, d, causal=None):
    recipe = PRESETS[recipe_name]
    q, k, v = _inputs(b, hq, hkv, sq, sk, d)
    out, lse = fp4attn.attention(q, k, v, recipe=recipe, causal=causal or False, enable_gqa=hq != hkv,
                                 return_lse=True, backend="triton")
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [t.grad for t in (q, k, v)]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in got)
    scale = d**-0.5
    ref = reference_forward(q.detach(), k.detach(), v.detach(), recipe, scale=scale, causal=causal)
    fwd = ForwardResult(out.detach().float(), lse.detach(), ref.q, ref.k, ref.v)
    want = reference_backward(fwd, out.detach(), dout, recipe, scale=scale, causal=causal)
    exact = _exact_grads(q, k, v, dout, causal)
    for name, g, w, e in zip("qkv", got, want, exact):
        ref_err = error_metrics(w, e)["rel_l2"]
        ker_err = error_metrics(g.float(), w)["rel_l2"]
        assert ker_err <= 0.1 * ref_err + 5e-3, (recipe_name, f"d{name}", ker_err, ref_err)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 3), (113, 239), (1023, 1023), (256, 1024)])
def test_backward_matches_reference(recipe, d, sq, sk):
    _check(recipe, 2, 4, 4, sq, sk, d)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1023, 1023), (113, 500), (500, 113)])
def test_backward_causal_gqa(recipe, causal, sq, sk):
    _check(recipe, 1, 6, 2, sq, sk, 128, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tma", [False, True])
def test_backward_tile_loads(recipe, d, tma, monkeypatch):
    """The loops' operand tiles by TMA and by pointer loads both match the reference:
    whole tiles (TMA where enabled), causal with GQA, and lengths that are not whole
    tiles (pointer loads whatever the config says). A NaN in one head's dO reaches that
    head's gradients and no other head's: no tile reads across heads."""
    import dataclasses

    from fp4attn import routing

    monkeypatch.setitem(routing.BACKWARD_LAUNCH, d, dataclasses.replace(routing.BACKWARD_LAUNCH[d], tma=tma))
    for b, hq, hkv, sq, sk, causal in ((2, 2, 2, 256, 1024, None), (1, 6, 2, 1024, 1024, "top_left"),
                                       (1, 4, 2, 512, 320, "bottom_right"), (1, 2, 2, 113, 239, None)):
        _check(recipe, b, hq, hkv, sq, sk, d, causal=causal)
    q, k, v = _inputs(1, 3, 3, 256, 256, d)
    dout = torch.randn(1, 3, 256, d, device="cuda", dtype=torch.bfloat16)
    dout[0, 1, 70, 5] = float("nan")
    out = fp4attn.attention(q, k, v, recipe=recipe, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g in grads:
        assert bool(torch.isnan(g[0, 1]).any())
        assert bool(torch.isfinite(g[0, [0, 2]]).all())


def _train_grads(q, k, v, dout, causal_offset, recipe="train"):
    """dq, dk, dv of `recipe` (`train`: NVFP4 Q/K; `train-fp8`: per-token FP8 Q/K, its
    own ops) through the two custom ops (causal_offset None: non-causal)."""
    import fp4attn.kernels.hopper.train_op  # noqa: F401  (registers the ops)

    r = PRESETS[recipe]
    ops = torch.ops.fp4attn
    forward, backward = ((ops.hopper_train_forward_fp8, ops.hopper_train_backward_fp8) if r.qk == "fp8" else
                         (ops.hopper_train_forward, ops.hopper_train_backward))
    off, causal, scale = causal_offset or 0, causal_offset is not None, q.shape[-1] ** -0.5
    saved = forward(q, k, v, r.qk, r.p, r.p_build, r.v, off, causal, scale)
    return backward(dout, *saved, r.p, r.p_build, off, causal, scale, *[torch.bfloat16] * 3)


# NVFP4 Q/K (a scale per head) and per-token FP8 Q/K (ROW_SCALES: a scale per query and per key)
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
@pytest.mark.parametrize("d", [64, 128])
# the routed D=128 and D=64 forms, and the numbers by asynchronous copies (STAGED 2)
@pytest.mark.parametrize("in_flight,staged", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pipelined_backward_equals_triton_kernels(recipe, d, in_flight, staged, monkeypatch):
    """The Gluon dK/dV and dQ kernels do the Triton kernels' arithmetic operation for
    operation, on the same tensor-core sums: dQ, dK and dV equal bit for bit,
    non-causal and causal from either corner (query blocks that see no key included),
    GQA, Sq != Sk; they match the reference as the Triton kernels do; a NaN in one
    head's dO stays in that head. For NVFP4 Q/K and, through both kernels' ROW_SCALES
    form, per-token FP8 Q/K (`train-fp8`: each tile's query scales from its own query
    head under GQA)."""
    import dataclasses

    from fp4attn import routing
    from fp4attn.kernels.hopper import backward_gluon

    triton_cfg = dataclasses.replace(routing.BACKWARD_LAUNCH[d], dkdv_gluon=False, dq_gluon=False, tma=True)
    gluon_cfg = dataclasses.replace(triton_cfg, dkdv_gluon=True, dq_gluon=True, dkdv_in_flight=in_flight,
                                    dkdv_staged=staged)
    # which Gluon kernels ran, in which scale form (so that neither side is the Triton kernels twice)
    launched = []
    for part in ("dkdv", "dq"):
        launch = getattr(backward_gluon, f"launch_{part}_gluon")
        monkeypatch.setattr(backward_gluon, f"launch_{part}_gluon", lambda *a, _part=part, _launch=launch, **kw:
                            launched.append((_part, kw.get("row_scales", False))) or _launch(*a, **kw))
    for b, hq, hkv, sq, sk, off in ((1, 2, 2, 128, 128, None), (2, 4, 2, 256, 192, 192 - 256), (1, 6, 2, 512, 512, 0),
                                    (1, 3, 3, 64, 320, None), (1, 2, 1, 1024, 1024, 0), (1, 2, 2, 192, 512, 320)):
        q, k, v = _inputs(b, hq, hkv, sq, sk, d)
        dout = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        grads = []
        for cfg in (triton_cfg, gluon_cfg):
            monkeypatch.setitem(routing.BACKWARD_LAUNCH, d, cfg)
            launched.clear()
            grads.append(_train_grads(q, k, v, dout, off, recipe))
        row_scales = recipe == "train-fp8"
        assert launched == [("dkdv", row_scales), ("dq", row_scales)], (recipe, launched)  # (the second run's)
        for name, t, g in zip("qkv", *grads):
            assert bool(torch.isfinite(g).all()), (recipe, name, b, hq, hkv, sq, sk, off)
            diff = float((t.float() - g.float()).abs().max().detach())
            assert torch.equal(t.view(torch.int16), g.view(torch.int16)), (recipe, f"d{name}", b, hq, hkv, sq, sk,
                                                                           off, diff)
    for b, hq, hkv, sq, sk, causal in ((2, 2, 2, 256, 1024, None), (1, 6, 2, 1024, 1024, "top_left"),
                                       (1, 4, 2, 512, 320, "bottom_right")):
        _check(recipe, b, hq, hkv, sq, sk, d, causal=causal)
    q, k, v = _inputs(1, 3, 3, 256, 256, d)
    dout = torch.randn(1, 3, 256, d, device="cuda", dtype=torch.bfloat16)
    dout[0, 1, 70, 5] = float("nan")
    for g in _train_grads(q, k, v, dout, 0, recipe):
        assert bool(torch.isnan(g[0, 1]).any())
        assert bool(torch.isfinite(g[0, [0, 2]]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [32, 96])
def test_backward_padded_head_dims(recipe, d):
    _check(recipe, 2, 4, 2, 300, 300, d, causal="top_left")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
def test_backward_is_deterministic_and_float_dtypes(recipe):
    for dtype in (torch.float16, torch.float32):
        q, k, v = _inputs(1, 4, 2, 300, 300, 64, dtype)
        grads = []
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            fp4attn.attention(q, k, v, recipe=recipe, causal=True, enable_gqa=True, backend="triton").sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
        assert all(g.dtype == dtype and bool(torch.isfinite(g).all()) for g in grads[0])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.gpu
def test_backward_peaked_attention_stays_finite():
    """Sharp attention makes whole dS tiles tiny (P underflows): their FP8 scales must
    not overflow into NaN (formats.constants.FP8_MIN_AMAX)."""
    q, k, v = _inputs(1, 2, 2, 512, 512, 64)
    with torch.no_grad():
        q *= 6.0
        k *= 6.0
    for recipe in RECIPES:
        out = fp4attn.attention(q, k, v, recipe=recipe, causal=True, backend="triton")
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert all(bool(torch.isfinite(g).all()) for g in grads), recipe


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
def test_backward_nan_propagates(recipe):
    q, k, v = _inputs(1, 1, 1, 64, 256, 64)
    with torch.no_grad():
        v[0, 0, 7, 3] = float("nan")
    fp4attn.attention(q, k, v, recipe=recipe, backend="triton").sum().backward()
    assert bool(torch.isnan(q.grad).any())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
def test_auto_backend_trains_on_the_kernels(recipe, monkeypatch):
    from fp4attn.kernels.hopper import train_op

    calls = []
    launch = train_op.launch_backward
    monkeypatch.setattr(train_op, "launch_backward", lambda *a: calls.append(a[0].row_scales) or launch(*a))
    q, k, v = _inputs(1, 2, 2, 128, 128, 128)
    fp4attn.attention(q, k, v, recipe=recipe, causal=True).sum().backward()
    assert calls == [recipe == "train-fp8"]  # per-token Q/K scales for FP8 Q/K
    out = fp4attn.attention(q, k, v, recipe="fp8", backend="triton")  # an inference recipe: its forward kernels
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
def test_torch_compile_and_checkpoint_through_the_kernels(recipe):
    q, k, v = _inputs(1, 2, 2, 256, 256, 128)

    def f(a, b, c):
        return fp4attn.attention(a, b, c, recipe=recipe, causal=True, backend="triton")

    eager = torch.autograd.grad(f(q, k, v).square().sum(), (q, k, v))
    compiled = torch.compile(f)
    comp = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    ckpt = torch.autograd.grad(
        torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=False).square().sum(), (q, k, v))
    for a, b, c in zip(eager, comp, ckpt):
        torch.testing.assert_close(a, b)
        assert torch.equal(a, c)


# Under the Triton interpreter (CPU): each program reads its own batch and heads; the
# recipes' gradients and training steps on the interpreter's arithmetic
SCRIPT = KERNEL_PATCHES + CALL_SHAPE + textwrap.dedent('''
    import dataclasses

    from fp4attn import routing
    from fp4attn.kernels.hopper import train_op

    kv_names = ("k", "ks", "v_t", "v_ts", "k_c", "k_cs")  # the operands of the K/V heads
    fp8, mxfp4 = ("fp8", "exp2", "fp8"), ("mxfp4", "directp", "mxfp4")  # train, train-mxfp4pv
    for i, (qk, D, sq, sk, causal, cfg, (p, p_build, v_fmt)) in enumerate((
            ("nvfp4", 64, 128, 128, True, {}, fp8), ("nvfp4", 64, 128, 192, False, {}, fp8),
            ("nvfp4", 64, 100, 76, True, {}, fp8), ("nvfp4", 128, 128, 128, True, {}, fp8),
            ("nvfp4", 128, 128, 128, True, {}, mxfp4),
            # train-fp8: a scale per query and per key (ROW_SCALES; its numerics at both head
            # dims in test_backward_matches_reference_under_the_interpreter)
            ("fp8", 64, 128, 192, True, {}, fp8))):
        # loads by pointer and by TMA (whole 64-token tiles only), taking turns over the cases
        tma = i % 2 == 1
        # the Triton kernels (the Gluon ones do not run under the interpreter; a GPU
        # test holds them to the Triton ones bit for bit)
        routing.BACKWARD_LAUNCH[D] = dataclasses.replace(routing.BACKWARD_LAUNCH[D], tma=tma,
                                                         dkdv_gluon=False, dq_gluon=False, **cfg)
        q, dout, out = (torch.randn(B, HQ, sq, D, generator=g).bfloat16() for _ in range(3))
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        # values in float32: the interpreter's bf16 dot is wrong, float32 holds them
        if qk == "fp8":
            _, saved = train_op.quantize_for_training_fp8(q, k, v, v_fmt)
            ops = train_op.backward_operands_fp8(dout, out, *saved, values_dtype=torch.float32)
            qd, kd = ops.q * ops.qs[..., None], ops.k * ops.ks[..., None]  # a scale per token
        else:
            _, saved = train_op.quantize_for_training(q, k, v, v_fmt)
            ops = train_op.backward_operands(dout, out, *saved, values_dtype=torch.float32)
            qd, kd = ops.q * ops.qs[..., None, None], ops.k * ops.ks[..., None, None]  # a tensor scale per head
        s = qd @ kd.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) * D**-0.5
        if causal:
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
        lse = torch.logsumexp(s, -1)  # the LSE a forward would have saved

        def grads(bs, gs):
            # the operands of batch entries bs and K/V heads gs (their query heads hq)
            hq = slice(gs.start * HQ // HKV, gs.stop * HQ // HKV)
            heads = {name: t[bs, gs if name in kv_names else hq].contiguous() for name, t in ops._asdict().items()}
            return train_op.launch_backward(train_op.BackwardOperands(**heads), lse[bs, hq].contiguous(), p,
                                            p_build, sk - sq, causal, D**-0.5, (torch.float32,) * 3)

        whole = grads(slice(0, B), slice(0, HKV))
        assert all(bool(torch.isfinite(t).all()) and bool(t.abs().sum() > 0) for t in whole), (D, sq, sk)
        for b in range(B):
            for h in range(HKV):
                part = grads(slice(b, b + 1), slice(h, h + 1))
                hq = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
                for name, w, got in zip(("dq", "dk", "dv"), whole, part):
                    sub = w[b:b + 1, hq] if name == "dq" else w[b:b + 1, h:h + 1]
                    assert equal(sub, got), (qk, D, sq, sk, causal, cfg, p, tma, name, b, h)
    print("ok")
''')


@pytest.mark.interpreter
def test_backward_programs_read_their_own_batch_and_heads():
    run_under_interpreter(SCRIPT)


NUMERICS = KERNEL_PATCHES + textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn import routing
    from fp4attn.kernels.hopper import train_op
    from fp4attn.metrics import error_metrics
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.backward import reference_backward
    from fp4attn.reference.masks import causal_offset

    # per-token FP8 Q/K with Direct-P MXFP4 P/V: not a preset, trained on the same kernels
    fp8_mxfp4 = PRESETS["train-fp8"].with_(p="mxfp4", v="mxfp4", p_build="directp")
    g = torch.Generator().manual_seed(0)
    for name, D, sq, sk, causal, tma in (("train", 64, 128, 128, "top_left", True),
                                         ("train-mxfp4pv", 64, 100, 192, None, False),
                                         ("train", 128, 128, 64, "bottom_right", True),
                                         ("train", 128, 113, 239, "top_left", False),
                                         ("train-fp8", 64, 128, 192, "bottom_right", True),
                                         ("train-fp8", 128, 113, 239, "top_left", False),
                                         ("train-fp8", 64, 239, 113, "bottom_right", False),
                                         ("train-fp8", 128, 239, 113, None, False),
                                         (fp8_mxfp4, 64, 113, 100, "top_left", False),
                                         # the trained affine FP8 P (P mode 6), rebuilt from the LSE
                                         ("train-affine", 64, 128, 192, "bottom_right", True),
                                         ("train-affine", 128, 113, 239, "top_left", False),
                                         ("train-affine", 64, 239, 113, None, False)):
        r = PRESETS.get(name, name)
        q, dout = (torch.randn(1, 2, sq, D, generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, 1, sk, D, generator=g).bfloat16() for _ in range(2))
        fwd = reference_forward(q, k, v, r, scale=D**-0.5, causal=causal)
        out = fwd.out.bfloat16()
        want = reference_backward(fwd, out, dout, r, scale=D**-0.5, causal=causal)
        # e4m3 by bit arithmetic: every value on its grid before the cast, which the
        # interpreter then does exactly (its own rounding of off-grid values is wrong)
        routing.BACKWARD_LAUNCH[D] = dataclasses.replace(routing.BACKWARD_LAUNCH[D], hw_cvt=False, tma=tma,
                                                         dkdv_gluon=False, dq_gluon=False)
        if r.qk == "fp8":  # a scale per query and per key (the kernels' ROW_SCALES)
            _, saved = train_op.quantize_for_training_fp8(q, k, v, r.v)
            ops = train_op.backward_operands_fp8(dout, out, *saved, values_dtype=torch.float32)
            assert ops.row_scales and ops.qs.shape == (1, 2, sq) and ops.ks.shape == (1, 1, sk)
        else:
            _, saved = train_op.quantize_for_training(q, k, v, r.v)
            ops = train_op.backward_operands(dout, out, *saved, values_dtype=torch.float32)
        got = train_op.launch_backward(ops, fwd.lse, r.p, r.p_build, causal_offset(causal, sq, sk) or 0,
                                       causal is not None, D**-0.5, (torch.float32,) * 3)
        for grad, a, b in zip(("dq", "dk", "dv"), got, want):
            err = error_metrics(a, b)["rel_l2"]
            # measured 2e-7 to 4e-7; an FP8 code of P or dS that float32 summation order
            # moves across a rounding threshold changes one element by up to 1/8
            assert err < 2e-2, (r.name, D, sq, sk, causal, grad, err)
    print("ok")
''')


@pytest.mark.interpreter
def test_backward_matches_reference_under_the_interpreter():
    """The kernels' gradients against the reference backward of the same recipe, on the
    CPU: with the e4m3 rounding done on the float32 bits (`hw_cvt=False`) and the bf16
    Q/K values handed over as float32, the interpreter computes the recipe's own values,
    and the gradients differ from the reference's by float32 summation order (2e-7 to
    4e-7 relative). A wrong scale, mask or tile bound shows at once."""
    run_under_interpreter(NUMERICS)



# what both training-route scripts check after their forward and backward: the LSE and
# output against the reference forward's, the gradients (GQA sums included) against the
# reference backward's from the same output and LSE
CHECK_ROUTE = textwrap.dedent('''
    from fp4attn.reference import reference_backward, reference_forward
    from fp4attn.reference.forward import ForwardResult


    def check_route(q, k, v, out, lse, dout, r, causal):
        (B, HQ, sq, D), (HKV, sk) = q.shape, k.shape[1:3]
        lse = lse.detach()  # (it carries no gradient)
        kx, vx = (t.detach().repeat_interleave(HQ // HKV, 1) for t in (k, v))
        ref = reference_forward(q.detach(), kx, vx, r, scale=D**-0.5, causal=causal)
        seen = torch.isfinite(ref.lse)
        assert torch.equal(seen, torch.isfinite(lse)) and float((lse[seen] - ref.lse[seen]).abs().max()) < 1e-5
        o_err = float((out.detach().float() - ref.out).norm() / ref.out.norm())
        assert o_err < 1e-2, o_err  # the bf16 rounding of the output
        fwd = ForwardResult(out.detach().float(), lse, ref.q, ref.k, ref.v)
        want = reference_backward(fwd, out.detach(), dout, r, scale=D**-0.5, causal=causal)
        G = HQ // HKV
        want = (want[0], want[1].reshape(B, HKV, G, sk, D).sum(2), want[2].reshape(B, HKV, G, sk, D).sum(2))
        for n, t, w in zip("qkv", (q, k, v), want):
            err = float((t.grad.float() - w).norm() / w.norm())
            # measured 3.3e-3 to 3.4e-3 (train-fp8): the bf16 rounding of the gradients
            assert t.grad.dtype == torch.bfloat16 and err < 1e-2, (sq, sk, D, causal, n, err)
''')

TRAIN_FP8 = BLACKWELL_PATCHES + CHECK_ROUTE + textwrap.dedent('''
    import dataclasses
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_90"

    import fp4attn
    from fp4attn.kernels.hopper import train_op
    from fp4attn.recipes import PRESETS
    from fp4attn.routing import BACKWARD_LAUNCH, ForwardLaunch, override_launch

    r = PRESETS["train-fp8"]
    g = torch.Generator().manual_seed(1)

    def launches(D):
        # what the interpreter runs: the Triton forward and backward with e4m3 rounded on
        # the float32 bits (no Gluon, no inline PTX)
        return override_launch(forward=ForwardLaunch(64, 4, 2),
                               backward=dataclasses.replace(BACKWARD_LAUNCH[D], hw_cvt=False))

    for B, HQ, HKV, sq, sk, D, causal in ((1, 2, 1, 113, 239, 64, "bottom_right"), (2, 2, 2, 64, 128, 128, "top_left"),
                                          (1, 4, 2, 70, 50, 64, None)):
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16().requires_grad_()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16().requires_grad_() for _ in range(2))
        info = fp4attn.explain(q, k, v, causal=causal, recipe="train-fp8", enable_gqa=True)
        # FP8 Q/K's backward on the Gluon kernels where the lengths are whole tiles, as
        # NVFP4's (routing.GLUON_BACKWARD_QK); the launch below (e4m3 rounded on the bits)
        # runs the Triton kernels
        assert info["backend"] == "triton" and info["launcher"].endswith("hopper_train_attention"), info
        assert "hopper.backward_gluon.dkdv + hopper.backward_gluon.dq (Gluon where the lengths" in info["kernel"], info
        with launches(D):
            out, lse = fp4attn.attention(q, k, v, causal=causal, recipe="train-fp8", enable_gqa=True,
                                         backend="triton", return_lse=True)
            dout = torch.randn(out.shape, generator=g).bfloat16()
            out.backward(dout)
        check_route(q, k, v, out, lse, dout, r, causal)

    # the ops' fake implementations (torch.compile traces them) give the real ops' shapes
    # and dtypes; what the forward keeps is Q/K's e4m3 bytes, not their bf16 values (GQA,
    # lengths off the tiles: one query block of the real ops, the shapes all they give here)
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k = torch.randn(2, 4, 40, 64, generator=g).bfloat16(), torch.randn(2, 2, 50, 64, generator=g).bfloat16()
    args = ("fp8", "fp8", "exp2", "fp8", 20, True, 0.125)
    with launches(64):
        real = torch.ops.fp4attn.hopper_train_forward_fp8(q, k, k, *args)
        grads = torch.ops.fp4attn.hopper_train_backward_fp8(real[0], *real, "fp8", "exp2", 20, True, 0.125,
                                                            torch.bfloat16, torch.float16, torch.float32)
    assert [t.dtype for t in real[2:6]] == [torch.float8_e4m3fn, torch.float32, torch.float8_e4m3fn, torch.float32]
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fake = torch.ops.fp4attn.hopper_train_forward_fp8(fq, fk, fk, *args)
        fake_grads = torch.ops.fp4attn.hopper_train_backward_fp8(fake[0], *fake, "fp8", "exp2", 20, True, 0.125,
                                                                 torch.bfloat16, torch.float16, torch.float32)
    for a, b in zip((*real, *grads), (*fake, *fake_grads)):
        assert (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype), (a.shape, a.dtype, b.shape, b.dtype)
    print("ok")
''')


@pytest.mark.interpreter
def test_train_fp8_trains_through_autograd_under_the_interpreter():
    """`train-fp8` through `fp4attn.attention` and autograd on the Hopper training route
    (FP4ATTN_TARGET=sm_90 on the interpreter, with a bf16 dot defined as the hardware's:
    `interpreter_blackwell.BLACKWELL_PATCHES`): routed to the training kernels with the
    Triton backward, the LSE within 1e-5 of the reference forward's, and dQ, dK, dV (GQA
    sums included) within 1% relative L2 of the reference backward's from the same output
    and LSE (the bf16 rounding of the gradients); the ops' fake implementations give the
    real ops' shapes and dtypes."""
    run_under_interpreter(TRAIN_FP8)


TRAIN_AFFINE = BLACKWELL_PATCHES + CHECK_ROUTE + textwrap.dedent('''
    import dataclasses
    import os

    os.environ["FP4ATTN_TARGET"] = "sm_90"

    import fp4attn
    from fp4attn.recipes import PRESETS
    from fp4attn.routing import BACKWARD_LAUNCH, ForwardLaunch, override_launch

    r = PRESETS["train-affine"]
    g = torch.Generator().manual_seed(4)
    for B, HQ, HKV, sq, sk, D, causal in ((1, 2, 1, 113, 239, 64, "bottom_right"), (2, 2, 2, 64, 128, 128, "top_left"),
                                          (1, 4, 2, 70, 50, 128, None)):
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16().requires_grad_()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16().requires_grad_() for _ in range(2))
        info = fp4attn.explain(q, k, v, causal=causal, recipe="train-affine", enable_gqa=True)
        # P mode 6 runs on the Triton kernels only: forward, dK/dV and dQ
        assert info["kernel"] == "hopper.forward_triton + backward_triton.dkdv + backward_triton.dq", info
        with override_launch(forward=ForwardLaunch(64, 4, 2),
                             backward=dataclasses.replace(BACKWARD_LAUNCH[D], hw_cvt=False)):
            out, lse = fp4attn.attention(q, k, v, causal=causal, recipe="train-affine", enable_gqa=True,
                                         backend="triton", return_lse=True)
            dout = torch.randn(out.shape, generator=g).bfloat16()
            out.backward(dout)
        check_route(q, k, v, out, lse, dout, r, causal)
    print("ok")
''')


@pytest.mark.interpreter
def test_train_affine_trains_through_autograd_under_the_interpreter():
    """`train-affine` through `fp4attn.attention` and autograd on the Hopper training route
    (the interpreter, FP4ATTN_TARGET=sm_90): the Triton forward builds P by the trained
    affine map (P mode 6, its codes from the integer grid), its LSE within 1e-5 of the
    reference forward's and its output within bf16 rounding; the backward kernels rebuild
    P from the LSE with no exponential, dQ, dK, dV within 1% of the reference backward's
    (GQA, both causal alignments, head dims 64 and 128, lengths off the tiles)."""
    run_under_interpreter(TRAIN_AFFINE)
