"""Decode attention's reference (`fp4attn.reference.decode`) on the CPU: that it is
attention over the cached values, causal bottom-right among the new rows, with GQA, per
sequence lengths and left padding; that a split of the keys combined by powers of two
gives its result (what lets the kernels split the keys anywhere); that a NaN reaches
exactly the rows that read it; and decode's argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp4attn import KVCache, decode
from fp4attn.reference.decode import P_HALF_SHIFT, half_queries, reference_decode, split_scales, visible_keys
from fp4attn.reference.forward import LOG2E


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("FP4ATTN_BACKEND", "reference")


def _filled(fmt, B=3, H=2, D=64, lens=(50, 7, 33), max_len=64, seed=0, page_size=None):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(B, H, D, max_len, k_format=fmt, page_size=page_size)
    n = max(lens)
    k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(2))
    cache.append(k, v, counts=list(lens))
    return cache, g


def _exact(q, cache, causal, key_start=None):
    """float64 attention over the cache's dequantized values, per sequence."""
    kd, vd = cache.dequantize()
    hq, sq = q.shape[1], q.shape[2]
    group = hq // cache.kv_heads
    lens = torch.tensor(cache.host_lengths)
    vis = visible_keys(lens, sq, kd.shape[2], causal, key_start)
    kd, vd = kd.repeat_interleave(group, 1).double(), vd.repeat_interleave(group, 1).double()
    s = (q.bfloat16().double() @ kd.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~vis, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vd


@pytest.mark.parametrize("fmt", ("bf16", "fp8", "nvfp4", "mxfp4"))
@pytest.mark.parametrize("sq,causal", [(1, True), (5, True), (5, False)])
def test_decode_is_attention_over_the_cached_values(fmt, sq, causal):
    cache, g = _filled(fmt)
    q = torch.randn(3, 4, sq, 64, generator=g)
    out = decode(q, cache, causal=causal)
    want = _exact(q, cache, causal)
    # bf16 P: a relative error of about 2**-9 per term
    assert ((out.double() - want).norm() / want.norm()) < 4e-3


def test_causal_is_bottom_right_and_key_start_hides_the_left():
    cache, g = _filled("bf16", lens=(20, 20, 20))
    q = torch.randn(3, 2, 4, 64, generator=g)
    start = torch.tensor([0, 5, 19])
    out = decode(q, cache, key_start=start)
    kd, vd = cache.dequantize()
    for b in range(3):
        for r in range(4):
            keys = slice(int(start[b]), 20 - 4 + r + 1)
            ref = F.scaled_dot_product_attention(q[b:b + 1, :, r:r + 1].bfloat16().double(),
                                                 kd[b:b + 1, :, keys].double(), vd[b:b + 1, :, keys].double())
            assert torch.allclose(out[b:b + 1, :, r:r + 1].double(), ref, rtol=0, atol=2e-2), (b, r)
    # a row that sees no key is 0 with LSE -inf: rows 0 and 1 of sequence 2 see keys up
    # to 16 and 17, all before its first visible key 18
    start = torch.tensor([0, 0, 18])
    out, lse = decode(q, cache, key_start=start, return_lse=True)
    assert not out[2, :, :2].any() and torch.isinf(lse[2, :, :2]).all() and torch.isfinite(lse[2, :, 2:]).all()


def test_splitting_the_keys_combines_to_the_same_result():
    """With integer maxima every rescale is a power of two, which commutes with the bf16
    rounding of P: a split of the keys, combined, is the unsplit result (up to float32
    summation order). Shown by emulating two splits and the combine in float32."""
    cache, g = _filled("nvfp4", lens=(50, 50, 50))
    q = torch.randn(3, 2, 1, 64, generator=g) * 3
    kb, ks, vb, vs = cache.reference_operands()
    lengths = torch.tensor(cache.host_lengths)
    scale = 64**-0.5
    whole = reference_decode(q, kb, ks, vb, vs, lengths, scale=scale, causal=False).out
    qv = q.bfloat16().float()
    t = (qv @ kb.transpose(-1, -2)) * (ks * (scale * LOG2E)).unsqueeze(-2)
    accs, ms, ls = [], [], []
    for sl in (slice(0, 17), slice(17, 50)):
        ts = t[..., sl]
        m = torch.ceil(ts.amax(-1))
        p = torch.exp2(ts - m.unsqueeze(-1))
        accs.append((p * vs[..., sl].unsqueeze(-2)).bfloat16().float() @ vb[:, :, sl])
        ms.append(m)
        ls.append(p.sum(-1))
    big = torch.maximum(*ms)
    w = [torch.exp2(m - big) for m in ms]
    assert all(torch.equal(x, torch.exp2(torch.round(torch.log2(x)))) for x in w)  # powers of two
    combined = (w[0].unsqueeze(-1) * accs[0] + w[1].unsqueeze(-1) * accs[1]) / (w[0] * ls[0] + w[1] * ls[1]).unsqueeze(-1)
    assert torch.allclose(combined, whole, rtol=1e-5, atol=1e-6)


def test_half_queries_is_exact_down_to_2_to_the_minus_28_of_the_row():
    """q in f16 at its row's power-of-two scale (rows whose largest lies in [2**-86, 2**140],
    where the scale is not clamped): every element at least 2**-28 of its row's largest is
    kept bit for bit, smaller ones round as f16 subnormals (within half a step, 2**-39 of the
    row's largest); a NaN stays NaN, a zero row zero."""
    g = torch.Generator().manual_seed(3)
    mags = torch.exp2(-torch.randint(0, 40, (6, 128), generator=g).float())
    q = (torch.randn(6, 128, generator=g).sign() * mags * torch.tensor([1e-20, 1e-3, 1.0, 7.0, 3e4, 1e30])[:, None])
    q = q.bfloat16().float()
    h = half_queries(q)
    amax = q.abs().amax(-1, keepdim=True)
    big = q.abs() >= amax * 2.0**-28
    assert torch.equal(h[big], q[big])
    assert ((h - q).abs()[~big] <= amax.expand_as(q)[~big] * 2.0**-39).all()
    assert torch.equal(half_queries(torch.zeros(2, 8)), torch.zeros(2, 8))
    x = torch.ones(1, 8)
    x[0, 3] = float("nan")
    assert torch.isnan(half_queries(x)[0, 3])  # (the row's scores are NaN whatever its other elements)


def test_split_scales_puts_the_exponent_apart_exactly():
    g = torch.Generator().manual_seed(4)
    vs = torch.exp2(torch.randn(1000, generator=g) * 30) * torch.rand(1000, generator=g).add(0.5)
    e, mu = split_scales(vs)
    assert ((mu >= 1) & (mu < 2)).all() and torch.equal(e, e.round())
    assert torch.equal(mu * torch.exp2(e), vs)
    odd = torch.tensor([0.0, 1e-40, float("inf"), float("nan")])
    e, mu = split_scales(odd)
    assert torch.equal(e, torch.zeros(4)) and torch.equal(mu[:3], odd[:3]) and torch.isnan(mu[3])


def test_fp8_values_f16_p_splits_and_combines_to_the_same_result():
    """FP8 values' P in f16 (`p_half`): a split that writes its partial in its own frame,
    acc * 2**(M_s - P_HALF_SHIFT - m_s) with l_s, merged by the ordinary power-of-two
    combine, is the unsplit result; and f16 P is at least as close to float64 attention
    over the same cached values as bf16 P."""
    cache, g = _filled("fp8", lens=(50, 50, 50))
    q = torch.randn(3, 2, 1, 64, generator=g) * 3
    kb, ks, vb, vs = cache.reference_operands()
    vs = vs * torch.exp2(torch.randint(-12, 12, vs.shape, generator=g).float())  # token scales far apart
    lengths = torch.tensor(cache.host_lengths)
    scale = 64**-0.5
    whole = reference_decode(q, kb, ks, vb, vs, lengths, scale=scale, causal=False, p_half=True).out
    t = (half_queries(q.bfloat16().float()) @ kb.transpose(-1, -2)) * (ks * (scale * LOG2E)).unsqueeze(-2)
    e, mu = split_scales(vs)
    accs, ms, ls = [], [], []
    for sl in (slice(0, 17), slice(17, 50)):
        ts, u = t[..., sl], t[..., sl] + e[..., sl].unsqueeze(-2)
        m, big_m = torch.ceil(ts.amax(-1)), torch.ceil(u.amax(-1))
        pv = (torch.exp2(u - big_m.unsqueeze(-1)) * (mu[..., sl] * 2.0**P_HALF_SHIFT).unsqueeze(-2)).half().float()
        accs.append((pv @ vb[:, :, sl]) * torch.exp2(big_m - P_HALF_SHIFT - m).unsqueeze(-1))
        ms.append(m)
        ls.append(torch.exp2(ts - m.unsqueeze(-1)).sum(-1))
    top = torch.maximum(*ms)
    w = [torch.exp2(m - top) for m in ms]
    combined = (w[0].unsqueeze(-1) * accs[0] + w[1].unsqueeze(-1) * accs[1]) / (w[0] * ls[0] + w[1] * ls[1]).unsqueeze(-1)
    assert (combined - whole).norm() <= 1e-6 * whole.norm()  # float32 summation order
    exact = torch.softmax(t.double() / LOG2E, -1) @ (vb * vs.unsqueeze(-1)).double()
    bf16_p = reference_decode(q, kb, ks, vb, vs, lengths, scale=scale, causal=False).out
    assert (whole.double() - exact).norm() <= (bf16_p.double() - exact).norm()


@pytest.mark.parametrize("fmt", ("bf16", "fp8", "nvfp4", "mxfp4"))
def test_a_nan_reaches_only_the_rows_that_read_it(fmt):
    B, H, D = 2, 1, 64
    cache = KVCache(B, H, D, 32, k_format=fmt)
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, H, 10, D, generator=g) for _ in range(2))
    cache.append(k, v)
    q = torch.randn(B, 2, 3, D, generator=g)
    k_new, v_new = (torch.randn(B, H, 3, D, generator=g) for _ in range(2))
    v_new[0, 0, 2, 5] = float("nan")  # the last new token of sequence 0: only its last row reads it
    k_new[1, 0, 1, 9] = float("inf")  # the middle new token of sequence 1: its last two rows
    out = decode(q, cache, k=k_new, v=v_new)
    nan_rows = torch.isnan(out).any(-1)  # (B, Hq, Sq)
    want = torch.zeros(B, 2, 3, dtype=torch.bool)
    want[0, :, 2] = True
    want[1, :, 1:] = True
    assert torch.equal(nan_rows, want)
    assert torch.isfinite(out[~want]).all()


