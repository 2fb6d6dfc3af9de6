"""FP8 products for the 4-bit caches (`fp4attn.decode(products="fp8")`) on the CPU: q's
e4m3 rounding at its row's power-of-two scale, the reference against a float64
computation of the same rounded operands (awkward lengths, GQA, one and several new rows,
causal and not, left padding, the paged layout), NaN reaching only the rows and sequences
that read it, the option's errors, and the routing that reaches the kernel only through
it. The kernel against this reference: tests/test_decode_hopper.py (GPU)."""

import math

import pytest
import torch

from fp4attn import KVCache, decode
from fp4attn import decode_routing as R
from fp4attn.reference.decode import e4m3_queries, half_queries, reference_decode, visible_keys
from fp4attn.reference.forward import LOG2E


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("FP4ATTN_BACKEND", "reference")


def _filled(fmt, vf=None, B=3, H=2, D=64, lens=(50, 7, 33), max_len=80, seed=0, page_size=None):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(B, H, D, max_len, k_format=fmt, v_format=vf or fmt, page_size=page_size)
    k, v = (torch.randn(B, H, max(lens), D, generator=g) * 2 for _ in range(2))
    cache.append(k, v, counts=list(lens))
    return cache, g


def test_e4m3_queries_round_at_the_rows_power_of_two_scale():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(4, 3, 128, generator=g) * torch.tensor([1e-3, 1.0, 3e4]).reshape(1, 3, 1)).bfloat16().float()
    q[0, 0, :5] = 0.0
    q[1, 1] = 0.0  # a row of zeros stays zeros
    got = e4m3_queries(q)
    amax = q.abs().amax(-1, keepdim=True)
    e = 7 - torch.floor(torch.log2(amax.clamp(min=1e-38)))
    scaled = got * torch.exp2(e)
    # the row's largest lands in [2**7, 2**8): below e4m3's 448, no saturation
    top = scaled.abs().amax(-1)
    ok = amax.squeeze(-1) > 0
    assert ((top[ok] >= 128) & (top[ok] <= 256)).all()  # 256: a value just below it rounding up
    # the scaled values are e4m3 values (round to nearest even), subnormals included
    want = (q * torch.exp2(e)).to(torch.float8_e4m3fn).float()
    assert torch.equal(scaled[ok], want[ok])
    assert not got[1, 1].any()
    # one e4m3 rounding: at most 2**-4 of an element's magnitude above the subnormals
    normal = scaled.abs() >= 2.0 ** -6
    assert ((got - q).abs() <= q.abs() * 2.0 ** -4 + 1e-30)[normal].all()
    # the f16 rounding of the exact path is far finer
    assert (half_queries(q) - q).abs().max() < (got - q).abs().max() / 100


def test_e4m3_queries_ignore_nan_in_the_scale():
    q = torch.tensor([[1.0, 2.0, float("nan"), -0.75]])
    got = e4m3_queries(q)
    assert torch.isnan(got[0, 2]) and torch.equal(got[0, [0, 1, 3]], torch.tensor([1.0, 2.0, -0.75]))


