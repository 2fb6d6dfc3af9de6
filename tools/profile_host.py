"""Where the host time of one causal `train` forward+backward goes (cProfile, after
warm-up), next to its device time: a call whose host time exceeds its device time is
launch-bound, and the ratio `fp4attn bench --backward` reports is then the host's.

    python tools/profile_host.py [4,16,4096,128] [recipe] [top]
"""

import sys
import time
from pathlib import Path

import torch

from fp4attn.api import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/
from dev.host_profile import print_host_profile  # noqa: E402

shape = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128").split(","))
recipe = sys.argv[2] if len(sys.argv) > 2 else "train"
top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def step():
    out = attention(q, k, v, recipe=recipe, causal=True, backend="triton")
    torch.autograd.backward(out, dout)


for _ in range(5):
    step()
torch.cuda.synchronize()
n = 20
t0 = time.perf_counter()
for _ in range(n):
    step()
host = (time.perf_counter() - t0) / n  # the host's time per step: launches return at once
torch.cuda.synchronize()
wall = (time.perf_counter() - t0) / n
print(f"{recipe} {shape}: host {host * 1e3:.3f} ms per step (calls returned), wall {wall * 1e3:.3f} ms per step")
print_host_profile(step, n, top)
