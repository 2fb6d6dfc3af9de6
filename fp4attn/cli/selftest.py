"""`fp4attn selftest`: on the GPU this machine has, run every kernel the routing sends a
call to, at small awkward shapes and, for each inference recipe, once past the key count
from which the Hopper routing takes the CUDA C++ kernel, against the reference of the
same recipe, time one call against SDPA, and print a pass/fail table (a few minutes, most
of it compiling).

What passes: the LSE within 1e-3 of the reference on >= 99% of the rows that see a key
(float32 summation order can move a score across a rounding threshold of P: a few rows
move by up to about 0.1), the same rows seeing no key, the output finite and within 2%
relative L2 of the reference's (bf16 output), and for the training recipes each
gradient within 2% relative L2 of the reference backward's. The `fast_accum` recipes,
whose QK^T sums no reference reproduces, and every recipe on the CUDA C++ forward, whose
fused softmax rounds on its own: the LSE within 2e-2 on >= 95% of the rows, the output
within 3%. On Blackwell the FP8 Q/K recipes multiply on the FP8 tensor cores
(`kind::f8f6f4`): the exact ones pass only if those sum in float32, which this checks.

Each case runs in a worker process under a watchdog (`cli/watchdog.py`, `--case-timeout`
seconds a case): a kernel that hangs or crashes its process is a failed row saying so,
and the next case runs in a fresh process.

Exit status: 0 all passed; 1 a case failed; 2 no CUDA GPU (`output.NO_GPU_STATUS`, as for bench: on a
CPU machine `fp4attn compile-report` and the test suite are the checks).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from fp4attn.cli.output import exit_no_gpu, markdown_table, write_json
from fp4attn.recipes import PRESETS

SHAPE = (2, 4, 2, 200, 333)  # B, Hq, Hkv (GQA), Sq, Sk: lengths not a multiple of any tile
# past the key counts from which the Hopper routing hands a recipe to the CUDA C++ kernel
# (`routing.ForwardLaunch.cuda_from_keys`), by this many keys: still no multiple of a tile
LONG_EXTRA_KEYS = 77
TIMING_SHAPE = (4, 16, 4096, 128)  # B, H, S, D
# a case's limit: the first one includes the worker's start and the first kernel compiles
CASE_TIMEOUT_S = 300.0


def _inputs(b, hq, hkv, sq, sk, d, device, requires_grad=False):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, sq, d, generator=g, device=device).bfloat16()
    k, v = (torch.randn(b, hkv, sk, d, generator=g, device=device).bfloat16() for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _expand(x, hq):
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return math.nan
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_forward(name: str, d: int, causal: str | None, masked: bool, device, shape=SHAPE) -> dict:
    """One forward call on the kernels against the reference."""
    import fp4attn
    from fp4attn.reference import reference_forward

    b, hq, hkv, sq, sk = shape
    q, k, v = _inputs(b, hq, hkv, sq, sk, d, device)
    mask = None
    if masked:  # key padding: batch item 0 sees its first 60% of keys
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool, device=device)
        mask[0, ..., int(0.6 * sk):] = False
    kw = dict(causal=causal or False, recipe=name, enable_gqa=True, attn_mask=mask)
    info = fp4attn.explain(q, k, v, **kw)
    rec = dict(recipe=name, head_dim=d, causal=causal or "no", mask="key" if masked else "none",
               direction="forward", keys=sk, kernel=info["kernel"])
    if info["backend"] != "triton":
        return {**rec, "status": "reference", "reason": info["reason"]}
    out, lse = fp4attn.attention(q, k, v, backend="triton", return_lse=True, **kw)
    ref = reference_forward(q, _expand(k, hq), _expand(v, hq), PRESETS[name], scale=d**-0.5, causal=causal,
                            attn_mask=mask)
    seen = torch.isfinite(ref.lse)
    same_seen = bool(torch.equal(seen, torch.isfinite(lse)))
    # fast_accum recipes: the tensor core's own QK^T sums, which the reference does not
    # reproduce (`Recipe.fast_accum`): about 1% of P codes differ, each moving its row; the
    # CUDA C++ kernel's fused softmax rounds apart from the reference too (its exp2
    # polynomial, its own score arithmetic: routing's one exception), its P codes held to
    # the Triton kernel's by tests/kernels/hopper/test_forward_cuda.py, so it is held here as they are
    loose = PRESETS[name].fast_accum or info["kernel"] == "hopper.forward_cuda"
    tol, rows, out_tol = (2e-2, 0.95, 3e-2) if loose else (1e-3, 0.99, 2e-2)
    err = (lse[seen] - ref.lse[seen]).abs()
    close = float((err < tol).float().mean()) if err.numel() else 1.0
    worst = float(err.max()) if err.numel() else 0.0
    out_err = _rel(out.float(), ref.out)
    ok = same_seen and close >= rows and worst < 0.2 and out_err < out_tol
    return {**rec, "status": "pass" if ok else "FAIL", "lse_rows_close": round(close, 4), "lse_max_err": worst,
            "out_rel_l2": out_err}


def check_forward_long(name: str, d: int, causal: str | None, keys: int, device) -> dict:
    """`check_forward` at one batch item of 4 query heads (2 KV heads), 200 queries over
    `keys` keys, no mask."""
    return check_forward(name, d, causal, False, device, (1, 4, 2, 200, keys))


def check_backward(name: str, d: int, causal: str, device, shape=SHAPE) -> dict:
    """One forward and backward through autograd on the training kernels against the
    reference backward."""
    import fp4attn
    from fp4attn.reference import reference_backward, reference_forward
    from fp4attn.reference.forward import ForwardResult

    b, hq, hkv, sq, sk = shape
    q, k, v = _inputs(b, hq, hkv, sq, sk, d, device, requires_grad=True)
    kw = dict(causal=causal, recipe=name, enable_gqa=True)
    info = fp4attn.explain(q, k, v, **kw)
    rec = dict(recipe=name, head_dim=d, causal=causal, mask="none", direction="backward", keys=sk, kernel=info["kernel"])
    if info["backend"] != "triton":
        return {**rec, "status": "reference", "reason": info["reason"]}
    out, lse = fp4attn.attention(q, k, v, backend="triton", return_lse=True, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    recipe = PRESETS[name]
    ref = reference_forward(q.detach(), _expand(k.detach(), hq), _expand(v.detach(), hq), recipe, scale=d**-0.5,
                            causal=causal)
    fwd = ForwardResult(out.detach().float(), lse.detach(), ref.q, ref.k, ref.v)
    want = reference_backward(fwd, out.detach(), dout, recipe, scale=d**-0.5, causal=causal)
    g = hq // hkv
    want = (want[0], want[1].reshape(b, hkv, g, sk, d).sum(2), want[2].reshape(b, hkv, g, sk, d).sum(2))
    errs = {f"d{n}_rel_l2": _rel(t.grad.float(), w) for n, t, w in zip("qkv", (q, k, v), want)}
    ok = all(e < 2e-2 for e in errs.values())
    return {**rec, "status": "pass" if ok else "FAIL", **errs}


def time_against_sdpa(device, recipe: str = "directp") -> dict:
    """Median time of one forward of `recipe` against SDPA bf16 (cuDNN where torch has
    it), at TIMING_SHAPE, quantization included."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    import fp4attn

    b, h, s, d = TIMING_SHAPE
    q, k, v = _inputs(b, h, h, s, s, d, device)
    ms = do_bench(lambda: fp4attn.attention(q, k, v, recipe=recipe, backend="triton"))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref_ms, sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v)), "cuDNN"
    except RuntimeError:
        ref_ms, sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v)), "default"
    flop = 4 * b * h * s * s * d
    return {"recipe": recipe, "shape": TIMING_SHAPE, "ms": ms, "tflops": flop / ms / 1e9, "sdpa": sdpa,
            "sdpa_ms": ref_ms, "sdpa_tflops": flop / ref_ms / 1e9, "ratio": ref_ms / ms}


