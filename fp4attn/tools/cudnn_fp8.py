"""cuDNN's FP8 SDPA (through the `nvidia-cudnn-frontend` package) as a benchmark
baseline: the strongest FP8 attention on Hopper we know of (facts: 900-940 TFLOP/s at
D=128 on the H200).

Per-tensor e4m3 Q, K, V (scale amax / 448), P scaled by 448 into e4m3, e4m3 output
(Hopper's cuDNN writes FP8 output only). Only the graph's execution is timed, as the
kernels' "kernel alone" column. The package is optional: `available()` says whether it
imports, and every failure to build a graph is reported by the caller, never fatal.

`CudnnFP8Training` is the training baseline (`fp4attn bench --backward`): the forward with
its softmax statistics (`sdpa_fp8`, is_inference=False) and `sdpa_fp8_backward`, every
tensor per-tensor e4m3 (dQ/dK/dV too: Hopper's cuDNN writes no bf16 gradients from FP8
inputs). The scales of O, dP and dQ/dK/dV come from the amaxes the graphs measure, as
delayed scaling does; with dP left unscaled, dS underflows e4m3 and dQ's cosine falls to
0.91-0.97. On Hopper its backward takes head dim 128 only (`NoKernel` otherwise).
"""

from __future__ import annotations

import importlib.util
import math

import torch

E4M3_MAX = 448.0


def available() -> bool:
    return importlib.util.find_spec("cudnn") is not None


