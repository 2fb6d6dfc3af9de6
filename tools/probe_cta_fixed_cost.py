"""What a CTA of the CUDA C++ forward costs besides its key tiles: the lazy affine FP8-P
build (fp8-ktile-affine-lazy-fastacc's kernel), the exact one and the exp2 one
(fp8-fastacc's), kernel alone on prepared operands, at a fixed grid (B, H, Sq) while the
keys per row grow, with a CTA per work unit and (--persistent) with a persistent grid of one
CTA per SM beside it (whose outputs must equal the other's bit for bit: checked); a
least-squares fit of time per wave of units = fixed + per_tile * key tiles says how much of
a short row's time is a unit's prologue, pipeline fill and epilogue. SDPA cuDNN bf16 at the
same shapes beside it. Median of triton.testing.do_bench.

    python tools/probe_cta_fixed_cost.py [--grid 8,16,4096,128] [--keys 1024,2048,4096] [--persistent [--ablate-epilogue]] [--causal] [--key-bias]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/ (the checking build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="8,16,4096,128;16,16,2048,64")
    p.add_argument("--keys", default="1024,2048,4096,8192,16384")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--causal", action="store_true", help="causal, at Sk = Sq only")
    p.add_argument("--ablate-epilogue", action="store_true",
                   help="with --persistent: the lazy build beside its timing build without an epilogue")
    p.add_argument("--key-bias", action="store_true", help="the key-bias builds (a bias of zeros: every key seen)")
    args = p.parse_args()
    from triton.testing import do_bench

    from dev.forward_cuda_check import launch_checking
    from fp4attn.kernels.hopper.forward_cuda import CONSUMERS
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe
    from fp4attn.tools.benchmark import sdpa

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    builds = {"lazy": {"affine_p": True, "lazy_rescale": True}, "exact": {"affine_p": True}, "exp2": {}}
    if args.persistent:
        builds = {f"{name}{tag}": {**kw, "persistent": pers} for name, kw in builds.items()
                  for tag, pers in (("", False), (" persistent", True))}
    if args.ablate_epilogue:  # the lazy build, persistent, with and without its epilogue
        builds = {"lazy persistent": builds["lazy persistent"],
                  "lazy persistent, no epilogue (timing only)": {**builds["lazy persistent"], "ablate_epilogue": True}}
    for grid in args.grid.split(";"):
        B, H, Sq, D = map(int, grid.split(","))
        ctas = B * H * math.ceil(Sq / (64 * CONSUMERS[D, args.causal]))  # 64 rows a consumer warpgroup
        waves = math.ceil(ctas / sms)
        print(f"grid {grid}: {ctas} CTAs, {waves} waves of {sms}")
        fits = {name: [] for name in builds}
        table = []
        # causal: square shapes only (the fit then mixes grid and keys: read the table)
        for sk in ([Sq] if args.causal else map(int, args.keys.split(","))):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, H, Sq, D, device="cuda", generator=g).bfloat16()
            k, v = (torch.randn(B, H, sk, D, device="cuda", generator=g).bfloat16() for _ in range(2))
            f = sdpa("sdpa-cudnn")
            off = 0 if args.causal else None
            base = do_bench(lambda: f(q, k, v, args.causal), return_mode="median")
            ops = prepare_operands_fused(q, k, v, get_recipe("fp8-ktile-affine-fastacc"))
            row = [f"{sk}", f"{base * 1e3:.1f}"]
            outs = {}
            for name, kw in builds.items():
                bias = torch.zeros((B, sk), device="cuda") if args.key_bias else None
                run = lambda: launch_checking(ops, scale=D**-0.5, causal_offset=off, key_bias=bias, **kw)  # noqa: E731
                outs[name] = run()
                ms = do_bench(run, return_mode="median")
                fits[name].append((sk / 128, ms * 1e3 / waves))
                row.append(f"{ms * 1e3:.1f} ({base / ms:.2f}x)")
            for name in builds:
                if name.endswith(" persistent") and name.removesuffix(" persistent") in outs:
                    a, b = outs[name], outs[name.removesuffix(" persistent")]
                    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                    print(f"{name}: outputs {'equal' if same else 'DIFFER'} to one CTA per unit", flush=True)
            table.append(row)
            print(" | ".join(row), flush=True)
            q = k = v = ops = None  # freed (the closures above keep the names bound)
        print("| keys | cuDNN bf16 us | " + " | ".join(f"{n} us" for n in builds) + " |\n|" + "---|" * (2 + len(builds)))
        for r in table:
            print("| " + " | ".join(r) + " |")
        for name, pts in fits.items() if not args.causal else ():
            n = len(pts)
            mx = sum(x for x, _ in pts) / n
            my = sum(y for _, y in pts) / n
            b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            a = my - b * mx
            worst = max(abs(y - (a + b * x)) / y for x, y in pts)
            shares = ", ".join(f"{int(x * 128)} keys {a / (a + b * x):.0%}" for x, _ in pts)
            print(f"{grid} {name}: per wave {a:.2f} us fixed + {b:.3f} us a key tile (worst residual {worst:.1%}); "
                  f"fixed share: {shares}")


if __name__ == "__main__":
    main()
