"""cuDNN's FP8 SDPA (through the `nvidia-cudnn-frontend` package) as a benchmark
baseline: the strongest FP8 attention on Hopper we know of (facts: 900-940 TFLOP/s at
D=128 on the H200).

Per-tensor e4m3 Q, K, V (scale amax / 448), P scaled by 448 into e4m3, e4m3 output
(Hopper's cuDNN writes FP8 output only). Only the graph's execution is timed, as the
kernels' "kernel alone" column. The package is optional: `available()` says whether it
imports, and every failure to build a graph is reported by the caller, never fatal.
"""

from __future__ import annotations

import importlib.util

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
