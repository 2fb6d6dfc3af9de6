"""The affine P builders (`reference/affine.py`): their float32 arithmetic is the map it
documents, code for code, and the forward that uses them is consistent.

Invariants: the magic-number sum fl(a t + C) - MAGIC is exactly RNE(a (t - m~) + offset)
(checked in float64 on random scores and on scores placed exactly on, and one ulp
either side of, every rounding midpoint: ties go to even); the reference point m~ is
idempotent and within 1/16 (FP8) or 1/2 (MXFP4) of m, so no FP8 byte exceeds 120
(P <= 1); masked keys give 0, NaN scores and NaN rows NaN; the forward's error is the
format's."""

import math

import numpy as np
import pytest
import torch

import fp4attn
from fp4attn.formats.minifloat import decode_ue4m3
from fp4attn.recipes import PRESETS, Recipe
from fp4attn.reference import reference_forward
from fp4attn.reference.affine import K_FP8_F32, affine_fp8_bytes, affine_mxfp4_codes, build_p_affine, snap_max
from fp4attn.reference.encoding import P_EMIN


def _rne(z: torch.Tensor) -> torch.Tensor:
    """Round half to even in float64 (torch.round rounds half to even)."""
    return torch.round(z.double())


def _rows(g, n=64, width=128, spread=40.0):
    t = torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g) * spread
    t = t + torch.randn(n, 1, generator=g) * 300.0  # large row offsets: C rounds there too
    return t.float()


def test_fp8_bytes_are_the_rounded_affine_map():
    g = torch.Generator().manual_seed(0)
    t = _rows(g)
    m = snap_max(t.amax(-1), "fp8")
    got = affine_fp8_bytes(t, m)
    want = _rne(8.0 * (t.double() - m.double()[:, None]) + K_FP8_F32).clamp(0, 126)
    assert torch.equal(got.double(), want)
    assert int(got.max()) <= 120  # P <= 1 (byte 120 is 2**0 times P's offset 2**8)


def test_fp8_bytes_on_every_midpoint_round_half_to_even():
    # scores whose 8 (t - m~) + K lands exactly on n + 1/2, and one float32 ulp either side
    m = snap_max(torch.tensor([0.0, 3.3, -17.7, 250.125]), "fp8")
    rows = []
    for mi in m.tolist():
        mid = (np.arange(-1, 122, dtype=np.float64) + 0.5 - K_FP8_F32) / 8.0 + mi
        t = np.float32(mid)
        assert np.all(np.float64(t) == mid) or abs(mi) > 100  # exact below |m| = 100
        rows.append(np.concatenate([t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(-np.inf))]))
    t = torch.from_numpy(np.stack(rows))
    got = affine_fp8_bytes(t, m)
    want = _rne(8.0 * (t.double() - m.double()[:, None]) + K_FP8_F32).clamp(0, 126)
    assert torch.equal(got.double(), want)
    ties = (8.0 * (t.double() - m.double()[:, None]) + K_FP8_F32) % 1 == 0.5
    assert int(ties.sum()) > 300 and bool((got.double()[ties] % 2 == 0).all())


def test_mxfp4_codes_are_the_rounded_affine_map():
    g = torch.Generator().manual_seed(1)
    t = _rows(g, spread=12.0)
    t[0, 32:64] = -math.inf  # a fully masked block
    t[1, 64:96] = t[1].amax() - 40.0  # a block below P_EMIN
    m = snap_max(t.amax(-1), "mxfp4")
    codes, e_b = affine_mxfp4_codes(t, m)
    tb = t.double().reshape(64, -1, 32)
    eb = torch.floor(tb.amax(-1) - m.double()[:, None]) - 2
    y = tb - m.double()[:, None, None] - eb[..., None]
    want = _rne(2.0 * y + 2.0).clamp(0, 7)
    keep = (eb >= P_EMIN) & torch.isfinite(eb)
    want = torch.where(keep[..., None], want, 0.0).reshape(t.shape)
    assert torch.equal(codes.double(), want)
    assert torch.equal(e_b[keep].double(), eb[keep]) and bool((e_b[~keep] == P_EMIN - 1).all())
    assert not bool(keep[0, 1]) and not bool(keep[1, 2])


