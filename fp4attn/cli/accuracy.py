"""`fp4attn accuracy`: each recipe's output against exact (float64) attention, on input
families that stand for what real layers hold, or on real captured activations.

Families (`make_inputs`; each generator draws its own details from the seed, so tests
can check fresh inputs of the same kind):
- "gaussian": the paper's protocol, q, k, v ~ N(0, 1).
- "hard": q and k scaled by 2, 4 key channels by a further 10, 0.1% of v by 20 (the
  first stress case).
- "channels": a few (2-6) key channels 5-10x larger than the rest (LLM keys).
- "offset": every key of a head shares an offset vector 2-4x the noise.
- "sharp": q and k scaled by 2-3 (logits 4-9x sharper than Gaussian).
- "mixture": all of those at once, with heavy-tailed v (Student t, 3 degrees).
- "sink": 64 keys, one of which takes 70-95% of each row's probability and has a small
  value vector (the attention sink of trained transformers).
"minilm" (`--inputs minilm`): the attention operands of every layer of
all-MiniLM-L6-v2 on the shipped sentences (padded batch; only real tokens' rows count).

Metrics: cosine, relative L2, max error over the whole output, and the 1st percentile
of the per-row cosine (`metrics.row_cosines`), which the means hide.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from fp4attn.api import attention
from fp4attn.cli.output import markdown_table, write_json
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS, get_recipe, preset_names

CASES = ("gaussian", "hard", "channels", "offset", "sharp", "mixture", "sink")
DEFAULT_CASES = ("gaussian", "hard")
SINK_KEYS = 64


def make_inputs(case: str, shape: tuple[int, int, int, int], seed: int, device: str):
    """(q, k, v) float32 for an accuracy case; k and v have SINK_KEYS keys for "sink"."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; accepted: {CASES}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, H, S, D = shape
    if case == "sink" and S < SINK_KEYS:
        raise ValueError(f"case 'sink' needs at least {SINK_KEYS} keys; got S={S} (use -S {SINK_KEYS} or more)")

    def u(lo, hi, *size):
        return lo + (hi - lo) * torch.rand(size, generator=g)

    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    if case == "hard":
        q, k = q * 2, k * 2
        k[..., :4] *= 10
        outliers = torch.rand(shape, generator=g) < 1e-3
        v = torch.where(outliers, v * 20, v)
    if case in ("sharp", "mixture"):
        f = u(2.0, 3.0, B, H, 1, 1)
        q, k = q * f, k * f
    if case in ("channels", "mixture"):
        n = int(torch.randint(2, 7, (1,), generator=g))
        ch = torch.randperm(D, generator=g)[:n]
        k[..., ch] *= u(5.0, 10.0, B, H, 1, n)
    if case in ("offset", "mixture"):
        k = k + torch.randn(B, H, 1, D, generator=g) * u(2.0, 4.0, B, H, 1, 1) * k.std()
    if case == "mixture":
        v = _student_t(shape, 3.0, g)
    if case == "sink":
        k, v = k[..., :SINK_KEYS, :], v[..., :SINK_KEYS, :]
        sink = torch.randint(0, SINK_KEYS, (B, H), generator=g)
        dirs = torch.nn.functional.normalize(torch.randn(B, H, 1, D, generator=g), dim=-1)
        # the sink's score q . k_sink / sqrt(D) is a_i + N(0, 1) with a_i in [5.5, 8]:
        # 70-95% of a row's probability against 63 N(0, 1) scores
        q = q + dirs * u(5.5, 8.0, B, H, S, 1)
        idx = sink[..., None, None].expand(B, H, 1, D)
        k = k.scatter(2, idx, dirs * math.sqrt(D))
        v = v.scatter(2, idx, 0.05 * torch.randn(B, H, 1, D, generator=g))
    return q.to(device), k.to(device), v.to(device)


def _student_t(shape, df: float, g: torch.Generator) -> torch.Tensor:
    """Student-t samples from normals: z / sqrt(chi2_df / df), chi2 as a sum of squares."""
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((*shape, int(df)), generator=g).square().sum(-1)
    return z / torch.sqrt(chi2 / df)


