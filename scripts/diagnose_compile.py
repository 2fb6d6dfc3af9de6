"""Does torch.compile change the training kernels' results? Eager vs aot_eager vs
inductor on the forward (out, LSE) and the gradients, one small causal case, with a
fingerprint of every tensor the backward op receives."""

import torch

import fp4attn
from fp4attn.kernels.hopper import training

_launch = training.launch_backward


def _traced_launch(*args):
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            print(f"  arg{i} {tuple(a.shape)} {a.stride()} {a.dtype} sum={a.float().sum().item():.6g} "
                  f"absmax={a.float().abs().max().item():.6g}")
        else:
            print(f"  arg{i} {a!r}")
    return _launch(*args)


training.launch_backward = _traced_launch


def run(fn, q, k, v):
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return [out, lse, *grads]


def f(a, b, c):
    return fp4attn.attention(a, b, c, recipe="train", causal=True, backend="triton", return_lse=True)


torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
print("eager")
eager = run(f, q, k, v)
for backend in ("aot_eager", "inductor"):
    torch._dynamo.reset()
    print(backend)
    got = run(torch.compile(f, backend=backend), q, k, v)
    diffs = [f"{n}: {(a.float() - b.float()).abs().max().item():.3g}" for n, a, b in zip(
        ("out", "lse", "dq", "dk", "dv"), eager, got)]
    print(backend, "max |compiled - eager|:", ", ".join(diffs))
