"""The Hopper forward and training backward decide their kernel once: `routing.hopper_forward_plan`
and `routing.hopper_backward_plan` name the kernel, its launch and variant from data; `explain`
reports those plans, and the launchers (`forward_op.launch_forward`, `train_op.launch_backward`)
run exactly the kernel a plan names, with its variant. Launches are recorded, not run: no GPU.
"""

import dataclasses
import functools
import itertools

import pytest
import torch

import fp4attn
from fp4attn import routing
from fp4attn.recipes import PRESETS
from fp4attn.routing import (
    BACKWARD_LAUNCH,
    FORWARD_LAUNCH,
    BackwardKernel,
    DkdvStaged,
    ForwardKernel,
    ForwardLaunch,
    PMode,
    WSOverlap,
    hopper_backward_plan,
    hopper_forward_plan,
)

HOPPER_FORWARD_RECIPES = [n for n, r in PRESETS.items() if routing.hopper_forward_unsupported(r, 128) is None]
HOPPER_TRAIN_RECIPES = [n for n, r in PRESETS.items() if routing.hopper_train_unsupported(r, 128) is None]


@pytest.fixture
def cuda_builds(monkeypatch):
    """The CUDA C++ kernels build here (the capability probe's answer on a Hopper GPU with
    the `cuda` extra)."""
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: None)


def _route_plans(recipe, head_dim, causal, mask, keys, needs_grad, on_cuda):
    """The plans made directly from the call's data, as a route describes a call."""
    d = routing.kernel_head_dim(head_dim)
    mode = routing.p_mode(recipe)
    fwd = hopper_forward_plan(head_dim=d, qk_fp8=recipe.fast_accum, p_mode=mode, causal=causal, keys=keys,
                              key_bias=mask == "key", training=needs_grad, on_cuda=on_cuda)
    if not needs_grad:
        return [fwd]
    return [fwd, hopper_backward_plan(head_dim=d, qk=recipe.qk, p_mode=mode, on_cuda=on_cuda)]


def test_explain_reports_the_plans(monkeypatch):
    """Over recipes, head dims, causal, key counts, key masks and gradients, `explain`
    names the kernels of the plans made from the call's data, and shows each plan
    (variant and reason). CPU tensors routed as on an H200 (no CUDA C++ kernel: not
    CUDA tensors)."""
    pytest.importorskip("triton")
    # the launchers imported first (explain imports them), outside the stand-in below
    from fp4attn.kernels.hopper import forward_op, train_op  # noqa: F401

    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.setattr(routing.targets, "interpreting", lambda: True)  # CPU tensors routed; no interpreter started
    seen = set()
    zeros = functools.cache(lambda *shape: torch.zeros(shape))  # explain reads shapes and dtypes only
    for name, d, causal, sk, masked, grad in itertools.product(
            HOPPER_FORWARD_RECIPES, (96, 128), (False, True), (200, 4096), (False, True), (False, True)):
        recipe = PRESETS[name]
        if grad and (recipe.grad is None or masked):
            continue
        q, k, v = zeros(1, 2, 3, d), zeros(1, 2, sk, d), zeros(1, 2, sk, d)
        mask = torch.ones(1, 1, 1, sk, dtype=torch.bool) if masked else None
        info = fp4attn.explain(q, k, v, attn_mask=mask, causal=causal, recipe=name, needs_grad=grad)
        assert info["backend"] == "triton", info
        plans = _route_plans(recipe, d, causal, "key" if masked else "none", sk, grad, on_cuda=False)
        assert info["kernel"] == " + ".join(p.name for p in plans), info
        assert info["plan"] == [p.as_dict() for p in plans], info
        seen.update(p.name for p in plans)
    assert {"hopper.forward_gluon_ws", "hopper.forward_triton"} <= seen, seen
    assert any("backward_gluon" in s for s in seen) and any("backward_triton" in s for s in seen), seen


