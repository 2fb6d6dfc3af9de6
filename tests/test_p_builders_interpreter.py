"""The kernels' Direct-P builder (`kernels/common.p_mxfp4_directp`) under the Triton
interpreter (CPU) against the reference's `directp_classify`, value for value, on tiles
built to sit on every threshold: for each of the seven E2M1 thresholds and several block
exponents, the float32 values just below, at and just above it, plus fully masked
blocks, blocks below the e4m3 range, row maxima at 0 and random rows.

The builder is compares, selects, floor and exponent bit assembly, all exact in the
interpreter's float32; the GPU tests (test_hopper_forward.py) check the compiled kernel's
codes on the H200. This one runs in CI."""

import textwrap

import pytest

from tests.interpreter import run_under_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from fp4attn.kernels.common import build_p_tile
    from fp4attn.reference.directp import DIRECTP_THRESHOLDS, build_p
    from fp4attn.reference.encoding import P_EMIN, P_OFFSET_LOG2

    @triton.jit
    def p_kernel(X, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_MODE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(P + offs, build_p_tile(tl.load(X + offs), P_MODE, 1))

    def near(t, k=3):  # the float32 values k ulps around t
        v = np.float32(t)
        out = [v]
        lo = hi = v
        for _ in range(k):
            lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
            out += [lo, hi]
        return out

    rows = []
    g = torch.Generator().manual_seed(0)
    for e_b in (0, -1, -2, -5, -17, P_EMIN, P_EMIN - 1):
        # x within 3 ulps of e_b + T for each threshold T, so y = x - e_b straddles T (and
        # is T exactly for e_b = 0: such a tile is not normalized, which the classifier
        # does not need); the block maximum e_b + 2 fixes the block exponent
        ys = [x for t in DIRECTP_THRESHOLDS for x in near(np.float32(e_b) + np.float32(t))]
        ys += [np.float32(e_b + d) for d in (-30.0, -2.0, 0.0, 1.0, 2.0)]
        while ys:
            block = np.full(32, -np.inf, np.float32)
            block[0] = np.float32(e_b + 2)
            part, ys = ys[:31], ys[31:]
            block[1:1 + len(part)] = part
            rows.append(block)
    tiles = []
    for i in range(0, len(rows), 4):  # four 32-key blocks per 128-key row
        r = rows[i:i + 4]
        r += [np.full(32, -np.inf, np.float32)] * (4 - len(r))  # fully masked blocks
        tiles.append(np.concatenate(r))
    x = torch.from_numpy(np.stack(tiles))
    rand = -torch.rand(64, 128, generator=g) * torch.tensor([0.5, 3.0, 12.0, 40.0]).repeat_interleave(16)[:, None]
    rand[::7, :] -= rand[::7, :].amax(-1, keepdim=True)  # rows whose maximum is exactly 0
    rand[3, 40:72] = -float("inf")
    x = torch.cat([x, rand.float()])
    x = torch.cat([x, torch.full((-x.shape[0] % 16, 128), -float("inf"))])
    p = torch.empty_like(x)
    p_kernel[(x.shape[0] // 16,)](x, p, BLOCK_M=16, BLOCK_N=128, P_MODE=1)
    want = build_p(x, "mxfp4", "directp") * 2.0**P_OFFSET_LOG2
    bad = (p != want).nonzero()
    assert bad.numel() == 0, (len(bad), [(x[i, j].item(), p[i, j].item(), want[i, j].item())
                                         for i, j in bad[:5].tolist()])
    on_threshold = sum(int((x == t).sum()) for t in DIRECTP_THRESHOLDS)
    assert on_threshold >= len(DIRECTP_THRESHOLDS), on_threshold
    print(tuple(x.shape), "identical;", on_threshold, "elements with y exactly on a threshold")
    print("ok")
''')


def test_directp_builder_under_the_interpreter():
    run_under_interpreter(SCRIPT, timeout=600)
