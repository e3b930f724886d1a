"""A user's reward function (``reward=python``) as a contained process tree (real worker
processes): what it starts dies with it on every exit path (a timed-out call, ``close()``,
Ctrl-C, SIGTERM, ``sat`` killed outright), it has a memory limit, and what it returns must
be representable by the trainer (float32) and must not overwrite built-in metrics."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sat_cli.config import ConfigError, load
from sat_cli.rewards import FLOAT32_MAX, BadReward, build_reward, combine, reserved_components

REPO = Path(__file__).resolve().parent.parent

SPAWNING = """
import os, subprocess, time

def spawn(marker):
    # a plain child, and a daemon that leaves the session and is orphaned (a double fork)
    subprocess.Popen(["sleep", marker])
    subprocess.Popen(["sh", "-c", f"sleep {marker} &"], start_new_session=True).wait()

def hang(prompt, response, row):
    spawn(response)
    open(row["ready"], "w").close()
    time.sleep(300)

def leave(prompt, response, row):
    spawn(response)
    return 1.0

def hog(prompt, response, row):
    if response == "hog":
        x = bytearray(1 << 30)
    return 1.0
"""


def settings(fn: str, **kw):
    base = dict(name="python", fn=fn, batched=False, pattern=None, url=None, weights={})
    base |= dict(timeout_s=10.0, deadline_s=60.0, on_error=-1.0, max_error_frac=0.5)
    return SimpleNamespace(**{**base, "workers": 1, "memory_mb": 16384, **kw})


def marked(marker: str) -> list[int]:
    """Live ``sleep <marker>`` processes."""
    from sat_cli.util.procs import pid_alive

    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode()
        except OSError:
            continue
        if pid.isdigit() and cmd.split("\0")[:2] == ["sleep", marker] and pid_alive(int(pid)):
            found.append(int(pid))
    return found


def wait_started(marker: str, seconds: float = 10.0) -> int:
    """How many ``sleep <marker>`` run once both have (a forked child execs ``sleep`` a moment
    after its parent returned)."""
    deadline = time.monotonic() + seconds
    while len(marked(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(marked(marker))


def wait_gone(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # the test leaves nothing behind either way
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING)
    return path


def new_marker() -> str:
    return f"{secrets.randbelow(10**6) + 10**6}.25"


def test_a_timed_out_call_kills_everything_its_worker_started(user_file, tmp_path):
    scorer = build_reward(settings(f"{user_file}:hang", timeout_s=3.0), task=None)
    marker = new_marker()
    try:
        got = scorer.score(["p"], [marker], [{"ready": str(tmp_path / "r")}])
        assert got.errors == ["timed out after 3 s"]
        assert wait_gone(marker, 1.0) == []  # the daemon too, though it left the session
    finally:
        scorer.close()


def test_close_kills_what_a_finished_call_left_running(user_file):
    scorer = build_reward(settings(f"{user_file}:leave"), task=None)
    marker = new_marker()
    try:
        assert scorer.score(["p"], [marker], [{}]).values == [1.0]
        assert wait_started(marker) == 2  # they run until the worker stops
    finally:
        scorer.close()
    assert wait_gone(marker, 1.0) == []


def test_a_worker_has_a_memory_limit(user_file):
    scorer = build_reward(settings(f"{user_file}:hog", memory_mb=512), task=None)
    try:
        got = scorer.score(["p"] * 2, ["hog", "fine"], [{}] * 2)
        assert got.values == [-1.0, 1.0] and got.errors[0] == "MemoryError"
    finally:
        scorer.close()


RUN = """
import sys, time
from types import SimpleNamespace
from sat_cli.rewards import build_reward
from sat_cli.util.signals import orderly_stop

s = SimpleNamespace(name="python", fn=sys.argv[1], batched=False, pattern=None, url=None,
                    weights={}, timeout_s=300.0, deadline_s=600.0, on_error=0.0,
                    max_error_frac=0.5, workers=1, memory_mb=16384)
