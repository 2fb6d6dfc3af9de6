"""Training speed (`fp4attn bench --backward`): causal forward+backward of the training
recipes against SDPA's cuDNN and flash backends in bf16, in one run, and optionally one
whole training step of a ~1B-parameter GPT with each attention.

Each recipe's gradients are checked against the reference backward on a (1, 2)-head
slice before timing. TFLOP/s count the forward's causal FLOPs times 3.5 (backward =
2.5 forwards), as the baselines in facts are counted.

cuDNN's FP8 forward+backward (`cudnn-fp8`: per-tensor e4m3, dP scaled from its measured
amax, kernels alone) is timed beside them when the `nvidia-cudnn-frontend` package is
installed, after its gradients are checked against bf16 SDPA's; its record is written
either way, with a note that says whether it ran and why not (no kernel at head dim 64
on Hopper, for one).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from fp4attn.cli.output import markdown_table, write_json
from fp4attn.tools.benchmark import parse_shapes, sdpa, time_cudnn_fp8_train, time_ms, visible_pairs

TRAIN_SHAPES = [(4, 16, 4096, 128), (2, 16, 8192, 128), (1, 32, 16384, 128), (8, 16, 4096, 64)]
TRAIN_RECIPES = ["train", "train-robust", "train-fp8"]


def _fwd_bwd(impl: str):
    from fp4attn.api import attention

    if impl.startswith("sdpa-"):
        baseline = sdpa(impl)
        return lambda q, k, v: baseline(q, k, v, True)
    return lambda q, k, v: attention(q, k, v, recipe=impl, causal=True, backend="triton")


def check_gradients(recipe: str, q, k, v, dout) -> float:
    """Smallest cosine of the kernel's dQ/dK/dV to the reference backward's on a (1, 2)-head
    slice (same quantized forward); raises below 0.99."""
    from fp4attn.api import attention
    from fp4attn.metrics import error_metrics

    sl = (slice(0, 1), slice(0, 2))
    ins = [t[sl].detach().requires_grad_() for t in (q, k, v)]
    grads = []
    for backend in ("triton", "reference"):
        out = attention(*ins, recipe=recipe, causal=True, backend=backend)
        grads.append(torch.autograd.grad(out, ins, dout[sl]))
    cos = min(error_metrics(a, b)["cos"] for a, b in zip(*grads))
    if not cos > 0.99:
        raise RuntimeError(f"{recipe} backward disagrees with its reference: cos {cos}")
    return cos


def run_train_bench(shapes, recipes, partial: Path | None = None, device: str = "cuda") -> list[dict]:
    """Records of every implementation on every shape (causal forward+backward), SDPA
    cuDNN bf16 first: its time is the speedups' base. `partial` gets the records written
    after each shape."""
    records = []
    for B, H, S, D in tqdm(shapes, desc="bench --backward", unit="shape"):
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        dout = torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=gen)
        flops = 3.5 * 4 * B * H * D * visible_pairs(S, S, True)
        timed, checks = {}, {}
        for impl in ["sdpa-cudnn", "sdpa-flash"] + list(recipes):
            if not impl.startswith("sdpa-"):
                checks[impl] = check_gradients(impl, q, k, v, dout)
            f = _fwd_bwd(impl)
            timed[impl] = time_ms(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), dout))
        base = timed["sdpa-cudnn"]
        for impl, ms in timed.items():
            rec = dict(impl=impl, B=B, H=H, S=S, D=D, causal=True, ms_fwd_bwd=ms, tflops=flops / ms * 1e-9,
                       speedup_vs_cudnn_bf16=base / ms)
            if impl in checks:
                rec["grad_cos_vs_reference"] = checks[impl]
            records.append(rec)
        ms, note = time_cudnn_fp8_train(q, k, v, True, dout)
        records.append(dict(impl="cudnn-fp8", B=B, H=H, S=S, D=D, causal=True, ms_fwd_bwd=ms,
                            tflops=None if ms is None else flops / ms * 1e-9,
                            speedup_vs_cudnn_bf16=None if ms is None else base / ms, note=note))

        torch.cuda.empty_cache()
        write_json(partial, records)
    return records


def format_train_table(records: list[dict]) -> str:
    """A row per (shape, implementation); an implementation that was not timed (cuDNN FP8
    without the package or without a kernel) shows "-" and its note says why."""
    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)

    rows = [[f"{r['B']},{r['H']},{r['S']},{r['D']}", r["impl"], cell(r["ms_fwd_bwd"], ".2f"), cell(r["tflops"], ".0f"),
             "-" if r["speedup_vs_cudnn_bf16"] is None else f"{r['speedup_vs_cudnn_bf16']:.2f}x", r.get("note", "")]
            for r in records]
    return markdown_table(["B,H,S,D", "impl", "ms", "TFLOP/s", "speedup", "note"], rows)


def model_step(recipes, *, layers=20, dim=2048, heads=16, seq=4096, batch=1, steps=12,
               compile_mode: str | None = None) -> list[dict]:
    """Median time of one AdamW step (forward, backward, update) of a GPT with bf16
    weights, and the peak GPU memory of those steps, for SDPA cuDNN and each recipe.
    compile_mode: the model runs under torch.compile(mode=compile_mode), SDPA's too
    ("reduce-overhead" replays CUDA graphs: no launch costs host time)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4attn.study.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq=seq, layers=layers, dim=dim, heads=heads)
    records = []
    for attn in tqdm(["sdpa"] + list(recipes), desc="model step", unit="attn"):
        torch.manual_seed(0)
        model = GPT(cfg, attn).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        run = torch.compile(model, mode=compile_mode) if compile_mode else model
        idx = torch.randint(0, cfg.vocab, (batch, seq + 1), device="cuda")
        times = []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                loss = run(idx[:, :-1], idx[:, 1:])
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        warm = times[4 if compile_mode else 2:]  # the first steps compile (and record graphs) and warm up
        ms = sorted(warm)[len(warm) // 2] * 1e3
        records.append(dict(impl="sdpa-cudnn" if attn == "sdpa" else attn, params=model.num_params(), layers=layers,
                            dim=dim, heads=heads, seq=seq, batch=batch, ms_step=ms, loss=loss.item(),
                            peak_gib=torch.cuda.max_memory_allocated() / 2**30, compile_mode=compile_mode))
        del model, opt, run
        torch.cuda.empty_cache()
    base = records[0]["ms_step"]
    for r in records:
        r["speedup_vs_cudnn_bf16"] = base / r["ms_step"]
    return records


def main(args) -> list[dict]:
    shapes = TRAIN_SHAPES if args.shapes == "all" else parse_shapes(args.shapes, ";")
    recipes = args.recipes.split(",") if args.recipes else TRAIN_RECIPES
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    records = run_train_bench(shapes, recipes, partial=args.json)
    print("causal forward+backward (speedup vs SDPA cuDNN bf16, same run)")
    print(format_train_table(records))
    if args.model_step:
        steps = model_step(recipes, compile_mode=args.model_step_compile)
        records += steps
        mode = args.model_step_compile
        print(f"GPT AdamW step, median of the warm steps{f', torch.compile(mode={mode!r})' if mode else ', eager'}")
        print(markdown_table(["impl", "params", "seq", "ms/step", "speedup", "peak GiB"],
                             [[r["impl"], f"{r['params'] / 1e9:.2f}B", r["seq"], f"{r['ms_step']:.0f}",
                               f"{r['speedup_vs_cudnn_bf16']:.3f}x", f"{r['peak_gib']:.1f}"] for r in steps]))
    write_json(args.json, records)
    return records