@pytest.mark.parametrize("fmt,tol", [("fp8", 1.0 / 16), ("mxfp4", 0.5)])
def test_reference_point_is_idempotent_and_close(fmt, tol):
    g = torch.Generator().manual_seed(0)
    m = (torch.randn(100000, dtype=torch.float64, generator=g) * 1000).float()
    r = snap_max(m, fmt)
    assert torch.equal(snap_max(r, fmt), r)
    # FP8: half a grid step, plus the float32 rounding of k - 8 m before the magic number
    # rounds it (a tie's neighbours can round across it: 3e-5 over at |m| ~ 500, measured)
    slack = (8.0 * m.abs() + K_FP8_F32) * 2.0**-24 / 8.0 if fmt == "fp8" else torch.zeros_like(m)
    assert bool(((r - m).abs() <= tol + slack).all())
    if fmt == "mxfp4":
        assert bool((r >= m).all())  # x~ <= 0: Direct-P's block exponents stay <= -2


def test_masked_keys_zero_nan_scores_nan():
    t = torch.randn(3, 64)
    t[0, :10] = -math.inf
    t[1, 5] = float("nan")
    for fmt in ("fp8", "mxfp4"):
        m = snap_max(t.nan_to_num(nan=-math.inf).amax(-1), fmt)
        p = build_p_affine(t, m, fmt)
        assert bool((p[0, :10] == 0).all()) and bool(torch.isnan(p[1, 5]))
        assert bool(torch.isfinite(p[2]).all())
        m[2] = float("nan")
        assert bool(torch.isnan(build_p_affine(t, m, fmt)[2]).all())


