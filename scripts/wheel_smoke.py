"""Run by scripts/wheel_smoke.sh in a fresh environment holding the built wheel: the installed
package imports from there, computes a reference call on the CPU, and (where cuda-bindings is
importable) compiles one CUDA C++ forward variant and one decode variant from its installed
sources to sm_90a cubins with NVRTC, no GPU needed."""

import importlib.util
import sys
from pathlib import Path

import torch

import fp4attn
from fp4attn import routing

venv = Path(sys.argv[1]).resolve()
where = Path(fp4attn.__file__).resolve()
assert venv in where.parents, f"fp4attn imported from {where}, not from the wheel installed in {venv}"
assert routing.missing_cuda_sources() == [], routing.missing_cuda_sources()
print(f"fp4attn {fp4attn.__version__} from {where.parent}")

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 64, 64, generator=g, dtype=torch.bfloat16) for _ in range(3))
out = fp4attn.attention(q, k, v, is_causal=True, recipe="fp8", backend="reference")
want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
cos = torch.nn.functional.cosine_similarity(out.double().flatten(), want.flatten(), dim=0).item()
assert out.shape == q.shape and out.dtype == q.dtype and cos > 0.99, (out.shape, out.dtype, cos)
print(f"reference call: fp8 recipe, cosine {cos:.4f} to float64 attention")

if importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None:
    from fp4attn.kernels.hopper import decode_cuda, forward_cuda

    variant = forward_cuda.variant_for(64, False)
    build = forward_cuda.compile_variant(variant, use_cache=False, announce=False)
    assert build.cubin[:4] == b"\x7fELF", variant
    dvariant = decode_cuda.all_variants()[0]
    dbuild = decode_cuda.compile_variant(dvariant, use_cache=False)
    assert dbuild.cubin[:4] == b"\x7fELF", dvariant
    print(f"NVRTC: a forward ({len(build.cubin)} bytes) and a decode ({len(dbuild.cubin)} bytes) sm_90a cubin")
else:
    print("NVRTC: cuda-bindings not importable, no CUDA C++ build checked")
