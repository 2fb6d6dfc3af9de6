"""cuDNN's FP8 attention forward+backward (`fp4attn.tools.cudnn_fp8.CudnnFP8Training`, the
`cudnn-fp8` baseline of `fp4attn bench --backward`) checked and timed on one GPU in one run.
Installs nothing: the `nvidia-cudnn-frontend` package must import (the wheel fetched into
.whl/ by the developer: carry .whl, then `pip install --no-deps .whl/nvidia_cudnn_frontend-*.whl`).

1. (1,4,1024,128) causal: dQ/dK/dV cosines to float64 autograd, beside bf16 SDPA's; the
   amaxes the graphs measured and the scales calibrated from them; dQ's cosine with dP
   left unscaled (scale 1), the failure the calibration is there to avoid; whether the
   dP amax is the same at both dP scales (it is measured before scaling, as calibration
   assumes).
2. `time_cudnn_fp8_train`'s note (the bench's path: build, gradient check, timing).
3. (4,16,4096,128) causal: fwd+bwd ms of SDPA cuDNN bf16 (autograd, as the bench times it)
   and of cuDNN FP8 (kernels alone; forward and backward apart too), and the speedup.
4. (8,16,4096,64): the bench's note (on Hopper: no kernel, head dim 128 only).

Exit status 1 when a step fails or a cosine is at or below 0.98.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import cudnn
except ImportError as e:
    sys.exit(f"cudnn does not import ({e}): pip install --no-deps .whl/nvidia_cudnn_frontend-*.whl")

from fp4attn.metrics import error_metrics  # noqa: E402
from fp4attn.tools.benchmark import sdpa, time_cudnn_fp8_train, time_ms  # noqa: E402
from fp4attn.tools.cudnn_fp8 import CudnnFP8Training  # noqa: E402


def inputs(B, H, S, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def fp64_grads(q, k, v, dout):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    S = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.autograd.grad(s.softmax(-1) @ v, (q, k, v), dout.double())


def cosines(got, want):
    return [error_metrics(g, w)["cos"] for g, w in zip(got, want)]


def fmt(coss):
    return " ".join(f"{n} {c:.4f}" for n, c in zip(("dQ", "dK", "dV"), coss))


bad = 0
print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn-frontend {cudnn.__version__}, "
      f"cuDNN {cudnn.backend_version()}")

print("\n1. (1,4,1024,128) causal, Gaussian inputs: cosine to float64 autograd")
q, k, v, dout = inputs(1, 4, 1024, 128)
ref = fp64_grads(q, k, v, dout)
ins = [t.clone().requires_grad_() for t in (q, k, v)]
bf16 = torch.autograd.grad(sdpa("sdpa-cudnn")(*ins, True), ins, dout)
print(f"  SDPA cuDNN bf16: {fmt(cosines(bf16, ref))}")
try:
    att = CudnnFP8Training(q, k, v, dout, True)
    fp8 = cosines(att.grads(), ref)
    print(f"  cuDNN FP8:       {fmt(fp8)}")
    bad += not min(fp8) > 0.98
    print("  amax " + ", ".join(f"{n} {t.item():.4g}" for n, t in att.amax.items()))
    print("  scales " + ", ".join(f"{n} {t.item():.4g}" for n, t in att.s.items()))
    for g in (att.fwd, att.bwd):
        engine = getattr(g, "selected_engine", None)
        print(f"  engine: {engine if engine is not None else 'cuDNN backend'}")
    amax_dp, scale_dp, descale_dp = att.amax["dP"].item(), att.s["scale_dP"].item(), att.s["descale_dP"].item()
    att.s["scale_dP"].fill_(1.0)
    att.s["descale_dP"].fill_(1.0)
    att.run()
    torch.cuda.synchronize()
    print(f"  dP unscaled (scale 1): {fmt(cosines(att.grads(), ref))}; amax dP {att.amax['dP'].item():.4g} "
          f"(calibrated run: {amax_dp:.4g})")
    att.s["scale_dP"].fill_(scale_dp)
    att.s["descale_dP"].fill_(descale_dp)
    att = None  # its buffers freed before the next build
except Exception as e:
    bad += 1
    print(f"  cuDNN FP8 failed: {type(e).__name__}: {e}")

print("\n2. the bench's path at (1,4,1024,128)")
ms, note = time_cudnn_fp8_train(q, k, v, True, dout)
print(f"  {ms if ms is None else f'{ms:.3f} ms'}: {note}")
bad += ms is None

print("\n3. (4,16,4096,128) causal forward+backward")
q, k, v, dout = inputs(4, 16, 4096, 128)
ins = [t.clone().requires_grad_() for t in (q, k, v)]
f = sdpa("sdpa-cudnn")
base = time_ms(lambda: torch.autograd.grad(f(*ins, True), ins, dout))
print(f"  SDPA cuDNN bf16 fwd+bwd: {base:.3f} ms")
try:
    att = CudnnFP8Training(q, k, v, dout, True)
    ms = time_ms(att.run)
    fwd, bwd = time_ms(att.run_forward), time_ms(att.run_backward)
    print(f"  cuDNN FP8 fwd+bwd: {ms:.3f} ms ({base / ms:.2f}x of bf16; forward {fwd:.3f} ms, backward {bwd:.3f} ms)")
    att = None  # its buffers freed before the next build
except Exception as e:
    bad += 1
    print(f"  cuDNN FP8 failed: {type(e).__name__}: {e}")
ms, note = time_cudnn_fp8_train(q, k, v, True, dout)
print(f"  bench path: {ms if ms is None else f'{ms:.3f} ms ({base / ms:.2f}x)'}: {note}")
bad += ms is None

print("\n4. (8,16,4096,64) causal")
q, k, v, dout = inputs(8, 16, 4096, 64)
ms, note = time_cudnn_fp8_train(q, k, v, True, dout)
print(f"  {ms if ms is None else f'{ms:.3f} ms'}: {note}")
bad += note.startswith("failed")
sys.exit(1 if bad else 0)
