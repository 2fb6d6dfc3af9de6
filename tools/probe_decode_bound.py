"""What bounds the CUDA decode kernel (docs/notes/decode.md): per cache format, the routed
build against a timing-only build that feeds the loaded words to the products unconverted
(`decode_cuda.Variant.ablate`: wrong outputs, the same loads, softmax and products), at
the routed ring depth and the others asked for (`--stages`), beside SDPA cuDNN bf16 over a bf16
cache and a device-to-device copy in the same process. Times are CUDA-graph replays (the
kernels alone). A short table last.

    python tools/probe_decode_bound.py [--shapes "8,32,8,32768,128;1,32,8,131072,128"] [--formats nvfp4,fp8]
        [--stages 0,2] [--ablate 0,1]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,32,8,32768,128;1,32,8,131072,128")
    p.add_argument("--formats", default="nvfp4,fp8")
    p.add_argument("--stages", default="0,2", help="ring depths besides the routed one (0: registers)")
    p.add_argument("--ablate", default="0,1", help="0: the routed build, 1: no dequantization (timing only)")
    args = p.parse_args()
    from fp4attn import KVCache
    from fp4attn.cli.bench_decode import _sdpa_decode, copy_bandwidth
    from fp4attn.kernels.hopper import decode_cuda
    from fp4attn.kernels.hopper.decode_op import hopper_decode
    from fp4attn.reference.kvcache import format_layout
    from fp4attn.routing import decode as decode_routing
    from fp4attn.tools.benchmark import graph_ms

    copy_bps = copy_bandwidth()
    print(f"device-to-device copy {copy_bps / 1e12:.2f} TB/s (read + write)")
    routed_variant = decode_cuda.Variant
    rows = []
    for shape in args.shapes.split(";"):
        B, Hq, Hkv, L, D = map(int, shape.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        k, v = (torch.randn(B, Hkv, L, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        q = torch.randn(B, Hq, 1, D, device="cuda", generator=g).bfloat16()
        base = graph_ms(lambda: _sdpa_decode("sdpa-cudnn")(q, k, v))
        for fmt in args.formats.split(","):
            cache = KVCache(B, Hkv, D, L, k_format=fmt, device="cuda")
            cache.append(k, v)
            nbytes = 2 * B * Hkv * L * format_layout(fmt, D).bytes_per_token()
            routed = decode_routing.cuda_stages(fmt, fmt)
            for stages in dict.fromkeys((routed, *map(decode_routing.parse_cuda_stages, args.stages.split(",")))):
                for ablate in map(int, args.ablate.split(",")):
                    decode_cuda.Variant = functools.partial(routed_variant, ablate=ablate)
                    launch = dataclasses.replace(decode_routing.decode_launch(fmt, fmt, D), kernel=f"cuda:{stages}")
                    try:
                        ms = graph_ms(lambda: hopper_decode(q, cache, scale=D**-0.5, causal=True, launch=launch))
                    finally:
                        decode_cuda.Variant = routed_variant
                    build = "no dequantization (timing only)" if ablate else "routed build"
                    label = f"{build}, " + (f"ring {stages}" if stages else "registers")
                    label += " (routed)" if stages == routed else ""
                    row = [shape, fmt, label, f"{ms * 1e3:.1f}", f"{base / ms:.2f}x",
                           f"{nbytes / (ms * 1e-3) / copy_bps:.2f}"]
                    rows.append(row)
                    print(" | ".join(row), flush=True)
        k = v = None  # freed (the closures above keep the names bound)
        torch.cuda.empty_cache()
    head = ["B,Hq,Hkv,L,D", "format", "build", "graph us", "vs SDPA cuDNN bf16", "of copy"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
