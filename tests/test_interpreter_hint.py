"""The CPU hint does what it says: `fp4attn.explain` on CPU tensors names
TRITON_INTERPRET=1 with FP4ATTN_TARGET=sm_90, and following it runs `fp4attn.attention`
(forward, the training backward) and `fp4attn.decode` on the Hopper Triton kernels under
the interpreter, the package putting in place what the interpreter lacks
(`kernels.interpreter_compat`) and the launches it can run (`routing.forward_launch`)."""

import textwrap

import pytest
import torch

import fp4attn
from tests.interpreter import run_under_interpreter

pytest.importorskip("triton")


def test_the_hint_names_the_interpreter_and_the_target():
    q = torch.randn(1, 2, 16, 64)
    reason = fp4attn.explain(q, q, q, recipe="fp8")["reason"]
    assert "TRITON_INTERPRET=1 with FP4ATTN_TARGET=sm_90" in reason, reason
    cache = fp4attn.KVCache(1, 2, 64, 8, k_format="fp8")
    assert "TRITON_INTERPRET=1 with FP4ATTN_TARGET=sm_90" in fp4attn.explain(q[:, :, :1], cache)["reason"]


SCRIPT = textwrap.dedent('''
    import os
    import warnings

    import torch

    import fp4attn

    os.environ["FP4ATTN_TARGET"] = "sm_90"
    warnings.simplefilter("error", fp4attn.ReferenceFallbackWarning)  # nothing falls back
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g).bfloat16() for _ in range(3))
    for recipe in ("fp8", "nvfp4-fp8", fp4attn.DEFAULT_RECIPE):
        assert fp4attn.explain(q, k, v, recipe=recipe)["kernel"] == "hopper.forward_triton"
        out = fp4attn.attention(q, k, v, recipe=recipe, is_causal=True)
        ref = fp4attn.attention(q, k, v, recipe=recipe, is_causal=True, backend="reference")
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2, recipe
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp4attn.attention(*leaves, recipe="train", causal=True).float().sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in leaves)
    cache = fp4attn.KVCache(1, 2, 64, 16, k_format="nvfp4")
    assert fp4attn.explain(q[:, :, :1], cache)["kernel"] == "hopper.decode_triton"
    out = fp4attn.decode(q[:, :, :2], cache, k=k[:, :, :5], v=v[:, :, :5])
    assert out.shape == (1, 2, 2, 64) and cache.host_lengths == [5]
    print("ok")
''')


def test_following_the_hint_runs_the_kernels_under_the_interpreter():
    run_under_interpreter(SCRIPT, timeout=600)


def test_the_gpu_routes_keep_their_kernels(monkeypatch):
    """Outside the interpreter the launch table's kernels are named (a CUDA device,
    FP4ATTN_TARGET=sm_90, no GPU needed): the Gluon backward for FP8 Q/K where the lengths
    are whole tiles; under it, the Triton kernels the interpreter runs."""
    from fp4attn import routing
    from fp4attn.recipes import PRESETS

    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.delenv(routing.INTERPRET_ENV, raising=False)
    call = dict(device=torch.device("cuda"), head_dim=64, causal=True, needs_grad=True, mask="none", keys=256)
    gpu = routing.route(PRESETS["train-fp8"], **call).kernel
    assert "hopper.backward_gluon.dkdv + hopper.backward_gluon.dq (Gluon where the lengths" in gpu, gpu
    monkeypatch.setenv(routing.INTERPRET_ENV, "1")
    interp = routing.route(PRESETS["train-fp8"], **call).kernel
    assert interp == "hopper.forward_triton + hopper.backward_triton.dkdv + hopper.backward_triton.dq", interp
