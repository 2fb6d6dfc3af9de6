"""The decode kernels under the Triton interpreter (CPU): the quantize-on-write append
writes the reference's bytes, and the split kernel with its combine computes the
reference decode, on awkward shapes (lengths that are no multiple of a tile, GQA,
several lengths in one batch, Sq > 1, left padding, both layouts with aligned and
unaligned pages, more splits than one). The interpreter runs the float arithmetic path
(no inline PTX) with float32 operands: the GPU tests (test_decode_hopper.py) check the
bf16 path and its dequantizing asm."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

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


def test_decode_kernels_match_the_reference_under_the_interpreter():
    run_under_interpreter(SCRIPT)
