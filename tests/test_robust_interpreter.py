"""The fused Hopper quantizers of the outlier-robust recipes under the Triton interpreter
(CPU): K smoothing, 4-or-6 NVFP4 block scales and the per-(batch, KV head) FP8 fallback
give the Q/K values and row scales of `reference.forward.robust_qk` bit for bit (the
same numbers on the GPU: test_robust_hopper.py)."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
import torch
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS
from fp4attn.reference.forward import robust_qk

def same(a, b, name):
    x, y = a.float(), b.float()
    nan = torch.isnan(x)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan]), (name, (x[~nan] != y[~nan]).sum())

g = torch.Generator().manual_seed(0)
DEVICE = globals().get("DEVICE", "cpu")
q = torch.randn(2, 4, 70, 64, generator=g).bfloat16().to(DEVICE)
k = (torch.randn(2, 2, 70, 64, generator=g) + 3 * torch.randn(2, 2, 1, 64, generator=g)).bfloat16().to(DEVICE)
v = torch.randn(2, 2, 70, 64, generator=g).bfloat16().to(DEVICE)
q[1, 2:] *= 3  # sharp logits in (batch 1, KV head 1): its Q/K fall back to FP8
k[0, 1, 5, 7] = 40.0
for name in ("nvfp4-fp8-robust", "train-robust"):
    r = PRESETS[name]
    qo, ko, sc, fb = robust_qk(q, k, r, 0.125)
    ops = prepare_operands_fused(q, k, v, r, scale=0.125)
    if fb is not None:
        assert fb.tolist() == [[False, False], [False, True]], fb
    same(qo.values.bfloat16(), ops.q, name + " q")
    same(ko.values.bfloat16(), ops.k, name + " k")
    same(qo.scale.expand(*q.shape[:-1], 1)[..., 0], ops.qs, name + " qs")
    same(ko.scale.expand(*k.shape[:-1], 1)[..., 0], ops.ks, name + " ks")
# the training's packed payload (train-robust: smoothing and 4-or-6 scales) is
# `formats.quantize_nvfp4`'s bytes of the smoothed K
from fp4attn.formats import quantize_nvfp4
from fp4attn.kernels.hopper.quantize import key_mean, quantize_qk_nvfp4
from fp4attn.reference import robust
mean = key_mean(k)
_, _, codes, bscale, _ = quantize_qk_nvfp4(k, packed=True, channel_amax=True, mean=mean, four_over_six=True)
want = quantize_nvfp4(robust.smooth(k, robust.key_mean(k)), scale_dims=2, four_over_six=True)
assert torch.equal(codes, want.data) and torch.equal(bscale.view(torch.uint8), want.scale.view(torch.uint8))
print("ok")
''')


def test_robust_quantizers_are_the_reference_under_the_interpreter():
    run_under_interpreter(KERNEL_PATCHES + SCRIPT)


FORWARD = textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.cli.accuracy import make_inputs
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import p_mode as _p_mode
    from fp4attn.kernels.hopper.quantize import prepare_operands_fused
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.routing import ForwardLaunch, override_launch

    # the robust presets through the Triton forward: the fused quantizers' operands and
    # P_MODE 3 give the reference's LSE (within float32 summation order) and output
    for name, case in (("nvfp4-fp8-robust", "mixture"), ("directp-robust", "sink")):
        r = PRESETS[name]
        q, k, v = (t.bfloat16() for t in make_inputs(case, (1, 2, 64, 64), 7, "cpu"))
        k[:, 1] *= 0.3  # one head under the fallback threshold, one over it
        ops = prepare_operands_fused(q, k, v, r, scale=0.125)
        ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())  # the interpreter's bf16 dot is wrong
        with override_launch(forward=ForwardLaunch(64, 4, 2)):
            out, lse = launch_forward(ops, scale=0.125, causal_offset=None, p_mode=_p_mode(r))[:2]
        ref = reference_forward(q, k, v, r, scale=0.125)
        assert float((lse - ref.lse).abs().max()) < 1e-4, (name, float((lse - ref.lse).abs().max()))
        err = float((out.float() - ref.out).norm() / ref.out.norm())
        assert err < 1e-2, (name, err)
    print("ok")
''')


def test_robust_presets_run_the_hopper_forward_as_the_reference():
    run_under_interpreter(KERNEL_PATCHES + FORWARD)


SINK_TILES = textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.quantize import prepare_operands_fused
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.masks import causal_offset
    from fp4attn.routing import ForwardLaunch, override_launch, p_mode, p_sink_tiles

    # directp-robust's P (p_sink on the first key tile, peeled, then plain Direct-P) is
    # the reference's bit for bit, on every tile of rows spanning several key tiles
    # with a sink in tile 0 and one in tile 1; causal both alignments and not, a query
    # block that sees no key (bottom-right, Sq - Sk >= 64), two sink tiles
    base = PRESETS["directp-robust"].with_(qk_fallback=None)
    g = torch.Generator().manual_seed(0)
    for keys, sq, sk, causal in ((128, 200, 400, None), (128, 200, 400, "top_left"), (128, 200, 400, "bottom_right"),
                                 (128, 200, 100, "bottom_right"), (256, 64, 400, None)):
        r = base.with_(p_sink_keys=keys)
        q = torch.randn(1, 2, sq, 64, generator=g).bfloat16()
        k, v = (torch.randn(1, 1, sk, 64, generator=g).bfloat16() for _ in range(2))
        k[0, 0, 3] = (q[0].float().mean((0, 1)) * 6.0).bfloat16()
        if sk > 200:
            k[0, 0, 200] = (q[0].float().mean((0, 1)) * 4.0).bfloat16()
        ops = prepare_operands_fused(q, k, v, r, scale=0.125)
        ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())  # the interpreter's bf16 dot is wrong
        assert p_mode(r) == 3 and p_sink_tiles(r) == keys // 128
        with override_launch(forward=ForwardLaunch(64, 4, 2)):
            out, lse, dbg = launch_forward(ops, scale=0.125, causal_offset=causal_offset(causal, sq, sk),
                                           p_mode=p_mode(r), sink_tiles=p_sink_tiles(r), write_p=1)
        case = (keys, sq, sk, causal)
        ref = reference_forward(q, k, v, r, scale=0.125, causal=causal, return_p=True)
        p = dbg[:, :, :sq] / 256  # the debug tile holds P times 2**8
        assert torch.equal(p, ref.p), (case, int((p != ref.p).sum()))
        seen = torch.isfinite(ref.lse)
        assert torch.equal(seen, torch.isfinite(lse)), case
        assert float((lse[seen] - ref.lse[seen]).abs().max()) < 1e-5, case
        assert float((out.float() - ref.out).norm() / ref.out.norm()) < 1e-2, case
        if sk > 128:  # the sink remedy on every tile or none is another P
            for other in (r.with_(p_sink_keys=0), r.with_(p_sink=False, p_sink_keys=0)):
                assert not torch.equal(p, reference_forward(q, k, v, other, scale=0.125, causal=causal,
                                                            return_p=True).p), case
    print("ok")
''')


def test_sink_tiles_run_the_hopper_forward_as_the_reference():
    """`Recipe.p_sink_keys` in the Triton forward (SINK_TILES): the peeled sink tiles
    and the plain Direct-P loops give the reference's P codes on every tile."""
    run_under_interpreter(KERNEL_PATCHES + SINK_TILES)


