"""The selftest's watchdog (fp4attn/cli/watchdog.py): a case that hangs, crashes its
process or raises becomes a failed outcome saying which, and the cases after it still
run (in a fresh worker); `fp4attn selftest` reports such a case as a FAIL row, writes
its JSON and exits 1 instead of freezing."""

import argparse
import json
import time

import pytest

from fp4attn.cli import selftest
from fp4attn.cli.watchdog import Watchdog


def test_hang_crash_and_error_are_outcomes_and_the_next_case_runs():
    with Watchdog(timeout_s=60) as dog:
        assert dog.run("builtins:abs", -2) == ("ok", 2)
        assert dog.run("builtins:divmod", 7, 2) == ("ok", [3, 1])  # JSON values back
        outcome, why = dog.run("math:sqrt", -1)
        assert outcome == "error" and "ValueError" in why, why
        outcome, why = dog.run("os:abort")
        assert outcome == "crash" and "SIGABRT" in why, why
        assert dog.run("builtins:abs", -3) == ("ok", 3)
        dog.timeout_s = 1.0
        t0 = time.monotonic()
        outcome, why = dog.run("time:sleep", 600)
        assert outcome == "hang" and "no result after 1 s" in why, why
        assert time.monotonic() - t0 < 30  # the stuck worker was killed, not waited for
        dog.timeout_s = 60
        assert dog.run("builtins:abs", -4) == ("ok", 4)


def test_a_case_printing_to_stdout_does_not_break_the_answers():
    with Watchdog(timeout_s=60) as dog:
        assert dog.run("builtins:print", "fp4attn-watchdog-answer {\"status\": \"error\"}") == ("ok", None)
        assert dog.run("builtins:abs", -5) == ("ok", 5)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="expected seconds > 0"):
        Watchdog(timeout_s=0)


def test_selftest_reports_a_hung_case_as_failed(monkeypatch, tmp_path, capsys):
    """`fp4attn selftest` as a Blackwell owner runs it, with one case that cannot finish
    within its limit (a forward check given 0.5 s, less than the worker needs to start):
    the table shows it as FAIL with the reason, the JSON is written, exit status 1."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selftest, "environment", lambda device: {"gpu": "none", "target": "cpu"})
    record = dict(recipe="directp", head_dim=64, causal="no", mask="none", direction="forward", keys=333)
    monkeypatch.setattr(selftest, "cases", lambda: [("check_forward", ("directp", 64, None, False), record)])
    out = tmp_path / "selftest.json"
    args = argparse.Namespace(json=out, no_timing=True, case_timeout=0.5, no_watchdog=False)
    with pytest.raises(SystemExit) as e:
        selftest.main(args)
    assert e.value.code == 1
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "FAIL" and rec["reason"].startswith("hang: no result after"), rec
    assert {k: rec[k] for k in record} == record
    assert "1 failed" in capsys.readouterr().out


def test_selftest_runs_each_recipe_past_its_cuda_key_count():
    """Every inference recipe that the Hopper routing hands to the CUDA C++ kernel from some
    key count has a forward case past that count, causal or not, at a length no tile divides;
    training recipes (whose forward never goes there) and the others keep the short rows."""
    from fp4attn import routing
    from fp4attn.recipes import PRESETS

    long = {(a[0], a[1], a[2]): a[3] for fn, a, rec in selftest.cases() if fn == "check_forward_long"}
    for name, recipe in PRESETS.items():
        for d in (64, 128):
            for causal in (None, "bottom_right"):
                launch = routing.forward_launch(d, recipe.fast_accum, causal is not None)
                n = launch.cuda_keys(routing.p_mode(recipe)) if recipe.grad is None else 0
                if n:
                    assert n < long[name, d, causal] and long[name, d, causal] % 64, (name, d, causal)
                else:
                    assert (name, d, causal) not in long
    assert long["directp-fast", 128, None] > routing.FORWARD_LAUNCH[128, False, False].cuda_keys(5)
    # a case runs as the selftest runs it: its arguments, then the device (here the CPU,
    # where the routing picks the reference)
    fn, args, rec = next(c for c in selftest.cases() if c[0] == "check_forward_long")
    got = selftest.run_case(None, fn, args, rec, "cpu")
    assert got["keys"] == rec["keys"] and got["status"] == "reference"
