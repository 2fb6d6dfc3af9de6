"""Where a short decode call's time goes: its host time (calls returned, nothing waiting
on the GPU) against the device time of the kernels it runs, for the public call, the
custom op, and the two Triton launches alone; then the top of a cProfile of the public
call. A call whose host time exceeds its device time is launch-bound.

    python tools/profile_decode_host.py [8,32,8,2048,128] [nvfp4] [top]
"""

import cProfile
import pstats
import sys

import torch

from fp4attn import KVCache, decode
from fp4attn.kernels.hopper import decode_op
from fp4attn.tools.benchmark import device_kernels, host_ms

B, Hq, Hkv, L, D = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8,32,8,2048,128").split(","))
fmt = sys.argv[2] if len(sys.argv) > 2 else "nvfp4"
top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
cache = KVCache(B, Hkv, D, L + 16, k_format=fmt, device="cuda")
cache.append(k, v)
ka, ks, kt = decode_op.pool_tensors(cache.k, q)
va, vs, vt = decode_op.pool_tensors(cache.v, q)
op_args = (q, ka, ks, kt, va, vs, vt, cache.block_table, cache.lengths, None, fmt, fmt, cache.page_size, Hkv,
           cache.max_length(), D**-0.5, True)
calls = {
    "fp4attn.decode": lambda: decode(q, cache),
    "hopper_decode": lambda: decode_op.hopper_decode(q, cache, scale=D**-0.5, causal=True),
    "custom op": lambda: decode_op._decode_op(*op_args),
    "op body (no dispatch)": lambda: decode_op._decode_impl(*op_args),
}
print(f"| call, {fmt} ({B},{Hq},{Hkv},{L},{D}) | host us a call | device us a call (kernels) |")
print("|---|---|---|")
for name, fn in calls.items():
    dev = device_kernels(fn)
    dev_us = sum(ms for _, ms in dev.values()) * 1e3
    print(f"| {name} | {host_ms(fn, 200) * 1e3:.1f} | {dev_us:.1f} ({len(dev)}) |")
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    decode(q, cache)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(top)