def exact_attention(q, k, v, causal: bool) -> torch.Tensor:
    """float64 softmax attention (the "fp32 attention" of the tables, computed exactly)."""
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def ablation_recipes() -> list:
    """The paper presets with the robust fields added one at a time, and the robust
    presets: which remedy fixes which case (docs/notes/robust-numerics.md)."""
    out = []
    for base in ("nvfp4-fp8", "directp"):
        r = PRESETS[base]
        steps = [("smooth_k", dict(smooth_k=True)), ("rotate_qk", dict(rotate_qk="hadamard")),
                 ("qk_four_over_six", dict(qk_four_over_six=True)), ("qk_fallback", dict(qk_fallback="fp8"))]
        if r.p == "mxfp4":
            steps += [("p_sink", dict(p_sink=True)), ("smooth_v", dict(smooth_v=True)), ("v=fp8", dict(v="fp8")),
                      ("p_sink, v=fp8", dict(p_sink=True, v="fp8"))]
        out += [r] + [r.with_(name=f"{base} + {label}", **fields) for label, fields in steps]
        out.append(PRESETS[f"{base}-robust"])
    return out


def minilm_operands(n_sentences: int = 64, layers=tuple(range(6)), device="cpu", dtype=torch.bfloat16,
                    operands: Path | None = None, save: Path | None = None) -> dict[int, tuple]:
    """{layer: (q, k, v, mask, scale)}: all-MiniLM-L6-v2's attention operands of the first
    `n_sentences` shipped sentences (one padded batch, its boolean key mask), q, k, v cast
    to `dtype` (what the records measure), on `device`. From the model (the eval extra),
    or from a file that `save` wrote before (`operands`), so that a machine without the
    model measures the same operands."""
    if operands is not None:
        captured = torch.load(operands, map_location=device)
    else:
        from fp4attn.cli.eval import minilm_attention_inputs

        captured = minilm_attention_inputs(tuple(layers), n_sentences=n_sentences, device=device)
    captured = {layer: (*(t.to(dtype) for t in c[:3]), *c[3:]) for layer, c in captured.items()}
    if save is not None:
        torch.save({layer: tuple(t.cpu() if torch.is_tensor(t) else t for t in c) for layer, c in captured.items()},
                   save)
    return captured


def minilm_records(recipes, *, n_sentences: int = 64, layers=tuple(range(6)), device="cpu",
                   backend="auto", dtype=torch.bfloat16, operands: Path | None = None,
                   save: Path | None = None) -> list[dict]:
    """One record per (layer, recipe) on all-MiniLM-L6-v2's attention operands
    (`minilm_operands`), against float64 attention of the same (cast) operands; metrics
    over the real tokens' rows only."""
    from fp4attn.reference.masks import key_mask_view

    records = []
    captured = minilm_operands(n_sentences, layers, device, dtype, operands, save)
    for layer, (q, k, v, mask, scale) in tqdm(captured.items(), desc="minilm", unit="layer", leave=False):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               attn_mask=mask, scale=scale)
        keys = key_mask_view(mask) if mask is not None else None
        rows = None if keys is None else keys.reshape(keys.shape[0], 1, -1)  # a query row is a real token
        for recipe in recipes:
            t0 = time.perf_counter()
            out = attention(q, k, v, recipe=recipe, attn_mask=mask, scale=scale, backend=backend)
            B, H, S, D = q.shape
            records.append({
                "recipe": get_recipe(recipe).name, "case": f"minilm L{layer}", "B": B, "H": H, "S": S, "D": D,
                "causal": False, "rows": int(rows.sum()) * H if rows is not None else B * H * S,
                "dtype": str(dtype).removeprefix("torch."), "device": str(q.device), "backend": backend,
                **error_metrics(out, ref, rows), "seconds": round(time.perf_counter() - t0, 3),
            })
    return records