def test_routes_carry_the_plans_with_the_cuda_kernel(monkeypatch, cuda_builds):
    """As above on CUDA tensors where the CUDA C++ kernels build: the route's plans (what
    `explain` shows) are the plans of the call's data, the CUDA C++ forward among them."""
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    kinds = set()
    for name, d, causal, sk, mask, grad in itertools.product(
            PRESETS, (64, 128), (False, True), (0, 511, 512, 1024, 2047, 2048, 4096, 8191, 8192),
            ("none", "key"), (False, True)):
        recipe = PRESETS[name]
        r = routing.route(recipe, device=torch.device("cuda"), head_dim=d, causal=causal, needs_grad=grad, mask=mask,
                          keys=sk)
        if r.family is None or not r.family.name.startswith("hopper"):
            continue
        plans = _route_plans(recipe, d, causal, mask, sk, grad, on_cuda=True)
        assert list(r.plans) == plans and r.kernel == " + ".join(p.name for p in plans), (name, d, causal, sk, r)
        kinds.add(plans[0].kernel)
    assert kinds == set(ForwardKernel)


def test_forward_plan_follows_the_launch_table(cuda_builds):
    """The CUDA C++ kernel from `cuda_from_keys` keys of its P mode (never a training
    forward, debug tiles or no query row), the Gluon kernel where the launch is
    warp-specialized and the call allows it (FP8 P, no debug tiles or key bias, K and V^T
    by TMA, Q contiguous), else the Triton kernel; each with the launch's variant."""
    from fp4attn.kernels.hopper.forward_cuda import P_MODE_BUILDS

    for (d, qk_fp8, causal), launch in FORWARD_LAUNCH.items():
        def plan(mode, keys, d=d, qk_fp8=qk_fp8, causal=causal, **kw):
            return hopper_forward_plan(head_dim=d, qk_fp8=qk_fp8, p_mode=mode, causal=causal, keys=keys, **kw)

        for mode in PMode:
            n = launch.cuda_keys(mode)
            below = plan(mode, max(n - 1, 0) if n else 1 << 16)
            gluon = launch.warp_specialized and mode in routing.GLUON_P_MODES
            assert below.kernel is (ForwardKernel.GLUON_WS if gluon else ForwardKernel.TRITON), (d, qk_fp8, mode)
            if not n:
                continue
            assert plan(mode, n).kernel is ForwardKernel.CUDA
            assert plan(mode, n, key_bias=True).kernel is ForwardKernel.CUDA  # the CUDA kernel takes a key bias
            for kw in (dict(training=True), dict(write_p=True), dict(queries=0), dict(on_cuda=False)):
                assert plan(mode, n, **kw).kernel is not ForwardKernel.CUDA, kw
            assert plan(mode, n, write_p=True).kernel is ForwardKernel.TRITON  # debug tiles
        for mode in routing.GLUON_P_MODES:
            if launch.warp_specialized:
                for kw in (dict(write_p=True), dict(key_bias=True), dict(kv_tma=False), dict(q_contiguous=False)):
                    assert plan(mode, 1).kernel is ForwardKernel.GLUON_WS
                    assert plan(mode, 1, **kw).kernel is ForwardKernel.TRITON, kw
        triton = plan(PMode.MXFP4_DIRECTP, 1 << 16)
        assert triton.kernel is ForwardKernel.TRITON and triton.tma_kv == launch.tma_kv
        assert not plan(PMode.MXFP4_DIRECTP, 1, kv_tma=False).tma_kv
        assert plan(PMode.MXFP4_DIRECTP, 1, write_p=True).stages == min(launch.stages, 2)
    assert {m for launch in FORWARD_LAUNCH.values() for m, _ in launch.cuda_from_keys} <= set(P_MODE_BUILDS)
    assert FORWARD_LAUNCH[64, True, False].cuda_keys(4) < FORWARD_LAUNCH[64, True, False].cuda_keys(0)
    # under the interpreter the Triton kernel at its launch; an override replaces the table
    interp = hopper_forward_plan(head_dim=128, qk_fp8=False, p_mode=0, causal=False, keys=8192, interpreter=True)
    assert interp.kernel is ForwardKernel.TRITON and interp.launch == routing.INTERPRETER_FORWARD_LAUNCH
    with routing.override_launch(forward=ForwardLaunch(64, 4, 2, True, tma_kv=True, pv_add=True)):
        assert hopper_forward_plan(head_dim=128, qk_fp8=False, p_mode=0, causal=False, keys=8192).kernel \
            is ForwardKernel.TRITON  # warp_specialized off, no cuda_from_keys


