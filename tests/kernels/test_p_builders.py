"""The kernels' Direct-P builder (`kernels/common.p_mxfp4_directp`) under the Triton
interpreter (CPU) against the reference's `directp_classify`, value for value, on tiles
built to sit on every threshold: for each of the seven E2M1 thresholds and several block
exponents, the float32 values just below, at and just above it, plus fully masked
blocks, blocks below the e4m3 range, row maxima at 0 and random rows.

The builder is compares, selects, floor and exponent bit assembly, all exact in the
interpreter's float32; the GPU tests (tests/kernels/hopper/test_forward.py) check the compiled kernel's
codes on the H200. This one runs in CI."""

import textwrap

import pytest

from tests.interpreter import run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

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


SINK_SCRIPT = textwrap.dedent('''
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from fp4attn.kernels.common import build_p_tile
    from fp4attn.reference.directp import DIRECTP_THRESHOLDS, build_p
    from fp4attn.reference.encoding import P_EMIN, P_OFFSET_LOG2

    @triton.jit
    def p_kernel(X, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_AXIS: tl.constexpr):
        # KEY_AXIS 1: a (rows, keys) tile, as the forward's S; 0: the same numbers
        # loaded as a (keys, rows) tile, as the backward's S^T
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        if KEY_AXIS == 1:
            offs = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        else:
            offs = rows[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(P + offs, build_p_tile(tl.load(X + offs), 3, KEY_AXIS))

    f32 = np.float32
    NEG = -np.inf

    def ulps(v, k):  # v moved by k float32 ulps (k < 0: down)
        v = f32(v)
        for _ in range(abs(k)):
            v = np.nextafter(v, f32(np.inf if k > 0 else -np.inf))
        return v

    g = np.random.default_rng(0)
    blocks = []

    def block(top, n_top, rest, at=None):
        b = np.full(32, NEG, f32)
        rest = list(rest)[:32 - n_top]
        b[:len(rest)] = rest
        g.shuffle(b)
        pos = g.choice(32, n_top, replace=False) if at is None else at
        b[pos] = f32(top)
        blocks.append(b)

    # the rest's Direct-P codes on every threshold (as the P_MODE 1 test), under a top
    # key up to 2.25 above the rest's maximum (at most e_b + 2.33), one key or ties of
    # two and three; x <= 0, as the kernels' normalized tiles
    for e_b in (-3, -4, -5, -17, P_EMIN, P_EMIN - 1):
        ys = [ulps(f32(e_b) + f32(t), k) for t in DIRECTP_THRESHOLDS for k in range(-3, 4)]
        ys += [f32(e_b + d) for d in (-30.0, -2.0, 0.0, 1.0)]
        for i in range(0, len(ys), 29):
            top = min(0.0, e_b + 2.4 + (i // 29) % 4 * 0.75)
            block(top, 1 + (i // 29) % 3, [f32(e_b + 2)] + ys[i:i + 29])
    # ties: the whole block, half of it, the rest's maximum tied and one ulp below the top
    for top in (0.0, -0.3, -7.25, -20.0):
        block(top, 32, [])
        block(top, 16, g.uniform(top - 6, top, 16).astype(f32))
        block(top, 1, [ulps(top, -1)] * 3 + list(g.uniform(top - 6, top, 20).astype(f32)))
        block(top, 2, [ulps(top, -1)] + list(g.uniform(top - 40, top, 29).astype(f32)))
    # the rest's maximum on an integer (its floor) and one ulp either side
    for m in (-1.0, -3.0, -8.0, -15.0):
        for k in (-1, 0, 1):
            block(0.0 if m > -8 else m + 0.5, 1, [ulps(m, k)] + list(g.uniform(m - 5, m, 20).astype(f32)))
    # only the top left (the others masked), fully masked, the rest dropped below P_EMIN
    # while the top is kept, and the top below e4m3's normals (2**(x + 8) < 2**-6)
    block(-0.5, 1, [])
    block(-9.0, 3, [])
    blocks.append(np.full(32, NEG, f32))
    block(-2.0, 1, g.uniform(-40, -20, 25).astype(f32))
    for top in (-14.5, -15.0, -16.9, -17.0, -17.5, -20.0):
        block(top, 1, g.uniform(top - 4, top, 25).astype(f32))
    # tops whose 2**(x + 8) sits near a midpoint of the e4m3 grid
    grid = np.array([(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)] +
                    [m / 8 * 2.0**-6 for m in range(1, 8)])
    grid = np.sort(grid[grid <= 256])
    mids = (grid[1:] + grid[:-1]) / 2
    for mid in mids[::3]:
        x = f32(np.log2(mid) - 8)
        for k in (-1, 0, 1):
            block(min(ulps(x, k), f32(0.0)), 1, g.uniform(x - 3, x, 10).astype(f32))
    # random blocks, some keys masked
    for _ in range(24):
        b = (-g.random(32) * g.choice([0.5, 3.0, 12.0, 40.0])).astype(f32)
        b[g.random(32) < 0.2] = NEG
        blocks.append(b)

    blocks += [np.full(32, NEG, f32)] * (-len(blocks) % 4)
    x = torch.from_numpy(np.stack(blocks).reshape(-1, 128))
    nan_rows = torch.arange(x.shape[0], x.shape[0] + 2)
    x = torch.cat([x, torch.full((2, 128), float("nan"))])  # a NaN score: the whole row is NaN
    x = torch.cat([x, torch.full((-x.shape[0] % 16, 128), -float("inf"))])
    want = build_p(x, "mxfp4", "directp", sink=True) * 2.0**P_OFFSET_LOG2
    for key_axis in (1, 0):
        p = torch.empty_like(x)
        p_kernel[(x.shape[0] // 16,)](x, p, BLOCK_M=16, BLOCK_N=128, KEY_AXIS=key_axis)
        # a NaN row's P is 0 (its NaN reaches the output through the running max, the
        # rescale and the row sum, online_softmax_p); the reference writes NaN into P
        assert torch.equal(p[nan_rows], torch.zeros(2, 128)), key_axis
        keep = torch.ones(x.shape[0], dtype=torch.bool)
        keep[nan_rows] = False
        got, ref = p[keep].view(torch.int32), want[keep].view(torch.int32)
        bad = (got != ref).nonzero()
        assert bad.numel() == 0, (key_axis, len(bad), [(x[keep][i, j].item(), p[keep][i, j].item(),
                                                        want[keep][i, j].item()) for i, j in bad[:5].tolist()])
    tops = int(((x == x.reshape(-1, 4, 32).amax(-1).repeat_interleave(32, -1)) & (x > -float("inf"))).sum())
    print(tuple(x.shape), "identical bit for bit on both key axes;", tops, "finite top keys")
    print("ok")
''')