def test_fp8_byte_values_are_e4m3():
    b = torch.arange(0, 127, dtype=torch.uint8)
    assert torch.equal(decode_ue4m3(b), b.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("name", ["fp8-affine", "directp-fast", "fp8-directp-fast"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_forward_error_is_the_formats(name, causal):
    """The affine forms' error to exact attention is about their exact builders' (the
    measured margins: docs/notes/affine-p.md), and their LSE too."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, s, 64, generator=g).bfloat16() for s in (100, 300, 300))
    r = PRESETS[name]
    exact_build = r.with_(p_build="directp" if r.p == "mxfp4" else "exp2")
    ref, base = (reference_forward(q, k, v, x, scale=0.125, causal=causal) for x in (r, exact_build))
    want = reference_forward(q, k, v, PRESETS["bf16"], scale=0.125, causal=causal)
    def err(a):
        return float((a.out - want.out).norm() / want.out.norm())
    # measured here: FP8 1.0-1.1x the exp2 form's error; the E2M1 map 1.4-1.5x Direct-P's
    # (its subnormal codes are off the log-linear line: code 1 stands for 2**-0.5, is 0.5)
    assert err(ref) < (1.2 if r.p == "fp8" else 1.6) * err(base) + 1e-3, (err(ref), err(base))
    assert bool(torch.isfinite(ref.lse).all())
    # the LSE sums the represented values, which the E2M1 map biases low (its codes 0
    # and 1 fall short of the exponential): measured 2.5-3x Direct-P's largest LSE error
    # here, 1-1.2x for the FP8 map
    def lse_err(a):
        return float((a.lse - want.lse).abs().max())
    assert lse_err(ref) < (1.5 if r.p == "fp8" else 4.0) * lse_err(base) + 0.02, (lse_err(ref), lse_err(base))


def test_recipe_rules():
    with pytest.raises(ValueError, match="affine.*FP8 or MXFP4"):
        Recipe(p="bf16", p_build="affine")
    with pytest.raises(ValueError, match="trains with FP8 P only"):
        Recipe(qk="nvfp4", p="mxfp4", v="mxfp4", p_build="affine", grad="e4m3")
    assert Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="affine", grad="e4m3").grad == "e4m3"
    with pytest.raises(ValueError, match="p_sink"):
        Recipe(p_build="affine", p_sink=True)
    with pytest.raises(ValueError, match="rescale='lazy'.*p_build='affine', p='fp8' and grad=None"):
        Recipe(qk="fp8", p="fp8", v="fp8", p_build="exp2", rescale="lazy")
    with pytest.raises(ValueError, match="rescale='lazy'"):
        Recipe(qk="nvfp4", p="fp8", v="fp8", p_build="affine", grad="e4m3", rescale="lazy")
    with pytest.raises(ValueError, match="rescale"):
        Recipe(rescale="sometimes")


def test_lazy_point_moves_only_when_a_byte_would_not_fit():
    """Recipe.rescale="lazy": a row keeps its point while every byte measured from it is
    at most 126, on the float32 values the bytes come from (byte 126.5 rounds to even,
    126, and keeps; one ulp above rounds to 127 and moves); it moves to the snapped
    maximum on its first key, on a byte of 127 or more however far above (no wrap), and
    on a NaN; masked keys never move it."""
    from fp4attn.reference.affine import K_FP8_LAZY_F32, MAGIC, lazy_reference_point

    m = snap_max(torch.tensor([3.0]), "fp8", k=K_FP8_LAZY_F32)
    edge = np.float32((126.5 - K_FP8_LAZY_F32) / 8.0 + float(m))
    def byte(x):
        return float((8.0 * torch.tensor(x) + ((K_FP8_LAZY_F32 - 8.0 * m) + MAGIC)) - MAGIC)
    assert byte(edge) == 126.0 and byte(np.nextafter(edge, np.float32(np.inf))) == 127.0  # the tie, to even
    rows = [[float(edge), -math.inf], [float(np.nextafter(edge, np.float32(np.inf))), 0.0], [1e30, 0.0],
            [float("nan"), 0.0], [-math.inf, -math.inf], [float(m) - 500.0, -1e30]]
    t = torch.tensor(rows, dtype=torch.float32)
    m_ref = m.expand(len(rows)).clone()
    m_tile = torch.maximum(m_ref, t.amax(-1))
    got = lazy_reference_point(t, m_ref, m_tile)
    moved = snap_max(m_tile, "fp8", k=K_FP8_LAZY_F32)
    assert float(got[0]) == float(m) and float(got[4]) == float(m) and float(got[5]) == float(m)
    assert float(got[1]) == float(moved[1]) > float(m) and float(got[2]) == float(moved[2])
    assert bool(torch.isnan(got[3]))
    assert bool((affine_fp8_bytes(t[[0, 4, 5]], got[[0, 4, 5]], K_FP8_LAZY_F32) <= 126).all())
    first = lazy_reference_point(t[:1], torch.tensor([-math.inf]), torch.tensor([float(edge)]))
    assert float(first) == float(snap_max(torch.tensor([float(edge)]), "fp8", k=K_FP8_LAZY_F32))


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_lazy_rescale_is_exact_rescale_within_the_format(causal):
    """The lazy form computes what the exact form does but for where P's bytes sit (three
    log2 units lower, the row's point moved less often): outputs within a fraction of the
    FP8 format's own error, the LSE about as close to exact, and the same rows empty; on logits that
    climb by hundreds of log2 units between tiles too (every tile moves the point)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, s, 64, generator=g) for s in (200, 700, 700))
    k[:, 1, ::128] += q[:, 1].mean(1, keepdim=True) * torch.arange(1, 7).view(1, -1, 1) * 40.0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    lazy = PRESETS["fp8-ktile-affine-lazy-fastacc"].with_(fast_accum=False)
    a, b = (reference_forward(q, k, v, r, scale=0.125, causal=causal) for r in (lazy, lazy.with_(rescale="exact")))
    want = reference_forward(q, k, v, PRESETS["bf16"], scale=0.125, causal=causal)
    def err(x):
        return float((x.out - want.out).norm() / want.out.norm())
    assert err(a) < 1.05 * err(b) + 1e-4, (err(a), err(b))
    assert float((a.out - b.out).norm() / b.out.norm()) < 0.5 * err(b)
    # the LSE sums the represented values: moved by the log-linear grid's error (up to
    # 0.086 in log2 a value) wherever a row's point differs from its maximum
    seen = torch.isfinite(b.lse)
    assert torch.equal(seen, torch.isfinite(a.lse))
    def lse_err(x):
        return float((x.lse - want.lse)[seen].abs().max())
    assert lse_err(a) < 1.5 * lse_err(b) + 0.02, (lse_err(a), lse_err(b))


def test_attention_runs_the_presets_on_the_reference():
    q, k, v = (torch.randn(1, 2, 40, 64).bfloat16() for _ in range(3))
    for name in ("directp-fast", "fp8-affine"):
        out = fp4attn.attention(q, k, v, recipe=name, causal=True)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())