def test_backward_plan_follows_the_launch_table(cuda_builds):
    """dK/dV and dQ on the Gluon kernels where the launch asks for them and the tiles
    arrive by TMA (whole 64-token tiles), e4m3 rounded by the hardware, FP8 P from exp2
    for dK/dV and not the trained affine P for dQ; the CUDA C++ backward where the launch
    asks for it (`train-fp8`'s operands); else the Triton kernels."""
    gluon, triton_, cuda = BackwardKernel.GLUON, BackwardKernel.TRITON, BackwardKernel.CUDA
    for d, launch in BACKWARD_LAUNCH.items():
        def plan(p_mode=PMode.FP8_EXP2, qk="nvfp4", sq=256, sk=128, d=d, **kw):
            return hopper_backward_plan(head_dim=d, qk=qk, p_mode=p_mode, queries=sq, keys=sk, **kw)

        for qk in ("nvfp4", "fp8"):
            whole = plan(qk=qk)
            assert (whole.dkdv, whole.dq) == (gluon, gluon) and whole.tma and not whole.triton_descriptors
            assert whole.row_scales == (qk == "fp8") and whole.launch == launch
            assert (plan(PMode.MXFP4_DIRECTP, qk).dkdv, plan(PMode.MXFP4_DIRECTP, qk).dq) == (triton_, gluon)
            assert plan(PMode.MXFP4_DIRECTP, qk).triton_descriptors
            affine = plan(PMode.FP8_AFFINE_TRAINED, qk)
            assert (affine.dkdv, affine.dq) == (triton_, triton_)
            for tail in (plan(qk=qk, tiles_tma=False), plan(qk=qk, tiles_tma=False, sq=200)):
                assert (tail.dkdv, tail.dq, tail.tma) == (triton_, triton_, False)
        with routing.override_launch(backward=dataclasses.replace(launch, hw_cvt=False)):
            assert (plan().dkdv, plan().dq) == (triton_, triton_)  # e4m3 by bit arithmetic: Triton only
        with routing.override_launch(backward=dataclasses.replace(launch, cuda=True)):
            assert (plan(qk="fp8").dkdv, plan(qk="fp8").dq) == (cuda, cuda)
            assert plan(qk="nvfp4").dkdv is gluon  # NVFP4's tensor scales: not the CUDA kernel's
            assert plan(qk="fp8", sq=200).dkdv is not cuda and plan(qk="fp8", on_cuda=False).dkdv is not cuda
        interp = plan(interpreter=True)
        assert (interp.dkdv, interp.dq) == (triton_, triton_) and not interp.launch.hw_cvt
    # made without the lengths (the route's): the kernels of whole tiles, which the name says
    unknown = hopper_backward_plan(head_dim=128, qk="fp8", p_mode=0)
    assert unknown.name == ("hopper.backward_gluon.dkdv + hopper.backward_gluon.dq (Gluon where the lengths are "
                            "whole 64-token tiles)")
    assert hopper_backward_plan(head_dim=128, qk="fp8", p_mode=0, queries=256, keys=128).name == \
        "hopper.backward_gluon.dkdv + hopper.backward_gluon.dq"


def test_plans_follow_a_changed_table_entry(cuda_builds, monkeypatch):
    """A plan is made once for each call and launch: changing a table's entry (as tests and
    measurements do) changes the next plan, though plans of the old entry are cached."""
    gluon, triton_ = BackwardKernel.GLUON, BackwardKernel.TRITON
    kw = dict(head_dim=128, qk="nvfp4", p_mode=PMode.FP8_EXP2, queries=256, keys=128)
    assert hopper_backward_plan(**kw).dkdv is gluon
    monkeypatch.setitem(BACKWARD_LAUNCH, 128, dataclasses.replace(BACKWARD_LAUNCH[128], dkdv_gluon=False))
    assert (hopper_backward_plan(**kw).dkdv, hopper_backward_plan(**kw).dq) == (triton_, gluon)
    key = (128, False, True)
    fwd = dict(head_dim=128, qk_fp8=False, p_mode=PMode.FP8_EXP2, causal=True, keys=1 << 16)
    assert hopper_forward_plan(**fwd).kernel is ForwardKernel.CUDA
    monkeypatch.setitem(FORWARD_LAUNCH, key, dataclasses.replace(FORWARD_LAUNCH[key], cuda_from_keys=()))
    assert hopper_forward_plan(**fwd).kernel is not ForwardKernel.CUDA


