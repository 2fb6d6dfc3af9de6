"""The host side of a decode call on the Hopper route, on the CPU with every launch
recorded instead of run: the route is decided once per form of call and executed as
decided, the partials' buffer is reused (not while a stream is captured), the CUDA
kernel's parameters are packed as its launch expects, and the host work of one call
stays within a budget of Python frames and tensor operations (counted, not timed: a
call that grows fails here)."""

import ctypes
import dataclasses
import math
import threading

import pytest
import torch

import fp4attn
from fp4attn import KVCache, decode, routing
from fp4attn.routing import decode as decode_routing
from tests.host_work import host_work

pytest.importorskip("triton")
from fp4attn.kernels.hopper import decode_cuda, decode_op  # noqa: E402


class _Kernel:
    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, grid, args, kwargs))


def _parameters(fn: str, args):
    """The CUDA kernel's parameters as the launch hands them over (read during the launch:
    the blocks they point at are the launcher's until it returns)."""
    if fn == decode_cuda.KERNEL_NAME:
        return decode_cuda._Params.from_buffer_copy(ctypes.string_at(args[0], ctypes.sizeof(decode_cuda._Params)))
    kinds = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3  # the combine's
    return [t.from_address(args[i]).value for i, t in enumerate(kinds)]


@pytest.fixture
def launches(monkeypatch):
    """The Hopper routes taken on CPU tensors (the routing's hooks: the device check, the
    interpreter, the CUDA probe), each kernel launch recorded instead of run."""
    out = []
    monkeypatch.setattr(decode_op, "decode_split_kernel", _Kernel("triton split", out))
    monkeypatch.setattr(decode_op, "decode_combine_kernel", _Kernel("triton combine", out))
    monkeypatch.setattr(decode_op, "kvcache_append_kernel", _Kernel("append", out))
    monkeypatch.setattr(decode_cuda, "_launch", lambda fn, grid, threads, shared, args, stream: out.append(
        (fn, grid, threads, shared, _parameters(fn, args))))
    monkeypatch.setattr(decode_cuda, "load_function", lambda key, build, name, device, shared=0: name)
    monkeypatch.setattr(decode_cuda, "resident_ctas", lambda variant: 2)
    monkeypatch.setattr(decode_routing, "unsupported_reason", lambda device, head_dim: None)
    monkeypatch.setattr(routing.targets, "interpreting", lambda: False)
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: None)
    decode_routing.clear_routes()
    yield out
    decode_routing.clear_routes()
    decode_op._EXECUTORS.clear()


def _cache(fmt, B=8, Hkv=8, L=1000, D=128, page_size=None, extra=64):
    cache = KVCache(B, Hkv, D, L + extra, k_format=fmt, page_size=page_size)
    cache.append(*(torch.randn(B, Hkv, L, D) for _ in range(2)))
    return cache


def _filled(monkeypatch, fmt, **kw):
    with monkeypatch.context() as m:
        m.setenv(routing.BACKEND_ENV, "reference")  # the reference's writes
        return _cache(fmt, **kw)


# Per call, after the first of its form (which decides the route, makes the executor and
# its buffers): the package's Python frames (checks, the cached route, the launches'
# arguments) and the tensor operations (the output and the LSE; the append's length
# update). Lower a budget when a change removes work; never raise it to let work in. (The
# input checks count one frame a checked tensor, `kvcache.check_input`: q, and the
# appended k and v.)
BUDGETS = {  # (format, new query rows, append): (frames, operations)
    ("nvfp4", 1, False): (17, {"aten.empty.memory_format": 2}),  # the CUDA split kernel
    ("fp8", 1, True): (32, {"aten.empty.memory_format": 2, "aten.add_.Tensor": 1}),
    # the CUDA split kernel, as nvfp4's (on the Triton split kernel bf16 took 16 frames here and
    # Triton's two launches beside them, 1.66x its CUDA-graph time on an H200)
    ("bf16", 1, False): (17, {"aten.empty.memory_format": 2}),
    # the Triton split kernel: its two launches' key and launcher call are the package's frames
    # (fp4attn/kernels/triton_launch.py, four) where Triton's binder ran them before, uncounted and
    # slower (an MXFP4 one-row call's host time 161.6 -> 66.1 us on an H100,
    # benchmarks/results/log/h100-decode-cuda-formats/host-mxfp4-4ff69e1.txt)
    ("mxfp4", 2, True): (35, {"aten.empty.memory_format": 2, "aten.add_.Tensor": 1}),
}


