"""The Hopper decode kernels against the reference decode and the reference cache writes.

On a Hopper GPU (`gpu`): the dequantizing asm on every code and scale, the append's
bytes, and decode on awkward shapes (lengths no multiple of any tile, GQA, several
lengths in one batch, Sq up to 16, left padding, contiguous and paged layouts with
aligned and unaligned pages, one long sequence split many ways), NaN isolation and
torch.compile. The reference runs on the same GPU tensors (`backend="reference"`), so
the two share the quantized operands and differ only in float32 summation order (and,
rarely, a bf16 rounding of P where an exp2 ulp tips it).

Under the Triton interpreter on the CPU (`interpreter`): the quantize-on-write append
writes the reference's bytes, and the split kernel with its combine computes the
reference decode, on awkward shapes (lengths that are no multiple of a tile, GQA,
several lengths in one batch, Sq > 1, left padding, both layouts with aligned and
unaligned pages, more splits than one). The interpreter runs the float arithmetic path
(no inline PTX) with float32 operands: the GPU tests check the bf16 path and its
dequantizing asm."""

import os
import textwrap

import pytest
import torch

from fp4attn import KVCache, decode
from fp4attn.kernels.hopper import decode_op
from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")


FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")


def _filled(kf, vf, B, H, D, lens, page_size=None, max_len=None, backend="auto", seed=0, scale=2.0, bad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = KVCache(B, H, D, max_len or max(lens) + 64, k_format=kf, v_format=vf, device="cuda",
                    page_size=page_size)
    old = os.environ.get("FP4ATTN_BACKEND")
    os.environ["FP4ATTN_BACKEND"] = backend
    try:
        n = max(lens)
        for part in (n - min(n, 5), min(n, 5)):  # a prefill, then a few steps' worth
            if part == 0:
                continue
            k, v = (torch.randn(B, H, part, D, device="cuda", generator=g) * scale for _ in range(2))
            if bad:
                k[0, 0, 0, 3] = float("nan")
                v[B - 1, H - 1, part - 1, 1] = float("inf")
            counts = [min(part, max(0, L - cache.host_lengths[b])) for b, L in enumerate(lens)]
            cache.append(k.bfloat16(), v.bfloat16(), counts)
    finally:
        if old is None:
            del os.environ["FP4ATTN_BACKEND"]
        else:
            os.environ["FP4ATTN_BACKEND"] = old
    return cache


def _check(got, want, lse, want_lse, name):
    assert torch.equal(torch.isnan(got), torch.isnan(want)), name
    g, w = got.float().nan_to_num(), want.float().nan_to_num()
    err = (g - w).norm() / w.norm().clamp(min=1e-30)
    assert err < 2e-3, (name, float(err))  # bf16 outputs: 2**-9 a value
    assert torch.allclose(lse.nan_to_num(), want_lse.nan_to_num(), rtol=1e-4, atol=1e-4), name


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_writes_the_reference_bytes(fmt):
    ref = _filled(fmt, fmt, 3, 2, 128, (300, 1, 37), page_size=16, backend="reference", bad=True)
    got = _filled(fmt, fmt, 3, 2, 128, (300, 1, 37), page_size=16, bad=True)
    assert got.host_lengths == ref.host_lengths and got.lengths.tolist() == ref.lengths.tolist()
    pages, slots = ref.token_positions()
    kd, vd = ref.dequantize()
    finite = torch.isfinite(kd).all(-1) & torch.isfinite(vd).all(-1)
    for pg, pr in ((got.k, ref.k), (got.v, ref.v)):
        for name in ("data", "block_scale", "token_scale"):
            x, y = getattr(pg, name), getattr(pr, name)
            if x is None:
                continue
            x, y = x[pages, :, slots].transpose(1, 2), y[pages, :, slots].transpose(1, 2)
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
            assert torch.equal(x[finite].view(bits), y[finite].view(bits)), (fmt, name)
    for a, b in zip(got.dequantize(), ref.dequantize()):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("fp8", "nvfp4", "mxfp4"))