def test_variant_codes_are_named():
    """The launch tables' variant codes are enums (P modes, WSOverlap, DkdvStaged); a
    plain code reads as its member, one that names no variant is refused."""
    assert {type(launch.ws_overlap) for launch in FORWARD_LAUNCH.values()} == {WSOverlap}
    assert {type(m) for launch in FORWARD_LAUNCH.values() for m, _ in launch.cuda_from_keys} == {PMode}
    assert {type(launch.dkdv_staged) for launch in BACKWARD_LAUNCH.values()} == {DkdvStaged}
    assert ForwardLaunch(ws_overlap=4).ws_overlap is WSOverlap.BEFORE_SOFTMAX
    assert ForwardLaunch(cuda_from_keys=((5, 512),)).cuda_from_keys == ((PMode.MXFP4_AFFINE, 512),)
    assert routing.BackwardLaunch(dkdv_staged=2).dkdv_staged is DkdvStaged.ASYNC_AHEAD
    with pytest.raises(ValueError, match="2 is not a valid WSOverlap"):
        ForwardLaunch(ws_overlap=2)
    with pytest.raises(ValueError, match="3 is not a valid DkdvStaged"):
        routing.BackwardLaunch(dkdv_staged=3)


def test_route_names_the_forward_kernel_by_key_count(monkeypatch, cuda_builds):
    """`explain`'s kernel at the thresholds: the CUDA C++ forward from `cuda_from_keys`
    keys (not for a training forward), the reference on CPU tensors, the Gluon/Triton
    kernels where the CUDA kernels do not build."""
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    rec = fp4attn.get_recipe("fp8-fastacc")
    kw = dict(device=torch.device("cuda"), head_dim=64, causal=False, needs_grad=False, mask="none")
    assert routing.route(rec, keys=8192, **kw).kernel == "hopper.forward_cuda"
    assert routing.route(rec, keys=8191, **kw).kernel == "hopper.forward_triton"
    exact = fp4attn.get_recipe("directp-fast")
    n = FORWARD_LAUNCH[64, False, False].cuda_keys(PMode.MXFP4_AFFINE)
    assert routing.route(exact, keys=n, **kw).kernel == "hopper.forward_cuda"
    assert routing.route(exact, keys=n - 1, **kw).kernel == "hopper.forward_triton"
    assert routing.route(fp4attn.get_recipe("directp"), keys=8192, **kw).kernel == "hopper.forward_triton"
    train = routing.route(fp4attn.get_recipe("train"), keys=8192, **{**kw, "needs_grad": True}).kernel
    assert "forward_cuda" not in train, train
    assert routing.route(rec, keys=8192, **{**kw, "device": torch.device("cpu")}).backend == "reference"
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: "not here")
    cpu = routing.route(rec, keys=8192, **kw)
    assert cpu.kernel == "hopper.forward_triton" and "not here" in cpu.plans[0].reason