def test_k_tile_scales_are_one_fp8_block_per_tile():
    """`Recipe.k_scale="tile"`: one e4m3 scale per 128 keys of a (batch, head), the tile's
    values quantized as one `quantize_fp8` block (a short last tile too); a NaN is a NaN
    element of its key, the tile's scale that of its finite values; the per-token form is
    unchanged."""
    from fp4attn.formats import quantize_fp8
    from fp4attn.reference.operands import quantize_qk

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 300, 64, generator=g) * torch.rand(2, 2, 300, 1, generator=g) * 5
    x[1, 0, 140, 7] = float("nan")
    op = quantize_qk(x, "fp8", tile=128)
    for b, h, j0 in ((0, 0, 0), (0, 1, 128), (1, 1, 256)):
        blk = x[b, h, j0:j0 + 128].reshape(1, -1)
        q = quantize_fp8(blk, dim=-1, block=None, fmt="e4m3")
        n = blk.shape[-1] // 64
        assert torch.equal(op.values[b, h, j0:j0 + n], q.data.float().reshape(n, 64))
        assert bool((op.scale[b, h, j0:j0 + n] == q.scale.reshape(())).all())
    assert bool(torch.isfinite(op.scale).all())
    zeroed = quantize_qk(x.nan_to_num(nan=0.0), "fp8", tile=128)
    assert torch.equal(op.scale, zeroed.scale)
    assert torch.equal(torch.isnan(op.values), torch.isnan(x))
    assert torch.equal(op.values.nan_to_num(nan=0.0), zeroed.values)
    per_token = quantize_qk(x, "fp8").scale.nan_to_num(nan=-1.0)
    assert torch.equal(per_token, quantize_fp8(x, dim=-1, block=None, fmt="e4m3").scale.nan_to_num(nan=-1.0))
    with pytest.raises(ValueError, match="k_scale='tile'.*qk='fp8'"):
        Recipe(qk="nvfp4", k_scale="tile")
    with pytest.raises(ValueError, match="k_scale"):
        Recipe(qk="fp8", k_scale="block")


def test_hopper_op_keeps_every_numerics_field(monkeypatch):
    """The Hopper forward's custom op rebuilds the recipe from its arguments: every field
    that changes a number (here `k_scale`) must reach the quantizers, or the kernels would
    run another recipe. The launch is stopped where the operands are made (no GPU)."""
    pytest.importorskip("triton")
    from fp4attn.kernels.hopper import forward_op

    seen = []

    def stop(q, k, v, recipe, **kw):
        seen.append(recipe)
        raise RuntimeError("stop")

    monkeypatch.setattr(forward_op, "prepare_operands_fused", stop)
    x = torch.zeros(1, 1, 4, 64)
    for name in ("fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc", "fp8-affine", "directp-fast"):
        with pytest.raises(RuntimeError, match="stop"):
            forward_op.hopper_attention(x, x, x, PRESETS[name], scale=0.125, causal_offset=None)
        want = PRESETS[name]
        got = seen[-1]
        for field in ("qk", "p", "v", "p_build", "fast_accum", "k_scale", "rescale", "block_n", "consistent_norm"):
            assert getattr(got, field) == getattr(want, field), (name, field)


