"""Errors by type: every trainer failure is a ``TrainerError`` (exit 1, log tail, no traceback),
an engine that could not load its model an ``EngineStartError`` (exit 2, "cannot load the
model"); the CLI catches them by class, not by name or message text. The end-to-end case kills
the Megatron worker of a real `sat train trainer=megatron` run mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer

from sat_cli.cli.guard import guard as _guard
from sat_cli.commands.common import loading
from sat_cli.engines.base import EngineError, EngineStartError
from sat_cli.errors import RunFailed, TrainerError, UserError
from sat_cli.errors import without_tracebacks as _without_tracebacks
from sat_cli.models.r3 import R3Error
from sat_cli.trainers.megatron.client import MegatronWorkerError

LOG_TAIL = """megatron worker died during step (torchrun exit code 1); last lines of x.log:
step 3 started
[rank0]: Traceback (most recent call last):
[rank0]:   File "worker.py", line 10, in <module>
[rank0]:     main()
[rank0]:     ^^^^^^
[rank0]: RuntimeError: boom
torchrun: worker 1234 exited with signal SIGKILL"""


def test_hierarchy():
    for cls in (MegatronWorkerError, R3Error):
        assert issubclass(cls, TrainerError)
    assert issubclass(TrainerError, RunFailed) and issubclass(TrainerError, RuntimeError)
    assert TrainerError.code == 1
    assert issubclass(EngineStartError, EngineError)


def test_tracebacks_cut_to_their_exception_line():
    assert _without_tracebacks(LOG_TAIL).splitlines() == [
        "megatron worker died during step (torchrun exit code 1); last lines of x.log:",
        "step 3 started",
        "[rank0]: RuntimeError: boom",
        "torchrun: worker 1234 exited with signal SIGKILL",
    ]


def _raise(exc):
    def body():
        raise exc

    return body


def test_guard_catches_by_type(capsys):
    cases = [
        (MegatronWorkerError(LOG_TAIL), 1),
        (R3Error("routes missing"), 1),
        (EngineError("engine process 7 died"), 1),
        (UserError("bad input"), 2),
    ]
    for exc, code in cases:
        with pytest.raises(typer.Exit) as info:
            _guard(_raise(exc))
        assert info.value.exit_code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "[rank0]: RuntimeError: boom" in err
    with pytest.raises(KeyError):  # anything else is a bug: it keeps its traceback
        _guard(_raise(KeyError("x")))


def test_loading_tells_a_bad_model_from_a_dead_worker():
    with pytest.raises(UserError, match=r"cannot load the model at m: OSError: no config"):
        loading(
            "m",
            _raise(EngineStartError("engine failed during engine startup:\nOSError: no config")),
        )
    with pytest.raises(UserError, match=r"cannot load the model at m: ValueError: shapes"):
        loading("m", _raise(ValueError("shapes")))
    for exc in (MegatronWorkerError("megatron worker failed to start: x"), EngineError("died")):
        with pytest.raises(type(exc)):  # a runtime fault, never "cannot load the model"
            loading("m", _raise(exc))


def _tree(root: int) -> dict[int, bytes]:
    """Live processes below ``root`` and their command lines (from /proc)."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd[int(d.name)] = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if stat[0] != "Z":
            parent[int(d.name)] = int(stat[1])
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update({k: cmd[k] for k in kids})
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_megatron_worker_killed_mid_run_exits_1_with_log_tail(tmp_path):
    """SIGKILL of the worker ranks after the first checkpoint: `sat train` exits 1 within seconds
    with the worker's log tail and no traceback, and no process of the run is left."""
    pytest.importorskip("megatron.core")
    args = [
        "experiment=cpu_smoke",
        "task.prompts_per_step=2",
        "task.samples_per_prompt=2",
        "eval.every=0",
        "run.dir=runs",
        "run.name=r",
        "trainer=megatron",
        "max_steps=500",
        "checkpoint.every=1",
    ]
    err = tmp_path / "err.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "train", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=err.open("w"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs/sat/r/checkpoints").glob("step_1*")):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        below = _tree(proc.pid)  # engine, torchrun, worker ranks
        workers = [p for p, c in below.items() if b"sat_cli.trainers.megatron.worker" in c]
        assert workers, below
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(60)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = err.read_text()
    assert code == 1, text[-3000:]
    assert "Traceback" not in text
    assert "sat: error: megatron worker died during" in text
    assert "last lines of" in text and "megatron_trainer.log" in text
    time.sleep(1)
    assert not [p for p in below if _alive(p)]  # engine, torchrun and workers all ended
