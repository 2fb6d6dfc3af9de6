"""The sm_90 (Hopper) kernels and their launchers: Triton, Gluon and CUDA C++ (`cuda/`)."""