DECODE_ERRORS = [
    (lambda c: dict(q=torch.randn(2, 3, 1, 64)), "a multiple of the cache's kv_heads=2"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 32)), "head_dim=64"),
    (lambda c: dict(q=torch.randn(3, 2, 1, 64)), "batch=2"),
    (lambda c: dict(q=torch.randn(2, 2, 64)), "4-D"),
    (lambda c: dict(q=torch.randn(2, 2, 0, 64)), "at least 1"),
    (lambda c: dict(q=torch.ones(2, 2, 1, 64, dtype=torch.int64)), "dtype"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 64, device="meta")), "is on meta"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 64), key_start=torch.zeros(3, dtype=torch.int32)), "key_start"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 64), scale=-1.0), "scale"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 64), k=torch.randn(2, 2, 1, 64)), "both k and v"),
    (lambda c: dict(q=torch.randn(2, 2, 1, 64), k=torch.randn(2, 2, 30, 64), v=torch.randn(2, 2, 30, 64)),
     "beyond max_len"),
]


@pytest.mark.parametrize("make,message", DECODE_ERRORS)
def test_decode_names_a_bad_argument_and_leaves_the_cache_unchanged(make, message):
    cache, _ = _filled("nvfp4", B=2, lens=(10, 3), max_len=32)
    before = [t.clone() for t in cache.k.tensors() if t is not None], list(cache.host_lengths)
    kwargs = make(cache)
    q = kwargs.pop("q")
    with pytest.raises((ValueError, TypeError), match=message):
        decode(q, cache, **kwargs)
    assert cache.host_lengths == before[1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], [t for t in cache.k.tensors() if t is not None]))