def run_accuracy(
    recipes, cases, shape, *, causal=False, seed=0, device="cpu", backend="auto", dtype=torch.bfloat16
) -> list[dict]:
    """One record per (case, recipe): cos, rel_l2, max_abs vs float64 attention.

    `recipes` holds preset names or `Recipe`s (recorded under their `name`). Inputs are cast to `dtype` first (what a model would pass); the reference is
    computed from the same cast inputs.
    """
    records = []
    jobs = [(c, r) for c in cases for r in recipes]
    for case, recipe in tqdm(jobs, desc="accuracy", unit="run", leave=False):
        name = get_recipe(recipe).name
        q, k, v = (t.to(dtype) for t in make_inputs(case, shape, seed, device))
        ref = exact_attention(q, k, v, causal)
        t0 = time.perf_counter()
        out = attention(q, k, v, recipe=recipe, causal=causal, backend=backend)
        B, H, S, D = shape
        records.append({
            "recipe": name, "case": case, "B": B, "H": H, "S": S, "Sk": k.shape[-2], "D": D, "causal": causal,
            "dtype": str(dtype).removeprefix("torch."), "device": str(q.device), "backend": backend,
            **error_metrics(out, ref), "seconds": round(time.perf_counter() - t0, 3),
        })
    return records


def backward_accuracy(recipes, q, k, v, dout, *, causal=False, attn_mask=None, scale=None, label="") -> list[dict]:
    """Cosine of dQ, dK, dV of each training recipe against float64 autograd of exact
    attention on the same inputs (cast to bf16 first, as a model would pass them)."""
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*exact, attn_mask=attn_mask, is_causal=causal,
                                                     scale=scale).backward(dout.double())
    records = []
    for recipe in tqdm(recipes, desc=f"backward {label}".strip(), unit="recipe", leave=False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe=recipe, causal=causal, attn_mask=attn_mask, scale=scale).backward(
            dout.to(q.dtype))
        B, H, S, D = q.shape
        rec = {"recipe": get_recipe(recipe).name, "inputs": label, "B": B, "H": H, "S": S, "D": D,
               "causal": causal, "device": str(q.device)}
        for g, (got, want) in zip("qkv", zip(leaves, exact)):
            rec[f"cos_d{g}"] = error_metrics(got.grad, want.grad)["cos"]
        records.append(rec)
    return records


def run_backward_accuracy(recipes, shape, *, causal=True, seed=0, device="cpu") -> list[dict]:
    """`backward_accuracy` on Gaussian inputs and a Gaussian output gradient."""
    q, k, v = make_inputs("gaussian", shape, seed, device)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return backward_accuracy(recipes, q, k, v, dout, causal=causal, label="gaussian")


def run_backward_accuracy_minilm(recipes, layers=(0, 2, 5), *, seed=0, device="cpu") -> list[dict]:
    """`backward_accuracy` on the attention operands of all-MiniLM-L6-v2's `layers` on the
    shipped sentences (padded batch, boolean key mask), Gaussian output gradient."""
    from fp4attn.cli.eval import minilm_attention_inputs

    records = []
    for layer, (q, k, v, mask, scale) in minilm_attention_inputs(layers, device=device).items():
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + layer)).to(device)
        records += backward_accuracy(recipes, q, k, v, dout, attn_mask=mask, scale=scale,
                                     label=f"minilm layer {layer}")
    return records