def test_directp_sink_builder_under_the_interpreter():
    """P_MODE 3 (`Recipe.p_sink`): the kernels' P tile is the reference's
    `build_p(..., sink=True)` bit for bit on tiles built against it: ties at the block
    maximum (two, three, sixteen, all 32 keys), the rest's maximum one ulp below the top
    and on an integer, every Direct-P threshold under a top key, a top alone in its block,
    fully masked blocks, the rest dropped below P_EMIN under a kept top, tops near the
    e4m3 midpoints and below its normals, and NaN rows (P 0, as the forward propagates
    NaN through the running max instead)."""
    run_under_interpreter(SINK_SCRIPT, timeout=600)


AFFINE_SCRIPT = textwrap.dedent('''
    import math

    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from fp4attn.kernels.common import online_softmax_p
    from fp4attn.reference.affine import K_FP8_F32, build_p_affine, snap_max

    @triton.jit
    def p_kernel(T, M, P, MO, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_MODE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        p, alpha, m_new, l = online_softmax_p(tl.load(T + offs), tl.load(M + rows),
                                              tl.zeros([BLOCK_M], tl.float32), P_MODE, False, True)
        tl.store(P + offs, p)
        tl.store(MO + rows, m_new)
        tl.store(L + rows, l)

    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 12 + torch.randn(64, 1, generator=g) * 200
    t[3] = -math.inf  # a row that has seen no key
    t[5, 7] = float("nan")  # a NaN row
    t[6, 40:] = -math.inf
    t[9, 32:64] = t[9].amax() - 40.0  # a block below P_EMIN
    # rows whose scores sit on the FP8 map's rounding midpoints (ties to even) and an ulp
    # either side, relative to a reference point taken from the row's own maximum 0
    mid = np.float32((np.arange(0, 42, dtype=np.float64) + 0.5 - K_FP8_F32) / 8.0 + snap_max(torch.zeros(1), "fp8").item())
    tie_row = np.concatenate([[0.0], mid, np.nextafter(mid, np.float32(1)), np.nextafter(mid, np.float32(-1)),
                              np.full(128 - 1 - 3 * len(mid), -np.inf)]).astype(np.float32)
    t[10] = torch.from_numpy(tie_row)
    t = t.float().contiguous()
    m0 = torch.full((64,), -math.inf)
    for mode, fmt in ((4, "fp8"), (5, "mxfp4")):
        p, mo, l = torch.empty_like(t), torch.empty(64), torch.empty(64)
        p_kernel[(4,)](t, m0, p, mo, l, BLOCK_M=16, BLOCK_N=128, P_MODE=mode)
        m_new = torch.where(torch.isnan(t).any(-1), float("nan"), t.amax(-1))
        m_ref = snap_max(torch.where(m_new == -math.inf, 0.0, m_new), fmt)
        want = build_p_affine(t, m_ref, fmt) * 256.0
        same = (p == want) | (torch.isnan(p) & torch.isnan(want))
        assert bool(same.all()), (fmt, [(t[i, j].item(), p[i, j].item(), want[i, j].item())
                                        for i, j in (~same).nonzero()[:5].tolist()])
        assert torch.equal(torch.isnan(l), torch.isnan(want).any(-1))
        ok = ~torch.isnan(l)
        assert torch.equal(l[ok], want.sum(-1)[ok]) or bool(((l[ok] - want.sum(-1)[ok]).abs() <= 1e-6 * l[ok]).all())
        carried = torch.where(m_new == -math.inf, m_new, m_ref)
        assert torch.equal(mo.nan_to_num(), carried.nan_to_num()), fmt

    # P mode 7 (Recipe.rescale="lazy") from rows that have a point already: points far above
    # the tile (kept), a little below it (kept while the bytes fit), below it by more than
    # the room (moved), by hundreds (moved: no byte wraps), a row on the keep/move edge and
    # one ulp above it, rows with no point yet (moved to the tile's own)
    from fp4attn.reference.affine import K_FP8_LAZY_F32, lazy_reference_point

    row_max = t.nan_to_num(nan=0.0).amax(-1)
    shift = torch.tensor([6.0, -1.0, -2.5, -4.5, -300.0, 0.0, 0.0, 0.0] * 8)
    m_pt = snap_max(torch.where(row_max == -math.inf, 0.0, row_max) + shift, "fp8", k=K_FP8_LAZY_F32)
    m_pt[[3, 11, 19]] = -math.inf
    t7 = t.clone()
    edge = [np.float32((126.5 - K_FP8_LAZY_F32) / 8.0 + m_pt[i].item()) for i in (12, 13)]
    t7[12].clamp_(max=float(edge[0]))
    t7[13].clamp_(max=float(edge[1]))
    t7[12, 0], t7[13, 0] = float(edge[0]), float(np.nextafter(edge[1], np.float32(np.inf)))
    p, mo, l = torch.empty_like(t7), torch.empty(64), torch.empty(64)
    p_kernel[(4,)](t7, m_pt, p, mo, l, BLOCK_M=16, BLOCK_N=128, P_MODE=7)
    m_new = torch.where(torch.isnan(t7).any(-1), float("nan"), torch.maximum(m_pt, t7.amax(-1)))
    m_ref = lazy_reference_point(t7, m_pt, torch.where(m_new == -math.inf, 0.0, m_new))
    assert float(m_ref[12]) == float(m_pt[12]) and float(m_ref[13]) > float(m_pt[13])
    kept = (m_ref == m_pt).sum().item()
    assert 8 < kept < 56, kept
    want = build_p_affine(t7, m_ref, "fp8", K_FP8_LAZY_F32) * 32.0
    same = (p == want) | (torch.isnan(p) & torch.isnan(want))
    assert bool(same.all()), [(i, j, t7[i, j].item(), p[i, j].item(), want[i, j].item())
                              for i, j in (~same).nonzero()[:5].tolist()]
    assert bool((p[~torch.isnan(p)] <= 448.0).all())
    ok = ~torch.isnan(l)
    assert torch.equal(torch.isnan(l), torch.isnan(want).any(-1))
    assert bool(((l[ok] - want.sum(-1)[ok]).abs() <= 1e-6 * l[ok]).all())
    carried = torch.where(m_new == -math.inf, m_new, m_ref)
    assert torch.equal(mo.nan_to_num(), carried.nan_to_num())
    print("ok")
''')


