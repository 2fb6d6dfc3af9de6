"""Run a command's cases in a child process under a time limit per case, so that a
kernel that hangs (a wait on a barrier that never completes) or crashes the process (an
illegal address, an abort in the driver) becomes one failed record instead of a frozen
terminal or a lost run.

`Watchdog.run(fn, *args, **kwargs)` calls `fn` ("module:function", importable, taking
and returning JSON values) in a worker process that imports torch and the kernels once
and runs case after case. The worker answers each case with one JSON line on a pipe of
its own (the case's own prints go to stderr). A case with no answer after `timeout_s`
seconds is a hang: the worker is killed (its GPU context with it) and the next case
starts a fresh one; so does a case whose worker died (a crash) or raised (the CUDA
context may be unusable after an error). The parent never imports torch for this.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from importlib import import_module

# the worker writes its answers to this file descriptor (its stdout at start, before
# fd 1 is pointed at stderr): a case that prints cannot break the protocol
_ANSWER_PREFIX = "fp4attn-watchdog-answer "


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit status {code}"


class Watchdog:
    """Cases in a reusable worker process, each under `timeout_s` seconds (its first
    call includes the worker's start and the kernels' first compile: give it room)."""

    def __init__(self, timeout_s: float, env: dict | None = None):
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout {timeout_s!r}: expected seconds > 0")
        self.timeout_s = float(timeout_s)
        self.env = env
        self._proc: subprocess.Popen | None = None
        self._answers: queue.Queue = queue.Queue()

    # -- worker lifetime
    def _start(self) -> None:
        self._answers = queue.Queue()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fp4attn.cli.watchdog"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None, text=True, env=self.env, bufsize=1)
        answers, out = self._answers, self._proc.stdout

        def read():
            for line in out:
                if line.startswith(_ANSWER_PREFIX):
                    answers.put(line[len(_ANSWER_PREFIX):])
            answers.put(None)  # end of the worker's output: it exited

        threading.Thread(target=read, daemon=True).start()

    def _stop(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the driver; the OS reaps it later
            pass
        return proc.returncode

    def close(self) -> None:
        """End the worker (no case runs after this)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # the worker's loop ends at end of input
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one case
    def run(self, fn: str, *args, **kwargs) -> tuple[str, object]:
        """("ok", the case's return value) or ("hang" | "crash" | "error", a sentence
        saying what happened). A hang, a crash or an error ends the worker."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        request = json.dumps({"fn": fn, "args": args, "kwargs": kwargs})
        t0 = time.monotonic()
        try:
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # the worker is gone: its end of output says so below
        try:
            line = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self._stop()
            return "hang", (f"no result after {self.timeout_s:.0f} s (a kernel that never finishes?); its process "
                            "was ended")
        if line is None:
            code = self._stop()
            return "crash", f"the process running it ended ({_describe_exit(code)}) after {time.monotonic() - t0:.1f} s"
        answer = json.loads(line)
        if answer["status"] == "ok":
            return "ok", answer["value"]
        self._stop()
        return "error", answer["error"]


def _worker() -> None:
    """The child's loop: one JSON request a line on stdin, one answer a line on the
    original stdout; everything the cases print goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        module, _, name = req["fn"].partition(":")
        try:
            value = getattr(import_module(module), name)(*req["args"], **req["kwargs"])
            answer = {"status": "ok", "value": value}
        except Exception as e:  # the parent records it as a failed case
            traceback.print_exc()
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            answer = {"status": "error", "error": f"raised {tb}"}
        answers.write(_ANSWER_PREFIX + json.dumps(answer) + "\n")


if __name__ == "__main__":
    _worker()
