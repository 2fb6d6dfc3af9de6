"""The host side of a forward call on the Hopper route, on the CPU with every Triton
launch recorded instead of run (the interpreter's route: TRITON_INTERPRET=1 with
FP4ATTN_TARGET=sm_90): an eager call runs the op's body without the dispatcher, launches
the recipe's quantizers and one forward kernel, and its host work stays within a budget
of Python frames and tensor operations (counted, not timed: a call that grows fails
here). Short calls are host-bound on the GPU (docs/notes/hopper-forward.md)."""


import pytest
import torch

import fp4attn
from fp4attn import routing
from tests.host_work import Ops, host_work

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from fp4attn.kernels.hopper import forward_op  # noqa: E402


@pytest.fixture
def launches(monkeypatch):
    """The kernel names launched, each launch recorded instead of run."""
    out = []

    def run(self, *args, grid, warmup, **kwargs):
        out.append(getattr(self, "__name__", None) or self.fn.__name__)

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.delenv(routing.BACKEND_ENV, raising=False)
    return out


# Per eager call at (2, 4, 300, 64) without gradients: the kernels launched (V's quantizer
# in two passes, as off the GPU: `quantize_v_t(one_pass=None)`), the package's Python frames
# (checks, the route, the quantizers' and the forward's launch arguments) and the tensor
# operations (the quantizers' outputs, the forward's output and LSE, their views). Lower a
# budget when a change removes work; never raise it to let work in.
FP8_QUANTIZERS = {"token": ["_fp8_rows_kernel", "_fp8_rows_kernel"], "tile": ["_fp8_rows_kernel", "_fp8_tiles_kernel"]}
NVFP4_QUANTIZERS = ["_abs_max_kernel", "_nvfp4_rows_kernel"] * 2
V_FP8 = ["_v_kernel", "_v_kernel"]
FP8_OPS = {"aten.empty.memory_format": 8, "aten.zeros.default": 1, "aten.view.default": 2, "aten.slice.Tensor": 3}
BUDGETS = {  # (recipe, causal): (kernels, frames, operations)
    ("fp8-ktile-affine-fastacc", True): (FP8_QUANTIZERS["tile"] + V_FP8 + ["attn_fwd_kernel"], 119, FP8_OPS),
    ("fp8-affine-fastacc", False): (FP8_QUANTIZERS["token"] + V_FP8 + ["attn_fwd_kernel"], 122, FP8_OPS),
    ("nvfp4-fp8", True): (NVFP4_QUANTIZERS + V_FP8 + ["attn_fwd_kernel"], 127,
                          {"aten.empty.memory_format": 12, "aten.zeros.default": 3, "aten.view.default": 14,
                           "aten.slice.Tensor": 7}),
}


@pytest.mark.parametrize("form", BUDGETS, ids=lambda f: f"{f[0]}-{'causal' if f[1] else 'full'}")
def test_the_host_work_of_an_eager_call_stays_within_its_budget(form, launches):
    recipe, causal = form
    q, k, v = (torch.randn(2, 4, 300, 64).bfloat16() for _ in range(3))

    def call():
        with torch.no_grad():
            return fp4attn.attention(q, k, v, recipe=recipe, causal=causal)

    call()
    launches.clear()
    frames, ops = host_work(call)
    kernels, budget_frames, budget_ops = BUDGETS[form]
    assert launches[: len(launches) // 2] == kernels
    assert frames <= budget_frames, f"{frames} Python frames of fp4attn a call; the budget is {budget_frames}"
    assert dict(ops) == budget_ops, dict(ops)


def test_an_eager_call_skips_the_dispatcher_and_a_traced_one_takes_the_op(launches, monkeypatch):
    q, k, v = (torch.randn(1, 2, 130, 64).bfloat16() for _ in range(3))
    recipe = fp4attn.get_recipe("fp8-affine-fastacc")
    with Ops() as mode:
        forward_op.hopper_attention(q, k, v, recipe, scale=0.125, causal_offset=0)
    assert "fp4attn.hopper_attention.default" not in mode.ops
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with Ops() as mode:
        forward_op.hopper_attention(q, k, v, recipe, scale=0.125, causal_offset=0)
    assert mode.ops["fp4attn.hopper_attention.default"] == 1
