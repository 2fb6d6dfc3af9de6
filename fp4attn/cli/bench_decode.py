"""`fp4attn bench --decode`: decode attention over a quantized KV cache against SDPA's
bf16 decode over a bf16 cache of the same contents, in one run.

For each shape (B sequences, Hq query heads, Hkv KV heads, context L, head dim D; one
new query row per sequence, GQA), the same random bf16 keys and values fill a bf16
cache for SDPA (cuDNN and flash backends, `enable_gqa`) and an `fp4attn.KVCache` per
format (K and V in the same format). Every kernel is checked once against the reference
decode on the same cache before it is timed. Reported per implementation: the kernel
time (median of `triton.testing.do_bench`, each call launched from Python) and the same
call replayed from a CUDA graph (`graph_ms`: the kernels alone, as a serving engine that
captures its decode step runs them), the speedup over the fastest SDPA backend,
the bytes of cache it reads per second and that rate as a fraction of a 2 GiB
device-to-device copy timed in the same run (bytes read plus written), and for the
cache formats the append of one new token per sequence (the quantize-on-write kernel).
Results go to a JSON file of records and a plot of time against context length.
"""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path

import torch

from fp4attn.cli.output import markdown_table, write_json

# (B, Hq, Hkv, L, D): the targets' shapes first, then a context sweep for the plot
SHAPES = [(8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128), (64, 32, 8, 4096, 128), (32, 32, 32, 8192, 128),
          (16, 32, 8, 16384, 128), (8, 32, 8, 8192, 128)]
SWEEP = [(8, 32, 8, L, 128) for L in (2048, 4096, 16384, 65536)]
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
COPY_BYTES = 2 * 2**30


def parse_decode_shapes(spec: str) -> list[tuple[int, ...]]:
    """Shapes "B,Hq,Hkv,L,D;..." ; 'all' for the default set."""
    if spec == "all":
        return SHAPES + SWEEP
    shapes = [tuple(int(x) for x in s.split(",")) for s in spec.split(";") if s]
    if any(len(s) != 5 for s in shapes):
        raise ValueError(f"--shapes {spec!r}: each shape is B,Hq,Hkv,L,D; accepted: 'all' or 'B,Hq,Hkv,L,D;...'")
    return shapes


