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

import fp4attn
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


def spoiled_keys(recipe, where, s) -> slice:
    """The keys a non-finite value at key s of `where` spoils: its MXFP4 V block of 32
    (whose shared scale it spoils), else key s alone."""
    if where == "v" and PRESETS[recipe].v == "mxfp4":
        return slice(s // 32 * 32, min(SK, s // 32 * 32 + 32))
    return slice(s, s + 1)


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
            out[b, hq, vis[:, spoiled_keys(recipe, where, s)].any(-1), c] = True
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


GPU_RECIPES = [name for name, r in PRESETS.items() if r.grad is None]


def _rows(mask: torch.Tensor, most: int = 4) -> list:
    """The first (batch, head, row) indices where a (B, H, S, D) or (B, H, S) mask is set."""
    rows = mask.any(-1) if mask.dim() == 4 else mask
    return [tuple(r) for r in rows.nonzero()[:most].tolist()]


def _nan_difference(got, want, got_lse, want_lse) -> str:
    """Where the kernel's NaN differ from the reference's (a failing case says it at once)."""
    missing, extra = want & ~got, got & ~want
    channels = sorted({int(c) for c in extra.nonzero()[:, 3].unique()[:6]})
    return (f"NaN missing {int(missing.sum())} at rows {_rows(missing)}; extra {int(extra.sum())} at rows "
            f"{_rows(extra)} channels {channels}; LSE NaN {int(got_lse.sum())} against {int(want_lse.sum())}")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("head_dim,sq,sk", [(128, 300, 2100), (64, 700, 600)])
def test_nonfinite_rows_on_the_gpu(recipe, head_dim, sq, sk):
    """The routed kernels on the GPU (the Triton, Gluon and CUDA C++ forwards and the
    fused quantizers), as under the interpreter (tests/kernels/hopper/test_nan_rows.py): q's
    and k's NaN rows, output and LSE, exactly the reference's; v's in channel c only, the
    reference's rows and at most rows whose query tile reads its key tile; every other
    entry bit for bit the kernel's output with a 0 in the spoiled place."""
    import warnings

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, sq, head_dim, generator=g).bfloat16().cuda()
    k, v = (torch.randn(1, 2, sk, head_dim, generator=g).bfloat16().cuda() for _ in range(2))
    pos = {"q": (0, 3, sq // 3, 5), "k": (0, 1, sk // 2, 9), "v": (0, 0, sk - 170, 33)}
    for where, p in pos.items():
        {"q": q, "k": k, "v": v}[where][p] = 0.0
    for causal in (None, "top_left", "bottom_right"):
        kw = dict(recipe=recipe, causal=causal, enable_gqa=True, return_lse=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", fp4attn.ReferenceFallbackWarning)
            base, base_lse = attention(q, k, v, **kw)
        for where, value in (("q", math.inf), ("k", math.nan), ("v", math.nan), ("v", -math.inf)):
            case = (recipe, head_dim, causal, where, value)
            args = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
            args[where][pos[where]] = value
            out, lse = attention(args["q"], args["k"], args["v"], **kw)
            # the reference on the same GPU (its NaN are IEEE's there as on the CPU, whose
            # float32 matmuls at 300 x 2100 under parallel test workers took minutes a case)
            ref = attention(*args.values(), backend="reference", **kw)
            want, want_lse = torch.isnan(ref[0]).cpu(), torch.isnan(ref[1]).cpu()
            got, got_lse = torch.isnan(out).cpu(), torch.isnan(lse).cpu()
            case = (*case, fp4attn.explain(args["q"], args["k"], args["v"], recipe=recipe, causal=causal,
                                           enable_gqa=True)["kernel"],
                    _nan_difference(got, want, got_lse, want_lse))
            if where == "v":
                c, j = pos["v"][3], pos["v"][2]
                offset = {None: None, "top_left": 0, "bottom_right": sk - sq}[causal]
                # rows that see only keys more than 256 before j's key tile: no query tile
                # of theirs reads it
                far = torch.zeros(sq, dtype=torch.bool) if offset is None else \
                    torch.arange(sq) + offset < j // 128 * 128 - 256
                extra = got & ~want
                assert bool((got | ~want).all()), case
                assert not extra[..., :c].any() and not extra[..., c + 1:].any(), case
                assert not got[..., far, :].any() and not got_lse.any(), case
            else:
                assert torch.equal(got, want) and torch.equal(got_lse, want_lse), case
            changed = (_bits(out) != _bits(base)) & ~got.cuda()
            assert not changed.any(), (*case, f"{int(changed.sum())} finite entries changed, rows "
                                       f"{_rows(changed.cpu())}")
            keep = ~got_lse.cuda()
            assert torch.equal(lse[keep].view(torch.int32), base_lse[keep].view(torch.int32)), case


TRAIN_RECIPES = [name for name, r in PRESETS.items() if r.grad is not None]


def expected_grad_nan(recipe, where, causal, b, h, s, c, sq=SQ):
    """(dq rows (B, HQ, Sq), dk keys (B, HKV, SK), dv keys (B, HKV, SK)) a non-finite
    value at (b, h, s, c) of `where` makes NaN in the reference backward
    (reference/backward.py, "Non-finite values"): the rows whose forward it reaches take
    NaN in their dq (a NaN score, or for v a NaN output and with it delta), and feed it
    to the dk of every key they attend; dv reads P and dO only, so it takes NaN from rows
    with a NaN score (q, k), not from a NaN output (v); a NaN in q reaches its own row."""
    vis = visible(causal, sq, SK)
    group = HQ // HKV
    rows = torch.zeros(B, HQ, sq, dtype=torch.bool)
    if where == "q":
        rows[b, h, s] = bool(vis[s].any())
    else:
        rows[b, h * group:(h + 1) * group, vis[:, spoiled_keys(recipe, where, s)].any(-1)] = True
    keys = ((rows.unsqueeze(-1) & vis).any(-2)).reshape(B, HKV, group, SK).any(2)
    return rows, keys, keys if where != "v" else torch.zeros_like(keys)


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nonfinite_gradients_reach_only_what_they_feed(recipe, where):
    """The training backward on the reference: a NaN reaches exactly the dq rows whose
    forward it reaches and the dk/dv of the keys those rows attend; every other gradient
    is finite (0 x NaN of a key a row does not attend is kept out of every product).
    Causal both alignments, GQA, a position with rows and keys on both sides of it."""
    q0, k0, v0 = _inputs(3)
    do = torch.randn(B, HQ, SQ, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    pos = {"q": (1, 3, 90, 5), "k": (1, 0, 120, 9), "v": (0, 1, 100, 33)}[where]
    for causal in (None, "top_left", "bottom_right"):
        args = {"q": q0.clone(), "k": k0.clone(), "v": v0.clone()}
        args[where][pos] = math.nan
        q, k, v = (t.requires_grad_() for t in args.values())
        attention(q, k, v, recipe=recipe, causal=causal, enable_gqa=True, backend="reference").backward(do)
        rows, dk_keys, dv_keys = expected_grad_nan(recipe, where, causal, *pos)
        case = (recipe, where, causal)
        assert torch.equal(q.grad.isnan().any(-1), rows) and torch.equal(q.grad.isnan().all(-1), rows), case
        assert torch.equal(k.grad.isnan().any(-1), dk_keys), case
        assert torch.equal(v.grad.isnan().any(-1), dv_keys), case
