"""The target a call runs for and the backend asked for: the environment every route reads.

FP4ATTN_TARGET routes as if on another GPU generation (with TRITON_INTERPRET=1, a
target's Triton kernels then run on CPU tensors under the interpreter); FP4ATTN_BACKEND
replaces backend="auto". Every route (the attention's families and launch tables,
decode's) looks `interpreting` up through this module at each call: a test that stands
in for the interpreter, or for its absence, patches it here once.
"""

from __future__ import annotations

import os

TARGET_ENV = "FP4ATTN_TARGET"  # "sm_90", "sm_100", "sm_120", "cpu": route as if on that target
BACKEND_ENV = "FP4ATTN_BACKEND"  # overrides backend="auto"
BACKENDS = ("auto", "reference", "triton")
TARGETS = ("sm_90", "sm_100", "sm_103", "sm_120", "sm_121", "cpu")
INTERPRET_ENV = "TRITON_INTERPRET"


def target_of(device) -> str:
    """The target a call on `device` (a torch.device or its type string) runs for:
    FP4ATTN_TARGET if set, else "cpu" for anything but CUDA, else "sm_<major><minor>"."""
    override = os.environ.get(TARGET_ENV)
    if override:
        if override not in TARGETS:
            raise ValueError(f"{TARGET_ENV}={override!r} is not a target; accepted: {TARGETS}")
        return override
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cuda":
        return "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (TRITON_INTERPRET=1): then a
    target's kernels run on CPU tensors."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def requested_backend(backend: str) -> str:
    """`backend` checked, with FP4ATTN_BACKEND applied to "auto"."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted: {BACKENDS}")
    env = os.environ.get(BACKEND_ENV)
    if backend == "auto" and env:
        if env not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={env!r} is not a backend; accepted: {BACKENDS}")
        return env
    return backend
