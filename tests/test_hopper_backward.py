"""Hopper training kernels (forward that keeps the quantized operands, backward) against
the reference backward of the same recipe (run on an H200): `train` and `train-mxfp4pv`
(NVFP4 Q/K) and `train-fp8` (per-token FP8 Q/K).

Invariant: with the kernel's own forward output and LSE fed to the reference backward,
the kernel's dQ, dK, dV differ from the reference's by much less than the reference
differs from exact float64 gradients (P codes at rounding thresholds, fp32 summation
order and the FP8 tensor cores' accumulation are the only differences)."""

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

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 3), (113, 239), (1023, 1023), (256, 1024)])
def test_backward_matches_reference(recipe, d, sq, sk):
    _check(recipe, 2, 4, 4, sq, sk, d)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1023, 1023), (113, 500), (500, 113)])
def test_backward_causal_gqa(recipe, causal, sq, sk):
    _check(recipe, 1, 6, 2, sq, sk, 128, causal=causal)


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


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [32, 96])
def test_backward_padded_head_dims(recipe, d):
    _check(recipe, 2, 4, 2, 300, 300, d, causal="top_left")


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


@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
def test_backward_nan_propagates(recipe):
    q, k, v = _inputs(1, 1, 1, 64, 256, 64)
    with torch.no_grad():
        v[0, 0, 7, 3] = float("nan")
    fp4attn.attention(q, k, v, recipe=recipe, backend="triton").sum().backward()
    assert bool(torch.isnan(q.grad).any())


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
