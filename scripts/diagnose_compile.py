"""Does torch.compile change the training kernels' results? Eager vs aot_eager vs
inductor on the forward (out, LSE) and the gradients, one small causal case."""

import torch

import fp4attn


def run(fn, q, k, v):
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return [out, lse, *grads]


def f(a, b, c):
    return fp4attn.attention(a, b, c, recipe="train", causal=True, backend="triton", return_lse=True)


torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
eager = run(f, q, k, v)
for backend in ("aot_eager", "inductor"):
    torch._dynamo.reset()
    got = run(torch.compile(f, backend=backend), q, k, v)
    diffs = [f"{n}: {(a.float() - b.float()).abs().max().item():.3g}" for n, a, b in zip(
        ("out", "lse", "dq", "dk", "dv"), eager, got)]
    print(backend, "max |compiled - eager|:", ", ".join(diffs))