def test_sink_tiles_are_for_p_mode_3_only():
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.recipes import PRESETS
    from fp4attn.routing import p_sink_tiles

    assert p_sink_tiles(PRESETS["directp-robust"]) == 1
    assert p_sink_tiles(PRESETS["directp"].with_(p_sink=True)) == 0
    assert p_sink_tiles(PRESETS["directp"]) == 0
    with pytest.raises(ValueError, match="sink_tiles"):
        launch_forward(None, scale=0.1, causal_offset=None, p_mode=1, sink_tiles=1)


def test_hopper_kernels_refuse_robust_fields_they_do_not_apply():
    """A robust field the kernels lack is a reason (for the routing) and an error at the
    launcher, never another recipe's numbers."""
    from fp4attn.kernels.hopper.forward_op import hopper_robust_unsupported
    from fp4attn.kernels.hopper.train_op import TRAIN_ROBUST_FIELDS
    from fp4attn.recipes import PRESETS, robust_unsupported_reason

    assert hopper_robust_unsupported(PRESETS["nvfp4-fp8-robust"]) is None
    assert hopper_robust_unsupported(PRESETS["directp-robust"]) is None
    assert "rotate_qk" in hopper_robust_unsupported(PRESETS["nvfp4-fp8"].with_(rotate_qk="hadamard"))
    assert "smooth_v" in hopper_robust_unsupported(PRESETS["directp"].with_(smooth_v=True))
    assert "exp2" in hopper_robust_unsupported(PRESETS["directp"].with_(p_build="exp2", p_sink=True))
    assert robust_unsupported_reason(PRESETS["train-robust"], TRAIN_ROBUST_FIELDS) is None
    assert "qk_fallback" in robust_unsupported_reason(PRESETS["train"].with_(qk_fallback="fp8"), TRAIN_ROBUST_FIELDS)


