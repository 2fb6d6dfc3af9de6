"""The CUDA C++ training backward (kernels/hopper/backward_cuda.py) against the routed Gluon/Triton
backward on the same operands, and both timed beside SDPA cuDNN bf16 (and cuDNN FP8, where the
nvidia-cudnn-frontend package imports) in one process. GPU only.

    python tools/check_backward_cuda.py [--out DIR] [--quick] [--ncu-one]

(The timing probes of docs/notes/hopper-train.md were builds of the
kernel at commit 637bfa6 with -DPROBE=1..3.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fp4attn.kernels.hopper import backward_cuda, train_op
from fp4attn.metrics import error_metrics


def operands(B, H, Hkv, Sq, Sk, D, causal_offset, causal, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, Sq, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, Hkv, Sk, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Hkv, Sk, D, device="cuda", generator=g).bfloat16()
    dout = torch.randn(B, H, Sq, D, device="cuda", generator=g).bfloat16()
    scale = D ** -0.5
    out, lse, *saved = train_op._train_forward_fp8_op(q, k, v, "fp8", "fp8", "exp2", "fp8", causal_offset, causal,
                                                       scale)
    ops = train_op.backward_operands_fp8(dout.contiguous(), out, *saved)
    return ops, lse, scale, (q, k, v, dout)


def check(case, log):
    B, H, Hkv, Sq, Sk, D, off, causal = case
    ops, lse, scale, _ = operands(B, H, Hkv, Sq, Sk, D, off, causal)
    ref = train_op.launch_backward(ops, lse, "fp8", "exp2", off, causal, scale)
    new = backward_cuda.launch_backward_cuda(ops, lse, off, causal, scale)
    torch.cuda.synchronize()
    row = {"case": list(case)}
    for name, a, b in zip(("dq", "dk", "dv"), new, ref):
        m = error_metrics(a.float(), b.float())
        row[name] = {"cos": m["cos"], "rel_l2": m.get("rel_l2"), "finite": bool(torch.isfinite(a).all()),
                     "max_abs": float((a.float() - b.float()).abs().max())}
    log.append(row)
    ok = all(row[n]["cos"] > 0.999 and row[n]["finite"] for n in ("dq", "dk", "dv"))
    print(f"check {case}: " + " ".join(f"{n} cos {row[n]['cos']:.6f} rel {row[n]['rel_l2']:.2e}"
                                         for n in ("dq", "dk", "dv")) + ("  OK" if ok else "  FAIL"), flush=True)
    return ok


def bench_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def timing(shape, log):
    B, H, S, D = shape
    ops, lse, scale, (q, k, v, dout) = operands(B, H, H, S, S, D, 0, True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        o.backward(dout)

    import fp4attn

    def ours_step():
        o = fp4attn.attention(qg, kg, vg, is_causal=True, recipe="train-fp8")
        o.backward(dout)

    res = {"shape": list(shape)}
    res["sdpa_cudnn_fwd_bwd_ms"] = bench_ms(sdpa_step)
    res["train_fp8_fwd_bwd_ms"] = bench_ms(ours_step)
    res["bwd_operands_ms"] = bench_ms(lambda: train_op.backward_operands_fp8(dout, *_saved(q, k, v, scale)))
    res["bwd_gluon_kernels_ms"] = bench_ms(lambda: train_op.launch_backward(ops, lse, "fp8", "exp2", 0, True, scale))
    res["bwd_cuda_kernel_ms"] = bench_ms(lambda: backward_cuda.launch_backward_cuda(ops, lse, 0, True, scale))
    flops = 3.5 * 4 * B * H * S * S * D / 2  # causal forward+backward, as the benchmarks count
    res["sdpa_tflops"] = flops / res["sdpa_cudnn_fwd_bwd_ms"] / 1e9
    # the whole step with the CUDA backward in place of the Gluon/Triton kernels
    fwd_ms = bench_ms(lambda: train_op._train_forward_fp8_op(q, k, v, "fp8", "fp8", "exp2", "fp8", 0, True, scale))
    res["train_fwd_ms"] = fwd_ms
    res["step_with_cuda_bwd_ms"] = fwd_ms + res["bwd_operands_ms"] + res["bwd_cuda_kernel_ms"]
    res["speedup_cuda_step_vs_cudnn_bf16"] = res["sdpa_cudnn_fwd_bwd_ms"] / res["step_with_cuda_bwd_ms"]
    res["speedup_today_vs_cudnn_bf16"] = res["sdpa_cudnn_fwd_bwd_ms"] / res["train_fp8_fwd_bwd_ms"]
    log.append(res)
    print(json.dumps(res), flush=True)


_saved_cache = {}


def _saved(q, k, v, scale):
    key = (q.data_ptr(), k.data_ptr())
    if key not in _saved_cache:
        out, lse, *saved = train_op._train_forward_fp8_op(q, k, v, "fp8", "fp8", "exp2", "fp8", 0, True, scale)
        _saved_cache[key] = (out, *saved)
    return _saved_cache[key]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ncu-one", action="store_true", help="one launch at (4,16,4096,128) causal, for ncu")
    ap.add_argument("--ab-source", help="another version of attn_bwd_fp8.cu (its headers beside it), timed "
                    "beside the package's in the same process")
    args = ap.parse_args()
    if args.ab_source:
        from pathlib import Path

        from fp4attn.kernels.hopper import nvrtc_build

        def other(variant, device):
            return nvrtc_build.load_function(
                ("backward-ab", variant), lambda: nvrtc_build.compile_source(
                    Path(args.ab_source), nvrtc_build.options_for(variant.defines()), "the other backward"),
                backward_cuda.KERNEL_NAME, device, variant.shared_bytes() + 8704)
        rows = []
        for shape in ((4, 16, 4096, 128), (8, 16, 4096, 64), (2, 16, 8192, 128)):
            B, H, S, D = shape
            ops, lse, scale, _ = operands(B, H, H, S, S, D, 0, True)
            run = lambda: backward_cuda.launch_backward_cuda(ops, lse, 0, True, scale)  # noqa: E731
            row = {"shape": list(shape), "package_ms": bench_ms(run),
                   "gluon_ms": bench_ms(lambda: train_op.launch_backward(ops, lse, "fp8", "exp2", 0, True, scale))}
            mine = backward_cuda._function
            backward_cuda._function = other
            try:
                row["other_ms"] = bench_ms(run)
            finally:
                backward_cuda._function = mine
            rows.append(row)
            print("ab", json.dumps(row), flush=True)
        with open(f"{args.out}/ab.json", "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    if args.ncu_one:
        ops, lse, scale, _ = operands(4, 16, 16, 4096, 4096, 128, 0, True)
        backward_cuda.launch_backward_cuda(ops, lse, 0, True, scale)
        torch.cuda.synchronize()
        return 0
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    for v in backward_cuda.all_variants():
        b = backward_cuda.compile_variant(v, announce=False)
        print(v, "regs", b.registers(), "spill", b.spill_bytes(), flush=True)
    print(f"built in {time.time() - t0:.1f} s", flush=True)
    log = []
    cases = [(1, 2, 2, 128, 128, 128, 0, False), (1, 2, 2, 256, 256, 128, 0, True), (1, 2, 2, 256, 256, 64, 0, True),
             (2, 4, 2, 320, 384, 128, 64, True), (1, 4, 1, 384, 256, 64, -128, True),
             (2, 3, 3, 192, 512, 64, 0, False), (1, 2, 2, 512, 512, 128, 0, True)]
    ok = True
    for c in cases:
        try:
            ok &= check(c, log)
        except Exception as e:  # report and go on
            ok = False
            print(f"check {c}: ERROR {type(e).__name__}: {e}", flush=True)
            log.append({"case": list(c), "error": repr(e)})
    with open(f"{args.out}/check.json", "w") as f:
        json.dump(log, f, indent=1)
    if not ok and not args.quick:
        print("checks failed: no timing", flush=True)
    shapes = [(4, 16, 4096, 128), (8, 16, 4096, 64)] + ([] if args.quick else [(2, 16, 8192, 128)])
    tl = []
    for s in shapes:
        try:
            timing(s, tl)
        except Exception as e:
            print(f"timing {s}: ERROR {type(e).__name__}: {e}", flush=True)
    with open(f"{args.out}/timing.json", "w") as f:
        json.dump(tl, f, indent=1)
    print("\n| shape | cuDNN bf16 ms | train-fp8 today ms (x) | bwd Gluon ms | bwd CUDA ms | step w/ CUDA bwd ms (x) |")
    for r in tl:
        print(f"| {r['shape']} | {r['sdpa_cudnn_fwd_bwd_ms']:.3f} | {r['train_fp8_fwd_bwd_ms']:.3f} "
              f"({r['speedup_today_vs_cudnn_bf16']:.2f}x) | {r['bwd_gluon_kernels_ms']:.3f} | "
              f"{r['bwd_cuda_kernel_ms']:.3f} | {r['step_with_cuda_bwd_ms']:.3f} "
              f"({r['speedup_cuda_step_vs_cudnn_bf16']:.2f}x) |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