def test_affine_builders_under_the_interpreter():
    """The kernels' affine builders (P modes 4, 5 and 7 of `online_softmax_p`) equal the
    reference's `build_p_affine` value for value, on random rows with large offsets (the
    rounding of C), masked keys, an empty row, a NaN row, a dropped block and scores on
    every FP8 rounding midpoint; the row sums and the carried reference point too; and
    the lazy point's keep-or-move choice (`lazy_reference_point`), on its edge too."""
    run_under_interpreter(AFFINE_SCRIPT)


TILE_SCRIPT = textwrap.dedent('''
    import torch

    from fp4attn.kernels.quantize.fp8 import quantize_k_fp8_tiles
    from fp4attn.reference.operands import quantize_qk

    g = torch.Generator().manual_seed(0)
    for S, D in ((300, 64), (128, 128), (5, 64)):
        x = (torch.randn(2, 3, S, D, generator=g) * torch.rand(2, 3, S, 1, generator=g) * 10).bfloat16()
        x[0, 1, 3, 5] = float("nan")
        x[1, 2] = 0  # an all-zero head: scale 1, zero values
        y, s = quantize_k_fp8_tiles(x, 128, torch.bfloat16)
        ref = quantize_qk(x, "fp8", tile=128)
        same = lambda a, b: torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))
        assert same(y.float(), ref.values) and same(s, ref.scale.squeeze(-1)), (S, D)
    print("ok")
''')


def test_k_tile_quantizer_under_the_interpreter():
    """The fused quantizer of FP8 K with one scale per key tile (`quantize_k_fp8_tiles`)
    gives the reference's codes and scales bit for bit: a short last tile, a NaN (its tile's
    scale NaN), an all-zero head."""
    run_under_interpreter(TILE_SCRIPT)
