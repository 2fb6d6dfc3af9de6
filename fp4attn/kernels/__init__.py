"""Triton kernels. Importing this package needs Triton; `fp4attn.api` imports it only
when a kernel backend is chosen. Under the Triton interpreter (TRITON_INTERPRET=1) it
first puts in place what the kernels need from it (`interpreter_compat`)."""

from fp4attn.kernels import interpreter_compat

interpreter_compat.apply()