KEY_MEAN = textwrap.dedent('''
    import torch
    from fp4attn.kernels.hopper.quantize import key_mean, robust_qk_operands
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import robust
    from fp4attn.reference.forward import robust_qk

    DEVICE = globals().get("DEVICE", "cpu")

    def bits(a, b, name):
        """Equal bit for bit, NaN where NaN (its payload aside)."""
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), (name, "NaN positions")
        assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)), (name, int((a != b).sum()))

    g = torch.Generator().manual_seed(3)
    # several programs a head from S = 513 (KEY_MEAN_BLOCKS = 32 blocks of 16 keys a
    # program): the float64 atomics and the last program's division; GQA-shaped K (B,
    # Hkv, S, D)
    for S in (1, 70, 600, 1100):
        for D in (64, 128):
            k = torch.randn(2, 3, S, D, generator=g) * 2 + torch.randn(2, 3, 1, D, generator=g) * 3
            k[0, 1, :, 5] += 300.0  # an outlier channel
            k[1, 2, :, 0] = -0.0  # a channel of -0 (the mean is +0, as the reference's)
            k[1, 0, :, 9] *= 2.0**-30  # a channel far below the others
            if S > 1:
                k[0, 0, S // 2, 3] = float("nan")
                k[1, 1, S - 1, 4] = float("inf")
                k[1, 1, 0, 6], k[1, 1, S - 1, 6] = float("inf"), -float("inf")  # NaN mean
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = k.to(dtype).to(DEVICE)
                got, want = key_mean(x), robust.key_mean(x)
                bits(got, want.to(got.device), f"key_mean S={S} D={D} {dtype}")
                if S > 1:
                    assert bool(torch.isnan(got[0, 0, 0, 3])) and got[1, 1, 0, 4] == float("inf")
                    assert bool(torch.isnan(got[1, 1, 0, 6]))
                    assert not bool(torch.isnan(got[1, 1, 0, :3]).any())

    # the fallback choice of `robust_qk_operands` (the last program of each K head) is the
    # reference's: groups of 3 query heads (padded to 4 in the kernel), a NaN in one
    # query head of a group whose other heads are over the threshold (torch's amax
    # propagates NaN: not a fallback), scales on either side of the threshold
    q = torch.randn(2, 6, 50, 64, generator=g)
    k = torch.randn(2, 2, 50, 64, generator=g)
    q[0, 3:] *= 4.0
    q[1, :3] *= 4.0
    q[1, 1, 7, 7] = float("nan")
    q, k = q.bfloat16().to(DEVICE), k.bfloat16().to(DEVICE)
    r = PRESETS["nvfp4-fp8-robust"]
    seen = set()
    for scale in (0.05, 0.125, 0.3, 1.0):
        fb = robust_qk_operands(q, k, r, scale)[4]
        want = robust_qk(q, k, r, scale)[3]
        assert torch.equal(fb.cpu(), want.cpu()), (scale, fb, want)
        seen.add(tuple(fb.flatten().tolist()))
    assert len(seen) > 1 and not any(f[2] for f in seen), seen
    print("ok")
''')


def test_key_mean_kernel_is_the_reference_under_the_interpreter():
    """`key_mean` (one pass over K: float64 sums per head and channel, atomics across the
    key programs, the last program's division and roundings) gives `robust.key_mean`
    bit for bit: awkward key counts, GQA-shaped K, an outlier channel, a channel of -0,
    bf16/fp16/fp32 inputs, and NaN and Inf propagating to their channel's mean only; and
    the fallback choice that `robust_qk_operands` makes in the K pass is the
    reference's."""
    run_under_interpreter(KERNEL_PATCHES + KEY_MEAN)


@pytest.mark.parametrize("kernel", ["_key_mean_kernel", "_abs_max_kernel"])
def test_robust_passes_build_for_sm90(kernel):
    """The key-mean pass and the K pass that makes the fallback choice compile for sm_90
    on the CPU as their launchers build them (bf16, D=128): no spill, at most 128
    registers, the float64 sums added by relaxed reductions (`RED`, no fence beside
    each), one acq_rel count a program, and the choice's float64 arithmetic IEEE-rounded
    as torch's (div.rn, sqrt.rn; no approximate or contracted operation)."""
    from fp4attn.kernels.hopper import quantize as qz
    from fp4attn.tools.machine_code import _compile_sm90, _pointers_and, inspect

    if kernel == "_key_mean_kernel":
        sig = dict(X="*bf16", SUM="*fp64", COUNT="*i32", MEAN="*fp32", S="i32")
        consts = dict(D=128, BLOCK_S=16, BLOCKS=qz.KEY_MEAN_BLOCKS, HW_CVT=True)
    else:
        sig = dict(X="*bf16", AMAX="*i32", MEAN="*fp32", SUMSQ="*fp64", S="i32", COUNT="*i32", SQ_Q="*fp64",
                   FB_Q="*i8", FB_K="*i8", S_Q="i32", GROUP="i32", SCALE="fp64", LIMIT="fp64")
        consts = dict(D=128, BLOCK_S=32, BLOCKS=qz.CHANNEL_BLOCKS, PER_CHANNEL=False, HAS_MEAN=True,
                      SUM_SQ=True, CHOICE=True, GROUP_P2=4)
    build = _compile_sm90(getattr(qz, kernel), sig, consts, _pointers_and(sig, ("S",)), 4, 1)
    r = inspect(build)
    assert r.stack == 0 and r.registers <= 128, (kernel, r.stack, r.registers)
    assert r.count(r"\bREDG\.E\.ADD\.F64") > 0, kernel
    assert r.count(r"\bATOMG\.E\.ADD") == 1 and r.count(r"MEMBAR") <= 2, kernel  # the count's acq_rel only
    ptx = build.asm["ptx"]
    assert "div.rn.f64" in ptx and "approx" not in ptx, kernel
    if kernel == "_abs_max_kernel":
        assert "sqrt.rn.f64" in ptx
    else:  # torch's roundings of the mean: float64 -> float32 -> bf16
        assert "cvt.rn.f32.f64" in ptx and "cvt.rn.bf16.f32" in ptx
