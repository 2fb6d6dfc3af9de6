"""The host work of one call, counted instead of timed (a timing is noise on a shared
machine; a count fails exactly when a call grows): the package's Python frames entered,
and the tensor operations dispatched (`Ops`: every aten or custom op, by name)."""

import collections
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

import fp4attn

PACKAGE = str(Path(fp4attn.__file__).parent)


class Ops(TorchDispatchMode):
    """The tensor operations dispatched while active, counted by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def host_work(fn) -> tuple[int, collections.Counter]:
    """(Python frames of the package entered, tensor operations dispatched) by one call of
    fn each (fn is called twice)."""
    frames = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            frames[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    with Ops() as mode:
        fn()
    return frames[0], mode.ops
