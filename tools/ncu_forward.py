"""One forward launch per recipe for Nsight Compute: warm-up launches first, then the
profiled one (`--launch-skip 2 --launch-count 1` per recipe), on the bench operands.

    ncu --clock-control none -k regex:attn_fwd --launch-skip 2 --launch-count 1 \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\\
        smsp__issue_active.avg.pct_of_peak_sustained_active \\
        python3 tools/ncu_forward.py fp8-fastacc [8,16,4096,128] [causal]
"""

import sys

import torch

from fp4attn.kernels.hopper.forward_op import launch_forward
from fp4attn.kernels.hopper.operands import prepare_operands_fused
from fp4attn.recipes import PRESETS
from fp4attn.routing import P_MODES

recipe = PRESETS[sys.argv[1]]
B, H, S, D = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,16,4096,128").split(","))
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
ops = prepare_operands_fused(q, k, v, recipe)
for _ in range(3):
    launch_forward(ops, scale=D**-0.5, causal_offset=0 if causal else None, p_mode=P_MODES[(recipe.p, recipe.p_build)])
torch.cuda.synchronize()
