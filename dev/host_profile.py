"""Where the host time of repeated calls goes: cProfile over n calls, the GPU running
behind (no synchronization inside the loop), printed by own time and by cumulative time.
What tools/profile_host.py and tools/probe_short_calls.py (`--profile`) print. Needs a
GPU to run."""

from __future__ import annotations

import cProfile
import pstats


def print_host_profile(call, n: int, top: int = 20) -> None:
    """Profile n calls of `call` after a synchronization and print the `top` functions by
    own time, then by cumulative time."""
    import torch

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
