"""A Triton kernel launched through its compiled form's own launcher, its binder skipped.

`kernel[grid](*args)` runs Triton's binder at every call: it inspects each argument (a
tensor's pointer alignment and dtype, an integer's value), builds the specialization key
and looks the compiled kernel up, about 15-20 us of host a launch. A decode step is a few
tens of microseconds on the GPU, so two such launches made an eager step host-bound
(docs/notes/decode.md). `CachedLaunch` keys the compiled kernel on what the binder's
specialization can depend on (each integer's value, each tensor's dtype and 16-byte
alignment, each other argument's type, the constexprs and the options), runs the binder
once per key, and launches later calls of that key through the compiled kernel's launcher
(`CompiledKernel.run`, as `JITFunction.run` does after its lookup).
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs

MAX_KEYS = 64  # compiled forms a launcher keeps (a long-running server's decode sees a handful)


class CachedLaunch:
    """`launch(grid, args, constexprs, stream, num_warps=, num_stages=)`: `fn[grid](*args,
    **constexprs, num_warps=, num_stages=)` on `stream`, the binder skipped after the first
    call of a specialization. Under the interpreter (no compiled kernel) every call is
    Triton's own."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, stream: int, **options) -> None:
        # each argument's part: a tensor's dtype and 16-byte alignment, an integer itself (bool
        # included: the binder specializes on the value, 1, multiples of 16, 64-bit), any other
        # argument's type; one comprehension, no call per argument (this runs at every launch)
        key = (tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a if isinstance(a, int)
                      else type(a) for a in args]), tuple(constexprs.values()), tuple(options.values()))
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **constexprs, **options)
            if hasattr(kernel, "run") and hasattr(kernel, "packed_metadata"):  # (the interpreter returns none)
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = kernel
            return
        # the launcher takes every parameter in the kernel's order, constexprs included
        bound = (*args, *[constexprs[n] for n in self.fn.arg_names[len(args):]])
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *bound), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *bound)
