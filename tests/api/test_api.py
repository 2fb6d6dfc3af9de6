"""Public API: SDPA layout and dtypes, presets and custom recipes, clear errors."""

import json
import re

import pytest
import torch

import fp4attn
from fp4attn import PRESETS, Recipe, routing
from fp4attn.cli.main import main as cli_main
from fp4attn.metrics import error_metrics


def _qkv(dtype=torch.bfloat16, shape=(1, 2, 16, 64)):
    return tuple(torch.randn(shape).to(dtype) for _ in range(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_dtype_and_shape(dtype):
    q, k, v = _qkv(dtype)
    out = fp4attn.attention(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape


def test_custom_recipe_and_presets():
    assert set(PRESETS) == {"directp", "nvfp4-fp8", "fp8-directp", "fp8", "train", "train-mxfp4pv", "bf16",
                            "fp8-directp-fastacc", "fp8-fastacc", "directp-robust", "nvfp4-fp8-robust",
                            "train-robust", "train-fp8", "directp-fast", "fp8-directp-fast",
                            "fp8-directp-fast-fastacc", "fp8-affine", "fp8-affine-fastacc",
                            "fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc", "train-affine"}
    with pytest.raises(ValueError, match="fast_accum.*qk='fp8'.*'nvfp4'"):
        Recipe(qk="nvfp4", fast_accum=True)
    from fp4attn.recipes import preset_names

    assert preset_names(True) == list(PRESETS)
    assert set(preset_names(False)) == set(PRESETS) - {"fp8-fastacc", "fp8-directp-fastacc", "fp8-directp-fast-fastacc",
                                                       "fp8-affine-fastacc", "fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc"}
    q, k, v = _qkv()
    r = Recipe(qk="fp8", p="fp8", v="mxfp4", p_build="exp2")
    assert fp4attn.attention(q, k, v, recipe=r).shape == q.shape
    assert PRESETS["directp"].with_(block_n=64).block_n == 64


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(qk="int4"), "Recipe.qk"),
        (dict(p="fp16"), "Recipe.p"),
        (dict(v="e2m1"), "Recipe.v"),
        (dict(p_build="exp"), "Recipe.p_build"),
        (dict(p="fp8", p_build="directp"), "directp"),
        (dict(grad="fp16"), "Recipe.grad"),
        (dict(block_n=48), "block_n"),
    ],
)
def test_bad_recipe_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kwargs)


def test_bad_inputs_get_clear_errors():
    q, k, v = _qkv()
    cases = [
        (dict(q=q.long()), TypeError, "dtype"),
        (dict(q=q[0, 0, 0]), ValueError, r"at least \(seq, head_dim\)"),
        (dict(k=k.float()), TypeError, "share a dtype"),
        (dict(v=v[..., :8, :]), ValueError, "v .* must have k's heads and keys"),
        (dict(q=torch.randn(3, 2, 16, 64).bfloat16(), k=k.expand(2, -1, -1, -1), v=v.expand(2, -1, -1, -1)),
         ValueError, "batch dims .* do not broadcast"),
        (dict(q=q[..., :48], k=k[..., :48], v=v[..., :48]), None, None),
        (dict(q=q[..., :40], k=k[..., :40], v=v[..., :40]), ValueError, "head_dim 40"),
        (dict(q=torch.randn(1, 3, 16, 64).bfloat16()), ValueError, "multiple of k/v heads"),
        (dict(q=torch.randn(1, 4, 16, 64).bfloat16()), ValueError, "enable_gqa"),
        (dict(q=q[..., :0, :]), None, None),  # empty, as SDPA
        (dict(recipe="fp4"), ValueError, "unknown recipe"),
        (dict(backend="cuda"), ValueError, "unknown backend"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(causal="left"), ValueError, "causal"),
        (dict(q="q"), TypeError, "torch.Tensor"),
    ]
    for over, exc, match in cases:
        args = dict(q=q, k=k, v=v)
        kw = {n: over.pop(n) for n in list(over) if n not in args}
        args.update(over)
        if exc is None:
            fp4attn.attention(args["q"], args["k"], args["v"], **kw)
            continue
        with pytest.raises(exc, match=match):
            fp4attn.attention(args["q"], args["k"], args["v"], **kw)


def test_device_mismatch_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device"):
        fp4attn.attention(q, k.to("meta"), v)