def cases() -> list[tuple[str, tuple, dict]]:
    """Every case the selftest runs: (function of this module, its arguments, the
    record a failure of it is reported under). Besides the short rows, each inference
    recipe's forward once past the key count from which the Hopper routing runs it on
    the CUDA C++ kernel (elsewhere the same kernels at a longer row)."""
    from fp4attn import routing

    out = []
    for name, recipe in PRESETS.items():
        for d in (64, 128):
            # bottom-right causal with Sq < Sk also covers a diagonal that starts mid-tile
            for causal, masked in ((None, False), ("bottom_right", False), (None, True)):
                out.append(("check_forward", (name, d, causal, masked),
                            dict(recipe=name, head_dim=d, causal=causal or "no", mask="key" if masked else "none",
                                 direction="forward", keys=SHAPE[-1])))
            for causal in (None, "bottom_right") if recipe.grad is None else ():
                n = routing.forward_launch(d, recipe.fast_accum, causal is not None).cuda_keys(routing.p_mode(recipe))
                if n:
                    out.append(("check_forward_long", (name, d, causal, n + LONG_EXTRA_KEYS),
                                dict(recipe=name, head_dim=d, causal=causal or "no", mask="none", direction="forward",
                                     keys=n + LONG_EXTRA_KEYS)))
            if recipe.grad is not None:
                out.append(("check_backward", (name, d, "bottom_right"),
                            dict(recipe=name, head_dim=d, causal="bottom_right", mask="none", direction="backward",
                                 keys=SHAPE[-1])))
    return out


