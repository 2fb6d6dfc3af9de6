"""Launches of the CUDA forward (forward_cuda) for Nsight Compute: warm-up launches,
then the profiled one (`--launch-skip 2 --launch-count 1`), on the bench operands.

    ncu --set full --import-source no --clock-control none -k regex:attn_fwd_fp8 \\
        --launch-skip 2 --launch-count 1 -o prof \\
        python3 tools/ncu_forward_cuda.py [2,16,16384,128] [causal] [fused]
    ncu -i prof.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 tools/ncu_sass_hotspots.py sass.csv
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/ (the checking build)

from dev.forward_cuda_check import MEASURED, launch_checking  # noqa: E402
from fp4attn.kernels.hopper.operands import prepare_operands_fused  # noqa: E402
from fp4attn.recipes import PRESETS  # noqa: E402

B, H, S, D = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2,16,16384,128").split(","))
causal = "causal" in sys.argv[2:]
fused = "fused" in sys.argv[2:]  # the launcher's build; else the checking build of the recipe's arithmetic
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
ops = prepare_operands_fused(q, k, v, PRESETS["fp8-fastacc"])
for _ in range(3):
    launch_checking(ops, scale=D**-0.5, causal_offset=0 if causal else None, **({} if fused else MEASURED["recipe"]))
torch.cuda.synchronize()