def test_decode_needs_a_cache():
    with pytest.raises(TypeError, match="fp4attn.KVCache"):
        decode(torch.randn(1, 1, 1, 64), object())


@pytest.mark.parametrize("fmt", ("bf16", "mxfp4"))
def test_rotated_keys_give_the_same_attention(fmt):
    """rotate_k stores H (s * k) and decode rotates q alike: the same scores in real
    arithmetic (bf16 roundings of the rotated values aside)."""
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))
    k[:, :, :, 7] *= 30.0  # a large key channel: what the rotation spreads out
    q = torch.randn(2, 4, 2, 64, generator=g)
    plain, rotated = (KVCache(2, 2, 64, 48, k_format=fmt, rotate_k=r) for r in (False, True))
    for c in (plain, rotated):
        c.append(k, v)
    kk = k.repeat_interleave(2, 1).double()
    vv = v.repeat_interleave(2, 1).double()
    vis = visible_keys(torch.tensor([40, 40]), 2, 40, True)
    s = (q.double() @ kk.transpose(-1, -2) / 8.0).masked_fill(~vis, -math.inf)
    want = torch.softmax(s, -1) @ vv
    errs = [float((decode(q, c).double() - want).norm() / want.norm()) for c in (plain, rotated)]
    if fmt == "bf16":
        assert errs[1] < 1e-2
    else:  # MXFP4's 32-channel power-of-two blocks: the spread-out channel costs the others less
        assert errs[1] < errs[0]


