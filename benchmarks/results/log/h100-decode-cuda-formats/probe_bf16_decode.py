"""bf16 decode: the CUDA split kernel (coalesced V copies), the Triton split + Triton combine, and the Triton split +
the CUDA combine: graph and eager (20 calls back to back) time, and the largest difference from the reference."""
import torch

from fp4attn import KVCache, decode
from fp4attn.kernels.hopper import decode_cuda, decode_op
from fp4attn.kernels.hopper.decode_op import hopper_decode
from fp4attn.routing import decode as R
from fp4attn.tools.benchmark import calls_ms, graph_ms

B, Hq, Hkv, L, D = 8, 32, 8, 4096, 128
rows = []
orig = decode_op._TritonSplit.__call__
comb = decode_cuda.Launcher(decode_cuda.Variant(D, "fp8", "fp8", False, stages=0), torch.device("cuda:0"))
def patched(self, qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, max_len, scale, causal, out, lse, stream):
    route, launch = self.route, self.route.launch
    Bq, Hqq, Sq, Dd = qb.shape
    kv_heads, nrows = route.kv_heads, route.group * Sq
    def args(split_tokens, o_acc, o_ml):
        return (qb, ka, ks, kt, va, vs, vt, table, lengths, key_start if key_start is not None else lengths,
                o_acc, o_ml, qb.stride(0), qb.stride(1), qb.stride(2), kv_heads, route.page_size,
                table.stride(0), Sq, nrows, split_tokens, scale * decode_op.LOG2E)
    form = self.forms.get((causal, key_start is not None)) or self._form(causal, key_start is not None, args)
    consts, resident = form
    n_split, split_tokens = route.split_plan(max_len, self.sms, resident)
    o_acc, o_ml = decode_op._partials(self.device, stream, n_split, Bq, Hqq, Sq, Dd)
    decode_op.decode_split_kernel[(n_split, Bq * kv_heads, -(-nrows // route.block_m))](
        *args(split_tokens, o_acc, o_ml), **consts, num_warps=launch.warps, num_stages=launch.stages)
    comb.combine(o_acc, o_ml, out, lse, stream=stream)

k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
cache = KVCache(B, Hkv, D, L + 16, k_format="bf16", device="cuda")
cache.append(k, v)
want = decode(q, cache, backend="reference").float()
for name, kernel, patch in (("cuda:2", "cuda:2", False), ("cuda:3", "cuda:3", False), ("triton", "triton", False),
                            ("triton+cuda combine", "triton", True), ("routed", None, False)):
    decode_op._TritonSplit.__call__ = patched if patch else orig
    launch = R.DecodeLaunch(128, 4, 2, kernel=kernel) if kernel else None
    def f():
        return hopper_decode(q, cache, scale=D**-0.5, causal=True, launch=launch)[0]
    err = (f().float() - want).abs().max().item()
    torch.cuda.synchronize()
    t, e = graph_ms(f) * 1e3, calls_ms(f) * 1e3
    t2, e2 = graph_ms(f) * 1e3, calls_ms(f) * 1e3
    rows.append((name, err, t, e, e / t, t2, e2, e2 / t2))
    print(rows[-1], flush=True)
decode_op._TritonSplit.__call__ = orig
print("| bf16 (8,32,8,4096,128) | max err vs reference | graph us | eager us | eager/graph | graph us (again) | eager us (again) | eager/graph (again) |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in r) + " |")