def run_case(dog, fn: str, args: tuple, record: dict, device: str) -> dict:
    """One case through the watchdog `dog` (or in this process if None): its record,
    or a failed row saying whether it hung, crashed or raised."""
    if dog is None:
        return globals()[fn](*args, device)
    outcome, value = dog.run(f"{__name__}:{fn}", *args, device)
    if outcome == "ok":
        return value
    return {**record, "kernel": "?", "status": "FAIL", "reason": f"{outcome}: {value}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="write the records as JSON")
    p.add_argument("--no-timing", action="store_true", help="skip the timing against SDPA")
    p.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, metavar="S",
                   help=f"seconds a case may take before it counts as hung (default {CASE_TIMEOUT_S:.0f})")
    p.add_argument("--no-watchdog", action="store_true",
                   help="run the cases in this process (a hang then hangs the command; for debugging)")


def environment(device) -> dict:
    from fp4attn import routing

    env = {"gpu": torch.cuda.get_device_name(device), "target": routing.target_of(device), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:
        print(f"fp4attn selftest: Triton is not importable ({e}); the kernels need it")
        raise SystemExit(1) from e
    return env


def main(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        exit_no_gpu("selftest", "on a CPU machine the checks are `fp4attn compile-report` and the test suite")
    from fp4attn.cli.watchdog import Watchdog

    env = environment(torch.device("cuda"))
    print("fp4attn selftest on", ", ".join(f"{k} {v}" for k, v in env.items()))
    t0 = time.time()
    dog = None if args.no_watchdog else Watchdog(args.case_timeout)
    try:
        recs = [run_case(dog, fn, a, record, "cuda") for fn, a, record in cases()]
        rows = [[r["recipe"], r["direction"], r["head_dim"], r["causal"], r["mask"], r["keys"], r["kernel"],
                 r["status"], r.get("reason") or ", ".join(f"{k} {v:.3g}" for k, v in r.items() if isinstance(v, float))]
                for r in recs]
        print(markdown_table(["recipe", "direction", "D", "causal", "mask", "keys", "kernel", "status", "figures"],
                             rows))
        timing = None
        if not args.no_timing:
            timing = run_case(dog, "time_against_sdpa", (), dict(recipe="directp", direction="timing"), "cuda")
            if timing.get("status") == "FAIL":
                print(f"\ntiming: {timing['reason']}")
            else:
                print(f"\ntiming at B,H,S,D = {tuple(timing['shape'])}: {timing['recipe']} {timing['tflops']:.0f} "
                      f"TFLOP/s, SDPA {timing['sdpa']} bf16 {timing['sdpa_tflops']:.0f} TFLOP/s "
                      f"({timing['ratio']:.2f}x)")
    finally:
        if dog is not None:
            dog.close()
    failed = [r for r in recs if r["status"] == "FAIL"]
    ran = sum(r["status"] != "reference" for r in recs)
    print(f"\n{ran} kernel cases run, {len(failed)} failed, {len(recs) - ran} on the reference "
          f"({time.time() - t0:.0f} s)")
    result = {"environment": env, "records": recs, "timing": timing}
    write_json(args.json, result)
    if failed:
        raise SystemExit(1)
    return result