def _per_tensor_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    descale = max(x.float().abs().amax().item(), 1e-30) / E4M3_MAX
    return (x.float() / descale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale


class CudnnFP8Attention:
    """One built graph for the shape of (q, k, v) (B, H, S, D), bf16 inputs quantized
    once; `run()` executes it, `output()` dequantizes the last result."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        import cudnn

        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        (q8, dq), (k8, dk), (v8, dv) = (_per_tensor_e4m3(t) for t in (q, k, v))
        scale_s, scale_o = E4M3_MAX, E4M3_MAX / max(dv * E4M3_MAX, 1e-30)  # |O| <= max |V|
        self.descale_o = 1.0 / scale_o

        def tensor(t):
            return graph.tensor(dim=tuple(t.shape), stride=tuple(t.stride()), data_type=fp8)

        def scalar():
            return graph.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

        qt, kt, vt = tensor(q8), tensor(k8), tensor(v8)
        scalars = [scalar() for _ in range(6)]
        o_t, _stats, amax_s_t, amax_o_t = graph.sdpa_fp8(
            q=qt, k=kt, v=vt, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
            descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], is_inference=True,
            attn_scale=q.shape[-1] ** -0.5, use_causal_mask=causal)
        self.out = torch.empty(q.shape, device=q.device, dtype=torch.float8_e4m3fn)
        o_t.set_output(True).set_dim(tuple(self.out.shape)).set_stride(tuple(self.out.stride())).set_data_type(fp8)
        amax_s, amax_o = (torch.empty((1, 1, 1, 1), device=q.device, dtype=torch.float32) for _ in range(2))
        for t in (amax_s_t, amax_o_t):
            t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        values = (dq, dk, dv, 1.0 / scale_s, scale_s, scale_o)
        self.pack = {qt: q8, kt: k8, vt: v8, o_t: self.out, amax_s_t: amax_s, amax_o_t: amax_o}
        self.pack.update({t: torch.full((1, 1, 1, 1), x, device=q.device) for t, x in zip(scalars, values)})
        self.workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
        self.graph = graph

    def run(self) -> None:
        self.graph.execute(self.pack, self.workspace, handle=self.handle)

    def output(self) -> torch.Tensor:
        return self.out.float() * self.descale_o


class NoKernel(RuntimeError):
    """cuDNN has no kernel for this graph (for example the FP8 backward at head dim 64 on
    Hopper): a result to report, not a failure."""


def _graph_not_supported(e: Exception) -> bool:
    import cudnn

    text = str(e).lower()
    return isinstance(e, cudnn.cudnnGraphNotSupportedError) or "not supported" in text or "hidden_dim" in text


def _build(graph, what: str) -> None:
    import cudnn

    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:
        if _graph_not_supported(e):
            raise NoKernel(f"cuDNN has no FP8 {what} kernel for this graph ({type(e).__name__}: {str(e)[:160]})") from e
        raise


class CudnnFP8Training:
    """cuDNN's FP8 attention forward+backward for the shape of (q, k, v) (B, H, S, D) and
    dout (B, H, S, D): two graphs built once, the bf16 inputs quantized once (per-tensor
    e4m3). `run()` executes the forward then the backward (the timed unit: kernels alone,
    inputs already e4m3); `grads()` dequantizes the last dQ, dK, dV to float32, `output()`
    the last O.

    Scales: P by 448 (P <= 1); O, dP, dQ, dK and dV from their amaxes, read after calibration
    runs at construction (each amax is measured before its scale is applied; dQ/dK/dV's
    depend on dS's quantization, so two rounds), then left fixed: the timed runs never sync.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool):
        import cudnn

        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        dev = q.device
        attn_scale = q.shape[-1] ** -0.5
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        (q8, dq), (k8, dk), (v8, dv), (do8, ddo) = (_per_tensor_e4m3(t.detach()) for t in (q, k, v, dout))
        self.q8, self.k8, self.v8, self.do8 = q8, k8, v8, do8
        self.out = torch.empty(q.shape[:-1] + v.shape[-1:], device=dev, dtype=torch.float8_e4m3fn)
        self.stats = torch.empty(q.shape[:-1] + (1,), device=dev, dtype=torch.float32)
        self.dq, self.dk, self.dv = (torch.empty(t.shape, device=dev, dtype=torch.float8_e4m3fn) for t in (q, k, v))

        def scalar_value(x: float) -> torch.Tensor:
            return torch.full((1, 1, 1, 1), x, device=dev, dtype=torch.float32)

        # Device scalars, shared by both graphs' packs; calibration rewrites them in place.
        self.s = {name: scalar_value(x) for name, x in dict(
            descale_q=dq, descale_k=dk, descale_v=dv, descale_dO=ddo, descale_s=1.0 / E4M3_MAX, scale_s=E4M3_MAX,
            scale_o=1.0 / dv, descale_o=dv,  # first guess: |O| <= max |V|
            scale_dP=1.0, descale_dP=1.0, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0).items()}
        self.amax = {name: scalar_value(0.0) for name in ("S", "O", "dQ", "dK", "dV", "dP")}

        def graph():
            return cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                                 handle=self.handle)

        def tensor(g, t, dtype=fp8):
            return g.tensor(dim=tuple(t.shape), stride=tuple(t.stride()), data_type=dtype)

        def output(t, like, dtype=fp8):
            t.set_output(True).set_dim(tuple(like.shape)).set_stride(tuple(like.stride())).set_data_type(dtype)

        # Forward: O and the softmax statistics (LSE) the backward reads.
        g = graph()
        qt, kt, vt = tensor(g, q8), tensor(g, k8), tensor(g, v8)
        sc = {n: tensor(g, self.s[n], f32) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
                                                   "scale_o")}
        o_t, stats_t, amax_s_t, amax_o_t = g.sdpa_fp8(
            q=qt, k=kt, v=vt, descale_q=sc["descale_q"], descale_k=sc["descale_k"], descale_v=sc["descale_v"],
            descale_s=sc["descale_s"], scale_s=sc["scale_s"], scale_o=sc["scale_o"], is_inference=False,
            attn_scale=attn_scale, use_causal_mask=causal)
        output(o_t, self.out)
        output(stats_t, self.stats, f32)
        for t in (amax_s_t, amax_o_t):
            output(t, self.amax["S"], f32)
        _build(g, "forward")
        self.fwd_pack = {qt: q8, kt: k8, vt: v8, o_t: self.out, stats_t: self.stats, amax_s_t: self.amax["S"],
                         amax_o_t: self.amax["O"]}
        self.fwd_pack.update({t: self.s[n] for n, t in sc.items()})
        self.fwd = g

        # Backward: dQ, dK, dV in e4m3 with their amaxes, and dP's amax.
        g = graph()
        ins = {"q": (q8, fp8), "k": (k8, fp8), "v": (v8, fp8), "o": (self.out, fp8), "dO": (do8, fp8),
               "stats": (self.stats, f32)}
        it = {n: tensor(g, x, dt) for n, (x, dt) in ins.items()}
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s",
                 "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
        sc = {n: tensor(g, self.s[n], f32) for n in names}
        dq_t, dk_t, dv_t, amax_dq_t, amax_dk_t, amax_dv_t, amax_dp_t = g.sdpa_fp8_backward(
            **it, **sc, attn_scale=attn_scale, use_causal_mask=causal)
        for t, like in ((dq_t, self.dq), (dk_t, self.dk), (dv_t, self.dv)):
            output(t, like)
        for t in (amax_dq_t, amax_dk_t, amax_dv_t, amax_dp_t):
            output(t, self.amax["dP"], f32)
        _build(g, "backward")
        self.bwd_pack = {it[n]: x for n, (x, _) in ins.items()}
        self.bwd_pack.update({dq_t: self.dq, dk_t: self.dk, dv_t: self.dv, amax_dq_t: self.amax["dQ"],
                              amax_dk_t: self.amax["dK"], amax_dv_t: self.amax["dV"], amax_dp_t: self.amax["dP"]})
        self.bwd_pack.update({t: self.s[n] for n, t in sc.items()})
        self.bwd = g
        self.workspace = torch.empty(max(self.fwd.get_workspace_size(), self.bwd.get_workspace_size()), device=dev,
                                     dtype=torch.uint8)
        for _ in range(2):
            self.run()
            self._rescale()
        self.run()

    def _rescale(self) -> None:
        """Each of O, dP, dQ, dK, dV scaled so its measured amax maps to 448 (a zero or
        non-finite amax keeps the scale it had)."""
        for name, scale, descale in (("O", "scale_o", "descale_o"), ("dP", "scale_dP", "descale_dP"),
                                     ("dQ", "scale_dQ", None), ("dK", "scale_dK", None), ("dV", "scale_dV", None)):
            amax = self.amax[name].item()
            if math.isfinite(amax) and amax > 0:
                self.s[scale].fill_(E4M3_MAX / amax)
                if descale:
                    self.s[descale].fill_(amax / E4M3_MAX)

    def run_forward(self) -> None:
        self.fwd.execute(self.fwd_pack, self.workspace, handle=self.handle)

    def run_backward(self) -> None:
        self.bwd.execute(self.bwd_pack, self.workspace, handle=self.handle)

    def run(self) -> None:
        self.run_forward()
        self.run_backward()

    def output(self) -> torch.Tensor:
        return self.out.float() * self.s["descale_o"]

    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV of the last `run()`, dequantized to float32."""
        return tuple(t.float() / self.s[f"scale_{n}"] for t, n in ((self.dq, "dQ"), (self.dk, "dK"), (self.dv, "dV")))
