"""Host time against device time of the `train` attention (forward + backward) at the
GPT model step's shape, where the host's time goes, and the model step itself, in one
run. Host ms: the time to enqueue one call when nothing waits on the GPU (N calls, then
one synchronization); a call whose host ms exceed its device ms is launch-bound. The
host profile is cProfile's over the same calls (its own overhead inflates every
Python function by about the same factor: read it as shares). Prints Markdown tables.

    python tools/profile_train_step.py [--shape 1,16,4096,128] [--steps 12] [--top 25]
"""

import argparse
import cProfile
import io
import pstats

import torch
import triton
import triton.language as tl

import fp4attn
from fp4attn.cli.bench_train import model_step
from fp4attn.kernels.hopper import backward_gluon as bp
from fp4attn.kernels.hopper import train_op
from fp4attn.kernels.hopper.forward_op import launch_forward
from fp4attn.kernels.quantize.nvfp4 import quantize_qk_nvfp4
from fp4attn.kernels.quantize.v_operand import quantize_v_t
from fp4attn.recipes import PRESETS
from fp4attn.routing import backward_launch
from fp4attn.tools.benchmark import device_kernels, host_ms

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="1,16,4096,128")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))


def device_ms(f) -> tuple[float, int]:
    """(device ms per call summed over its kernels, kernels per call)."""
    kernels = device_kernels(f, reps=10).values()
    return sum(ms for _, ms in kernels), round(sum(n for n, _ in kernels))


@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, X: tl.constexpr):
    pass


q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
def step():
    return torch.autograd.grad(fp4attn.attention(q, k, v, recipe="train", causal=True), (q, k, v), dout)
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
    def sdpa():
        return torch.autograd.grad(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)
    sdpa_host = host_ms(sdpa)
ptrs = [torch.empty(64, device="cuda") for _ in range(8)]
def empty():
    return _empty_kernel[(1,)](*ptrs, *range(8), X=1)

dev, launches = device_ms(step)
wall = triton.testing.do_bench(step, warmup=5, rep=50, return_mode="median")
host = host_ms(step)
empty_host = host_ms(empty, 200)
prof = cProfile.Profile()
step()
torch.cuda.synchronize()
prof.enable()
for _ in range(20):
    step()
prof.disable()
torch.cuda.synchronize()
# the host time of each layer of the call: the custom ops against their bodies, and the
# bodies' parts (quantizers, kernel launches)
r = PRESETS["train"]
fargs = (q, k, v, r.qk, r.p, r.p_build, r.v, 0, True, D**-0.5)
saved = torch.ops.fp4attn.hopper_train_forward(*fargs)
bargs = (dout.contiguous(), *saved, r.p, r.p_build, 0, True, D**-0.5, *[torch.bfloat16] * 3)
ops_f, _ = train_op.quantize_for_training(q, k, v, r.v)
ops_b = train_op.backward_operands(dout, *saved[:1], *saved[2:])
parts = {
    "forward op (torch.ops, no autograd)": lambda: torch.ops.fp4attn.hopper_train_forward(*fargs),
    "forward op body": lambda: train_op._train_forward_op._init_fn(*fargs),
    "  its quantizers (quantize_for_training)": lambda: train_op.quantize_for_training(q, k, v, r.v),
    "  its kernel launch (launch_forward)": lambda: launch_forward(ops_f, scale=D**-0.5, causal_offset=0, p_mode=0),
    "backward op (torch.ops)": lambda: torch.ops.fp4attn.hopper_train_backward(*bargs),
    "backward op body": lambda: train_op._train_backward_op._init_fn(*bargs),
    "  its operand views (backward_operands)": lambda: train_op.backward_operands(dout, *saved[:1], *saved[2:]),
    "  its kernel launches (launch_backward)": lambda: train_op.launch_backward(ops_b, saved[1], r.p, r.p_build, 0,
                                                                                True, D**-0.5),
}
out0 = fp4attn.attention(q, k, v, recipe="train", causal=True)
gops = {n: getattr(ops_b, n) for n in ("q", "k", "do_t", "v_t", "do_c", "q_c", "k_c")}
descs = bp.descriptors(**gops)
dk, dv, dq = (torch.empty_like(t) for t in (k, v, q))
b = ops_b
parts.update({
    "attention forward alone (autograd graph built)": lambda: fp4attn.attention(q, k, v, recipe="train", causal=True),
    "torch.autograd.grad alone (retain_graph)": lambda: torch.autograd.grad(out0, (q, k, v), dout, retain_graph=True),
    "  Gluon descriptors of the backward (7)": lambda: bp.descriptors(**gops),
    "  dK/dV launch alone": lambda: bp.launch_dkdv_gluon(descs, b.qs, b.ks, saved[1], b.delta, b.do_ts, b.do_cs,
                                                            b.v_ts, b.q_cs, dk, dv, 0, True, D**-0.5,
                                                            staged=backward_launch(D).dkdv_staged),
    "  dQ launch alone": lambda: bp.launch_dq_gluon(descs, b.qs, b.ks, saved[1], b.delta, b.do_ts, b.v_ts, b.k_cs,
                                                       dq, 0, True, D**-0.5),
    "  one NVFP4 quantization (quantize_qk_nvfp4)": lambda: quantize_qk_nvfp4(q, packed=True, channel_amax=True),
    "  V's quantization (quantize_v_t)": lambda: quantize_v_t(v, "fp8", pad_keys_to=64, tokens=True),
})
part_ms = {name: host_ms(f) for name, f in parts.items()}
print("| part of one call | host ms |\n|---|---|")
print("\n".join(f"| {name} | {ms:.3f} |" for name, ms in part_ms.items()), flush=True)
model = {r["impl"]: r["ms_step"] for r in model_step(["train"], steps=args.steps)}

print(f"`train` causal fwd+bwd at (B,H,S,D) = {(B, H, S, D)}; GPT step: 20 layers, dim 2048, seq 4096, batch 1")
print("| host ms per call | device ms per call | kernels per call | do_bench ms | SDPA cuDNN host ms | "
      "empty Triton launch (16 args) host ms | GPT step ms (train) | GPT step ms (SDPA cuDNN) |")
print("|---|---|---|---|---|---|---|---|")
print(f"| {host:.2f} | {dev:.2f} | {launches} | {wall:.2f} | {sdpa_host:.3f} | {empty_host:.4f} | "
      f"{model['train']:.1f} | {model['sdpa-cudnn']:.1f} |")
out = io.StringIO()
stats = pstats.Stats(prof, stream=out)
print(f"\nHost profile of 20 calls (cProfile, top {args.top} by own time, then by cumulative time):\n")
stats.sort_stats("tottime").print_stats(args.top)
stats.sort_stats("cumulative").print_stats(args.top)
print("```\n" + out.getvalue() + "```")