def _float64_attention(q, cache, causal, scale, key_start=None):
    """float64 attention over the cache's values, with q rounded as the FP8 products
    round it (`e4m3_queries`): the scores the exact products, P unrounded."""
    kb, ks, vb, vs = cache.reference_operands()
    hq, sq = q.shape[1], q.shape[2]
    group = hq // cache.kv_heads
    q8 = e4m3_queries(q.bfloat16().float()).double()
    kd = (kb * ks[..., None]).repeat_interleave(group, 1).double()
    vd = (vb * vs[..., None]).repeat_interleave(group, 1).double()
    vis = visible_keys(torch.tensor(cache.host_lengths), sq, kd.shape[2], causal, key_start)
    s = (q8 @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vd, lse


CASES = [  # K, V, B, Hkv, Hq, D, lengths, Sq, causal, page size, key_start
    ("nvfp4", "nvfp4", 3, 2, 8, 64, (50, 7, 33), 1, True, None, None),
    ("nvfp4", "fp8", 3, 2, 4, 128, (50, 1, 79), 5, True, 16, None),
    ("mxfp4", "mxfp4", 2, 1, 4, 64, (17, 64), 3, False, None, (0, 9)),
    ("mxfp4", "nvfp4", 1, 4, 16, 64, (33,), 1, True, 32, None),
    ("nvfp4", "bf16", 2, 2, 2, 64, (1, 45), 2, True, None, (0, 40)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-Hq{c[4]}-D{c[5]}-sq{c[7]}-{c[8]}")
def test_fp8_products_are_attention_over_e4m3_queries(case):
    kf, vf, B, Hkv, Hq, D, lens, sq, causal, ps, start = case
    cache, g = _filled(kf, vf, B=B, H=Hkv, D=D, lens=lens, page_size=ps)
    q = torch.randn(B, Hq, sq, D, generator=g)
    key_start = None if start is None else torch.tensor(start)
    out, lse = decode(q, cache, causal=causal, key_start=key_start, return_lse=True, products="fp8")
    want, want_lse = _float64_attention(q, cache, causal, D ** -0.5, key_start)
    seen = torch.isfinite(want_lse)
    # the scores are exact up to float32 rounding: the LSE to float32's
    assert torch.allclose(lse[seen].double(), want_lse[seen], rtol=1e-6, atol=1e-6)
    assert torch.isinf(lse[~seen]).all() and not out[~seen].any()
    # P in bf16 (f16 for FP8 values): a relative error of about 2**-9 per term
    assert ((out.double() - want).norm() / want.norm()) < 4e-3
    # the exact path's q differs: the FP8 products are a different recipe, close to it
    exact = decode(q, cache, causal=causal, key_start=key_start, products="exact")
    diff = (exact - out).norm() / exact.norm()
    assert 1e-4 < diff < 0.1, float(diff)


def test_fp8_products_scores_are_the_float32_rounding_of_exact_sums():
    """reference_decode with products="fp8" rounds the exact sums once to float32: the
    scores, read back through the LSE of one key, equal the float64 dot product's
    rounding exactly."""
    cache, g = _filled("nvfp4", B=1, H=1, D=128, lens=(1,), max_len=16)
    kb, ks, vb, vs = cache.reference_operands()
    q = torch.randn(1, 1, 1, 128, generator=g).bfloat16().float()
    res = reference_decode(q, kb, ks, vb, vs, torch.tensor([1]), scale=1.0, products="fp8")
    q8 = e4m3_queries(q)
    dot = (q8.double() @ kb.double().transpose(-1, -2)).float() * (ks * LOG2E).unsqueeze(-2)
    # one key: l = 2**(t - ceil t), lse = (ceil t + log2 l) ln 2 = t ln 2
    assert torch.allclose(res.lse.double(), dot.double().squeeze(-1) / LOG2E, rtol=1e-7, atol=0)


def test_a_nan_reaches_only_the_rows_and_sequences_that_read_it():
    B, H, D = 3, 1, 64
    cache = KVCache(B, H, D, 32, k_format="nvfp4")
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, H, 10, D, generator=g) for _ in range(2))
    cache.append(k, v)
    q = torch.randn(B, 2, 3, D, generator=g)
    q[2, 1, 0, 7] = float("nan")  # one query row of sequence 2
    k_new, v_new = (torch.randn(B, H, 3, D, generator=g) for _ in range(2))
    v_new[0, 0, 2, 5] = float("nan")  # the last new token of sequence 0: only its last row reads it
    k_new[1, 0, 1, 9] = float("inf")  # the middle new token of sequence 1: its last two rows
    out = decode(q, cache, k=k_new, v=v_new, products="fp8")
    nan_rows = torch.isnan(out).any(-1)
    want = torch.zeros(B, 2, 3, dtype=torch.bool)
    want[0, :, 2] = True
    want[1, :, 1:] = True
    want[2, 1, 0] = True
    assert torch.equal(nan_rows, want)
    assert torch.isfinite(out[~want]).all()


@pytest.mark.parametrize("fmt", ("bf16", "fp8"))
def test_fp8_products_take_4_bit_keys_only(fmt):
    cache, g = _filled(fmt, "nvfp4")
    q = torch.randn(3, 4, 1, 64, generator=g)
    with pytest.raises(ValueError, match="takes 4-bit keys"):
        decode(q, cache, products="fp8")
    with pytest.raises(ValueError, match="accepted"):
        decode(q, cache, products="fp4")
    with pytest.raises(ValueError, match="accepted"):
        reference_decode(q, *cache.reference_operands(), torch.tensor(cache.host_lengths), scale=0.1, products="x")


def test_fp8_products_reach_the_kernel_only_where_it_runs():
    ok = dict(k_format="nvfp4", v_format="nvfp4", head_dim=128, group=4, sq=1, page_size=256)
    nvrtc = R.NVRTC_IMPORTABLE
    if nvrtc:
        assert R.fp8_products_unsupported_reason(**ok) is None
        assert R.split_kernel(*ok.values(), on_gpu=True, products="fp8") == "cuda"
    for bad, word in ((dict(k_format="mxfp4"), "nvfp4 keys"), (dict(v_format="mxfp4"), "formats"),
                      (dict(head_dim=96), "head_dim"), (dict(sq=2), "new query rows"),
                      (dict(group=32), "query heads"), (dict(page_size=40), "page size")):
        assert word in R.fp8_products_unsupported_reason(**{**ok, **bad})
        with pytest.raises(ValueError, match="FP8-products decode kernel cannot run"):
            R.split_kernel(*{**ok, **bad}.values(), on_gpu=True, products="fp8")
    assert "interpreter" in R.fp8_products_unsupported_reason(**ok, on_gpu=False)
    if nvrtc:
        with pytest.raises(ValueError, match="no FP8 products"):
            R.split_kernel(*ok.values(), on_gpu=True, asked="triton", products="fp8")
    # "auto" runs a call the kernel does not take on the reference; "triton" refuses it
    assert R.fp8_products_backend("auto", **{**ok, "sq": 3}, on_gpu=True)[0] == "reference"
    with pytest.raises(ValueError, match="cannot run this products='fp8' call"):
        R.fp8_products_backend("triton", **{**ok, "sq": 3}, on_gpu=True)
    # forms 1 and 2 take up to 8 query heads a KV head, form 3 (routed) up to 16
    assert R.fp8_products_max_rows(1) == R.fp8_products_max_rows(2) == 8 and R.fp8_products_max_rows(3) == 16
    assert R.FP8_PRODUCTS_FORM in R.FP8_PRODUCTS_FORMS
    # the default never reaches it
    assert R.split_kernel(*ok.values(), on_gpu=True) in ("cuda", "triton")
