"""A GPU call that `backend="auto"` runs on the reference warns, once per distinct reason,
with `fp4attn.explain`'s reason and what would run it on the kernels; the reference
asked for (`backend="reference"`, FP4ATTN_BACKEND) stays silent, and so do CPU calls.

The routing runs as on a Hopper GPU with CPU tensors: FP4ATTN_TARGET=sm_90 and
TRITON_INTERPRET=1 (no kernel runs here: every call below routes to the reference)."""

import warnings

import pytest
import torch

import fp4attn
import fp4attn.api as api
from fp4attn import routing


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.setenv(routing.INTERPRET_ENV, "1")
    monkeypatch.delenv(routing.BACKEND_ENV, raising=False)
    monkeypatch.setattr(api, "_WARNED", set())


def _warnings(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [w for w in seen if issubclass(w.category, fp4attn.ReferenceFallbackWarning)]


def _x(d=64, s=16, grad=False):
    return torch.randn(1, 2, s, d, dtype=torch.bfloat16).requires_grad_(grad)


CAUSAL_MASK = torch.ones(16, 16, dtype=torch.bool).tril()

# (call, a phrase of explain's reason, what the hint names)
CASES = [
    (lambda: fp4attn.attention(_x(256), _x(256), _x(256), recipe="fp8"), "head_dim 256",
     "a head_dim the kernels take (multiples of 16 up to 128)"),
    (lambda: fp4attn.attention(_x(), _x(), _x(), recipe="fp8", attn_mask=CAUSAL_MASK), "not a key mask",
     "a key mask (broadcastable as (B, 1, 1, Sk)"),
    (lambda: fp4attn.attention(_x(), _x(), _x(), recipe="bf16"), "Q/K format 'bf16'", "recipe 'directp', "),
    (lambda: fp4attn.attention(_x(grad=True), _x(), _x(), recipe="train", attn_mask=torch.ones(1, 1, 1, 16, dtype=torch.bool)),
     "attn_mask with a backward", "no gradients (torch.no_grad()"),
]


@pytest.mark.parametrize("call,reason,hint", CASES, ids=["head_dim", "mask", "recipe", "grad"])
def test_auto_on_the_reference_warns_once_per_reason(hopper, call, reason, hint):
    first = _warnings(call)
    assert len(first) == 1, [str(w.message) for w in first]
    message = str(first[0].message)
    assert reason in message and hint in message and "backend='reference'" in message, message
    assert first[0].filename == __file__  # points at the caller of fp4attn.attention
    assert _warnings(call) == []  # the same reason again: silent


def test_warning_carries_explains_reason_and_each_reason_warns(hopper):
    q = _x(256)
    why = fp4attn.explain(q, q, q, recipe="fp8")["reason"]
    (w,) = _warnings(lambda: fp4attn.attention(q, q, q, recipe="fp8"))
    assert why in str(w.message)
    # a second reason warns on its own; recipes with kernels list the alternatives
    (w,) = _warnings(lambda: fp4attn.attention(_x(grad=True), _x(), _x(), recipe="train", attn_mask=CAUSAL_MASK))
    assert "no attn_mask (causal=True for a causal mask)" in str(w.message)


def test_a_reference_that_was_asked_for_is_silent(hopper, monkeypatch):
    q = _x(256)
    assert _warnings(lambda: fp4attn.attention(q, q, q, recipe="fp8", backend="reference")) == []
    assert _warnings(lambda: fp4attn.explain(q, q, q, recipe="fp8")) == []
    monkeypatch.setenv(routing.BACKEND_ENV, "reference")
    assert _warnings(lambda: fp4attn.attention(q, q, q, recipe="fp8")) == []
    assert api._WARNED == set()


def test_cpu_calls_are_silent(monkeypatch):
    """On CPU tensors (no interpreter) the reference is the only backend: no warning."""
    monkeypatch.delenv(routing.INTERPRET_ENV, raising=False)
    monkeypatch.delenv(routing.BACKEND_ENV, raising=False)
    monkeypatch.setattr(api, "_WARNED", set())
    q = _x(256)
    assert _warnings(lambda: fp4attn.attention(q, q, q, recipe="fp8")) == []


def test_hint_names_the_targets_and_triton(hopper, monkeypatch):
    """On a GPU no kernel is built for, the hint names the targets; with Triton missing, Triton."""
    q = _x()
    kw = dict(q=q, rec=fp4attn.get_recipe("fp8"), mode=None, needs_grad=False, attn_mask=None, keys=16)
    r = routing.Route("reference", "reference", "sm_80", "no kernels are built for target sm_80")
    assert api._kernel_hint(r=r, **kw) == "the kernels are built for sm_90, sm_100, sm_103, sm_120, sm_121"
    r = routing.Route("reference", "reference", "sm_90", "Triton is not importable (No module named 'triton')")
    assert "installing Triton" in api._kernel_hint(r=r, **kw)
