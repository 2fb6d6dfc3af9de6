"""The CUDA C++ Hopper training backward (fp4attn/kernels/hopper/backward_cuda.py).

CPU: every variant compiles for sm_90a with NVRTC with the wgmmas kept pipelined and at most
48 bytes of spill; the launch shape's shared memory fits one CTA an SM; the route
(`routing.use_cuda_backward`) takes exactly the operands the kernel takes, and only where the
launch asks for it.
GPU (Hopper): dQ, dK, dV against the routed Gluon/Triton kernels on the same operands (the
same arithmetic: the float32 sums differ in order only, and where that moves a dS value
across an e4m3 rounding boundary, one code of dQ's view), GQA, causal from either corner,
Sq != Sk, both head dims; NaN reaches exactly the gradients it feeds; the route through
`fp4attn.attention` with `override_launch`.
"""

import dataclasses
import importlib.util

import pytest
import torch

from fp4attn import routing

NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.compile
@pytest.mark.skipif(not NVRTC, reason="cuda-bindings (NVRTC) not installed")
def test_every_variant_compiles(tmp_path, monkeypatch):
    from fp4attn.kernels.hopper import backward_cuda
    from fp4attn.kernels.hopper.nvrtc_build import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # a fresh build, not a cached one
    for variant in backward_cuda.all_variants():
        build = backward_cuda.compile_variant(variant, announce=False)
        assert build.cubin[:4] == b"\x7fELF", variant
        assert not build.serialized_wgmma(), f"{variant}: ptxas serialized the wgmmas:\n{build.log}"
        # the head-dim-128 non-causal build keeps 48 bytes of loop values in local memory (NVRTC 13.0)
        assert build.spill_bytes() <= 48, f"{variant}: ptxas spilled to local memory:\n{build.log}"
        assert variant.shared_bytes() <= 227 * 1024, variant


def test_route_takes_exactly_the_kernels_operands(monkeypatch):
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: None)
    table = routing.backward_launch(128)
    assert not table.cuda  # measured slower than the Gluon kernels: not in the table
    on = dataclasses.replace(table, cuda=True)
    assert routing.use_cuda_backward(on, "fp8", 0, 128, 4096, 4096, True)
    assert routing.use_cuda_backward(on, "fp8", 0, 64, 64, 128, True)
    assert not routing.use_cuda_backward(table, "fp8", 0, 128, 4096, 4096, True)
    assert not routing.use_cuda_backward(on, "nvfp4", 0, 128, 4096, 4096, True)  # NVFP4 Q/K: tensor scales
    assert not routing.use_cuda_backward(on, "fp8", 6, 128, 4096, 4096, True)  # trained affine P
    assert not routing.use_cuda_backward(on, "fp8", 0, 96, 4096, 4096, True)
    assert not routing.use_cuda_backward(on, "fp8", 0, 128, 4000, 4096, True)  # Sq not whole 64-query tiles
    assert not routing.use_cuda_backward(on, "fp8", 0, 128, 4096, 4032, True)  # Sk not whole 128-key blocks
    assert not routing.use_cuda_backward(on, "fp8", 0, 128, 4096, 4096, False)
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: "no NVRTC")
    assert not routing.use_cuda_backward(on, "fp8", 0, 128, 4096, 4096, True)


def test_backward_source_is_installed_with_its_headers():
    assert "attn_bwd_fp8.cu" in routing.CUDA_SOURCES
    assert routing.missing_cuda_sources() == []


def _operands(B, H, Hkv, Sq, Sk, D, off, causal, nan_at=None):
    from fp4attn.kernels.hopper import train_op

    g = torch.Generator(device="cuda").manual_seed(B * 1000 + Sq + D)

    def mk(h, s):
        return torch.randn(B, h, s, D, device="cuda", generator=g).bfloat16()

    q, k, v, dout = mk(H, Sq), mk(Hkv, Sk), mk(Hkv, Sk), mk(H, Sq)
    if nan_at is not None:
        k[nan_at] = float("nan")
    scale = D ** -0.5
    out, lse, *saved = train_op._train_forward_fp8_op(q, k, v, "fp8", "fp8", "exp2", "fp8", off, causal, scale)
    return train_op.backward_operands_fp8(dout, out, *saved), lse, scale


