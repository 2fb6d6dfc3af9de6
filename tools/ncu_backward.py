"""Forward and backward of a training recipe through `fp4attn.attention`, for Nsight
Compute: warm-up steps first, then the profiled ones (pick the kernel with -k and
--launch-skip), on bench-sized operands.

    ncu --set full --import-source no -k regex:dkdv --launch-skip 2 --launch-count 1 \\
        -o prof python3 tools/ncu_backward.py [train] [4,16,4096,128]
"""

import sys

import torch

from fp4attn.api import attention

recipe = sys.argv[1] if len(sys.argv) > 1 else "train"
B, H, S, D = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4,16,4096,128").split(","))
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    attention(q, k, v, recipe=recipe, causal=True, backend="triton").backward(dout)
torch.cuda.synchronize()
