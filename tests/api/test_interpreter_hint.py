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


@pytest.mark.interpreter
def test_following_the_hint_runs_the_kernels_under_the_interpreter():
    run_under_interpreter(SCRIPT, timeout=600)


def test_the_interpreter_runs_safe_launches_and_names_the_gpus(monkeypatch):
    """Under the interpreter the routes keep the GPU's kernel names (it stands in for an
    H200: `explain`, tools/sanitize_driver.py --list), while the launches the kernels
    run are the forms it can run: no PTX conversion, TMA or Gluon kernel."""
    from fp4attn import routing
    from fp4attn.recipes import PRESETS

    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.delenv(routing.INTERPRET_ENV, raising=False)
    call = dict(device=torch.device("cuda"), head_dim=128, causal=True, needs_grad=True, mask="none", keys=256)
    gpu = routing.route(PRESETS["train-fp8"], **call).kernel
    assert "hopper.backward_gluon.dkdv + hopper.backward_gluon.dq (Gluon where the lengths" in gpu, gpu
    assert routing.forward_launch(128, False, True) == routing.FORWARD_LAUNCH[128, False, True]
    assert routing.backward_launch(128).hw_cvt
    monkeypatch.setenv(routing.INTERPRET_ENV, "1")
    assert routing.route(PRESETS["train-fp8"], **call).kernel == gpu
    assert routing.forward_launch(128, False, True) == routing.INTERPRETER_FORWARD_LAUNCH
    assert not routing.backward_launch(128).hw_cvt
    other = routing.ForwardLaunch(128, 8, 2)
    with routing.override_launch(forward=other):
        assert routing.forward_launch(128, False, True) == other