def test_cli_accuracy_writes_json(tmp_path, capsys):
    path = tmp_path / "acc.json"
    cli_main(["accuracy", "--recipes", "directp,bf16", "--cases", "gaussian", "-S", "64", "-H", "2",
              "--device", "cpu", "--json", str(path)])
    records = json.loads(path.read_text())
    assert [r["recipe"] for r in records] == ["directp", "bf16"]
    assert records[1]["cos"] > 0.999 and 0.9 < records[0]["cos"] < 1
    assert "| directp |" in capsys.readouterr().out


def test_cli_report(tmp_path):
    cli_main(["report", "--out", str(tmp_path), "-S", "128"])
    names = {p.name for p in tmp_path.iterdir()}
    assert {"accuracy.json", "backward.json", "directp.json", "environment.json", "accuracy.png"} <= names
    study = json.loads((tmp_path / "directp.json").read_text())
    assert all(a["codes_identical"] > 0.999 for a in study["agreement"])


def test_backend_choice_and_env_override(monkeypatch):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cannot run recipe 'fp8': inputs on cpu"):
        fp4attn.attention(q, k, v, recipe="fp8", backend="triton")
    monkeypatch.setenv("FP4ATTN_BACKEND", "reference")
    ref = fp4attn.attention(q, k, v, recipe="fp8")
    assert torch.equal(ref, fp4attn.attention(q, k, v, recipe="fp8", backend="reference"))
    monkeypatch.setenv("FP4ATTN_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="FP4ATTN_BACKEND='cudnn' is not a backend"):
        fp4attn.attention(q, k, v)


def test_cli_backward_accuracy(tmp_path):
    path = tmp_path / "bwd.json"
    cli_main(["accuracy", "--backward", "--causal", "-S", "64", "-H", "2", "--device", "cpu", "--json", str(path)])
    records = {r["recipe"]: r for r in json.loads(path.read_text())}
    assert set(records) == {"train", "train-mxfp4pv", "train-robust", "train-fp8", "train-affine", "bf16"}  # with a backward
    assert records["bf16"]["cos_dq"] > 0.999 and 0.9 < records["train"]["cos_dk"] < 1


def test_bench_table_and_geomean():
    from fp4attn.cli.bench import format_table, geomean_speedups
    from fp4attn.tools.benchmark import visible_pairs

    recs = [dict(B=1, H=2, S=64, D=128, causal=c, impl=i, quant_included=False, tflops=t, speedup_vs_cudnn_bf16=x)
            for c in (False, True) for i, t, x in (("sdpa-cudnn", 100.0, 1.0), ("fp8", 50.0, 0.5))]
    table = format_table(recs).splitlines()
    assert table[0] == "| B,H,S,D | causal | sdpa-cudnn | fp8 |"
    assert table[2] == "| 1,2,64,128 | False | 100 (1.00x) | 50 (0.50x) |" and len(table) == 4
    assert geomean_speedups(recs, 128, False)["fp8"] == pytest.approx(0.5)
    assert visible_pairs(4, 4, True) == 10 and visible_pairs(2, 5, True) == 3


def _route_to(monkeypatch, kernel, accepts_mask):
    """`fp4attn.attention` sends calls to `kernel` as if the Hopper forward kernels ran
    them (masks where `accepts_mask(mask)`), on CPU tensors."""
    import fp4attn.api as api

    family = next(f for f in routing.KERNEL_FAMILIES if f.name == "hopper-forward")

    def fake_route(backend, q, recipe, causal, needs_grad, attn_mask, keys, value_dim=None):
        if attn_mask is not None and not accepts_mask(attn_mask):
            return routing.Route("reference", "reference", "sm_90", "mask"), None
        key_mask = None if attn_mask is None else api.key_mask_view(attn_mask)
        return routing.Route("triton", "fake", "sm_90", "test", family), key_mask

    monkeypatch.setattr(api, "_route", fake_route)
    monkeypatch.setattr(api, "_launcher", lambda spec: kernel)


def test_padded_head_dims_reproduce_the_unpadded_recipe(monkeypatch):
    """The kernel path zero-pads head dims below 64 / 128 and cuts the output back. With the
    kernel op replaced by the reference at the padded dim, the result must equal the
    reference at the original dim: padding is exact in every recipe."""
    pytest.importorskip("triton")
    from fp4attn.reference import reference_forward

    seen = []

    def fake_kernel(q, k, v, recipe, *, scale, causal_offset, write_p=0, key_bias=None, head_dim=None):
        assert key_bias is None
        seen.append((q.shape[-1], head_dim))
        res = reference_forward(q, k, v, recipe, scale=scale, causal=None if causal_offset is None else "top_left")
        return res.out.to(torch.bfloat16), res.lse, None

    _route_to(monkeypatch, fake_kernel, lambda mask: True)
    gen = torch.Generator().manual_seed(0)
    for d in (16, 32, 48, 80, 112):
        q, k, v = (torch.randn(1, 2, 70, d, generator=gen).bfloat16() * 3 for _ in range(3))
        for recipe in ("directp", "nvfp4-fp8", "fp8-directp", "fp8"):
            for causal in (False, True):
                got, lse = fp4attn.attention(q, k, v, recipe=recipe, causal=causal, return_lse=True)
                want = reference_forward(q, k, v, fp4attn.PRESETS[recipe], scale=d**-0.5,
                                         causal="top_left" if causal else None)
                assert got.shape == q.shape and got.is_contiguous()
                assert error_metrics(got.float(), want.out)["rel_l2"] < 5e-3, (d, recipe, causal)
                torch.testing.assert_close(lse, want.lse, rtol=1e-5, atol=1e-5)
        assert seen[-1] == (64 if d <= 64 else 128, d)  # the caller's head dim goes with the padded inputs


def test_zero_padding_leaves_every_operand_unchanged():
    """Why padding is exact: the quantized Q, K (values and scales) and V of the padded
    inputs are the unpadded ones plus zero channels, in every format."""
    from fp4attn.reference.operands import quantize_qk, quantize_v

    gen = torch.Generator().manual_seed(1)
    for d, dk in ((16, 64), (48, 64), (80, 128), (112, 128)):
        x = torch.randn(2, 3, 70, d, generator=gen).bfloat16() * 5
        x[0, 1, :, 2] = 0.0
        xp = torch.nn.functional.pad(x, (0, dk - d))
        for fmt in ("nvfp4", "fp8", "bf16"):
            a, b = quantize_qk(x, fmt), quantize_qk(xp, fmt)
            assert torch.equal(b.values[..., :d], a.values) and not b.values[..., d:].any(), (d, fmt)
            assert torch.equal(b.scale.expand(*b.values.shape[:-1], 1), a.scale.expand(*a.values.shape[:-1], 1))
        for fmt in ("mxfp4", "fp8", "bf16"):
            a, b = quantize_v(x, fmt), quantize_v(xp, fmt)
            assert torch.equal(b[..., :d], a) and not b[..., d:].any(), (d, fmt)


def test_bench_table_with_a_baseline_missing_for_some_cases(tmp_path):
    """cuDNN's FP8 SDPA may fail on some shapes: the table and the plot show a gap."""
    pytest.importorskip("matplotlib")
    from fp4attn.cli.bench import format_table, plot

    cases = [(64, "sdpa-cudnn"), (64, "cudnn-fp8"), (128, "sdpa-cudnn")]
    recs = [{"B": 1, "H": 2, "S": s, "D": 128, "causal": False, "impl": i, "quant_included": False, "tflops": 10.0,
             "speedup_vs_cudnn_bf16": 1.0} for s, i in cases]
    assert format_table(recs).splitlines()[-1].endswith("| - |")
    plot(recs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_builds_bench_arguments_with_every_default(monkeypatch):
    """The main job calls `fp4attn bench` on a Hopper GPU: its arguments come from the bench
    parser, so a new bench option can never be missing there."""
    import fp4attn.cli.bench as bench
    from fp4attn.cli.report import run_cli

    seen = []
    monkeypatch.setattr(bench, "main", lambda args: seen.append(args))
    run_cli(bench, ["--backward", "--shapes", "4,16,4096,128"])
    assert seen[0].backward and not seen[0].model_step and seen[0].recipes is None and seen[0].json is None
    assert seen[0].model_step_compile is None  # the eager step unless a compile mode is named
    run_cli(bench, ["--backward", "--model-step", "--model-step-compile", "reduce-overhead"])
    assert seen[1].model_step and seen[1].model_step_compile == "reduce-overhead"
    with pytest.raises(SystemExit):  # argparse names the accepted modes
        run_cli(bench, ["--backward", "--model-step", "--model-step-compile", "reduce_overhead"])
    assert len(seen) == 2


def test_key_masks_reach_the_kernel_as_a_key_bias(monkeypatch):
    """Key masks (broadcastable as (B, 1, 1, Sk)) go to the kernel as the reference's own
    log2 bias, one row per batch element; other masks, and masks with a backward, stay
    on the reference. With the kernel op replaced by the reference fed that bias back as
    a mask, results equal the reference with the original mask."""
    pytest.importorskip("triton")
    import fp4attn.api as api
    from fp4attn.reference import reference_forward

    def fake_kernel(q, k, v, recipe, *, scale, causal_offset, write_p=0, key_bias=None, head_dim=None):
        assert key_bias.shape == (q.shape[0], k.shape[-2]) and key_bias.dtype == torch.float32
        res = reference_forward(q, k, v, recipe, scale=scale, attn_mask=(key_bias == 0)[:, None, None, :])
        return res.out.to(torch.bfloat16), res.lse, None

    _route_to(monkeypatch, fake_kernel, lambda mask: api.key_mask_view(mask) is not None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 50, 64, generator=gen).bfloat16() for _ in range(3))
    lengths = torch.tensor([50, 17, 0])  # a batch element with no key at all
    pad = torch.arange(50)[None, :] < lengths[:, None]
    expanded = pad[:, None, None, :].expand(3, 1, 50, 50)  # transformers' padding masks: (B, 1, Sq, Sk)
    for mask in (pad[:, None, None, :], pad[:1, None, None, :].expand(3, 1, 1, 50), pad[1], expanded):
        got = fp4attn.attention(q, k, v, recipe="fp8", attn_mask=mask)
        want = reference_forward(q, k, v, fp4attn.PRESETS["fp8"], scale=64**-0.5, attn_mask=mask).out
        assert torch.equal(got.float(), want.to(torch.bfloat16).float())
    assert api.key_mask_view(expanded).shape == (3, 1, 1, 50)
    assert api.key_mask_view(torch.ones(50, 50, dtype=torch.bool).tril()) is None  # a query-dependent mask
    assert api.key_mask_view(torch.ones(3, 2, 1, 50, dtype=torch.bool)) is None  # per head
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    assert routing.route(fp4attn.PRESETS["fp8"], device="cuda", head_dim=64, causal=False, needs_grad=False,
                         mask=api._mask_kind(torch.ones(50, 50).tril().bool())[0], backend="auto").backend == "reference"
    bias = api.key_bias_of_mask(torch.tensor([0.5, -1.0]), 2, 2)
    assert torch.equal(bias, torch.tensor([[0.5, -1.0]] * 2) * 1.4426950408889634)


def test_launch_override_is_typed_scoped_and_thread_local():
    """`routing.override_launch` replaces the table's launches inside its block, in its
    thread only, restores them after (also on an error), nests, and takes only the
    launch types."""
    import threading

    from fp4attn.routing import (
        BACKWARD_LAUNCH,
        FORWARD_LAUNCH,
        BackwardLaunch,
        ForwardLaunch,
        backward_launch,
        forward_launch,
        override_launch,
    )

    for key, cfg in FORWARD_LAUNCH.items():
        assert forward_launch(*key) == cfg
    mine, other = ForwardLaunch(64, 4, 3, False), ForwardLaunch(128, 8, 2, True)
    seen = []
    with override_launch(forward=mine):
        assert forward_launch(128, True, False) == mine and backward_launch(128) == BACKWARD_LAUNCH[128]
        t = threading.Thread(target=lambda: seen.append(forward_launch(128, True, False)))
        t.start()
        t.join()
        with override_launch(forward=other, backward=BackwardLaunch(tma=True)):
            assert forward_launch(64, False, True) == other and backward_launch(64) == BackwardLaunch(tma=True)
        assert forward_launch(64, False, True) == mine and backward_launch(64) == BACKWARD_LAUNCH[64]
    assert seen == [FORWARD_LAUNCH[128, True, False]]  # another thread kept the table's
    with pytest.raises(RuntimeError), override_launch(forward=mine):
        raise RuntimeError
    assert forward_launch(128, True, False) == FORWARD_LAUNCH[128, True, False]
    with pytest.raises(TypeError, match="ForwardLaunch"), override_launch(forward="64,4,2"):
        pass

def test_quantize_v_t_rejects_a_scale_for_mxfp4():
    pytest.importorskip("triton")
    from fp4attn.kernels.quantize.v_operand import quantize_v_t

    with pytest.raises(ValueError, match="fmt='fp8' only"):
        quantize_v_t(torch.zeros(1, 1, 32, 64), "mxfp4", scale=torch.ones(1))
    with pytest.raises(ValueError, match="`channel_amax` are for fmt='fp8' only"):  # MXFP4 has no channel scales
        quantize_v_t(torch.zeros(1, 1, 32, 64), "mxfp4", channel_amax=torch.zeros(1, 1, 64, dtype=torch.int32))
    for bad in (0, -128, 1.5):
        with pytest.raises(ValueError, match="pad_keys_to must be a positive int"):
            quantize_v_t(torch.zeros(1, 1, 32, 64), "fp8", pad_keys_to=bad)
    # V read once waits on its head's blocks: it needs them resident together on a GPU
    with pytest.raises(ValueError, match="one_pass needs a head of one"):
        quantize_v_t(torch.zeros(1, 1, 300, 64), "fp8", one_pass=True)


def test_bench_reports_why_cudnn_fp8_did_not_run(monkeypatch):
    import fp4attn.tools.cudnn_fp8 as cudnn_fp8
    from fp4attn.tools.benchmark import time_cudnn_fp8

    monkeypatch.setattr(cudnn_fp8, "available", lambda: False)
    ms, note = time_cudnn_fp8(None, None, None, False)
    assert ms is None and "nvidia-cudnn-frontend" in note


def test_gpu_test_timeout_names_what_it_accepts():
    from tests.conftest import gpu_test_timeout

    assert gpu_test_timeout("2.5") == 2.5
    with pytest.raises(ValueError, match="FP4ATTN_GPU_TEST_TIMEOUT='5m'.*seconds as a number"):
        gpu_test_timeout("5m")


def test_quantize_qk_fp8_rejects_other_output_dtypes():
    pytest.importorskip("triton")
    from fp4attn.kernels.quantize.fp8 import quantize_qk_fp8

    for bad in (torch.float16, torch.float32, torch.float8_e5m2):
        with pytest.raises(ValueError, match="dtype float8_e4m3fn or bfloat16"):
            quantize_qk_fp8(torch.zeros(2, 64), dtype=bad)


def test_training_routes_fp8_qk_to_the_hopper_kernels(monkeypatch):
    """`train-fp8` (per-token FP8 Q/K) trains on the Hopper training kernels: the
    Gluon or Triton forward and, as `train`, the Gluon backward where the lengths are
    whole tiles (per-token scales: ROW_SCALES, `routing.GLUON_BACKWARD_QK`), through
    `hopper_train_attention`. What stays on the reference says what was wrong and what the kernels
    accept, and backend="triton" raises with it."""
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    kw = dict(device="cuda", needs_grad=True, mask="none")
    for d in (64, 128, 96):
        for causal in (False, True):
            r = routing.route(fp4attn.get_recipe("train-fp8"), head_dim=d, causal=causal, **kw)
            assert r.backend == "triton" and r.family.name == "hopper-train", r
            assert r.family.launcher == "fp4attn.kernels.hopper.train_op:hopper_train_attention"
            assert r.kernel.endswith("hopper.backward_gluon.dkdv + hopper.backward_gluon.dq (Gluon where the "
                                     "lengths are whole 64-token tiles)"), r.kernel
    train = routing.route(fp4attn.get_recipe("train"), head_dim=128, causal=True, **kw)
    assert "hopper.backward_gluon.dkdv + hopper.backward_gluon.dq" in train.kernel
    fp8 = fp4attn.get_recipe("train-fp8")
    for recipe, why in ((fp8.with_(smooth_k=True), "outlier-robust field smooth_k of recipe 'custom' with 'fp8' Q/K "
                                                   r"for training \(the training kernels apply none with 'fp8' Q/K; "
                                                   "smooth_k, qk_four_over_six with 'nvfp4' Q/K"),
                        (fp8.with_(fast_accum=True), r"fast_accum=True for training \(the training kernels sum QK\^T "
                                                     "exactly: fast_accum=False"),
                        (fp8.with_(qk="bf16"), r"Q/K format 'bf16' for training \(kernels train 'nvfp4' and "
                                               "'fp8' Q/K"),
                        (fp8.with_(grad="e5m2"), r"gradient format 'e5m2' \(kernels run \('e4m3',\)")):
        r = routing.route(recipe, head_dim=128, causal=True, **kw)
        assert r.backend == "reference" and re.search(why, r.reason), r.reason
        with pytest.raises(ValueError, match="backend='triton' cannot run recipe .*" + why):
            routing.route(recipe, head_dim=128, causal=True, backend="triton", **kw)
    # the launcher refuses them too, before any kernel runs, never training another recipe
    pytest.importorskip("triton")
    from fp4attn.kernels.hopper.train_op import hopper_train_attention

    x = torch.zeros(1, 1, 16, 64)
    for recipe, why in ((fp8.with_(smooth_k=True), "outlier-robust field smooth_k .* with 'fp8' Q/K; the reference"),
                        (fp8.with_(fast_accum=True), "fast_accum=True"),
                        (fp8.with_(qk="bf16"), "Q/K format 'bf16' .*'nvfp4' and 'fp8'")):
        with pytest.raises(ValueError, match="hopper_train_attention: " + why):
            hopper_train_attention(x, x, x, recipe, scale=0.125, causal_offset=None)
