"""The affine P builders as a user calls them, on the kernels the routing picks (run on an
H200): the Gluon warp-specialized kernel and the Triton kernel with FP8 P's bytes packed by
PRMT, the CUDA C++ kernel for the fast-accumulation FP8 form from 4096 keys, the Triton
kernel for MXFP4 P. tests/kernels/hopper/test_forward.py holds the P codes of every affine preset
to the reference's (the Triton kernel's checking path); here the routed kernels' outputs
and LSE are held to the reference by the same rule, and NaN stays in its row."""

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.masks import causal_offset

pytestmark = pytest.mark.gpu

AFFINE = ["fp8-affine", "fp8-affine-fastacc", "directp-fast", "fp8-directp-fast", "fp8-directp-fast-fastacc",
          "fp8-ktile-affine-fastacc", "fp8-ktile-affine-lazy-fastacc"]


@pytest.mark.parametrize("name", AFFINE)
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [
    (2, 4, 2, 1000, 4500, 128, None), (1, 4, 4, 4500, 4500, 128, "bottom_right"),
    (2, 4, 2, 777, 8300, 64, "top_left"), (1, 2, 1, 333, 1030, 64, None), (1, 4, 2, 500, 2100, 128, "bottom_right"),
    (2, 2, 1, 700, 3000, 64, "bottom_right")])
def test_routed_kernels_match_the_reference(name, b, hq, hkv, sq, sk, d, causal):
    g = torch.Generator(device="cuda").manual_seed(sk)
    def mk(h, s):
        return torch.randn(b, h, s, d, device="cuda", generator=g).bfloat16()
    q, k, v = mk(hq, sq), mk(hkv, sk), mk(hkv, sk)
    r = PRESETS[name]
    out, lse = fp4attn.attention(q, k, v, recipe=name, causal=causal, enable_gqa=True, return_lse=True)
    ref = reference_forward(q, k, v, r, scale=d**-0.5, causal=causal)
    rep = hq // hkv
    off = causal_offset(causal, sq, sk)
    bias = None
    if off is not None:
        i = torch.arange(sq, device="cuda")[:, None]
        j = torch.arange(sk, device="cuda")[None, :]
        bias = torch.zeros(sq, sk, device="cuda", dtype=torch.float64).masked_fill(j > i + off, float("-inf"))
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(rep, 1),
                                           v.double().repeat_interleave(rep, 1), attn_mask=bias)
    seen = torch.isfinite(ref.lse)
    ref_err = error_metrics(ref.out[seen], exact[seen])["rel_l2"]
    ker_err = error_metrics(out.float()[seen], ref.out[seen])["rel_l2"]
    share = 0.3 if r.fast_accum else 0.1
    assert ker_err <= share * ref_err + 4e-3, (name, ker_err, ref_err)
    dl = (lse[seen] - ref.lse[seen]).abs()
    assert dl.mean().item() < 2e-3 and dl.max().item() < 0.25, (dl.mean().item(), dl.max().item())
    assert bool((out.float()[~seen] == 0).all())


@pytest.mark.parametrize("name", AFFINE)
def test_nan_stays_in_its_row(name):
    q = torch.randn(2, 2, 300, 128, device="cuda").bfloat16()
    k = torch.randn(2, 2, 4200, 128, device="cuda").bfloat16()
    v = torch.randn(2, 2, 4200, 128, device="cuda").bfloat16()
    q[1, 0, 5, 3] = float("nan")
    out = fp4attn.attention(q, k, v, recipe=name)
    nan_rows = torch.isnan(out.float()).any(-1)
    # the row with the NaN is NaN; nothing outside its (batch, head) is (NVFP4's scales are
    # per (batch, head): a NaN reaches that head's rows, FP8's per-token scales only its row)
    assert bool(nan_rows[1, 0, 5])
    outside = nan_rows.clone()
    outside[1, 0] = False
    assert not bool(outside.any())
    if PRESETS[name].qk == "fp8":
        assert int(nan_rows.sum()) == 1, int(nan_rows.sum())



@pytest.mark.parametrize("d,causal", [(128, None), (128, "bottom_right"), (64, None)])
def test_rows_whose_maximum_climbs(d, causal):
    """Scores that climb from tile to tile, by small steps (Recipe.rescale="lazy" keeps a
    row's point, then moves it) and by huge ones (a byte thousands of codes above the
    point: the kernel's test must see it, not its low byte). Head 0 (small steps) against
    the reference by the rule above; both heads, the lazy kernel against the exact-rescale
    kernel of the same sums (fast accumulation's scores of hundreds of log2 units are off
    the reference's by more than a code: the two kernels share them) within the format's
    own error, the LSE within the log-linear grid's error."""
    g = torch.Generator(device="cuda").manual_seed(d)
    sq, sk = 300, 4500
    q = torch.randn(1, 2, sq, d, device="cuda", generator=g)
    k = torch.randn(1, 2, sk, d, device="cuda", generator=g)
    v = torch.randn(1, 2, sk, d, device="cuda", generator=g)
    # one key per tile along q's mean direction, its score growing with the tile: by a
    # fraction of a log2 unit a tile in head 0, by hundreds in head 1
    direction = torch.nn.functional.normalize(q.mean(2, keepdim=True), dim=-1)
    tiles = torch.arange(0, sk, 128, device="cuda") + 17
    steps = torch.tensor([0.15, 30.0], device="cuda").view(1, 2, 1, 1)
    k[:, :, tiles] = direction * steps * torch.arange(1, len(tiles) + 1, device="cuda").view(1, 1, -1, 1) * d**0.5
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    lazy, exact = "fp8-ktile-affine-lazy-fastacc", "fp8-ktile-affine-fastacc"
    out, lse = fp4attn.attention(q, k, v, recipe=lazy, causal=causal, return_lse=True)
    out_x, lse_x = fp4attn.attention(q, k, v, recipe=exact, causal=causal, return_lse=True)
    assert bool(torch.isfinite(out.float()).all())
    ref = reference_forward(q[:, :1], k[:, :1], v[:, :1], PRESETS[lazy], scale=d**-0.5, causal=causal)
    want = reference_forward(q[:, :1], k[:, :1], v[:, :1], PRESETS["bf16"], scale=d**-0.5, causal=causal)
    ref_err = error_metrics(ref.out, want.out)["rel_l2"]
    assert error_metrics(out.float()[:, :1], ref.out)["rel_l2"] <= 0.3 * ref_err + 4e-3
    assert error_metrics(out.float(), out_x.float())["rel_l2"] < 1e-2
    assert (lse - lse_x).abs().max().item() < 0.1, (lse - lse_x).abs().max().item()