@pytest.mark.parametrize("form", BUDGETS, ids=lambda f: f"{f[0]}-sq{f[1]}{'-append' if f[2] else ''}")
def test_the_host_work_of_a_call_stays_within_its_budget(form, launches, monkeypatch):
    fmt, sq, append = form
    cache = _filled(monkeypatch, fmt, extra=64)
    q = torch.randn(8, 32, sq, 128).bfloat16()
    k, v = (torch.randn(8, 8, 1, 128).bfloat16() for _ in range(2))

    def call():
        return decode(q, cache, k=k, v=v) if append else decode(q, cache)

    call()
    launches.clear()
    frames, ops = host_work(call)
    kernels = [x[0] for x in launches[: len(launches) // 2]]
    assert kernels == (["append"] if append else []) + (
        ["decode_split", "decode_combine"] if fmt in ("bf16", "fp8", "nvfp4", "mxfp4") and sq == 1 else
        ["triton split", "triton combine"]), kernels
    budget_frames, budget_ops = BUDGETS[form]
    assert frames <= budget_frames, f"{frames} Python frames of fp4attn a call; the budget is {budget_frames}"
    assert dict(ops) == budget_ops, dict(ops)


def test_the_route_is_decided_once_per_form_and_shared_by_layers(launches, monkeypatch):
    decided = []
    decide = decode_routing.decide_route
    monkeypatch.setattr(decode_routing, "decide_route", lambda *a: decided.append(a) or decide(*a))
    layers = [_filled(monkeypatch, "nvfp4", L=300) for _ in range(3)]
    decided.clear()
    q = torch.randn(8, 32, 1, 128).bfloat16()
    for _ in range(2):  # two steps of three layers
        for cache in layers:
            decode(q, cache, k=q[:, :8], v=q[:, :8])
    assert len(decided) == 1
    assert len(decode_op._EXECUTORS) == 1
    decode(torch.randn(8, 32, 2, 128), layers[0])  # another form of call: its own route
    assert len(decided) == 2
    monkeypatch.setenv(routing.BACKEND_ENV, "reference")  # the environment is part of the form
    decode(q, layers[0])
    assert len(decided) == 3 and decided[-1][-1] == "auto"


def test_explain_returns_the_record_the_call_executes(launches, monkeypatch):
    cache = _filled(monkeypatch, "fp8", L=200, page_size=16)
    q = torch.randn(8, 32, 1, 128).bfloat16()
    ran = []
    run = decode_op.run_route
    monkeypatch.setattr(decode_op, "run_route", lambda route, *a: ran.append(route) or run(route, *a))
    decode(q, cache)
    route = ran[0]
    assert route.kernel == "cuda" and route.ring == decode_routing.cuda_stages("fp8", "fp8")
    assert fp4attn.explain(q, cache) == route.as_dict()
    assert route.as_dict()["kernel"] == "hopper.decode_cuda"


def test_a_measured_launch_is_a_route_of_its_own(launches, monkeypatch):
    R = decode_routing
    route = R.decode_route(torch.device("cpu"), 2, 2, 8, 1, 128, "nvfp4", "nvfp4", 256, "triton")
    assert route.kernel == "cuda" and route.launch == R.CUDA_LAUNCH and route.programs == 4
    ring = R.with_launch(route, R.DecodeLaunch(128, 4, 2, kernel="cuda:0"))
    assert ring.kernel == "cuda" and ring.ring == 0 and ring is R.with_launch(route, R.DecodeLaunch(128, 4, 2,
                                                                                                    kernel="cuda:0"))
    split = R.with_launch(route, R.DecodeLaunch(128, 4, 2, splits=37, kernel="cuda"))
    assert split.launch.splits == math.ceil(37 / R.CUDA_WARPS) and split.ring == R.cuda_stages("nvfp4", "nvfp4")
    tri = R.with_launch(route, R.DecodeLaunch(64, 8, 3, 2, 1, False, 5, "triton"))
    table = R.decode_launch("nvfp4", "nvfp4", 128, route.block_m)
    assert tri.kernel == "triton" and tri.launch == R.DecodeLaunch(64, 8, 3, 2, table.min_split_tiles, False, 5,
                                                                   "triton")
    assert tri.programs == 2 * 2 * math.ceil(4 / route.block_m)
    with pytest.raises(ValueError, match="CUDA decode kernel cannot run"):
        R.with_launch(R.decode_route(torch.device("cpu"), 2, 2, 8, 2, 128, "nvfp4", "nvfp4", 256, "triton"),
                      R.DecodeLaunch(128, 4, 2, kernel="cuda"))
    with pytest.raises(ValueError, match="accepted 0"):
        R.with_launch(route, R.DecodeLaunch(128, 4, 2, kernel="cuda:1"))


@pytest.mark.parametrize("max_len", [1, 63, 64, 65, 1000, 4096, 32767, 131072])
def test_the_routes_plan_is_the_split_plan(max_len):
    route = decode_routing.decide_route(torch.device("cpu"), 8, 8, 32, 1, 128, "bf16", "bf16", 256, "reference")
    for launch, programs in ((decode_routing.CUDA_LAUNCH, 64), (decode_routing.DEFAULT_LAUNCH, 7)):
        r = dataclasses.replace(route, launch=launch, programs=programs)
        for sms, resident in ((132, 2), (4, 1)):
            want = decode_routing.split_plan(launch, max_len, programs, sms, resident)
            assert r.split_plan(max_len, sms, resident) == want == r.split_plan(max_len, sms, resident)


def test_the_partials_are_reused_except_under_capture(monkeypatch):
    cpu = torch.device("cpu")  # with stream numbers as the CUDA calls have them
    monkeypatch.setattr(decode_op, "_LOCAL", threading.local())
    monkeypatch.setattr(decode_op, "_capturing", lambda: False)
    a = decode_op._partials(cpu, 7, 3, 2, 4, 1, 64)
    b = decode_op._partials(cpu, 7, 3, 2, 4, 1, 64)
    assert a[0] is b[0] and a[1] is b[1]
    assert a[0].shape == (3, 2, 4, 1, 64) and a[1].shape == (3, 2, 4, 1, 2)
    assert a[1].data_ptr() - a[0].data_ptr() == a[0].numel() * 4 and (a[1].data_ptr() % 256) == (
        a[0].data_ptr() % 256)  # as aligned as the buffer, for the kernels' specializations
    other = decode_op._partials(cpu, 8, 3, 2, 4, 1, 64)  # another stream: its own buffer
    assert other[0].untyped_storage().data_ptr() != a[0].untyped_storage().data_ptr()
    small = decode_op._partials(cpu, 7, 1, 2, 4, 1, 64)  # a smaller call: the same buffer
    assert small[0].untyped_storage().data_ptr() == a[0].untyped_storage().data_ptr()
    big = decode_op._partials(cpu, 7, 9, 2, 4, 1, 128)  # a larger one: the buffer grows
    assert big[0].numel() == 9 * 2 * 4 * 128
    monkeypatch.setattr(decode_op, "_capturing", lambda: True)
    c, d = decode_op._partials(cpu, 7, 3, 2, 4, 1, 64), decode_op._partials(cpu, 7, 3, 2, 4, 1, 64)
    assert c[0].data_ptr() != d[0].data_ptr()  # captured calls: their own, for the graph to keep
    monkeypatch.setattr(decode_op, "_capturing", lambda: False)
    elsewhere = []  # another thread: its own buffer
    thread = threading.Thread(target=lambda: elsewhere.append(decode_op._partials(cpu, 7, 3, 2, 4, 1, 64)))
    thread.start()
    thread.join()
    assert elsewhere[0][0].untyped_storage().data_ptr() != a[0].untyped_storage().data_ptr()


def test_the_cuda_kernels_parameters(launches, monkeypatch):
    """What the split kernel and the combine receive: decode_split.cu's `Params` and the
    combine's arguments, field by field, from one call with left padding."""
    B, Hq, Hkv, D = 3, 24, 2, 64
    cache = _filled(monkeypatch, "nvfp4", B=B, Hkv=Hkv, L=500, D=D, page_size=32)
    q = torch.randn(B, Hq, 1, D, dtype=torch.float16)
    start = torch.tensor([0, 5, 9], dtype=torch.int32)
    out, lse = decode(q, cache, key_start=start, scale=0.3, return_lse=True)
    (split_fn, grid, threads, shared, p), (comb_fn, cgrid, cthreads, cshared, vals) = launches
    variant = decode_cuda.Variant(D, "nvfp4", "nvfp4", hi_rows=True, stages=decode_routing.cuda_stages("nvfp4",
                                                                                                      "nvfp4"))
    ctas, cta_tokens = decode_routing.split_plan(decode_routing.CUDA_LAUNCH, 500, B * Hkv, 4, 2)
    assert (split_fn, grid, threads, shared) == ("decode_split", (ctas, B * Hkv), 32 * variant.warps,
                                                 variant.shared_bytes())
    assert [p.ka, p.ks, p.kt, p.va, p.vs, p.vt] == [t.data_ptr() for t in (*cache.k.tensors(), *cache.v.tensors())]
    assert (p.table, p.lens, p.start) == (cache.block_table.data_ptr(), cache.lengths.data_ptr(), start.data_ptr())
    assert (p.hkv, p.page_size, p.table_stride, p.hq, p.group, p.batch, p.has_start) == (
        Hkv, 32, cache.block_table.stride(0), Hq, Hq // Hkv, B, 1)
    assert p.split_tokens == cta_tokens // variant.warps
    assert p.qk_scale == ctypes.c_float(0.3 * math.log2(math.e)).value
    assert comb_fn == "decode_combine" and cgrid == (B * Hq, 1) and cthreads == 32 * decode_cuda.COMBINE_WARPS
    assert cshared == 0
    assert vals[:4] == [p.o_acc, p.o_ml, out.data_ptr(), lse.data_ptr()] and vals[4:] == [B * Hq, ctas * variant.warps,
                                                                      decode_cuda.OUT_KINDS[torch.float16]]
    assert out.dtype == torch.float16 and lse.shape == (B, Hq, 1)


def test_torch_compile_traces_the_op_and_the_op_runs_the_route(launches, monkeypatch):
    """Traced, decode calls the `fp4attn::decode` op (its schema: what a route needs), whose
    body looks the route up and launches what an eager call launches."""
    cache = _filled(monkeypatch, "nvfp4", B=2, Hkv=2, L=100)
    q = torch.randn(2, 8, 1, 128).bfloat16()
    decode(q, cache)
    eager = [(x[0], x[1]) for x in launches]
    launches.clear()
    torch._dynamo.reset()
    out = torch.compile(lambda q: decode(q, cache) * 2, fullgraph=True, backend="eager")(q)
    assert out.shape == q.shape and [(x[0], x[1]) for x in launches] == eager == [
        ("decode_split", eager[0][1]), ("decode_combine", (16, 1))]
    torch._dynamo.reset()
