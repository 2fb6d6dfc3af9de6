"""The outlier-robust recipes and the rules of reference/forward.py ("Non-finite values")
through the Hopper kernels.

On a Hopper GPU (`gpu`, run on an H200):

- isolation: a batch item's output (and, for the training recipes, gradients) is
  bit-identical whatever the other items hold;
- NaN/Inf: the NaN rows of the kernels' output are the reference's (a NaN in q, k, a
  float key mask, an Inf, an overflowing score), never in another (batch, head);
- the fused robust quantizers give `reference.forward.robust_qk`'s values and scales
  bit for bit, and the key-mean pass `robust.key_mean`'s (the interpreter's scripts
  below, on CUDA tensors).

Under the Triton interpreter on the CPU (`interpreter`): the fused Hopper quantizers of
the outlier-robust recipes (K smoothing, 4-or-6 NVFP4 block scales and the per-(batch, KV
head) FP8 fallback) give the Q/K values and row scales of `reference.forward.robust_qk`
bit for bit, and the forward runs the robust presets as the reference. Their passes
build for sm_90 (`compile`)."""

import textwrap

import pytest
import torch

from fp4attn.api import attention
from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")


def _inputs(seed, shape=(3, 4, 200, 128), hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g)
    k, v = (torch.randn(shape[0], hkv, *shape[2:], generator=g) for _ in range(2))
    return [t.bfloat16().cuda() for t in (q, k, v)]


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "directp", "fp8-directp", "fp8"])
def test_forward_item_is_bit_identical_whatever_the_others_hold(recipe):
    q, k, v = _inputs(0)
    base = attention(q, k, v, recipe=recipe, enable_gqa=True, backend="triton")
    for which in range(3):
        args = [q.clone(), k.clone(), v.clone()]
        args[which][1:] *= 500.0
        args[which][2, 0, 3, 5] = float("nan")
        out = attention(*args, recipe=recipe, enable_gqa=True, backend="triton")
        assert torch.equal(_bits(out[0]), _bits(base[0])), (recipe, "qkv"[which])