def format_table(records: list[dict]) -> str:
    """GitHub-style table: one row per (inputs, causal, recipe): cos, 1st-percentile row
    cos, rel L2, max err."""
    rows = [[r["case"], "yes" if r["causal"] else "no", r["recipe"], f"{r['cos']:.4f}", f"{r['cos_p1']:.4f}",
             f"{r['rel_l2']:.4f}", f"{r['max_abs']:.4f}"] for r in records]
    return markdown_table(["inputs", "causal", "recipe", "cos", "row cos p1", "rel L2", "max err"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipes", help="comma-separated presets (default: every preset; on the reference, "
                   "without the -fastacc ones, which it computes as their exact forms)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from {CASES}")
    p.add_argument("-B", type=int, default=1, help="batch size (default 1)")
    p.add_argument("-H", type=int, default=4, help="heads (default 4)")
    p.add_argument("-S", type=int, default=1024, help="sequence length, queries and keys (default 1024)")
    p.add_argument("-D", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--causal", action="store_true", help="causal attention (SDPA's is_causal)")
    p.add_argument("--both-causal", action="store_true", help="run each case non-causal and causal")
    p.add_argument("--ablation", action="store_true",
                   help="instead of --recipes: the paper presets with each robust field alone, and the robust presets")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the inputs and kernels run: cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--backend", default="auto", help="fp4attn.attention's backend: auto, triton or reference "
                   "(default auto)")
    p.add_argument("--backward", action="store_true",
                   help="gradients instead: cos of dQ, dK, dV of the training recipes vs float64 autograd")
    p.add_argument("--inputs", default=None,
                   help=f"forward: comma-separated input families from {CASES} (replaces --cases), or 'minilm': "
                        "the attention operands of every layer of all-MiniLM-L6-v2 on the first 64 shipped "
                        "sentences, real tokens' rows only (needs the eval extra). With --backward: 'gaussian' "
                        "(default) or 'minilm' (layers 0, 2, 5)")
    p.add_argument("--operands", type=Path,
                   help="with --inputs minilm: read the captured operands from this file (--save-operands "
                        "wrote it) instead of running the model")
    p.add_argument("--save-operands", type=Path,
                   help="with --inputs minilm: also write the captured operands (bf16) to this file")
    p.add_argument("--grad-formats", default="",
                   help="with --backward: also run each FP8-gradient recipe with these gradient formats "
                        "(e.g. e5m2) to compare them with its own")
    p.add_argument("--json", type=Path, help="write the records here")


def main(args: argparse.Namespace) -> list[dict]:
    on_kernels = args.device.startswith("cuda") and args.backend != "reference"
    chosen = args.recipes is not None
    args.recipes = args.recipes or ",".join(preset_names(on_kernels))
    named = [get_recipe(r) for r in args.recipes.split(",")]  # an unknown name fails before any work
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise ValueError(f"--cases {','.join(unknown)}: unknown; accepted: {', '.join(CASES)}")
    if args.backward:
        inference = [r.name for r in named if r.grad is None]
        if chosen and inference:
            raise ValueError(f"--backward needs recipes with a backward; inference-only (grad=None): "
                             f"{', '.join(inference)}; accepted: "
                             f"{', '.join(n for n, r in PRESETS.items() if r.grad is not None)}")
        recipes = [r for r in named if r.grad is not None]
        for fmt in filter(None, args.grad_formats.split(",")):
            recipes += [r.with_(grad=fmt, name=f"{r.name} (grad {fmt})") for r in list(recipes)
                        if r.grad not in ("bf16", fmt) and "(grad" not in r.name]
        if (args.inputs or "gaussian") == "minilm":
            records = run_backward_accuracy_minilm(recipes, seed=args.seed, device=args.device)
            print(f"gradients vs float64 autograd, all-MiniLM-L6-v2 attention operands, device={args.device}")
        else:
            records = run_backward_accuracy(recipes, (args.B, args.H, args.S, args.D), causal=args.causal,
                                            seed=args.seed, device=args.device)
            print(f"gradients vs float64 autograd, (B,H,S,D)=({args.B},{args.H},{args.S},{args.D}), "
                  f"causal={args.causal}, Gaussian bf16 inputs, device={args.device}")
        print(markdown_table(["recipe", "inputs", "cos dQ", "cos dK", "cos dV"],
                             [[r["recipe"], r["inputs"]] + [f"{r[f'cos_d{g}']:.4f}" for g in "qkv"]
                              for r in records]))
        write_json(args.json, records)
        return records
    forward = ablation_recipes() if args.ablation else args.recipes.split(",")
    if (args.operands or args.save_operands) and args.inputs != "minilm":
        raise ValueError(f"--operands and --save-operands go with --inputs minilm, got --inputs {args.inputs!r}")
    if args.inputs == "minilm":
        records = minilm_records(forward, device=args.device, backend=args.backend, operands=args.operands,
                                 save=args.save_operands)
        print(f"accuracy vs float64 attention, all-MiniLM-L6-v2 attention operands (64 sentences, bf16), "
              f"device={args.device}")
        print(format_table(records))
        write_json(args.json, records)
        return records
    cases = (args.inputs or args.cases).split(",")
    records = []
    for causal in ((False, True) if args.both_causal else (args.causal,)):
        records += run_accuracy(
            forward, cases, (args.B, args.H, args.S, args.D),
            causal=causal, seed=args.seed, device=args.device, backend=args.backend,
        )
    print(f"accuracy vs float64 attention, (B,H,S,D)=({args.B},{args.H},{args.S},{args.D}) "
          f"({SINK_KEYS} keys for 'sink'), bf16 inputs, device={args.device}, seed={args.seed}")
    print(format_table(records))
    write_json(args.json, records)
    return records
