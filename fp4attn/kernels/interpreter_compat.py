"""What the kernels need from Triton 3.6's interpreter (TRITON_INTERPRET=1, CPU tensors)
and it lacks, put in place by the package when it runs under the interpreter (importing
`fp4attn.kernels` calls `apply`), so that `fp4attn.attention` and `fp4attn.decode` run
there as `fp4attn.explain` says (with FP4ATTN_TARGET naming the GPU to act as):

- loop bounds: the interpreter holds scalars as 1-element arrays and converts them with
  int(), which NumPy >= 2.3 refuses for arrays of one dimension ("only 0-dimensional
  arrays can be converted to Python scalars"): its tensors get an `__index__`;
- `libdevice.mul_rn`, `add_rn`, `sub_rn`, which it cannot run: NumPy's plain operations,
  which round the same, once each (nothing is contracted there);
- `tl.dot` of bf16 operands: the interpreter holds bf16 as uint16 and multiplies the
  bits; here they are decoded to float32 first (every product of two bf16 values is
  exact in float32, and the sums are float32's, as the tensor cores');
- e4m3 (`tl.float8e4nv`) casts of NaN: the interpreter's bit conversion makes a float NaN
  the byte 0x7C (384) and reads 0x7F (e4m3's NaN) as 480; here NaN stays NaN both ways,
  as torch and the GPU convert it (0x7F, 0xFF with the sign);
- NaN where the GPU's instructions differ from NumPy's: `tl.minimum`/`tl.maximum`
  without `propagate_nan` are PTX min.f32/max.f32, which return the other
  operand where one is NaN (NumPy's minimum/maximum return the NaN); float-to-integer
  casts are cvt.rzi, which make NaN 0 and saturate out-of-range values (NumPy's are
  undefined there). A kernel that loses a NaN on the GPU loses it here too.

The interpreter's values are not the GPU's (its fp8 casts of values between grid points
round wrongly; the kernels round on the bits there, `HW_CVT` off): it checks indexing,
layouts and the arithmetic the kernels spell out, and the GPU tests check the numbers.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_APPLIED = False


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sub(a, b):
    return a - b


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def apply() -> bool:
    """Put the patches in place (once; a no-op outside the interpreter). Returns whether
    they are in place."""
    global _APPLIED
    if _APPLIED:
        return True
    if not interpreting():
        return False
    import numpy as np
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_with_index

    # (libdevice's own are calls into the CUDA library, which the interpreter cannot make)
    libdevice.mul_rn, libdevice.add_rn, libdevice.sub_rn = _mul, _add, _sub

    convert = interpreter._convert_float

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        out = convert(input, input_dtype, output_dtype, rounding_mode)
        if output_dtype == tl.float8e4nv and input_dtype.primitive_bitwidth > 8:
            w, m = input_dtype.primitive_bitwidth, input_dtype.fp_mantissa_width
            bits = np.frombuffer(input.tobytes(), dtype=getattr(np, f"uint{w}")).reshape(input.shape)
            exp_ones = (1 << (w - 1 - m)) - 1
            nan = (((bits >> m) & exp_ones) == exp_ones) & ((bits & ((1 << m) - 1)) != 0)
            if nan.any():
                sign = ((bits >> (w - 1)) & 1).astype(np.uint8)
                out = np.where(nan, (sign << 7) | 0x7F, out).astype(out.dtype)
        elif input_dtype == tl.float8e4nv and output_dtype.primitive_bitwidth > 8:
            byte = np.frombuffer(input.tobytes(), dtype=np.uint8).reshape(input.shape)
            nan = (byte & 0x7F) == 0x7F
            if nan.any():
                w, m = output_dtype.primitive_bitwidth, output_dtype.fp_mantissa_width
                quiet = (((1 << (w - 1 - m)) - 1) << m) | (1 << (m - 1))  # exponent all ones, top mantissa bit
                sign = (byte >> 7).astype(out.dtype) << (w - 1)
                out = np.where(nan, sign | quiet, out).astype(out.dtype)
        return out

    interpreter._convert_float = _convert_float

    create_dot = interpreter.InterpreterBuilder.create_dot

    def _bf16_as_float32(x):
        data = (x.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = _bf16_as_float32(a)
        if b.dtype == tl.bfloat16:
            b = _bf16_as_float32(b)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = _create_dot

    builder = interpreter.InterpreterBuilder
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)

    def _create_fp_to_si(self, src, dst_type):
        info = np.iinfo(interpreter._get_np_dtype(dst_type))
        x = np.trunc(src.data.astype(np.float64))
        data = np.where((x > info.min) & (x < info.max), x, 0).astype(info.dtype)  # in range: exact; NaN 0
        data[x >= info.max] = info.max
        data[x <= info.min] = info.min
        return interpreter.TensorHandle(data, dst_type.scalar)

    builder.create_fp_to_si = _create_fp_to_si
    _APPLIED = True
    return True
