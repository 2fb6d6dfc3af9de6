"""Running the Blackwell kernels under the Triton interpreter (CPU).

Triton 3.6's interpreter cannot run a block-scaled product: `semantic.dot_scaled` reads
`.value` of the format strings the interpreter passes bare (AttributeError: 'str' object
has no attribute 'value'), and its builder has no `create_dot_scaled`. The patch below,
put in place before the kernels are imported (`BLACKWELL_PATCHES`, with
`tests.interpreter.KERNEL_PATCHES` for the loop bounds and `mul_rn`), gives it one
defined as the hardware's: decode the E2M1 codes (two a byte, element 2i in the low
nibble, along the contraction dim), multiply each by its block scale (e4m3 per 16
elements, or E8M0 per 32: 2**(s - 127), 0xFF NaN), and multiply the decoded operands in
float64, rounded once to float32 and added to the accumulator. The tensor cores' float32
sums differ from that only in order, which the tests' tolerances allow. `tl.dot` gets
the same definition (the interpreter multiplies bf16 operands as their raw bits; the
Blackwell training backward's D=128 dK/dV kernel forms S^T as a bf16 product).
`tests/kernels/blackwell/test_kernels.py` checks the patch itself against a float64 product of
the reference's dequantized payloads.

The kernels' inline PTX (the packed e2m1/e4m3 conversions) does not run on the
interpreter: the launcher builds the same bytes with integer arithmetic there (HW_CVT
off); the compile tests check the PTX, the GPU self-test the values.
"""

import textwrap

from tests.interpreter import KERNEL_PATCHES

BLACKWELL_PATCHES = KERNEL_PATCHES + textwrap.dedent('''
    import numpy as np
    import torch
    import triton.language as tl
    from triton._C.libtriton import ir as _ir
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as _interp

    _E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
    _E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    _E8M0 = np.where(np.arange(256) == 255, np.nan, np.exp2(np.arange(256, dtype=np.float64) - 127))

    def _unpack_e2m1(packed, axis):
        """Codes of uint8 bytes, two along `axis` per byte (element 2i in the low nibble)."""
        lo, hi = packed & 0xF, packed >> 4
        both = np.stack([lo, hi], axis=axis + 1)
        shape = list(packed.shape)
        shape[axis] *= 2
        return _E2M1[both.reshape(shape)]

    def _block_scales(scale):
        data = scale.data.view(np.uint8)
        if scale.dtype == tl.float8e4nv:
            return _E4M3[data], 16
        return _E8M0[data], 32

    def _operand(x, fmt, k_axis, scale):
        """A dot_scaled operand as float64, contraction dim along k_axis."""
        if fmt == _ir.ScaleDotElemTypeTY.E2M1:
            vals = _unpack_e2m1(x.data.view(np.uint8), k_axis)
        elif fmt == _ir.ScaleDotElemTypeTY.E4M3:
            vals = _E4M3[x.data.view(np.uint8)]
        else:
            raise NotImplementedError(f"interpreter dot_scaled: operand format {fmt}")
        if scale is not None:
            s, block = _block_scales(scale)  # (rows or cols, K // block)
            s = np.repeat(s, block, axis=1)
            vals = vals * (s if k_axis == 1 else s.T)
        return vals

    def create_dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math, lhs_k_pack,
                          rhs_k_pack, acc):
        assert lhs_k_pack and rhs_k_pack, "interpreter dot_scaled: codes packed along the contraction dim only"
        a = _operand(lhs, lhs_format, 1, lhs_scale)
        b = _operand(rhs, rhs_format, 0, rhs_scale)
        with np.errstate(invalid="ignore"):
            out = (a @ b).astype(np.float32) + acc.data
        return _interp.TensorHandle(out, acc.dtype.scalar)

    _interp.InterpreterBuilder.create_dot_scaled = create_dot_scaled

    def _dot_operand(x):
        """A tl.dot operand as float64: bf16 from its bits (the interpreter holds bf16 as
        uint16 and multiplies the bits), fp8 by the interpreter's own exact upcast."""
        if x.dtype == tl.bfloat16:
            return (x.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating():
            return _interp._convert_float(x.data, x.dtype, tl.float16, None).view(np.float16).astype(np.float64)
        return x.data.astype(np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = (_dot_operand(a) @ _dot_operand(b)).astype(d.data.dtype) + d.data
        return _interp.TensorHandle(out, d.dtype.scalar)

    _interp.InterpreterBuilder.create_dot = create_dot

    _dot_scaled = TritonSemantic.dot_scaled

    def dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, *args, **kwargs):
        wrap = lambda f: tl.constexpr(f) if isinstance(f, str) else f
        return _dot_scaled(self, lhs, lhs_scale, wrap(lhs_format), rhs, rhs_scale, wrap(rhs_format), *args,
                           **kwargs)

    TritonSemantic.dot_scaled = dot_scaled
''')
