"""Running a script under the Triton interpreter (CPU), for the tests that check the
kernels' indexing and the quantizers' layouts in CI. The interpreter's values are not
the GPU's: the GPU tests check the numbers."""

import os
import subprocess
import sys
import textwrap

# What the kernels need from Triton 3.6's interpreter and it lacks, put in place before
# they are imported: it holds scalars as 1-element arrays and converts them with int(),
# which NumPy >= 2.3 refuses for arrays of one dimension (loop bounds); it has no
# libdevice.mul_rn, add_rn, sub_rn (NumPy's plain operations round the same, once each:
# nothing is contracted there). Its bf16 dot is also wrong: scripts hand the kernels
# float32 copies of bf16 values.
KERNEL_PATCHES = textwrap.dedent('''
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _patch_with_index(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_with_index

    @triton.jit
    def _mul(a, b):
        return a * b

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _sub(a, b):
        return a - b

    libdevice.mul_rn = _mul
    libdevice.add_rn = _add
    libdevice.sub_rn = _sub
''')

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
    override); it must exit 0 and print "ok" last."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    env.pop("FP4ATTN_FORWARD_LAUNCH", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