with orderly_stop():
    scorer = build_reward(s, task=None)
    try:
        scorer.score(["p"], [sys.argv[2]], [{"ready": sys.argv[3]}])
    finally:
        scorer.close()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopping_sat_stops_the_reward_tree(user_file, tmp_path, sig):
    """A process like ``sat train`` (its signal handling, the scorer closed in ``finally``),
    scoring with a reward that started a daemon and hangs, gets Ctrl-C, SIGTERM or SIGKILL
    (no ``finally`` runs: the worker's watchdog sees its parent gone)."""
    marker, ready = new_marker(), tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN, f"{user_file}:hang", marker, str(ready)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists() and wait_started(marker) == 2
        proc.send_signal(sig)
        proc.wait(timeout=15)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    assert wait_gone(marker, 3.0) == []


def test_values_the_trainer_cannot_hold_are_errors():
    assert combine(FLOAT32_MAX, {}) == (FLOAT32_MAX, {})
    assert combine({"a": -FLOAT32_MAX}, {}) == (-FLOAT32_MAX, {"a": -FLOAT32_MAX})
    for bad, why in [
        (1e39, "beyond float32"),
        (-3.5e38, "beyond float32"),
        (10**400, "too large for float32"),
        ({"a": 1e39}, "component 'a' is 1e\\+39, beyond float32"),
        ({"a": 3e38, "b": 3e38}, "summing to 6e\\+38, beyond float32"),
    ]:
        with pytest.raises(BadReward, match=why):
            combine(bad, {})
    with pytest.raises(BadReward, match="weighing"):
        combine({"a": 2e38}, {"a": 2.0})


def test_a_component_may_not_overwrite_a_built_in_metric():
    assert "error_frac" in reserved_components()  # reward/error_frac: the failure guard's input
    for key, why in [("error_frac", "built-in metric"), ("", "1-64"), ("a\x1b[2J", "printable")]:
        with pytest.raises(BadReward, match=why):
            combine({key: 0.0, "ok": 1.0}, {})
    with pytest.raises(ConfigError, match="reward.weights: 'error_frac' is a built-in metric"):
        load(["reward=python", "reward.fn=m:f", "+reward.weights.error_frac=1"])


@pytest.mark.parametrize("value", [0, 127, 1 << 21, "1g", True, 1.5])
def test_reward_memory_mb_is_bounded(value):
    with pytest.raises(ConfigError, match="reward.memory_mb"):
        load(["reward=python", "reward.fn=m:f", f"reward.memory_mb={value}"])


HOSTILE_RESULTS = """
def score(prompt, response, row):
    return {"huge": 1e39, "overwrite": {"error_frac": 0.0, "ok": 1.0}, "fine": 0.25}[response]
"""


def test_a_real_plugins_unrepresentable_result_is_refused_naming_the_plugin(tmp_path):
    """Through a real worker process: a reward of 1e39 (finite in Python, inf in float32) and a
    component named ``error_frac`` are that sample's errors, named after ``reward.fn``; the
    step's ``reward/error_frac`` (the failure guard's input) stays the real fraction."""
    from sat_cli import metric_names as M
    from sat_cli.loop.steps import reward_metrics

    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_RESULTS)
    scorer = build_reward(settings(f"{path}:score"), task=None)
    try:
        got = scorer.score(["p"] * 3, ["huge", "overwrite", "fine"], [{}] * 3)
    finally:
        scorer.close()
    assert got.values == [-1.0, -1.0, 0.25]
    assert got.errors[0] == (
        f"reward.fn={path}:score returned 1e+39, beyond float32 (the trainer's dtype)"
    )
    assert got.errors[1].startswith(f"reward.fn={path}:score component 'error_frac'")
    metrics: dict = {}
    reward_metrics(got, metrics)
    assert metrics[M.REWARD_ERROR_FRAC] == pytest.approx(2 / 3)
