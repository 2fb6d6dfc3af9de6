"""The KV cache on the CPU (reference backend): what each format stores for a token, that
no token's bytes depend on any other token or sequence, the two layouts holding the same
values, and the errors that leave the cache as it was."""

import pytest
import torch

from fp4attn import KVCache
from fp4attn.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4
from fp4attn.reference.kvcache import CACHE_FORMATS, format_layout, quantize_tokens, token_values

FORMATS = CACHE_FORMATS


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("FP4ATTN_BACKEND", "reference")


def _values(payload, fmt, d):
    vals, scale = token_values(payload, fmt, d)
    return vals * scale[:, None]


def _same(a, b):
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def test_bytes_per_token_at_head_dim_128():
    assert [format_layout(f, 128).bytes_per_token() for f in ("bf16", "fp8", "nvfp4", "mxfp4")] == [256, 132, 76, 68]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_token_is_the_prefill_quantizers_applied_to_its_own_values(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    got = _values(quantize_tokens(x, fmt), fmt, 64)
    want = {"bf16": lambda: x.bfloat16().float(),
            "fp8": lambda: quantize_fp8(x, dim=-1, block=None).dequantize(),
            "nvfp4": lambda: quantize_nvfp4(x, dim=-1, scale_dims=1).dequantize(),
            "mxfp4": lambda: quantize_mxfp4(x, dim=-1).dequantize()}[fmt]()
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tokens_bytes_do_not_depend_on_the_other_tokens(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 64, generator=g)
    together = quantize_tokens(x, fmt)
    x2 = x.clone()
    x2[5:] *= 1000.0  # later tokens far larger: a tensor-wide scale would move token 0's codes
    apart = quantize_tokens(x2, fmt)
    for a, b in ((together.data, apart.data), (together.block_scale, apart.block_scale),
                 (together.token_scale, apart.token_scale)):
        if a is not None:
            assert torch.equal(a[:5], b[:5])


def test_non_finite_tokens_are_nan_wherever_they_are_read():
    x = torch.randn(4, 64)
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    for fmt in FORMATS:
        vals = _values(quantize_tokens(x, fmt), fmt, 64)
        assert torch.isfinite(vals[[0, 3]]).all(), fmt
        assert torch.isnan(vals[1]).any() and torch.isnan(vals[2]).any(), fmt
        if fmt in ("fp8", "nvfp4"):  # one token scale: the whole token
            assert torch.isnan(vals[1:3]).all(), fmt


def test_mxfp4_blocks_far_below_their_tokens_largest_are_zero():
    x = torch.ones(1, 64)
    x[0, :32] = 2.0**100
    x[0, 32:] = 2.0**-30  # 130 binades below: beyond the decode operands' window
    vals = _values(quantize_tokens(x, "mxfp4"), "mxfp4", 64)
    assert torch.equal(vals[0, 32:], torch.zeros(32)) and torch.equal(vals[0, :32], x[0, :32])


@pytest.mark.parametrize("fmt", FORMATS)
def test_contiguous_and_paged_layouts_hold_the_same_tokens(fmt):
    g = torch.Generator().manual_seed(3)
    B, H, D = 3, 2, 64
    flat = KVCache(B, H, D, 100, k_format=fmt)
    paged = KVCache(B, H, D, 100, k_format=fmt, page_size=16, num_pages=20)
    for s_new, counts in ((23, [23, 5, 0]), (1, None), (40, [40, 17, 33])):
        k, v = (torch.randn(B, H, s_new, D, generator=g) for _ in range(2))
        flat.append(k, v, counts)
        paged.append(k, v, counts)
    assert flat.host_lengths == paged.host_lengths == [64, 23, 34]
    assert flat.lengths.tolist() == [64, 23, 34]
    for a, b in zip(flat.dequantize(), paged.dequantize()):
        assert _same(a, b)
    # pages come from the pool as sequences grow, and return to it on reset
    assert len(paged._free) == 20 - (4 + 2 + 3)
    paged.reset(0)
    assert len(paged._free) == 20 - 5 and paged.host_lengths == [0, 23, 34]


def test_append_writes_the_tokens_each_sequence_takes_and_nothing_else():
    cache = KVCache(2, 1, 32, 10, k_format="bf16")
    k = torch.arange(2 * 4 * 32, dtype=torch.float32).reshape(2, 1, 4, 32)
    cache.append(k, -k, counts=[4, 2])
    kd, vd = cache.dequantize()
    assert torch.equal(kd[0, :, :4], k[0].bfloat16().float()) and torch.equal(kd[1, :, :2], k[1, :, :2].bfloat16().float())
    assert not kd[1, :, 2:].any() and torch.equal(vd, -kd)


def _state(cache):
    tensors = [t.clone() for pool in (cache.k, cache.v) for t in pool.tensors() if t is not None]
    return tensors, list(cache.host_lengths), cache.lengths.clone(), cache._host_table.clone()


def _unchanged(cache, before):
    after = _state(cache)
    return (all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]
            and torch.equal(before[2], after[2]) and torch.equal(before[3], after[3]))