@pytest.mark.gpu
def test_training_gradients_of_an_item_are_bit_identical_whatever_the_others_hold():
    q, k, v = _inputs(1, shape=(2, 4, 256, 128))
    dout = torch.randn(q.shape, device="cuda").bfloat16()

    def grads(q, k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe="train", causal=True, enable_gqa=True, backend="triton").backward(dout)
        return [t.grad for t in leaves]

    base = grads(q, k, v)
    q1, k1, v1 = q.clone(), k.clone(), v.clone()
    for t in (q1, k1, v1):
        t[1] *= 300.0
    for got, want in zip(grads(q1, k1, v1), base):
        assert torch.equal(_bits(got[0]), _bits(want[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "directp", "fp8-directp", "fp8"])
@pytest.mark.parametrize("case", ["nan-q", "nan-k", "inf-q", "overflow", "nan-mask"])
def test_nan_rows_are_the_references(recipe, case):
    from fp4attn.recipes import get_recipe
    from fp4attn.reference import reference_forward

    q, k, v = _inputs(2, shape=(2, 2, 192, 128), hkv=2)
    mask = None
    if case == "nan-q":
        q[1, 0, 9, 5] = float("nan")
    elif case == "nan-k":
        k[1, 0, 9, 5] = float("nan")
    elif case == "inf-q":
        q[1, 0, 9, 5] = float("inf")
    elif case == "overflow":
        q[1, 0, 9] = 3e38
    else:
        mask = torch.zeros(2, 1, 1, 192, device="cuda")
        mask[1, 0, 0, 9] = float("nan")
    out = attention(q, k, v, recipe=recipe, attn_mask=mask, backend="triton")
    ref = reference_forward(q, k, v, get_recipe(recipe), scale=128**-0.5, attn_mask=mask)
    want = torch.isnan(ref.out).any(-1)
    assert bool(want[1, 0, 9]) and not bool(want[0].any())
    assert torch.equal(torch.isnan(out.float()).any(-1), want), (recipe, case)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_training_nan_reaches_its_heads_gradients_only(where):
    q, k, v = _inputs(3, shape=(2, 2, 128, 128))
    dout = torch.randn(q.shape, device="cuda").bfloat16()
    args = {"q": q, "k": k, "v": v}
    args[where] = args[where].clone()
    args[where][0, 1, 2, 3] = float("nan")
    leaves = [args[n].clone().requires_grad_() for n in "qkv"]
    attention(*leaves, recipe="train", causal=True, backend="triton").backward(dout)
    for name, t in zip("qkv", leaves):
        if not (where == "v" and name == "v"):
            assert bool(torch.isnan(t.grad[0, 1]).any()), (where, name)
        assert bool(torch.isfinite(t.grad[1]).all()) and bool(torch.isfinite(t.grad[0, 0]).all()), (where, name)


@pytest.mark.gpu
def test_robust_quantizers_are_the_reference_on_the_gpu():
    exec(compile(SCRIPT, "robust_script", "exec"), {"DEVICE": "cuda"})


@pytest.mark.gpu
def test_key_mean_kernel_is_the_reference_on_the_gpu():
    """`key_mean` bit for bit against `robust.key_mean` (the interpreter test's cases, and
    a bench-sized K: 8 programs a head adding float64 sums in whatever order they run)."""
    from fp4attn.kernels.quantize.statistics import key_mean
    from fp4attn.reference import robust

    exec(compile(KEY_MEAN, "key_mean_script", "exec"), {"DEVICE": "cuda"})
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(2, 8, 4096, 128, device="cuda", generator=g)
    k += 4 * torch.randn(2, 8, 1, 128, device="cuda", generator=g)
    k[..., 17] *= 100.0
    k = k.bfloat16()
    for _ in range(3):  # the atomics' order differs from run to run; the bits may not
        assert torch.equal(key_mean(k).view(torch.int32), robust.key_mean(k).view(torch.int32))


# Under the Triton interpreter (CPU), and the passes' sm_90 builds
SCRIPT = textwrap.dedent('''
import torch
from fp4attn.kernels.hopper.operands import prepare_operands_fused
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
from fp4attn.kernels.quantize.nvfp4 import quantize_qk_nvfp4
from fp4attn.kernels.quantize.statistics import key_mean
from fp4attn.reference import robust
mean = key_mean(k)
_, _, codes, bscale, _ = quantize_qk_nvfp4(k, packed=True, channel_amax=True, mean=mean, four_over_six=True)
want = quantize_nvfp4(robust.smooth(k, robust.key_mean(k)), scale_dims=2, four_over_six=True)
assert torch.equal(codes, want.data) and torch.equal(bscale.view(torch.uint8), want.scale.view(torch.uint8))
# the training's quantization (`quantize_for_training`: K's mean and the amax of K - mean
# from one pass) gives the same payload and the inference quantizers' operands
from fp4attn.kernels.hopper.train_op import quantize_for_training
ops, saved = quantize_for_training(q, k, v, "fp8", smooth_k=True, four_over_six=True)
assert torch.equal(saved[2], want.data) and torch.equal(saved[3].view(torch.uint8), want.scale.view(torch.uint8))
fused = prepare_operands_fused(q, k, v, PRESETS["train-robust"], scale=0.125)
same(fused.k, ops.k, "train-robust k")
same(fused.ks, ops.ks, "train-robust ks")
print("ok")
''')


@pytest.mark.interpreter
def test_robust_quantizers_are_the_reference_under_the_interpreter():
    run_under_interpreter(KERNEL_PATCHES + SCRIPT)


FORWARD = textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.cli.accuracy import make_inputs
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import p_mode as _p_mode
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
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


@pytest.mark.interpreter
def test_robust_presets_run_the_hopper_forward_as_the_reference():
    run_under_interpreter(KERNEL_PATCHES + FORWARD)


SINK_TILES = textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
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


@pytest.mark.interpreter
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
    from fp4attn.recipes import PRESETS, robust_unsupported_reason
    from fp4attn.routing import HOPPER_TRAIN_ROBUST_FIELDS as TRAIN_ROBUST_FIELDS

    assert hopper_robust_unsupported(PRESETS["nvfp4-fp8-robust"]) is None
    assert hopper_robust_unsupported(PRESETS["directp-robust"]) is None
    assert "rotate_qk" in hopper_robust_unsupported(PRESETS["nvfp4-fp8"].with_(rotate_qk="hadamard"))
    assert "smooth_v" in hopper_robust_unsupported(PRESETS["directp"].with_(smooth_v=True))
    assert "exp2" in hopper_robust_unsupported(PRESETS["directp"].with_(p_build="exp2", p_sink=True))
    assert robust_unsupported_reason(PRESETS["train-robust"], TRAIN_ROBUST_FIELDS) is None
    assert "qk_fallback" in robust_unsupported_reason(PRESETS["train"].with_(qk_fallback="fp8"), TRAIN_ROBUST_FIELDS)


KEY_MEAN_PROLOGUE = textwrap.dedent('''
    import math
    import torch
    from fp4attn.cli.accuracy import make_inputs
    from fp4attn.kernels.quantize import robust as quantize
    from fp4attn.kernels.quantize import statistics
    from fp4attn.kernels.quantize.robust import robust_qk_operands
    from fp4attn.kernels.quantize.statistics import abs_max_bits, key_mean
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import robust
    from fp4attn.reference.forward import expand_heads, robust_qk

    DEVICE = globals().get("DEVICE", "cpu")

    def bits(a, b, name):
        \"\"\"Equal bit for bit, NaN where NaN (its payload aside).\"\"\"
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), (name, "NaN positions")
        assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)), (name, int((a != b).sum()))
''')

KEY_PASS = textwrap.dedent('''
    g = torch.Generator().manual_seed(3)
    # several programs a head at S = 1100 (1024 keys a program): the float64 atomics and
    # the last program's division; GQA-shaped K (B, Hkv, S, D); S not a multiple of the
    # block (the masked blocks after the whole ones). With amax=True the same pass gives
    # each head's max |k - mean|, the NVFP4 tensor amax of smoothed K, bit for bit as the
    # reference's and as the second pass (`abs_max_bits(mean=...)`) it replaces. Every
    # input dtype at the short lengths (the load's conversion), bf16 at each length and
    # head dim; S = 1100 at D = 64 under the interpreter (the cheaper head dim: D = 128's
    # blocks run at the short lengths), at both on the GPU
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    long = ((1100, 128, (bf16,)),) if DEVICE != "cpu" else ()
    for S, D, dtypes in ((1, 64, (bf16, f16, f32)), (1, 128, (bf16,)), (70, 128, (bf16, f16, f32)),
                         (70, 64, (bf16,)), *long, (1100, 64, (bf16,))):
        k = torch.randn(2, 4, S, D, generator=g) * 2 + torch.randn(2, 4, 1, D, generator=g) * 3
        k[0, 1, :, 5] += 300.0  # an outlier channel
        k[1, 2, :, 0] = -0.0  # a channel of -0 (the mean is +0, as the reference's)
        k[1, 0, :, 9] *= 2.0**-30  # a channel far below the others
        k[0, 3] = k[0, 3, :1]  # every key the same: max |k - mean| is 0 in bf16
        k[1, 3, :, 1] = 3.4e38  # a finite channel whose mean rounds to bf16 Inf (fp32)
        k[1, 3, :, 2] = 2.0  # a channel of one value
        finite_k = k.clone()
        if S > 1:  # every statistic counts a NaN or Inf as 0
            k[0, 0, S // 2, 3] = float("nan")
            k[1, 1, S - 1, 4] = float("inf")
            k[1, 1, 0, 6], k[1, 1, S - 1, 6] = float("inf"), -float("inf")
            k[0, 2, S // 3, 7] = -float("inf")
            k[1, 2, :, 8] = float("nan")  # a channel without a finite value
            finite_k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
        for dtype in dtypes:
            x = k.to(dtype).to(DEVICE)
            case = f"S={S} D={D} {dtype}"
            want = robust.key_mean(x.cpu())
            got, amax = key_mean(x, amax=True)
            bits(got.cpu(), want, f"key_mean {case}")
            bits(got.cpu(), robust.key_mean(finite_k.to(dtype)), f"key_mean of the finite values {case}")
            ref = robust.finite_or_zero(robust.smooth(x.cpu(), want)).abs().amax(dim=(-2, -1))
            bits(amax.view(torch.float32).cpu(), ref, f"amax {case}")
            if dtype == torch.bfloat16:  # the mean alone, and the second pass replaced
                bits(key_mean(x), got, f"key_mean(amax=False) {case}")
                second = abs_max_bits(x, per_channel=False, mean=got.reshape(-1).contiguous(), finite=True)
                assert torch.equal(amax, second), case
            assert not bool(torch.isnan(ref).any()), case  # the finite values' maxima
            if dtype == torch.bfloat16:
                assert float(ref[0, 3]) == 0.0, case
            if dtype == torch.float32:  # channel 1's mean rounds to Inf: 3.4e38 - Inf is left out
                assert math.isfinite(float(ref[1, 3])), case
''')

FALLBACK_CHOICE = textwrap.dedent('''
    g = torch.Generator().manual_seed(4)
    # Below, only the fallback choice of `robust_qk_operands` is read (its fifth result,
    # made by the passes before the quantizing ones): under the interpreter the quantizing
    # passes (`quantize_qk_nvfp4`, three quarters of each call; their payloads under the
    # fallback are test_robust_quantizers_are_the_reference_under_the_interpreter's) are
    # stood in for until the count of passes at the end
    from fp4attn.kernels.quantize.nvfp4 import quantize_qk_nvfp4
    if DEVICE == "cpu":
        quantize.quantize_qk_nvfp4 = lambda *args, **kwargs: (None, None)

    # the fallback choice of `robust_qk_operands` (the last program of each K head) is the
    # reference's: groups of 3 query heads (padded to 4 in the kernel), a NaN in one
    # query head of a group whose other heads are over the threshold (counted as 0: the
    # choice of the same inputs with a 0 there), scales on either side of the threshold
    q = torch.randn(2, 6, 50, 64, generator=g)
    k = torch.randn(2, 2, 50, 64, generator=g)
    q[0, 3:] *= 4.0
    q[1, :3] *= 4.0
    q[1, 1, 7, 7] = float("nan")
    q, k = q.bfloat16().to(DEVICE), k.bfloat16().to(DEVICE)
    q0 = q.nan_to_num(nan=0.0)
    r = PRESETS["nvfp4-fp8-robust"]
    seen = set()
    for scale in (0.05, 0.125, 0.3, 1.0):
        fb = robust_qk_operands(q, k, r, scale)[4]
        want = robust_qk(q, k, r, scale)[3]
        assert torch.equal(fb.cpu(), want.cpu()), (scale, fb, want)
        assert torch.equal(fb.cpu(), robust_qk(q0, k, r, scale)[3].cpu()), (scale, fb)
        seen.add(tuple(fb.flatten().tolist()))
    assert len(seen) > 1 and any(f[2] for f in seen), seen

    # smoothed K's statistic (`robust.smoothed_sum_sq`, from the per-channel sums of the
    # pass that makes the mean) bit for bit: with the threshold at a head's reference
    # spread exactly, that head does not fall back, and one float64 ulp below it, it
    # does. Inputs of the issue's families (key offsets, outlier channels, sharp logits),
    # GQA groups of 2 and 4 and MHA, bf16 values of at least 2**-6 in magnitude (smaller
    # ones flushed to 0), whose float64 sums and sums of squares are exact in any order,
    # so the atomics' order cannot show; and NaN and Inf in K: counted as 0
    if DEVICE == "cpu":
        # the interpreter hands a kernel a Python float as float32 whatever its
        # annotation; the GPU build takes SCALE and LIMIT as float64 (`tl.float64`), as
        # here (the kernels of this script have no float32 scalar)
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
        _cvt = interpreter._implicit_cvt

        def _cvt64(arg):
            if isinstance(arg, float):
                return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float64), tl.float64), tl.float64)
            return _cvt(arg)

        interpreter._implicit_cvt = _cvt64

    def flushed(t):
        t = t.bfloat16()
        return torch.where(t.abs() < 2.0**-6, torch.zeros_like(t), t)

    def spreads(q, k, scale):
        sq_q = q.double().square().sum(dim=(-2, -1))
        sq_k = robust.smoothed_sum_sq(*robust.key_sums(k), robust.key_mean(k), k.shape[-2])
        return robust.logit_std_of_sums(sq_q, expand_heads(sq_k, q.shape[1]), q.shape[-2], k.shape[-2],
                                        q.shape[-1], scale)

    for name, hq, hkv, sq, sk in (("offset", 4, 2, 70, 90), ("channels", 4, 1, 33, 130), ("sharp", 2, 2, 64, 64),
                                  ("mixture", 8, 2, 40, 120)):
        q = flushed(make_inputs(name, (2, hq, sq, 64), 11, "cpu")[0])
        k = flushed(make_inputs(name, (2, hkv, sk, 64), 12, "cpu")[1])
        scale = 0.125
        s = spreads(q, k, scale).reshape(2, hkv, hq // hkv).amax(-1)
        for b, h in ((0, 0), (1, hkv - 1)):
            lim = float(s[b, h])
            for limit, over in ((lim, False), (math.nextafter(lim, 0.0), True)):
                rr = r.with_(qk_fallback_logit_std=limit)
                fb = robust_qk_operands(q.to(DEVICE), k.to(DEVICE), rr, scale)[4].cpu()
                want = robust_qk(q, k, rr, scale)[3]
                assert torch.equal(fb, want), (name, b, h, limit, fb, want)
                assert bool(fb[b, h]) == over, (name, b, h, limit)
    q = flushed(make_inputs("sharp", (1, 4, 64, 64), 13, "cpu")[0])
    k = flushed(make_inputs("sharp", (1, 2, 64, 64), 14, "cpu")[1])
    k[0, 0, 3, 5] = float("nan")
    k[0, 1, 9, 2] = float("inf")
    rr = r.with_(qk_fallback_logit_std=1e-6)  # every head over it
    fb = robust_qk_operands(q.to(DEVICE), k.to(DEVICE), rr, 0.125)[4].cpu()
    assert torch.equal(fb, robust_qk(q, k, rr, 0.125)[3]) and fb.tolist() == [[True, True]], fb
    k0 = robust.finite_or_zero(k)
    lim = float(spreads(q, k0, 0.125).reshape(1, 2, 2).amax(-1)[0, 1])
    for limit, over in ((lim, False), (math.nextafter(lim, 0.0), True)):  # the statistic of K with 0s there
        rr = r.with_(qk_fallback_logit_std=limit)
        fb = robust_qk_operands(q.to(DEVICE), k.to(DEVICE), rr, 0.125)[4].cpu()
        assert torch.equal(fb, robust_qk(q, k, rr, 0.125)[3]) and bool(fb[0, 1]) == over, (limit, fb)

    # a head dim the kernels zero-pad (32 runs as 64): the statistic divides by the
    # caller's head dim, which `robust_qk_operands` takes (`head_dim`), so the choice is
    # the reference's of the unpadded inputs; by the padded width it would be another
    import torch.nn.functional as F
    q = flushed(make_inputs("sharp", (2, 4, 40, 32), 15, "cpu")[0])
    k = flushed(make_inputs("sharp", (2, 2, 50, 32), 16, "cpu")[1])
    qp, kp = (F.pad(t, (0, 32)).to(DEVICE) for t in (q, k))
    scale = 32**-0.5
    lim = float(spreads(q, k, scale).reshape(2, 2, 2).amax(-1)[0, 0])
    for limit, over in ((lim, False), (math.nextafter(lim, 0.0), True)):
        rr = r.with_(qk_fallback_logit_std=limit)
        fb = robust_qk_operands(qp, kp, rr, scale, head_dim=32)[4].cpu()
        assert torch.equal(fb, robust_qk(q, k, rr, scale)[3]) and bool(fb[0, 0]) == over, (limit, fb)
    fb = robust_qk_operands(qp, kp, r.with_(qk_fallback_logit_std=math.nextafter(lim, 0.0)), scale)[4].cpu()
    assert not bool(fb[0, 0]), fb  # the padded width's statistic, sqrt(2) smaller

    # one pass over K before its quantizing pass: the smoothed recipes launch the maxima
    # pass (`_abs_max_kernel`) over Q only (the quantizing passes real again)
    quantize.quantize_qk_nvfp4 = quantize_qk_nvfp4
    launches = []
    kernel = statistics._abs_max_kernel

    class Counted:
        def __getitem__(self, grid):
            def run(x, *args, **kwargs):
                launches.append(tuple(x.shape))
                return kernel[grid](x, *args, **kwargs)
            return run

    statistics._abs_max_kernel = Counted()
    try:
        q = torch.randn(1, 4, 40, 64, generator=g).bfloat16().to(DEVICE)
        k = torch.randn(1, 2, 50, 64, generator=g).bfloat16().to(DEVICE)
        for name in ("nvfp4-fp8-robust", "directp-robust"):
            launches.clear()
            robust_qk_operands(q, k, PRESETS[name], 0.125)
            assert launches == [(4, 40, 64)], (name, launches)
        launches.clear()
        robust_qk_operands(q, k, PRESETS["nvfp4-fp8-robust"].with_(smooth_k=False), 0.125)
        assert launches == [(4, 40, 64), (2, 50, 64)], launches
    finally:
        statistics._abs_max_kernel = kernel
''')

# both parts in one script, as the GPU test above runs them
KEY_MEAN = KEY_MEAN_PROLOGUE + KEY_PASS + FALLBACK_CHOICE + 'print("ok")\n'


@pytest.mark.interpreter
@pytest.mark.parametrize("part", ["key_pass", "fallback_choice"])
def test_key_mean_kernel_is_the_reference_under_the_interpreter(part):
    """`key_mean` (one pass over K: float64 sums per head and channel, atomics across the
    key programs, the last program's division and roundings) gives `robust.key_mean`
    bit for bit: awkward key counts, GQA-shaped K, an outlier channel, a channel of -0,
    bf16/fp16/fp32 inputs, and NaN and Inf counted as 0, as the reference counts them
    (KEY_PASS); and the fallback choice that `robust_qk_operands` makes in the K pass is
    the reference's, for zero-padded head dims too (the caller's head dim in its
    statistic), the smoothed recipes passing over K once before quantizing it
    (FALLBACK_CHOICE). Each part a test of its own (half the time each: the two
    workers share them)."""
    body = {"key_pass": KEY_PASS, "fallback_choice": FALLBACK_CHOICE}[part]
    run_under_interpreter(KERNEL_PATCHES + KEY_MEAN_PROLOGUE + body + 'print("ok")\n')


@pytest.mark.compile
@pytest.mark.parametrize("kernel,D,choice", [("_key_mean_kernel", 128, False), ("_key_mean_kernel", 128, True),
                                             ("_key_mean_kernel", 64, True), ("_abs_max_kernel", 128, True)])
def test_robust_passes_build_for_sm90(kernel, D, choice):
    """The pass over K (its mean, with the maximum of K - mean and under `qk_fallback`
    the sums of squares and the choice) and the maxima pass that makes the choice
    without smoothing compile for sm_90 on the CPU as their launchers build them (bf16):
    no spill, at most 96 registers for the pass over K (its two row halves folded within
    each thread, no shared memory in its loop; unfolded it took 124 at D = 128, 243
    with a reduction tree Triton held whole in every thread) and 128 otherwise, the
    float64 sums added and the extremes maxed by relaxed reductions (`RED`, no fence
    beside each), one acq_rel count a program, and the choice's float64 arithmetic
    IEEE-rounded as torch's (div.rn, sqrt.rn, the `_rn` forms; no approximate or
    contracted operation)."""
    from dev.machine_code import _compile_sm90, _pointers_and, inspect
    from fp4attn.kernels.quantize import statistics as qz

    choice_sig = dict(COUNT="*i32", SQ_Q="*fp64", FB_Q="*i8", FB_K="*i8", S_Q="i32", D_STAT="i32", GROUP="i32",
                      SCALE="fp64", LIMIT="fp64")
    if kernel == "_key_mean_kernel":
        sig = dict(X="*bf16", SUM="*fp64", MEAN="*fp32", S="i32", EXT="*i32", AMAX="*i32", SUMSQ="*fp64",
                   **choice_sig)
        block, blocks, fold = qz._key_pass_block(4096, D, 2)
        assert fold == 2 and block * blocks == qz.KEY_PASS_ROWS
        consts = dict(D=D, BLOCK_S=block, BLOCKS=blocks, FOLD=fold, HW_CVT=True, STATS=True, CHOICE=choice,
                      GROUP_P2=4)
    else:
        sig = dict(X="*bf16", AMAX="*i32", MEAN="*fp32", SUMSQ="*fp64", S="i32", **choice_sig)
        consts = dict(D=D, BLOCK_S=32, BLOCKS=qz.CHANNEL_BLOCKS, PER_CHANNEL=False, HAS_MEAN=False,
                      SUM_SQ=True, CHOICE=True, GROUP_P2=4)
    build = _compile_sm90(getattr(qz, kernel), sig, consts, _pointers_and(sig, ("S",)), 4, 1)
    r = inspect(build)
    assert r.stack == 0 and r.registers <= (96 if kernel == "_key_mean_kernel" else 128), (kernel, r.registers)
    assert r.count(r"\bREDG\.E\.ADD\.F64") == (1 + choice if kernel == "_key_mean_kernel" else 1), kernel
    assert r.count(r"\bATOMG\.E\.ADD") == 1 and r.count(r"MEMBAR") <= 2, kernel  # the count's acq_rel only
    ptx = build.asm["ptx"]
    assert "div.rn.f64" in ptx and "approx" not in ptx, kernel
    if choice:
        assert "sqrt.rn.f64" in ptx
    if kernel == "_key_mean_kernel":
        # torch's roundings of the mean: float64 -> float32 -> bf16; the extremes by
        # unsigned maxima
        assert "cvt.rn.f32.f64" in ptx and "cvt.rn.bf16.f32" in ptx
        assert "atom.global.gpu.relaxed.max.u32" in ptx and r.count(r"\bREDG\.E\.MAX") > 0, kernel
        loop = r.loops()[0]
        assert any(op.startswith("LDG") for op in loop) and not any(op.startswith(("STS", "LDS", "SHFL", "BAR"))
                                                                    for op in loop), kernel
        if choice:  # smoothed_sum_sq's operations, each rounded once
            assert "sub.rn.f64" in ptx and "add.rn.f64" in ptx and "mul.rn.f64" in ptx


def test_head_dim_beyond_the_padded_inputs_is_refused():
    """`head_dim` names the caller's channels inside zero-padded inputs: more than the
    inputs hold, or none, is an error naming the accepted range, before any launch."""
    import torch

    from fp4attn.kernels.blackwell.operands import prepare_operands
    from fp4attn.kernels.quantize.robust import robust_qk_operands
    from fp4attn.recipes import PRESETS

    q = k = v = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    for bad in (80, 0):
        with pytest.raises(ValueError, match=rf"head_dim={bad} for inputs padded to 64 channels; accepted: 1 to 64"):
            robust_qk_operands(q, k, PRESETS["nvfp4-fp8-robust"], 0.125, head_dim=bad)
        with pytest.raises(ValueError, match=rf"head_dim={bad} for inputs padded to 64 channels; accepted: 1 to 64"):
            prepare_operands(q, k, v, PRESETS["nvfp4-fp8"], 0.125, head_dim=bad)