def parse_launches(spec: str | None):
    """Kernel launches "block_n,warps,stages[,programs_per_sm[,asm[,splits]]];..." of the
    Triton split kernel, "triton", "cuda" or "cuda:<ring stages>" (the CUDA kernel with
    that ring, 0 its register prefetch), to time beside the routing table's (None: the
    table's only); programs_per_sm 0 and splits 0: the compiled kernel's occupancy and the
    split plan's; asm 0 dequantizes by float arithmetic."""
    from fp4attn.routing.decode import DEFAULT_LAUNCH, DecodeLaunch, parse_cuda_stages

    if not spec:
        return []
    out = []
    for part in spec.split(";"):
        if part in ("triton", "cuda") or part.startswith("cuda:"):  # the table's launch of that split kernel
            if part.startswith("cuda:"):
                parse_cuda_stages(part[5:])  # a clear error for a ring it does not take
            out.append(DecodeLaunch(DEFAULT_LAUNCH.block_n, DEFAULT_LAUNCH.warps, DEFAULT_LAUNCH.stages, kernel=part))
            continue
        try:
            vals = [int(x) for x in part.split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (3, 4, 5, 6):
            raise ValueError(f"--launches {spec!r}: each launch is "
                             "block_n,warps,stages[,programs_per_sm[,asm[,splits]]]")
        pps = vals[3] if len(vals) > 3 else DEFAULT_LAUNCH.programs_per_sm
        out.append(DecodeLaunch(*vals[:3], pps, DEFAULT_LAUNCH.min_split_tiles, bool(vals[4]) if len(vals) > 4 else True,
                                vals[5] if len(vals) > 5 else 0, kernel="triton"))
    return out


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, read plus written."""
    from fp4attn.tools.benchmark import time_ms

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.random_()
    ms = time_ms(lambda: dst.copy_(src))
    src = dst = None  # freed (the closure above keeps the names bound)
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (ms * 1e-3)


def _sdpa_decode(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _launch_runs(launch, fmt: str, head_dim: int, group: int, page_size: int) -> bool:
    """Whether a launch to time runs on this cache: a forced CUDA split kernel only where
    it takes the format and shape (elsewhere there is nothing to time)."""
    from fp4attn.routing import decode as decode_routing

    return launch is None or not launch.kernel.startswith("cuda") or not decode_routing.cuda_unsupported_reason(
        fmt, fmt, head_dim, group, 1, page_size)


def _warm(args: tuple) -> None:
    """Compile one format's kernels at one shape's specialization (a process of its own:
    the compiles run side by side)."""
    fmt, (B, Hq, Hkv, L, D), launches = args
    from fp4attn import KVCache, decode
    from fp4attn.kernels.hopper.decode_op import hopper_append, hopper_decode

    cache = KVCache(B, Hkv, D, max(L, 2048), k_format=fmt, device="cuda")
    k = torch.randn(B, Hkv, 1024, D, device="cuda", dtype=torch.bfloat16)
    cache.append(k, k)
    hopper_append(cache, k[:, :, :1], k[:, :, :1], None)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    decode(q, cache)
    for launch in launches:
        if _launch_runs(launch, fmt, D, Hq // Hkv, cache.page_size):
            hopper_decode(q, cache, scale=D**-0.5, causal=True, launch=launch)
    torch.cuda.synchronize()


def warm_up(shapes, formats, launches, processes: int = 8) -> None:
    """Compile every kernel the run will launch, in parallel processes (the Triton cache
    is on disk and shared), before anything is timed."""
    jobs = [(f, s, launches) for s in dict.fromkeys((B, Hq, Hkv, min(L, 4096), D) for B, Hq, Hkv, L, D in shapes)
            for f in formats]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(processes, len(jobs))) as pool:
        pool.map(_warm, jobs)


def run_bench(shapes, formats, launches, partial: Path | None = None, check: bool = True) -> list[dict]:
    """Time SDPA and every format (and launch) on every shape; `partial` gets the
    records after each shape, so a cut-short run keeps what it measured."""
    from fp4attn import KVCache, decode
    from fp4attn.kernels.hopper.decode_op import hopper_append, hopper_decode
    from fp4attn.tools.benchmark import calls_ms, graph_ms, time_ms

    copy_bps = copy_bandwidth()
    print(f"device-to-device copy: {copy_bps / 1e12:.2f} TB/s (read + write, {COPY_BYTES >> 30} GiB)")
    records = [{"impl": "d2d-copy", "bytes": 2 * COPY_BYTES, "bw_TBps": copy_bps / 1e12}]
    for B, Hq, Hkv, L, D in shapes:
        shape = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, D=D)
        gen = torch.Generator(device="cuda").manual_seed(0)
        k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        timed = []
        exact = _sdpa_decode("sdpa-cudnn")(q, k, v).float()
        for impl in ("sdpa-cudnn", "sdpa-flash"):
            f = _sdpa_decode(impl)
            try:
                ms = time_ms(lambda: f(q, k, v))
                g_ms, c_ms = graph_ms(lambda: f(q, k, v)), calls_ms(lambda: f(q, k, v))
            except RuntimeError as e:  # a backend that refuses the shape is a result, not a crash
                print(f"{impl} at {shape}: not run ({str(e).splitlines()[0][:120]})")
                continue
            timed.append(dict(impl=impl, format="bf16", launch="sdpa", ms=ms, graph_ms=g_ms, calls_ms=c_ms,
                              bytes=2 * k.numel() * 2, cos=1.0))
        for fmt in formats:
            cache = KVCache(B, Hkv, D, L + 16, k_format=fmt, device="cuda")
            cache.append(k, v)
            cache_bytes = B * L * cache.bytes_per_token()
            cos_exact = _cosine(decode(q, cache), exact)
            if check:
                want = decode(q, cache, backend="reference")
                got = decode(q, cache)
                cos = _cosine(got, want)
                if not cos > 0.9999:
                    raise RuntimeError(f"decode {fmt} at {shape} disagrees with its reference: cos {cos}")
            for launch in [None] + list(launches):
                if not _launch_runs(launch, fmt, D, Hq // Hkv, cache.page_size):
                    continue
                def call(launch=launch):
                    return hopper_decode(q, cache, scale=D**-0.5, causal=True, launch=launch)
                ms, g_ms, c_ms = time_ms(call), graph_ms(call), calls_ms(call)
                name = "table" if launch is None else f"{launch.block_n},{launch.warps},{launch.stages}," \
                    f"{launch.programs_per_sm},{int(launch.asm)},{launch.splits}" if not launch.kernel else launch.kernel
                timed.append(dict(impl=f"fp4attn-{fmt}", format=fmt, launch=name, ms=ms, graph_ms=g_ms, calls_ms=c_ms,
                                  bytes=cache_bytes, cos=cos_exact))
            # the append of one token per sequence (a step's write), on a copy at the same length
            kn, vn = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
            lens = cache.lengths.clone()

            def append_one():
                cache.lengths.copy_(lens)
                hopper_append(cache, kn, vn, None)

            timed.append(dict(impl=f"append-{fmt}", format=fmt, launch="table", ms=time_ms(append_one),
                              graph_ms=None, bytes=B * cache.bytes_per_token(), cos=None))
            cache = None  # freed (the closures above keep the name bound)
            torch.cuda.empty_cache()
        base = min(t["ms"] for t in timed if t["impl"].startswith("sdpa"))
        g_base = min(t["graph_ms"] for t in timed if t["impl"].startswith("sdpa"))
        for t in timed:
            decode_row = not t["impl"].startswith("append")
            bps = t["bytes"] / (t["ms"] * 1e-3)
            g_bps = t["bytes"] / (t["graph_ms"] * 1e-3) if decode_row else None
            records.append({**shape, **t, "speedup_vs_sdpa": base / t["ms"] if decode_row else None,
                            "bw_TBps": bps / 1e12, "bw_frac_copy": bps / copy_bps,
                            "graph_speedup_vs_sdpa": g_base / t["graph_ms"] if decode_row else None,
                            "graph_bw_frac_copy": g_bps / copy_bps if decode_row else None})
        k = v = None  # freed
        torch.cuda.empty_cache()
        write_json(partial, records)
    return records


def best_records(records: list[dict]) -> list[dict]:
    """Per shape and implementation, the fastest launch."""
    best: dict[tuple, dict] = {}
    for r in records:
        if "L" not in r:
            continue
        key = (r["B"], r["Hq"], r["Hkv"], r["L"], r["D"], r["impl"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return list(best.values())


def format_table(records: list[dict]) -> str:
    rows = []
    for r in best_records(records):
        graph = r.get("graph_ms") is not None
        rows.append([f"{r['B']},{r['Hq']},{r['Hkv']},{r['L']},{r['D']}", r["impl"], r["launch"], f"{r['ms'] * 1e3:.1f}",
                     "-" if r["speedup_vs_sdpa"] is None else f"{r['speedup_vs_sdpa']:.2f}x",
                     f"{r['graph_ms'] * 1e3:.1f}" if graph else "-",
                     f"{r['calls_ms'] / r['graph_ms']:.2f}" if graph and r.get("calls_ms") else "-",
                     f"{r['graph_speedup_vs_sdpa']:.2f}x" if graph else "-",
                     f"{r['graph_bw_frac_copy']:.2f}" if graph else "-",
                     "-" if r["cos"] is None else f"{r['cos']:.4f}"])
    return markdown_table(["B,Hq,Hkv,L,D", "impl", "launch", "us", "vs SDPA", "graph us", "eager/graph", "graph vs SDPA",
                           "graph of copy", "cos vs bf16"], rows)


def plot(records: list[dict], path: Path, gpu: str | None = None) -> None:
    """Kernel time against context length at B=8, Hq=32, Hkv=8, D=128 (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in best_records(records) if (r["B"], r["Hq"], r["Hkv"], r["D"]) == (8, 32, 8, 128)
          and not r["impl"].startswith("append")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in rs):
        pts = sorted((r["L"], r["ms"] * 1e3) for r in rs if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode kernel time (us)")
    gpu = gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    ax.set_title(f"decode, B=8, Hq=32, Hkv=8, D=128, one query row, {gpu}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> list[dict]:
    shapes = parse_decode_shapes(args.shapes)
    formats = tuple((args.formats or ",".join(FORMATS)).split(","))
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"--formats: {bad} are not cache formats; accepted: {FORMATS}")
    launches = parse_launches(args.launches)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.warm_processes:
        warm_up(shapes, formats, launches, args.warm_processes)
    records = run_bench(shapes, formats, launches, partial=args.json)
    print(format_table(records))
    write_json(args.json, records)
    try:
        plot(records, args.png or args.json.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot")
    return records


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The decode options of `fp4attn bench` (with --decode)."""
    p.add_argument("--formats", help=f"with --decode: comma-separated cache formats; default {','.join(FORMATS)}")
    p.add_argument("--launches", help="with --decode: also time these kernel launches, "
                   "'block_n,warps,stages[,programs_per_sm[,asm[,splits]]];...' of the Triton split kernel (0: "
                   "the table's or the plan's), 'triton', 'cuda' or 'cuda:<ring stages>'")
    p.add_argument("--warm-processes", type=int, default=0,
                   help="with --decode: compile the kernels first in this many parallel processes")