def test_every_code_and_scale_dequantizes_exactly(fmt):
    """Random bytes in every payload slot (all codes, every scale including e4m3
    subnormals, zero and NaN), each token alone in its sequence and q = 0, so that P = 1:
    the output is the token's V as the reference reads it, and with a one-hot q per
    query head the LSE is scale * (K's value in that channel)."""
    B, H, D = 64, 1, 64
    cache = KVCache(B, H, D, 8, k_format=fmt, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    for pool in (cache.k, cache.v):
        pool.data.copy_(torch.randint(0, 256, pool.data.shape, device="cuda", generator=g, dtype=torch.int32))
        if fmt == "fp8":  # e4m3 NaN codes are stored only beside a NaN token scale
            pool.data.masked_fill_((pool.data & 0x7F) == 0x7F, 0x7E)
        if pool.block_scale is not None:
            top = 128 if fmt == "nvfp4" else 256  # e4m3 scales are positive (0x7F NaN); e8m0 0..255 (0xFF NaN)
            pool.block_scale.copy_(torch.randint(0, top, pool.block_scale.shape, device="cuda", generator=g,
                                                 dtype=torch.int32))
            if fmt == "mxfp4":  # keep tokens within the window: exponents near each other
                pool.block_scale.copy_(pool.block_scale % 16 + 120)
        if pool.token_scale is not None:
            pool.token_scale.copy_(torch.rand(pool.token_scale.shape, device="cuda", generator=g) + 0.5)
    cache.host_lengths = [1] * B
    cache.lengths.fill_(1)
    q = torch.zeros(B, D, 1, D, device="cuda")  # GQA group D: one query head per channel
    got, lse = decode(q, cache, return_lse=True)
    want, want_lse = decode(q, cache, return_lse=True, backend="reference")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())
    q = torch.eye(D, device="cuda").reshape(1, D, 1, D).expand(B, D, 1, D).contiguous()
    _, lse = decode(q, cache, return_lse=True, scale=1.0)
    _, want_lse = decode(q, cache, return_lse=True, scale=1.0, backend="reference")
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    # the score is exact; exp2 and log2 are the GPU's approximations in the kernel
    assert torch.allclose(lse.nan_to_num(), want_lse.nan_to_num(), rtol=1e-6, atol=1e-6)


