"""The benchmark harness the CLI's `bench` commands and the developer tools share:
shapes, exact causal FLOPs, timers (device median, host time, per-kernel device time)
and the baselines (SDPA's cuDNN and flash backends, cuDNN's FP8 SDPA). Needs CUDA to
time; imported by the CLI and tools only, never by `import fp4attn`."""

from __future__ import annotations

import torch


def parse_shapes(spec: str, sep: str) -> list[tuple[int, ...]]:
    """(B, H, S, D) shapes from text such as "8,16,4096,128;2,16,16384,128" (sep ";")."""
    return [tuple(map(int, x.split(","))) for x in spec.split(sep)]


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    if not causal:
        return sq * sk
    return sum(min(sk, i + 1) for i in range(sq)) if sq != sk else sq * (sq + 1) // 2


def time_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def calls_ms(fn, calls: int = 20) -> float:
    """Time per call of `calls` eager calls back to back (median of `do_bench` over groups,
    divided by `calls`), the L2 flushed before each group as `graph_ms` flushes it before each
    replay: against `graph_ms`, the host's launch cost alone (a call whose operands fit the
    L2 reads them from it in both, where `time_ms`, flushing before every call, does not)."""
    import triton

    def group():
        for _ in range(calls):
            fn()

    return triton.testing.do_bench(group, warmup=10, rep=100, return_mode="median") / calls


def graph_ms(fn, calls: int = 20) -> float:
    """Device time per call of `fn` replayed from a CUDA graph of `calls` calls (median of
    `do_bench` over replays, divided by `calls`): the kernels' time with no host launch
    cost, as a serving engine that captures its decode step sees it. do_bench flushes the
    L2 only before each replay: the later calls of one replay read from memory only where
    a call reads more than the L2 holds (60 MiB on the H200), as the decode benchmark's do."""
    import triton

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: compiles, allocator pools
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    del graph
    return ms / calls


def host_ms(fn, n: int = 20, rounds: int = 5) -> float:
    """Host time per call of `fn` when nothing waits on the GPU: the median over `rounds`
    of n calls then one synchronization (a shared host's hiccup moves one round, not the
    figure). A call whose host time exceeds its device time (`device_kernels`) is
    launch-bound."""
    import statistics
    import time

    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return statistics.median(per_call) * 1e3


def device_kernels(fn, reps: int = 20) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per call, device ms per call)} of the kernels `fn` runs,
    from the torch profiler (CUDA activity; each kernel's own span on the device). For
    the scripts that ask where a call's time goes, or whether its host is the bound."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n_ms = out.setdefault(e.name, [0, 0.0])
            n_ms[0] += 1
            n_ms[1] += e.time_range.elapsed_us() / 1e3
    return {k: (n / reps, ms / reps) for k, (n, ms) in out.items()}


def sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def time_cudnn_fp8(q, k, v, causal: bool) -> tuple[float | None, str]:
    """(ms, note) of cuDNN's FP8 SDPA on these inputs, after checking its output against
    bf16 SDPA; (None, why) if the package is missing or the graph fails."""
    from fp4attn.metrics import error_metrics
    from fp4attn.tools import cudnn_fp8

    if not cudnn_fp8.available():
        return None, "not run: the nvidia-cudnn-frontend package is not installed"
    try:
        att = cudnn_fp8.CudnnFP8Attention(q, k, v, causal)
        att.run()
        sl = (slice(0, 1), slice(0, 2))
        cos = error_metrics(att.output()[sl], sdpa("sdpa-cudnn")(q[sl], k[sl], v[sl], causal))["cos"]
        if not cos > 0.99:
            return None, f"not timed: its output disagrees with bf16 SDPA (cos {cos:.4f})"
        return time_ms(att.run), f"checked (cos {cos:.4f} to bf16 SDPA), e4m3 in and out"
    except Exception as e:  # an unsupported graph is a result to report, not a crash
        return None, f"failed: {type(e).__name__}: {str(e)[:200]}"


def time_cudnn_fp8_train(q, k, v, causal: bool, dout=None) -> tuple[float | None, str]:
    """(ms, note) of cuDNN's FP8 attention forward+backward (kernels alone, e4m3 inputs
    quantized beforehand) on these inputs, after checking its dQ/dK/dV against bf16 SDPA
    autograd on a (1, 2)-head slice (smallest cosine > 0.98); (None, why) if the package
    is missing, cuDNN has no kernel for the shape, the gradients disagree or anything
    fails. dout: the output gradient (a seeded normal one if None)."""
    from fp4attn.metrics import error_metrics
    from fp4attn.tools import cudnn_fp8

    if not cudnn_fp8.available():
        return None, "not run: the nvidia-cudnn-frontend package is not installed"
    try:
        if dout is None:
            gen = torch.Generator(device=q.device).manual_seed(1)
            dout = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=gen)
        att = cudnn_fp8.CudnnFP8Training(q, k, v, dout, causal)
        sl = (slice(0, 1), slice(0, 2))
        ins = [t[sl].detach().requires_grad_() for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*ins, is_causal=causal)
        want = torch.autograd.grad(out, ins, dout[sl])
        coss = [error_metrics(g[sl], w)["cos"] for g, w in zip(att.grads(), want)]
        got = " ".join(f"{n} {c:.4f}" for n, c in zip(("dQ", "dK", "dV"), coss))
        if not min(coss) > 0.98:
            return None, f"not timed: its gradients disagree with bf16 SDPA ({got})"
        ms = time_ms(att.run)
        return ms, f"checked (grad cos to bf16 SDPA: {got}), e4m3 in and out, dP scaled from its amax"
    except cudnn_fp8.NoKernel as e:
        return None, f"no kernel: {e}"
    except Exception as e:  # an unsupported graph is a result to report, not a crash
        return None, f"failed: {type(e).__name__}: {str(e)[:200]}"
