"""Static SASS counts of the CUDA decode split kernel (`kernels/hopper/cuda/decode_split.cu`),
compiled by NVRTC for sm_90a on any machine (no GPU): per build, registers, spills, and
the instructions a lane issues for one unmasked 16-key tile (the loop's head and the
plain copy of the tile's work; the masked copy and the rescale that a tile skips when
no row's maximum grew left out), by opcode, and the difference from the exact build
(`--against`), per key value a lane holds (16 keys x D / 32 lanes for the keys alone).

    python tools/decode_cuda_sass.py [--head-dim 128] [--values nvfp4] [--stages 2] [--fp8 1] [--against 0]
"""

from __future__ import annotations

import argparse
import collections
import glob
import subprocess
import sys
from pathlib import Path

from fp4attn.kernels.hopper import decode_cuda
from fp4attn.tools.machine_code import KernelReport


def cuobjdump() -> str:
    found = glob.glob(str(Path(sys.prefix) / "lib" / "python3*" / "site-packages" / "triton" / "backends" / "nvidia"
                          / "bin" / "cuobjdump"))
    if not found:
        raise RuntimeError("cuobjdump not found (Triton's NVIDIA backend ships it)")
    return found[0]


def sass_of(variant: decode_cuda.Variant, tmp: Path) -> tuple[object, str]:
    build = decode_cuda.compile_source(decode_cuda.SOURCE, decode_cuda.options_for(variant.defines()), str(variant),
                                       use_cache=False, announce=False)
    cubin = tmp / "decode_split.cubin"
    cubin.write_bytes(build.cubin)
    sass = subprocess.run([cuobjdump(), "-sass", "-fun", decode_cuda.KERNEL_NAME, str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    return build, sass


def plain_tile(sass: str) -> list[str]:
    """The opcodes of one unmasked tile: the tile loop (the longest loop) less the larger
    of the two forward-branched regions holding half its mma (the masked copy of the
    work) and less the forward-branched regions without mma inside the plain copy (the
    rescale)."""
    r = KernelReport(0, 0, sass)
    ins = r.instructions()
    i, j = max(r.loop_spans(), key=lambda s: s[1] - s[0])
    at = {a: k for k, (a, _, _) in enumerate(ins)}
    mmas = sum(op.startswith("HMMA") for _, op, _ in ins[i:j + 1])
    regions = []
    for k in range(i, j):
        a, op, operands = ins[k]
        t = r._target(op, operands)
        if op.startswith("BRA") and t in at and k < at[t] <= j:
            regions.append((k + 1, at[t], sum(o.startswith("HMMA") for _, o, _ in ins[k + 1:at[t]])))
    copies = [reg for reg in regions if reg[2] * 2 == mmas]
    if len(copies) != 2:
        raise ValueError(f"expected two copies of the tile's work in the loop, found {len(copies)}")
    masked = max(copies, key=lambda reg: reg[1] - reg[0])
    plain = min(copies, key=lambda reg: reg[1] - reg[0])
    skip = set(range(masked[0], masked[1]))
    for a, b, n in regions:  # the rescale inside the plain copy
        if n == 0 and plain[0] <= a and b <= plain[1]:
            skip.update(range(a, b))
    return [ins[k][1] for k in range(i, j + 1) if k not in skip]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--values", default="nvfp4")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--fp8", type=int, default=1, help="the FP8-products build (QK_FP8): 1 e4m3 mma, 2 f16 mma")
    ap.add_argument("--against", type=int, default=0, help="also count this QK_FP8 build and print the difference")
    args = ap.parse_args()
    import tempfile

    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fp8 in dict.fromkeys((args.fp8, args.against)):
            v = decode_cuda.Variant(args.head_dim, "nvfp4", args.values, False, stages=args.stages, qk_fp8=fp8)
            build, sass = sass_of(v, Path(tmp))
            tile = plain_tile(sass)
            c = collections.Counter(op.split(".")[0] for op in tile)
            counts[fp8] = c
            native = sum("QMMA" in line or "QGMMA" in line for line in sass.splitlines())
            emulated = sum("F2FP.F16.E4M3" in line for line in tile)
            print(f"{f'QK_FP8={fp8}' if fp8 else 'exact'} D={args.head_dim} V={args.values} ring={args.stages}: "
                  f"{build.registers(decode_cuda.KERNEL_NAME)} registers, {build.spill_bytes()} bytes spilled, "
                  f"plain tile {len(tile)} instructions a lane ({emulated} F2FP.F16.E4M3), native e4m3 mma "
                  f"(QMMA, QGMMA) in the kernel: {native}")
            print("   " + ", ".join(f"{k} {n}" for k, n in c.most_common(16)))
    if len(counts) == 2:
        a, b = counts[args.fp8], counts[args.against]
        key_values = 16 * args.head_dim // 32
        diff = {k: a[k] - b[k] for k in set(a) | set(b) if a[k] != b[k]}
        total = sum(a.values()) - sum(b.values())
        print(f"difference (QK_FP8 - exact): {total:+d} a tile, {total / key_values:+.2f} a key value "
              f"({key_values} key values a lane and tile)")
        print("   " + ", ".join(f"{k} {n:+d}" for k, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))))


if __name__ == "__main__":
    main()
