"""A NaN or Inf reaches exactly the rows that attend to it, on the reference
(reference/forward.py, "Non-finite values"), for every preset: every statistic is taken
over the finite values, so the output equals, bit for bit, that of the same inputs with
the element set to 0, except in the entries that read it, which are NaN:

- q[i, c]: row i (its LSE too);
- k[j, c]: the rows that attend to key j (their LSE too);
- v[j, c]: channel c of the rows that attend to key j (MXFP4 V: to a key of its block
  of 32, whose shared scale it spoils); the LSE is untouched.

Causal both alignments (Sq != Sk, so they differ), a key tile boundary crossed, GQA."""

import math

import pytest
import torch

from fp4attn.api import attention
from fp4attn.recipes import PRESETS

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 150, 200, 64


def _inputs(seed=0, sq=SQ):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
    k, v = (torch.randn(B, HKV, SK, D, generator=g).bfloat16() for _ in range(2))
    return q, k, v


def visible(causal, sq, sk):
    """(Sq, Sk) bool: key j visible to row i."""
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    if causal == "top_left":
        return j <= i
    if causal == "bottom_right":
        return j <= i + sk - sq
    return torch.ones(sq, sk, dtype=torch.bool)


def expected_nan(recipe, where, causal, b, h, s, c, sq=SQ):
    """(B, HQ, Sq, D) bool of the output entries a non-finite value at (b, h, s, c) of
    `where` makes NaN, and (B, HQ, Sq) of the LSE entries."""
    vis = visible(causal, sq, SK)
    out = torch.zeros(B, HQ, sq, D, dtype=torch.bool)
    lse = torch.zeros(B, HQ, sq, dtype=torch.bool)
    group = HQ // HKV
    heads = [h] if where == "q" else list(range(h * group, (h + 1) * group))
    for hq in heads:
        if where == "q":
            if vis[s].any():
                out[b, hq, s] = lse[b, hq, s] = True
        elif where == "k":
            out[b, hq, vis[:, s]] = True
            lse[b, hq, vis[:, s]] = True
        else:
            keys = slice(s // 32 * 32, min(SK, s // 32 * 32 + 32)) if PRESETS[recipe].v == "mxfp4" else slice(s, s + 1)
            out[b, hq, vis[:, keys].any(-1), c] = True
    return out, lse


def _run(q, k, v, recipe, causal):
    return attention(q, k, v, recipe=recipe, causal=causal, enable_gqa=True, return_lse=True, backend="reference")


def _bits(t):
    return t.float().view(torch.int32)


def check(recipe, where, value, causal, pos=(1, 1, 7, 5), sq=SQ, seed=0):
    q, k, v = _inputs(seed, sq)
    args = {"q": q, "k": k, "v": v}
    b, h, s, c = pos
    zeroed = dict(args)
    zeroed[where] = args[where].clone()
    zeroed[where][b, h, s, c] = 0.0
    spoiled = dict(args)
    spoiled[where] = args[where].clone()
    spoiled[where][b, h, s, c] = value
    base, base_lse = _run(zeroed["q"], zeroed["k"], zeroed["v"], recipe, causal)
    out, lse = _run(spoiled["q"], spoiled["k"], spoiled["v"], recipe, causal)
    want, want_lse = expected_nan(recipe, where, causal, b, h, s, c, sq)
    # a row whose score is NaN is NaN in every channel
    assert torch.equal(torch.isnan(out), want), (recipe, where, value, causal)
    assert torch.equal(torch.isnan(lse), want_lse), (recipe, where, value, causal)
    assert torch.equal(_bits(out)[~want], _bits(base)[~want]), (recipe, where, value, causal)
    assert torch.equal(lse[~want_lse].view(torch.int32), base_lse[~want_lse].view(torch.int32))


@pytest.mark.parametrize("recipe", list(PRESETS))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_reaches_exactly_the_rows_that_attend_to_it(recipe, where, value):
    for causal in (None, "top_left", "bottom_right"):
        # row/key 7: inside the first key tile, with rows before it that do not see it
        # under either alignment; key 140: in the second tile
        check(recipe, where, value, causal, pos=(1, 1, 7, 5))
    check(recipe, where, value, "top_left", pos=(0, 0, 140, 33))


@pytest.mark.parametrize("recipe", ["directp", "nvfp4-fp8-robust", "fp8-ktile-affine-lazy-fastacc", "fp8"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_negative_inf_and_rows_that_see_no_key(recipe, where):
    check(recipe, where, -math.inf, "bottom_right", pos=(0, 1, 3, 60))
    # Sq > Sk bottom-right: the first rows see no key and stay 0, whatever q holds
    check(recipe, where, math.nan, "bottom_right", pos=(1, 0, 2, 9), sq=SK + 20)