gpu = pytest.mark.skipif(not (HOPPER and NVRTC), reason="needs a Hopper GPU and NVRTC")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B, H, Hkv, Sq, Sk, D, off, causal", [
    (1, 2, 2, 128, 128, 128, 0, False),
    (1, 2, 2, 256, 256, 64, 0, True),
    (2, 4, 2, 320, 384, 128, 64, True),    # GQA, bottom-right alignment (Sk - Sq)
    (1, 4, 1, 384, 256, 64, -128, True),   # top-left with Sq > Sk: early queries see no key
    (2, 3, 3, 192, 512, 64, 0, False),
    (1, 2, 2, 512, 512, 128, 0, True),
])
def test_matches_routed_kernels(B, H, Hkv, Sq, Sk, D, off, causal):
    from fp4attn.kernels.hopper import backward_cuda, train_op
    from fp4attn.metrics import error_metrics

    ops, lse, scale = _operands(B, H, Hkv, Sq, Sk, D, off, causal)
    ref = train_op.launch_backward(ops, lse, "fp8", "exp2", off, causal, scale)
    new = backward_cuda.launch_backward_cuda(ops, lse, off, causal, scale)
    plan = routing.hopper_backward_plan(head_dim=D, qk="fp8", p_mode=0, queries=Sq, keys=Sk).name
    for name, a, b in zip(("dq", "dk", "dv"), new, ref):
        a, b = a.float(), b.float()
        if name == "dq":
            # dS differs from the routed kernels' in float32 rounding (the CUDA kernel forms
            # dP - delta in one FMA, softmax_bwd.cuh; the routed dq kernel recomputes S and dP
            # with queries as rows), so a dS value that sits on an e4m3 rounding boundary takes
            # the next code in dQ's view and moves its query's row: measured (H100, H200) one
            # row of 1152 at (2,3,3,192,512,64), row error about 1e-2 (the tensor's 3.7e-4), the others 1e-7
            rows = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).flatten()
            moved = int((rows > 1e-4).sum())
            assert moved <= -(-rows.numel() // 512) and rows.max() < 5e-2, (name, moved, rows.max().item(), plan)
            b, a = b.flatten(0, -2)[rows <= 1e-4], a.flatten(0, -2)[rows <= 1e-4]
        m = error_metrics(a, b)
        # measured 1e-7 to 2e-5 (H100): float32 summation order only
        assert m["rel_l2"] < 1e-4, (name, m, plan)


@pytest.mark.gpu
@gpu
def test_nan_reaches_only_what_it_feeds():
    """One NaN in key 200 of head 0 (batch 0), causal, through the CUDA kernel and the
    routed ones: the rows that attend to it (200 on) are NaN in dq, and every key they
    attend (all 256) in dk and dv (reference/backward.py, "Non-finite values"); the
    kernels' query tiles of up to 128 rows may carry it to the rows of the tile that
    reads key 200's tile (0 x NaN in the tile's product, as in the forward), never
    further; the other head and batch item stay finite."""
    from fp4attn.kernels.hopper import backward_cuda, train_op

    ops, lse, scale = _operands(2, 2, 2, 256, 256, 64, 0, True, nan_at=(0, 0, 200, 3))
    ref = train_op.launch_backward(ops, lse, "fp8", "exp2", 0, True, scale)
    new = backward_cuda.launch_backward_cuda(ops, lse, 0, True, scale)
    plan = routing.hopper_backward_plan(head_dim=64, qk="fp8", p_mode=0, queries=256, keys=256).name
    for kernel, grads in (("cuda", new), (plan, ref)):
        for name, g in zip(("dq", "dk", "dv"), grads):
            case = (kernel, name, f"NaN per (batch, head) {torch.isnan(g).flatten(2).any(-1).tolist()}")
            assert not torch.isnan(g[1]).any() and not torch.isnan(g[0, 1]).any(), case  # other batch item, head
            if name == "dq":
                assert torch.isnan(g[0, 0, 200:]).all() and not torch.isnan(g[0, 0, :128]).any(), case
            else:
                assert torch.isnan(g[0, 0]).all(), case


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_routed_through_attention(D):
    import fp4attn

    g = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(1, 4, 256, D, device="cuda", generator=g).bfloat16() for _ in range(3))
    dout = torch.randn(1, 4, 256, D, device="cuda", generator=g).bfloat16()

    def grads(launch):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with routing.override_launch(backward=launch):
            fp4attn.attention(qq, kk, vv, is_causal=True, recipe="train-fp8").backward(dout)
        return qq.grad.float(), kk.grad.float(), vv.grad.float()

    table = routing.backward_launch(D)
    for a, b in zip(grads(dataclasses.replace(table, cuda=True)), grads(table)):
        assert torch.isfinite(a).all()
        assert (a - b).norm() <= 1e-2 * b.norm()  # bf16 gradients of the same float32 sums



def test_operands_it_cannot_run_are_named():
    from fp4attn.kernels.hopper import backward_cuda

    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    assert "CUDA tensors" in backward_cuda.unsupported_reason(q, k, True, 0)
    if HOPPER:
        qc, kc = q.cuda(), k.cuda()
        assert "train-fp8" in backward_cuda.unsupported_reason(qc, kc, False, 0)
        assert "head dims" in backward_cuda.unsupported_reason(qc[..., :96], kc[..., :96], True, 0)
        assert "multiple of 128" in backward_cuda.unsupported_reason(qc, kc[:, :, :96], True, 0)
