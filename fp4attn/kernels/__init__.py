"""Triton kernels. Importing this package needs Triton; `fp4attn.api` imports it only
when a kernel backend is chosen."""
