"""Host time of the `train` forward through the registered custom op against its body
called directly and against the body inside a plain autograd.Function, interleaved
(three rounds), at (1,16,4096,128) causal."""

import torch

from fp4attn.cli.bench import host_ms
from fp4attn.kernels.hopper import training
from fp4attn.recipes import PRESETS

B, H, S, D = 1, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
r = PRESETS["train"]
fargs = (q, k, v, r.qk, r.p, r.p_build, r.v, 0, True, D**-0.5)
dargs = tuple(t.detach() for t in fargs[:3]) + fargs[3:]


class Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *a):
        outs = training._train_forward_op._init_fn(*a)
        ctx.save_for_backward(*outs)
        ctx.mark_non_differentiable(*outs[1:])
        return outs


saved = torch.ops.fp4attn.hopper_train_forward(*dargs)
bargs = (torch.randn_like(saved[0]), *saved, r.p, r.p_build, 0, True, D**-0.5, *[torch.bfloat16] * 3)
cases = {
    "forward op, inputs requiring grad": lambda: torch.ops.fp4attn.hopper_train_forward(*fargs),
    "forward op, detached inputs": lambda: torch.ops.fp4attn.hopper_train_forward(*dargs),
    "forward body": lambda: training._train_forward_op._init_fn(*fargs),
    "forward body in a plain autograd.Function": lambda: Plain.apply(*fargs),
    "backward op": lambda: torch.ops.fp4attn.hopper_train_backward(*bargs),
    "backward body": lambda: training._train_backward_op._init_fn(*bargs),
}
res = {n: [] for n in cases}
for _ in range(3):
    for n, f in cases.items():
        res[n].append(host_ms(f, 50))
print("| call | host ms, three rounds |\n|---|---|")
for n, ms in res.items():
    print(f"| {n} | {' / '.join(f'{x:.3f}' for x in ms)} |")