@pytest.mark.parametrize("seed", range(4))
def test_trained_affine_p_is_rebuilt_from_the_lse_exactly(seed):
    """`train-affine`: the forward measures its FP8 codes from the integer m~ = ceil(max t)
    and the backward rebuilds them from the LSE alone, measured from ceil(lse2) and scaled
    by 2**(ceil(lse2) - lse2): the forward's normalized P exactly wherever its byte is
    normal (>= 8), with no exponential per score. Rows of one key tile (one reference
    point), logits of several sharpnesses, masked keys."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(64, 128, generator=g) * (1 + 4 * seed)
    t[:, 100:] = float("-inf")
    m_ref = snap_max(t.amax(-1), "fp8", trained=True)
    assert torch.equal(m_ref, torch.ceil(t.amax(-1)))
    p_f = build_p_affine(t, m_ref, "fp8")
    l = p_f.sum(-1)
    lse2 = m_ref + torch.log2(l)
    mb = torch.ceil(lse2)
    p_b = build_p_affine(t, mb, "fp8") * torch.exp2(mb - lse2)[:, None]
    b_f = affine_fp8_bytes(t, m_ref).int()
    b_b = affine_fp8_bytes(t, mb).int()
    normal = (b_f >= 8) & (b_b >= 8)
    # the same codes, shifted by 8 per integer of the reference point (a power of two)
    assert torch.equal((b_b - b_f)[normal], (8 * (m_ref - mb)).int()[:, None].expand_as(b_f)[normal])
    want = p_f / l[:, None]
    # and the same values to the rounding of lse2 (an ulp of a log2 near 30 is 4e-6) in
    # 2**(mb - lse2) against 1 / l
    torch.testing.assert_close(p_b[normal], want[normal], rtol=1e-5, atol=0)
    # elsewhere the rebuilt P is a smaller subnormal or zero: never above the forward's
    assert bool((p_b[~normal] <= want[~normal] * (1 + 1e-6) + 1e-30).all())
    assert bool((p_b[:, 100:] == 0).all())


def test_train_affine_trains_on_the_reference():
    """`train-affine` through `fp4attn.attention` and autograd on the CPU (the reference
    forward and backward): finite gradients of the accuracy of `train`'s against exact
    attention's (the NVFP4 Q/K dominate both)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(1, 2, 150, 64, generator=g).bfloat16()
    grads = {}
    for name in ("train-affine", "train", "bf16"):
        for x in (q, k, v):
            x.grad = None
        fp4attn.attention(q, k, v, recipe=name, causal=True).backward(dout)
        grads[name] = [x.grad.float().clone() for x in (q, k, v)]
    for a, b, e in zip(grads["train-affine"], grads["train"], grads["bf16"]):
        assert bool(torch.isfinite(a).all())
        err_affine, err_train = float((a - e).norm() / e.norm()), float((b - e).norm() / e.norm())
        assert err_affine < 1.1 * err_train + 0.01, (err_affine, err_train)


def test_blackwell_refuses_the_lazy_rescale():
    """The Blackwell kernels move the point at every tile: a lazy recipe is refused there
    by name, never run as its exact form."""
    from fp4attn.routing import blackwell_forward_unsupported

    lazy = PRESETS["fp8-ktile-affine-lazy-fastacc"].with_(k_scale="token")
    for target in ("sm_100", "sm_120"):
        assert "rescale='lazy'" in blackwell_forward_unsupported(lazy, 128, target=target)
    assert blackwell_forward_unsupported(lazy.with_(rescale="exact"), 128) is None
