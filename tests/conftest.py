import contextlib
import faulthandler
import os

import pytest
import torch


def gpu_test_timeout(value: str) -> float:
    """FP4ATTN_GPU_TEST_TIMEOUT's seconds (0 or less: no watchdog)."""
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"FP4ATTN_GPU_TEST_TIMEOUT={value!r}: expected seconds as a number, e.g. 300 (0 turns the "
                         "watchdog off)") from None


# A GPU test that waits forever (a kernel stuck on an mbarrier never returns) ends its
# process after this many seconds instead of holding the whole run: pytest-xdist
# reports the test as crashed and goes on. Each process logs the GPU tests it starts
# and, on a timeout, every thread's traceback to .pytest_cache/gpu-test-timeout-<pid>.txt
# (pytest captures the process's stderr).
GPU_TEST_TIMEOUT_S = gpu_test_timeout(os.environ.get("FP4ATTN_GPU_TEST_TIMEOUT", "300"))
_watchdog_log = None


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _schedule_rank(item) -> int:
    """Where a test runs in the suite: 2 for the interpreter and compile tests, last; 0 for
    those of them that share a module-scoped fixture (the Blackwell builds' records, the
    Gluon builds), first, where their module's tests stay together on one worker and the
    fixture is built once (split over two workers, the Blackwell records were built twice:
    70 s more); 1 for the rest."""
    if not any(item.get_closest_marker(name) is not None for name in ("interpreter", "compile")):
        return 1
    fixturedefs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return 0 if any(defs and defs[-1].scope == "module" for defs in fixturedefs.values()) else 2


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA Hopper GPU (sm_90)")
    for item in items:
        if "gpu" in item.keywords and not _hopper():
            item.add_marker(skip)
    # The interpreter and compile tests (under a tenth of the tests, most of the CPU suite's
    # time, single tests of minutes) run last, each folder's in its order: pytest-xdist's
    # load scheduling hands each worker a long run of the first tests at once and the rest
    # a few at a time, so the long tests are shared out as the workers free up. Played
    # through its scheduling with three runs' measured durations, the later worker finishes
    # within 2.5% of half the total time; in folder order, up to 10% after it, depending on
    # where the long tests fell.
    items.sort(key=_schedule_rank)


@pytest.fixture(autouse=True)
def _gpu_test_watchdog(request):
    if "gpu" not in request.node.keywords or GPU_TEST_TIMEOUT_S <= 0:
        yield
        return
    global _watchdog_log
    if _watchdog_log is None:
        folder = request.config.rootpath / ".pytest_cache"
        folder.mkdir(exist_ok=True)
        _watchdog_log = open(folder / f"gpu-test-timeout-{os.getpid()}.txt", "w")  # noqa: SIM115 (kept open)
    print(f"start (watchdog {GPU_TEST_TIMEOUT_S:.0f} s): {request.node.nodeid}", file=_watchdog_log, flush=True)
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True, file=_watchdog_log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class LaunchOverride:
    """`launch(forward=ForwardLaunch(...), backward=BackwardLaunch(...))` runs the rest of
    the test with those launches instead of the routing table's; `launch.clear()` goes
    back to the table."""

    def __init__(self):
        self._stack = contextlib.ExitStack()

    def __call__(self, **launches):
        from fp4attn import routing

        self._stack.enter_context(routing.override_launch(**launches))

    def clear(self):
        self._stack.close()
        self._stack = contextlib.ExitStack()


@pytest.fixture
def launch():
    override = LaunchOverride()
    yield override
    override.clear()