BAD_APPENDS = [
    ("beyond max_len", lambda c: (torch.randn(2, 2, 9, 32), torch.randn(2, 2, 9, 32), None), "beyond max_len=12"),
    ("counts beyond max_len", lambda c: (torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32), [1, 10]),
     "beyond max_len"),
    ("head count", lambda c: (torch.randn(2, 3, 1, 32), torch.randn(2, 3, 1, 32), None), "kv_heads=2"),
    ("head dim", lambda c: (torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), None), "head_dim=32"),
    ("batch", lambda c: (torch.randn(3, 2, 1, 32), torch.randn(3, 2, 1, 32), None), "batch=2"),
    ("dtype", lambda c: (torch.ones(2, 2, 1, 32, dtype=torch.int32),) * 2 + (None,), "accepted"),
    ("k and v differ", lambda c: (torch.randn(2, 2, 2, 32), torch.randn(2, 2, 1, 32), None), "must match"),
    ("device", lambda c: (torch.randn(2, 2, 1, 32, device="meta"),) * 2 + (None,), "is on meta"),
    ("counts too many", lambda c: (torch.randn(2, 2, 2, 32), torch.randn(2, 2, 2, 32), [3, 0]), "must lie in [0, 2]"),
    ("counts length", lambda c: (torch.randn(2, 2, 2, 32), torch.randn(2, 2, 2, 32), [1]), "one per sequence"),
]


@pytest.mark.parametrize("fmt", ("nvfp4", "bf16"))
@pytest.mark.parametrize("paged", (False, True))
@pytest.mark.parametrize("name,make,message", BAD_APPENDS, ids=[b[0] for b in BAD_APPENDS])
def test_a_bad_append_names_what_was_wrong_and_leaves_the_cache_unchanged(fmt, paged, name, make, message):
    cache = KVCache(2, 2, 32, 12, k_format=fmt, page_size=4 if paged else None)
    cache.append(torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32), counts=[4, 3])
    before = _state(cache)
    k, v, counts = make(cache)
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        cache.append(k, v, counts)
    assert _unchanged(cache, before)


def test_a_paged_append_that_needs_more_pages_than_are_free_changes_nothing():
    cache = KVCache(2, 1, 32, 64, page_size=8, num_pages=3)
    cache.append(torch.randn(2, 1, 8, 32), torch.randn(2, 1, 8, 32))
    before = _state(cache)
    with pytest.raises(ValueError, match="needs 2 new pages, the pool has 1 free"):
        cache.append(torch.randn(2, 1, 1, 32), torch.randn(2, 1, 1, 32))
    assert _unchanged(cache, before)


def test_assign_pages_checks_the_pages_and_shares_a_prefix():
    cache = KVCache(2, 1, 32, 64, k_format="bf16", page_size=4, num_pages=8)
    k = torch.randn(2, 1, 6, 32)
    cache.append(k, k, counts=[6, 0])
    with pytest.raises(ValueError, match="out of range or unused"):
        cache.assign_pages(1, [0, 7], 6)
    with pytest.raises(ValueError, match="cannot hold length=9"):
        cache.assign_pages(1, [0, 1], 9)
    cache.assign_pages(1, cache._host_table[0, :2].tolist(), 6)
    kd, _ = cache.dequantize()
    assert torch.equal(kd[1], kd[0])
    cache.reset(1)  # the shared pages stay the first owner's
    assert cache.host_lengths == [6, 0] and len(cache._free) == 6


@pytest.mark.parametrize("kwargs,message", [
    (dict(head_dim=40), "multiple of 16"), (dict(k_format="int4"), "accepted"), (dict(max_len=0), "max_len"),
    (dict(num_pages=4), "pass page_size"), (dict(page_size=0), "page_size"),
])
def test_bad_cache_arguments_are_refused(kwargs, message):
    args = {**dict(batch=1, kv_heads=1, head_dim=64, max_len=8), **kwargs}
    with pytest.raises(ValueError, match=message):
        KVCache(**args)


def test_counts_must_be_on_the_host():
    cache = KVCache(1, 1, 32, 8)
    k = torch.randn(1, 1, 2, 32)
    with pytest.raises(ValueError, match="on the host"):
        cache.append(k, k, counts=torch.tensor([1], device="meta"))
    assert cache.bytes_per_token() == 2 * (16 + 2 + 4)  # K and V: codes, E4M3 scales, the token scale
