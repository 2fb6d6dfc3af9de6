"""Running a script under the Triton interpreter (CPU), for the tests that check the
kernels' indexing and the quantizers' layouts in CI. The interpreter's values are not
the GPU's: the GPU tests check the numbers."""

import os
import subprocess
import sys
import textwrap

# What the kernels need from Triton 3.6's interpreter and it lacks (loop bounds under
# NumPy >= 2.3, libdevice's rounded operations, bf16 dots, e4m3 NaN casts) is put in place
# by the package itself under TRITON_INTERPRET=1 (`fp4attn.kernels.interpreter_compat`,
# applied when `fp4attn.kernels` is imported); the scripts import it first.
KERNEL_PATCHES = textwrap.dedent('''
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    from fp4attn.kernels import interpreter_compat

    assert interpreter_compat.apply()
''')

# Two of the interpreter's costs that buy nothing, cut without changing what it
# computes (the scripts without KERNEL_PATCHES put these first on their own).
# tests/kernels/test_interpreter_patches.py checks both against the interpreter's own paths.
SPEEDUPS = textwrap.dedent('''
    import inspect as _inspect

    import numpy as _np
    import triton.language as tl
    from triton.runtime import interpreter

    # A tl.reduce with a combiner of the kernels' own (`max_propagating_nan`: the row
    # maxima of every forward tile) the interpreter runs element by element, a Python
    # call of the combiner for each element of the tile: most of the forwards' time.
    # Here the same left fold along the axis, the combiner applied to whole slices of
    # the other axes at a time: each output element meets the same operations in the
    # same order, stored in the input's dtype after each step as there. A reduction to
    # one value (axis None, 1-D input) keeps the interpreter's own path.
    _element_reduce = interpreter.ReduceOps.generic_reduce

    def _folded_reduce(self, input):
        axis = self.axis
        if axis is None or input[0].handle.data.ndim < 2:
            return _element_reduce(self, input)
        datas = [arg.handle.data for arg in input]
        acc = [_np.take(d, 0, axis=axis) for d in datas]
        for i in range(1, datas[0].shape[axis]):
            a = [self.to_tensor(x, arg.dtype) for x, arg in zip(acc, input)]
            b = [self.to_tensor(_np.take(d, i, axis=axis), arg.dtype) for d, arg in zip(datas, input)]
            out = self.combine_fn.fn(*a, *b)
            out = out if isinstance(out, tuple) else (out,)
            out = [o.handle.data if isinstance(o, tl.core.tensor) else o for o in out]
            acc = [_np.broadcast_to(o, x.shape).astype(x.dtype) for o, x in zip(out, acc)]
        if self.keep_dims:
            acc = [_np.expand_dims(x, axis) for x in acc]
        return [self.to_tensor(x, arg.dtype) for x, arg in zip(acc, input)]

    interpreter.ReduceOps.generic_reduce = _folded_reduce

    # Every call of a jit function from a kernel patches triton.language again (each
    # builtin looked up by inspect.getmembers) though the kernel's launch patched it
    # already: about half of the quantizers' time. Once the running kernel's launch has
    # patched the modules a function sees, its calls skip that; the launch's restore
    # (after its last program) ends it.
    _patch_lang = interpreter._patch_lang
    _patched = []  # the ids of the language modules the running kernel's launch patched

    def _lang_ids(fn):
        return {id(v) for v in fn.__globals__.values() if _inspect.ismodule(v) and v in (tl, tl.core)}

    def _patch_lang_once(fn):
        ids = _lang_ids(fn)
        if _patched and ids <= _patched[0]:
            return interpreter._LangPatchScope()
        scope = _patch_lang(fn)
        if _patched:
            _patched[0].update(ids)
        else:
            _patched.append(ids)
            restore = scope.restore

            def _restore():
                _patched.clear()
                restore()

            scope.restore = _restore
        return scope

    interpreter._patch_lang = _patch_lang_once
''')
KERNEL_PATCHES += SPEEDUPS  # the kernel scripts take them with the rest

# For the indexing checks: a call on (B, HQ query heads, HKV K/V heads) against one call
# per batch and K/V head, compared bit for bit with NaN equal to NaN
CALL_SHAPE = textwrap.dedent('''
    import torch

    B, HQ, HKV = 2, 4, 2

    def equal(a, b):
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])

    g = torch.Generator().manual_seed(0)
''')


def run_under_interpreter(script: str, timeout: int = 900) -> None:
    """Run `script` in a fresh interpreter with TRITON_INTERPRET=1 (and no launch
    override); it must exit 0 and print "ok" last. One thread for torch's and NumPy's
    operations unless OMP_NUM_THREADS says otherwise: the suite runs a script on each
    core (`pytest -n 2` on CI's two), where the threads of two scripts competing for
    them took 13% more time in all."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("FP4ATTN_FORWARD_LAUNCH", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