# ---------------------------------------------------------------------------- the launchers
class _Recorder:
    """A Triton kernel's launch, recorded: (name, its keyword arguments)."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((self.name, kw))


@pytest.fixture
def kernels(monkeypatch):
    """The forward's and backward's kernel entry points, recorded instead of run: a list
    of (entry point, its arguments). CPU tensors stand for CUDA ones (the CUDA C++
    forward's operand check is the GPU's)."""
    pytest.importorskip("triton")
    from fp4attn.kernels.hopper import (
        backward_cuda,
        backward_gluon,
        forward_cuda,
        forward_gluon_ws,
        forward_op,
        train_op,
    )

    calls = []

    def entry(name, result):
        def run(*a, **kw):
            calls.append((name, kw if name != "launch_dkdv_gluon" else dict(kw, in_flight=a[14], maxnreg=a[15],
                                                                              staged=a[16])))
            return result(*a, **kw)
        return run

    def out(ops, **kw):
        B, H, Sq, D = ops.q.shape
        return torch.empty(B, H, Sq, D, dtype=torch.bfloat16), torch.empty(B, H, Sq)

    for module, name, result in ((forward_gluon_ws, "launch_forward_ws", out), (forward_cuda, "launch_forward_cuda", out),
                                 (backward_gluon, "launch_dkdv_gluon", lambda *a, **k: None),
                                 (backward_gluon, "launch_dq_gluon", lambda *a, **k: None),
                                 (backward_cuda, "launch_backward_cuda", lambda *a, **k: (None,) * 3)):
        monkeypatch.setattr(module, name, entry(name, result))
    monkeypatch.setattr(forward_op, "attn_fwd_kernel", _Recorder(calls, "attn_fwd_kernel"))
    monkeypatch.setattr(train_op, "attn_bwd_dkdv_kernel", _Recorder(calls, "attn_bwd_dkdv_kernel"))
    monkeypatch.setattr(train_op, "attn_bwd_dq_kernel", _Recorder(calls, "attn_bwd_dq_kernel"))
    monkeypatch.setattr(forward_cuda, "cuda_unsupported_reason", lambda ops, **kw: None)
    return calls


def _forward_operands(d, sk=200, sq=3, qk=torch.bfloat16, padded=True, q_contiguous=True):
    from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands

    q = torch.zeros(1, 2, sq, d, dtype=qk) if q_contiguous else torch.zeros(1, sq, 2, d, dtype=qk).transpose(1, 2)
    k = torch.zeros(1, 2, sk, d, dtype=qk)
    rows = -(-sk // BLOCK_N) * BLOCK_N if padded else sk
    vt = torch.zeros(1, 2, d, rows, dtype=torch.float8_e4m3fn)[..., :sk]
    return KernelOperands(q, k, torch.ones(1, 2, sq), torch.ones(1, 2, sk), vt, torch.ones(1, 2, d),
                          vt_keys_padded=padded)


FORWARD_ENTRY = {ForwardKernel.CUDA: "launch_forward_cuda", ForwardKernel.GLUON_WS: "launch_forward_ws",
                 ForwardKernel.TRITON: "attn_fwd_kernel"}


def _check_forward_launch(calls, plan, write_p=0):
    """The one recorded launch is the plan's kernel with the plan's variant."""
    assert len(calls) == 1 and calls[0][0] == FORWARD_ENTRY[plan.kernel], (calls, plan)
    kw, launch = calls[0][1], plan.launch
    if plan.kernel is ForwardKernel.CUDA:
        assert kw["persistent"] == launch.cuda_persistent
    elif plan.kernel is ForwardKernel.GLUON_WS:
        assert (kw["p_mode"], kw["stages"], kw["overlap"], kw["p_hw_cvt"]) == (plan.p_mode, launch.stages,
                                                                               launch.ws_overlap, launch.p_hw_cvt)
    else:
        got = {k: kw[k] for k in ("P_MODE", "BLOCK_M", "P_HW_CVT", "TMA_KV", "PV_ADD", "num_warps", "num_stages",
                                  "WRITE_P", "KEY_BIAS", "CAUSAL")}
        assert got == dict(P_MODE=plan.p_mode, BLOCK_M=launch.block_m, P_HW_CVT=launch.p_hw_cvt, TMA_KV=plan.tma_kv,
                           PV_ADD=launch.pv_add, num_warps=launch.warps, num_stages=plan.stages, WRITE_P=write_p,
                           KEY_BIAS=plan.key_bias, CAUSAL=plan.causal), (got, plan)


def test_launch_forward_runs_the_kernel_its_plan_names(kernels, cuda_builds):
    """Every plan of a grid (each kernel, every launch of the table, every P mode, key
    counts at the thresholds, key bias, debug tiles), given to `launch_forward`, runs
    that kernel with that variant and nothing else."""
    from fp4attn.kernels.hopper.forward_op import launch_forward

    ran = set()
    operands = functools.cache(_forward_operands)  # zeros, read by no kernel here: one set per shape
    for (d, qk_fp8, causal), launch in FORWARD_LAUNCH.items():
        most = max(n for _, n in launch.cuda_from_keys)
        cases = [(keys, False, 0) for keys in sorted({1, *(n + e for _, n in launch.cuda_from_keys for e in (-1, 0))})]
        for mode, (keys, key_bias, write_p) in itertools.product(PMode, cases + [(most, True, 0), (most, False, 1)]):
            plan = hopper_forward_plan(head_dim=d, qk_fp8=qk_fp8, p_mode=mode, causal=causal, keys=keys,
                                       key_bias=key_bias, write_p=bool(write_p))
            ops = operands(d, keys, qk=torch.float8_e4m3fn if qk_fp8 else torch.bfloat16)
            kernels.clear()
            launch_forward(ops, scale=0.1, causal_offset=0 if causal else None, p_mode=mode, write_p=write_p,
                           key_bias=torch.zeros(1, keys) if key_bias else None,
                           sink_tiles=1 if mode == PMode.MXFP4_DIRECTP_SINK else 0, plan=plan)
            _check_forward_launch(kernels, plan, write_p)
            ran.add(plan.kernel)
    assert ran == set(ForwardKernel)


def test_launch_forward_plans_from_the_operands(kernels):
    """Without a plan, `launch_forward` runs `forward_plan` of its operands: the plan of
    their data, which for operands as the fused quantizers lay them out (K, V^T
    TMA-loadable, Q contiguous) is the plan the route of the same call carries (here
    CPU tensors: no CUDA C++ kernel); K and V^T otherwise laid out leave the Gluon
    kernel and TMA."""
    from fp4attn.kernels.hopper.forward_op import forward_plan, launch_forward
    from fp4attn.kernels.hopper.operands import qk_dtype

    # one recipe of each Q/K dtype and P mode
    recipes = {(PRESETS[n].fast_accum, routing.p_mode(PRESETS[n])): n for n in reversed(HOPPER_FORWARD_RECIPES)}
    operands = functools.cache(_forward_operands)
    for name, d, causal, key_bias, training in itertools.product(
            recipes.values(), (64, 128), (None, 197), (False, True), (False, True)):
        recipe = PRESETS[name]
        if training and (name not in HOPPER_TRAIN_RECIPES or key_bias):
            continue
        mode = routing.p_mode(recipe)
        kb = torch.zeros(1, 200) if key_bias else None
        routed = routing.hopper_forward_route_plan(recipe, d, causal is not None, "key" if key_bias else "none",
                                                   keys=200, on_cuda=False, training=training)
        for padded, q_contiguous in ((True, True), (False, True), (True, False)):
            ops = operands(d, qk=qk_dtype(recipe), padded=padded, q_contiguous=q_contiguous)
            plan = forward_plan(ops, causal_offset=causal, p_mode=mode, key_bias=kb, training=training)
            assert plan == hopper_forward_plan(head_dim=d, qk_fp8=recipe.fast_accum, p_mode=mode,
                                               causal=causal is not None, keys=200, queries=3, key_bias=key_bias,
                                               training=training, on_cuda=False, kv_tma=padded,
                                               q_contiguous=q_contiguous)
            if padded and q_contiguous:
                assert plan == routed, (name, plan, routed)
            else:
                assert plan.kernel is ForwardKernel.TRITON and plan.tma_kv == (padded and plan.launch.tma_kv)
            kernels.clear()
            launch_forward(ops, scale=0.1, causal_offset=causal, p_mode=mode, key_bias=kb, training=training,
                           sink_tiles=routing.p_sink_tiles(recipe))
            _check_forward_launch(kernels, plan)


def test_launch_forward_refuses_a_plan_it_cannot_run(cuda_builds):
    """A plan is executed as it says or refused: the CUDA C++ kernel on operands it
    cannot run (CPU tensors here), TMA on operands that do not allow it, a plan made
    for another call; never another kernel instead."""
    pytest.importorskip("triton")
    from fp4attn.kernels.hopper.forward_op import launch_forward

    cuda = hopper_forward_plan(head_dim=64, qk_fp8=False, p_mode=0, causal=False, keys=1 << 14)
    assert cuda.kernel is ForwardKernel.CUDA
    with pytest.raises(ValueError, match="the plan runs the CUDA C.. kernel, which cannot run these operands: the "
                                         "CUDA forward runs on CUDA tensors only"):
        launch_forward(_forward_operands(64, 1 << 14), scale=0.1, causal_offset=None, p_mode=0, plan=cuda)
    tma = hopper_forward_plan(head_dim=64, qk_fp8=False, p_mode=1, causal=False, keys=200)
    assert tma.tma_kv
    with pytest.raises(ValueError, match="reads K and V.T by TMA, which these operands do not allow"):
        launch_forward(_forward_operands(64, padded=False), scale=0.1, causal_offset=None, p_mode=1, plan=tma)
    with pytest.raises(ValueError, match=r"the plan is for another call: .* \(1, False, False, False, False\), this "
                                         r"call's \(1, True, False, False, False\)"):
        launch_forward(_forward_operands(64), scale=0.1, causal_offset=0, p_mode=1, plan=tma)


def _backward_operands(d, sq=256, sk=128, row_scales=False):
    from fp4attn.kernels.hopper.train_op import BackwardOperands

    B, H, Hkv = 1, 4, 2  # the operands' shapes, not their values
    e4m3 = lambda *s: torch.zeros(*s, dtype=torch.float8_e4m3fn)  # noqa: E731
    qs, ks = (torch.ones(B, H, sq), torch.ones(B, Hkv, sk)) if row_scales else (torch.ones(B, H), torch.ones(B, Hkv))
    return BackwardOperands(
        q=torch.zeros(B, H, sq, d, dtype=torch.bfloat16), k=torch.zeros(B, Hkv, sk, d, dtype=torch.bfloat16),
        qs=qs, ks=ks, do_t=e4m3(B, H, sq, d), do_ts=torch.ones(B, H, sq), do_c=e4m3(B, H, d, sq),
        do_cs=torch.ones(B, H, d), v_t=e4m3(B, Hkv, sk, d), v_ts=torch.ones(B, Hkv, sk), q_c=e4m3(B, H, d, sq),
        q_cs=torch.ones(B, H, d), k_c=e4m3(B, Hkv, d, sk), k_cs=torch.ones(B, Hkv, d), delta=torch.zeros(B, H, sq))


def _check_backward_launch(calls, plan):
    """The recorded launches are the plan's kernels with its variant: dK/dV, then dQ (or
    the CUDA C++ backward alone); the Triton kernels' tiles by TMA descriptors exactly
    where the plan says."""
    launch = plan.launch
    if plan.dkdv is BackwardKernel.CUDA:
        assert [c[0] for c in calls] == ["launch_backward_cuda"]
        return
    names = {BackwardKernel.GLUON: ("launch_dkdv_gluon", "launch_dq_gluon"),
             BackwardKernel.TRITON: ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")}
    assert [c[0] for c in calls] == [names[plan.dkdv][0], names[plan.dq][1]], (calls, plan)
    (_, dkdv), (_, dq) = calls
    if plan.dkdv is BackwardKernel.GLUON:
        assert (dkdv["in_flight"], dkdv["maxnreg"], dkdv["staged"], dkdv["row_scales"]) == (
            launch.dkdv_in_flight, launch.dkdv_maxnreg, launch.dkdv_staged, plan.row_scales)
    else:
        assert (dkdv["P_MODE"], dkdv["BLOCK_N"], dkdv["HW_CVT"], dkdv["TMA"], dkdv["ROW_SCALES"], dkdv["num_warps"],
                dkdv["num_stages"]) == (plan.p_mode, launch.block_n_dkdv, launch.hw_cvt, plan.triton_descriptors,
                                        plan.row_scales, launch.warps_dkdv, launch.stages_dkdv)
    if plan.dq is BackwardKernel.GLUON:
        assert dq["row_scales"] == plan.row_scales
    else:
        assert (dq["P_MODE"], dq["BLOCK_M"], dq["HW_CVT"], dq["TMA"], dq["ROW_SCALES"], dq["num_warps"],
                dq["num_stages"]) == (plan.p_mode, launch.block_m_dq, launch.hw_cvt, plan.triton_descriptors,
                                      plan.row_scales, launch.warps_dq, launch.stages_dq)


def test_launch_backward_runs_the_kernels_its_plan_names(kernels, cuda_builds, monkeypatch):
    """Without a plan, `launch_backward` runs `backward_plan` of its operands (the plan of
    their head dim, Q/K scales, lengths and layout); given one (the CUDA C++ backward's
    here, which CPU tensors never plan), that one. The TMA descriptors are host time at
    every call: the Triton kernels' are built only where one of them runs, the Gluon
    kernels' once for both, each the tile its kernel reads."""
    from fp4attn.kernels.hopper import backward_gluon, train_op

    gluon_tiles = {}  # name -> tile shape of the Gluon descriptors of the last call

    def descriptors(build=backward_gluon.descriptors, **ops):
        descs = build(**ops)
        gluon_tiles.update({n: list(t.block_shape) for n, t in descs.items()})
        return descs

    monkeypatch.setattr(backward_gluon, "descriptors", descriptors)
    operands = functools.cache(_backward_operands)
    seen = set()
    for d, p, row_scales, (sq, sk) in itertools.product(
            (64, 128), (("fp8", "exp2"), ("mxfp4", "directp"), ("fp8", "affine")), (False, True),
            ((256, 128), (200, 128), (256, 100), (4096, 4096))):
        ops = operands(d, sq, sk, row_scales)
        mode = routing.TRAIN_P_MODES[p]
        plan = train_op.backward_plan(ops, mode)
        assert plan == hopper_backward_plan(head_dim=d, qk="fp8" if row_scales else "nvfp4", p_mode=mode, queries=sq,
                                            keys=sk, on_cuda=False, tiles_tma=not (sq % 64 or sk % 64))
        for given in (None, plan):
            kernels.clear()
            gluon_tiles.clear()
            train_op.launch_backward(ops, torch.zeros(1, 4, sq), *p, sk - sq, True, d**-0.5, plan=given)
            _check_backward_launch(kernels, plan)
            token, channel = [64, d], [d, 64]
            want = dict(q=token, k=token, do_t=token, v_t=token) if BackwardKernel.GLUON in (plan.dkdv, plan.dq) else {}
            want.update(dict(do_c=channel, q_c=channel) if plan.dkdv is BackwardKernel.GLUON else {})
            want.update(dict(k_c=channel) if plan.dq is BackwardKernel.GLUON else {})
            assert gluon_tiles == want, (gluon_tiles, plan)
        seen.add((plan.dkdv, plan.dq))
    assert seen == {(BackwardKernel.GLUON,) * 2, (BackwardKernel.TRITON, BackwardKernel.GLUON),
                    (BackwardKernel.TRITON,) * 2}
    ops = _backward_operands(128, row_scales=True)
    with routing.override_launch(backward=dataclasses.replace(BACKWARD_LAUNCH[128], cuda=True)):
        cuda = hopper_backward_plan(head_dim=128, qk="fp8", p_mode=0, queries=256, keys=128)
    kernels.clear()
    train_op.launch_backward(ops, torch.zeros(1, 4, 256), "fp8", "exp2", 0, True, 0.125, plan=cuda)
    _check_backward_launch(kernels, cuda)
    with pytest.raises(ValueError, match=r"the plan is for another call: \(p_mode, row_scales\) \(0, True\), this "
                                         r"call's \(1, True\)"):
        train_op.launch_backward(ops, torch.zeros(1, 4, 256), "mxfp4", "directp", 0, True, 0.125, plan=cuda)
    whole = hopper_backward_plan(head_dim=128, qk="fp8", p_mode=0, queries=256, keys=128)
    with pytest.raises(ValueError, match="reads the tiles by TMA, which these operands do not allow"):
        train_op.launch_backward(_backward_operands(128, 200, 128, True), torch.zeros(1, 4, 200), "fp8", "exp2", 0,
                                 True, 0.125, plan=whole)
