"""One decode call of a given launch, for `ncu` (its counters say what binds the split
kernel): a cache of the shape's random keys and values, two warm-up calls, then one.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:decode_split \\
        -s 2 -c 1 python3 tools/ncu_decode.py 8,32,8,32768,128 nvfp4 cuda:2
"""

import sys

import torch

from fp4attn import KVCache
from fp4attn.kernels.hopper.decode_op import hopper_decode
from fp4attn.routing import decode as decode_routing

B, Hq, Hkv, L, D = (int(x) for x in sys.argv[1].split(","))
fmt, kernel = sys.argv[2], sys.argv[3]
k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
cache = KVCache(B, Hkv, D, L + 16, k_format=fmt, device="cuda")
cache.append(k, v)
launch = decode_routing.DecodeLaunch(128, 4, 2, kernel=kernel)
for _ in range(3):
    hopper_decode(q, cache, scale=D**-0.5, causal=True, launch=launch)
torch.cuda.synchronize()