CASES = [  # K, V, B, Hkv, Hq, D, lengths, Sq, page size
    ("nvfp4", "nvfp4", 3, 8, 32, 128, (4099, 1, 1000), 1, None),
    ("mxfp4", "mxfp4", 2, 8, 32, 128, (37, 2300), 1, 256),
    ("fp8", "fp8", 4, 2, 16, 128, (1, 63, 129, 777), 3, None),
    ("bf16", "bf16", 2, 4, 16, 64, (515, 12), 16, 64),
    ("nvfp4", "fp8", 2, 1, 8, 64, (333, 90), 5, 16),
    ("mxfp4", "nvfp4", 1, 8, 8, 128, (2049,), 2, 128),
    ("fp8", "mxfp4", 2, 2, 4, 64, (100, 1500), 1, 32),
    ("bf16", "nvfp4", 1, 4, 32, 128, (640,), 16, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-L{c[6]}-sq{c[7]}-ps{c[8]}" for c in CASES])
@pytest.mark.parametrize("causal", (True, False))
def test_decode_matches_the_reference(case, causal):
    kf, vf, B, Hkv, Hq, D, lens, sq, ps = case
    cache = _filled(kf, vf, B, Hkv, D, lens, page_size=ps)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(B, Hq, sq, D, device="cuda", generator=g).bfloat16()
    want, want_lse = decode(q, cache, causal=causal, return_lse=True, backend="reference")
    got, lse = decode(q, cache, causal=causal, return_lse=True)
    _check(got, want, lse, want_lse, case)
    # another split of the keys (64-key tiles, many splits) gives the same result
    many = decode_op.decode_routing.DecodeLaunch(64, 4, 2, min_split_tiles=1, splits=64)
    got2, lse2 = decode_op.hopper_decode(q, cache, scale=D**-0.5, causal=causal, launch=many)
    _check(got2, want, lse2, want_lse, (case, "many splits"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("fp8", "nvfp4", "mxfp4"))
def test_the_asm_and_the_float_dequantization_agree(fmt):
    """The inline-PTX bit placement and the float arithmetic make the same bf16 operands,
    so the whole decode is bit-identical."""
    cache = _filled(fmt, fmt, 2, 8, 128, (700, 130))
    q = torch.randn(2, 32, 2, 128, device="cuda").bfloat16()
    launch = decode_op.decode_routing.DEFAULT_LAUNCH
    outs = [decode_op.hopper_decode(q, cache, scale=128**-0.5, causal=True,
                                    launch=decode_op.decode_routing.DecodeLaunch(
                                        launch.block_n, launch.warps, launch.stages, launch.programs_per_sm,
                                        launch.min_split_tiles, asm))
            for asm in (True, False)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.gpu
def test_left_padding_and_rows_that_see_nothing():
    cache = _filled("nvfp4", "mxfp4", 3, 2, 128, (300, 300, 300))
    q = torch.randn(3, 8, 4, 128, device="cuda").bfloat16()
    start = torch.tensor([0, 131, 298], device="cuda", dtype=torch.int32)
    want, want_lse = decode(q, cache, key_start=start, return_lse=True, backend="reference")
    got, lse = decode(q, cache, key_start=start, return_lse=True)
    _check(got, want, lse, want_lse, "key_start")
    assert not got[2, :, :2].float().any() and torch.isinf(lse[2, :, :2]).all()


@pytest.mark.gpu
def test_one_long_sequence_split_many_ways():
    cache = _filled("nvfp4", "nvfp4", 1, 8, 128, (131072,), max_len=131072, scale=1.0)
    q = torch.randn(1, 32, 1, 128, device="cuda").bfloat16()
    want, want_lse = decode(q, cache, return_lse=True, backend="reference")
    got, lse = decode(q, cache, return_lse=True)
    _check(got, want, lse, want_lse, "131072")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_reaches_only_the_rows_that_read_it(fmt):
    cache = _filled(fmt, fmt, 3, 2, 128, (200, 200, 200))
    k, v = (torch.randn(3, 2, 4, 128, device="cuda").bfloat16() for _ in range(2))
    v[0, 1, 3, 7] = float("nan")  # sequence 0's last new token: only the last row of heads 4..7 reads it
    k[2, 0, 1, 0] = float("inf")  # sequence 2's second new token: rows 1..3 of heads 0..3
    q = torch.randn(3, 8, 4, 128, device="cuda").bfloat16()
    got = decode(q, cache, k=k, v=v)
    nan_rows = torch.isnan(got).any(-1)
    want = torch.zeros_like(nan_rows)
    want[0, 4:, 3] = True
    want[2, :4, 1:] = True
    assert torch.equal(nan_rows, want)


@pytest.mark.gpu
def test_decode_compiles():
    cache = _filled("nvfp4", "nvfp4", 2, 2, 128, (100, 70))
    q = torch.randn(2, 8, 1, 128, device="cuda").bfloat16()

    def step(q):
        return decode(q, cache) * 2

    got = torch.compile(step, fullgraph=True)(q)
    assert torch.equal(got, step(q))


CUDA_CASES = [  # (K, V, B, Hkv, Hq, D, lengths, page size, key_start)
    ("nvfp4", "nvfp4", 3, 8, 32, 128, (4099, 1, 1000), None, None),
    ("fp8", "fp8", 2, 2, 32, 128, (17, 2345), 16, None),  # 16 query heads a KV head: rows 8-15 of the tile
    ("nvfp4", "fp8", 2, 4, 8, 64, (700, 63), 32, (5, 0)),
    ("fp8", "nvfp4", 1, 1, 12, 64, (16,), 16, (15,)),
    ("nvfp4", "nvfp4", 2, 2, 4, 128, (1, 31), 48, (0, 30)),
    ("bf16", "bf16", 2, 2, 32, 128, (17, 2345), 16, None),  # bf16 keys: q in two bf16 parts
    ("bf16", "fp8", 2, 4, 8, 64, (700, 63), 32, (5, 0)),
    ("nvfp4", "bf16", 1, 8, 32, 128, (1000,), None, None),
    ("mxfp4", "mxfp4", 2, 2, 32, 128, (17, 2345), 16, None),  # MXFP4 keys: bf16 operands, as bf16 keys
    ("mxfp4", "fp8", 2, 4, 8, 128, (700, 63), 32, (5, 0)),
    ("fp8", "mxfp4", 1, 1, 12, 128, (16,), 16, (15,)),
    ("bf16", "mxfp4", 2, 2, 4, 128, (1, 31), 48, (0, 30)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"{c[0]}-{c[1]}-Hq{c[4]}-D{c[5]}-L{c[6]}-ps{c[7]}")
def test_the_cuda_split_kernel_matches_the_reference_and_the_triton_kernel(case):
    """One warp a split (`decode_cuda`): against the reference, and against the Triton
    split kernel on the same cache, with the planned splits and with many, its tiles
    through the cp.async ring (the routed depth and 2) and prefetched in registers; the
    combine writes q's dtype (bf16, and fp16 / float32 for one case each)."""
    kf, vf, B, Hkv, Hq, D, lens, ps, start = case
    cache = _filled(kf, vf, B, Hkv, D, lens, page_size=ps, bad=True)
    q = torch.randn(B, Hq, 1, D, device="cuda").bfloat16()
    ks = None if start is None else torch.tensor(start, device="cuda", dtype=torch.int32)
    want, want_lse = decode(q, cache, key_start=ks, return_lse=True, backend="reference")
    R = decode_op.decode_routing
    for kernel in ("cuda", "cuda:2") + (("cuda:0",) if "bf16" not in (kf, vf) else ()):  # (bf16: a ring only)
        for launch in (R.DecodeLaunch(128, 4, 2, kernel=kernel), R.DecodeLaunch(128, 4, 2, splits=37, kernel=kernel)):
            got, lse = decode_op.hopper_decode(q, cache, scale=D**-0.5, causal=True, key_start=ks, launch=launch)
            _check(got, want, lse, want_lse, (case, launch))
    dtype = {2: torch.float16, 3: torch.float32}.get(CUDA_CASES.index(case))
    if dtype is not None:
        got, lse = decode_op.hopper_decode(q.to(dtype), cache, scale=D**-0.5, causal=True, key_start=ks,
                                           launch=R.DecodeLaunch(128, 4, 2, kernel="cuda"))
        assert got.dtype == dtype
        _check(got.bfloat16(), want, lse, want_lse, (case, dtype))
    tri, tri_lse = decode_op.hopper_decode(q, cache, scale=D**-0.5, causal=True, key_start=ks,
                                           launch=R.DecodeLaunch(128, 4, 2, kernel="triton"))
    _check(got, tri, lse, tri_lse, (case, "triton"))


@pytest.mark.gpu
def test_the_cuda_split_kernel_refuses_what_it_cannot_run():
    cache = _filled("mxfp4", "mxfp4", 1, 1, 64, (40,))  # (it takes MXFP4 at D = 128 only)
    q = torch.randn(1, 4, 1, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="CUDA decode kernel cannot run"):
        decode_op.hopper_decode(q, cache, scale=0.1, causal=True,
                                launch=decode_op.decode_routing.DecodeLaunch(128, 4, 2, kernel="cuda"))


# Under the Triton interpreter (CPU)
SCRIPT = KERNEL_PATCHES + textwrap.dedent('''
    import os
    os.environ["FP4ATTN_TARGET"] = "sm_90"  # CPU tensors routed to the Hopper kernels, interpreted
    import torch
    from fp4attn import KVCache, decode
    from fp4attn.kernels.hopper import decode_op

    def same(a, b, name):
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]), name

    def filled(fmt_k, fmt_v, B, H, D, lens, page_size, backend, g, bad=False):
        os.environ["FP4ATTN_BACKEND"] = backend
        cache = KVCache(B, H, D, 400, k_format=fmt_k, v_format=fmt_v, page_size=page_size)
        for n in (max(lens) - 3, 3):  # a long append, then a short one
            k, v = (torch.randn(B, H, n, D, generator=g) * 2 for _ in range(2))
            if bad:
                k[0, 0, 1, 3] = float("nan")
                v[-1, -1, 0, 2] = float("inf")
            counts = [min(n, max(0, L - cache.host_lengths[b])) for b, L in enumerate(lens)]
            cache.append(k, v, counts)
        del os.environ["FP4ATTN_BACKEND"]
        return cache

    g = torch.Generator().manual_seed(0)
    # the append: the kernel's values equal the reference's (bytes too, on finite tokens:
    # the interpreter's e4m3 cast of NaN is not torch's)
    for fmt, ps in (("bf16", 16), ("fp8", None), ("nvfp4", 16), ("mxfp4", None)):
        state = g.get_state()
        ref = filled(fmt, fmt, 2, 2, 64, (40, 9), ps, "reference", g, bad=True)
        g.set_state(state)
        got = filled(fmt, fmt, 2, 2, 64, (40, 9), ps, "auto", g, bad=True)
        assert got.host_lengths == ref.host_lengths and got.lengths.tolist() == ref.lengths.tolist()
        for a, b in zip(got.dequantize(), ref.dequantize()):
            same(a, b, f"append {fmt} {ps}")
        kd, vd = ref.dequantize()
        finite = torch.isfinite(kd).all(-1) & torch.isfinite(vd).all(-1)  # (B, H, N) tokens
        for pool_got, pool_ref in ((got.k, ref.k), (got.v, ref.v)):
            pages, slots = got.token_positions()
            for name in ("data", "block_scale", "token_scale"):
                x, y = getattr(pool_got, name), getattr(pool_ref, name)
                if x is None:
                    continue
                x, y = x[pages, :, slots].transpose(1, 2)[finite], y[pages, :, slots].transpose(1, 2)[finite]
                if fmt == "fp8" and name == "data":  # the interpreter's e4m3 cast drops the sign of zero
                    x, y = (t.masked_fill(t == 0x80, 0) for t in (x, y))
                same(x.float(), y.float(), f"bytes {fmt} {ps} {name}")

    # decode: kernels against the reference
    cases = [  # K, V, B, Hkv, Hq, D, lengths, Sq, page size, causal, key_start
        ("nvfp4", "nvfp4", 2, 2, 8, 64, (200, 37), 1, None, True, None),
        ("mxfp4", "fp8", 2, 2, 4, 64, (131, 5), 3, 16, True, None),
        ("fp8", "mxfp4", 1, 1, 3, 128, (131,), 2, 128, True, None),
        ("bf16", "nvfp4", 2, 1, 2, 64, (129, 64), 4, 64, False, None),
        ("nvfp4", "bf16", 3, 2, 4, 64, (150, 90, 1), 2, None, True, (3, 70, 0)),
        ("fp8", "fp8", 1, 2, 2, 64, (70,), 16, 32, True, None),
    ]
    for kf, vf, B, Hkv, Hq, D, lens, sq, ps, causal, start in cases:
        cache = filled(kf, vf, B, Hkv, D, lens, ps, "reference", g, bad=kf == "fp8")
        q = torch.randn(B, Hq, sq, D, generator=g)
        ks = None if start is None else torch.tensor(start)
        want, want_lse = decode(q, cache, causal=causal, key_start=ks, return_lse=True, backend="reference")
        for launch in (None, decode_op.decode_routing.DecodeLaunch(64, 4, 1, min_split_tiles=1, splits=16)):  # planned, and many
            got, lse = decode_op.hopper_decode(q, cache, scale=D**-0.5, causal=causal, key_start=ks, launch=launch)
            name = f"decode {kf} {vf} {lens} sq={sq} ps={ps} {launch}"
            assert torch.equal(torch.isnan(got), torch.isnan(want)), name
            assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-6), name
            assert torch.allclose(lse.nan_to_num(), want_lse.nan_to_num(), rtol=1e-5, atol=1e-5), name
    print("ok")
''')


@pytest.mark.interpreter
def test_decode_kernels_match_the_reference_under_the_interpreter():
    run_under_interpreter(SCRIPT)