def test_smoothed_keys_give_the_same_attention_and_lse():
    """smooth_k subtracts the first append's K mean from every key: each row's scores
    shift by one constant (the softmax removes it, the LSE is corrected back), and a
    shared offset no longer costs the 4-bit codes their range."""
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))
    k = k + 3.0
    q = torch.randn(2, 4, 1, 64, generator=g)
    caches = {name: KVCache(2, 2, 64, 48, k_format=fmt, smooth_k=sm) for name, fmt, sm in
              (("bf16", "bf16", False), ("bf16-smooth", "bf16", True), ("nvfp4", "nvfp4", False),
               ("nvfp4-smooth", "nvfp4", True))}
    for c in caches.values():
        c.append(k[:, :, :30], v[:, :, :30])  # the prompt: the mean is fixed here
        c.append(k[:, :, 30:], v[:, :, 30:])
    res = {n: decode(q, c, return_lse=True) for n, c in caches.items()}
    assert torch.allclose(res["bf16-smooth"][0], res["bf16"][0], atol=2e-2)
    assert torch.allclose(res["bf16-smooth"][1], res["bf16"][1], atol=2e-2)
    exact = res["bf16"][0].double()
    err = {n: float((res[n][0].double() - exact).norm() / exact.norm()) for n in ("nvfp4", "nvfp4-smooth")}
    assert err["nvfp4-smooth"] < err["nvfp4"]
    assert torch.equal(caches["nvfp4-smooth"].k_mean[0, 0], k[0, 0, :30].double().mean(0).float())
