"""Fault catalogue of `sat train` / `sat eval` (issue 10): processes really killed, stores really
down, checkpoint writes really failing, losses really non-finite.

Every run is a `python -m sat_cli.cli` subprocess in its own session (so the test can signal it
like a terminal or a scheduler would, and clean up whatever is left) on the embedded CPU default
(``experiment=cpu_smoke``, small batches, the shipped warm-started model). The run writes
``logs/pids.json`` (its own pid and the engine process's pid), which the tests use to kill the
engine and to check that no process outlives the run. For each fault the run either goes on or
stops within seconds with a clear message and the documented exit code (Ctrl-C 130, SIGTERM
143, runtime faults 1, bad input 2); the MLflow run ends KILLED/FAILED; the last complete
checkpoint stays loadable; and ``resume=auto`` continues with every step logged exactly once and
the same prompts per step as an uninterrupted run (``rollout/prompt_digest``, computed here from
the task itself).

SIGKILL of the whole run followed by resume is covered by
``tests/test_train_cli.py::test_sigkill_then_resume_matches_uninterrupted_run``; here the
orchestrator alone is SIGKILLed to show that its engine does not outlive it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import fs_faults
import pytest
from cli_helpers import run_sat, seeded_store

SMALL = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.every=0",
    "run.dir=runs",
]


# ----------------------------------------------------------------------------- helpers


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def sat(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_sat(*args, cwd=cwd, timeout=timeout)


class Run:
    """A `sat` subprocess in its own session, output in files, killed at the end of the test."""

    def __init__(self, cwd: Path, *args: str, name: str = "run"):
        self.cwd = cwd
        self.out = cwd / f"{name}.out"
        self.err = cwd / f"{name}.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sat_cli.cli", *args],
            cwd=cwd,
            env=_env(),
            stdout=self.out.open("w"),
            stderr=self.err.open("w"),
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for r in started:
        r.cleanup()


def wait_for(pred, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Live processes below ``pid`` (from /proc/*/stat parent links)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(d.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def pids(run_dir: Path) -> dict:
    p = run_dir / "logs" / "pids.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def assert_gone(pid_list, timeout: float = 15.0) -> None:
    wait_for(lambda: not any(alive(p) for p in pid_list), timeout, f"processes {pid_list} to end")


def client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}")


def mlflow_run(root: Path, name: str, experiment: str = "sat"):
    c = client(root)
    exp = c.get_experiment_by_name(experiment)
    (run,) = [r for r in c.search_runs([exp.experiment_id]) if r.info.run_name == name]
    return run


def history(root: Path, run, key: str) -> list[tuple[int, float]]:
    pts = client(root).get_metric_history(run.info.run_id, key)
    return sorted((m.step, m.value) for m in pts)


def expected_digests(steps: int, overrides: list[str]) -> list[tuple[int, float]]:
    """``rollout/prompt_digest`` of steps 1..steps, from the task the run builds (batch t is
    logged at step t+1): an uninterrupted run's prompts, without running it."""
    from sat_cli.build.parts import build_task
    from sat_cli.config import load
    from sat_cli.loop.train import _digest

    _, obj = load(overrides)
    task = build_task(obj)
    n = obj.task.prompts_per_step
    return [
        (t + 1, _digest([r["prompt"] for r in task.sample_prompts(n, cursor=t * n)]))
        for t in range(steps)
    ]


def assert_checkpoint_loadable(ckpt_root: Path) -> Path:
    """The latest complete checkpoint: readable loop state, finite safetensors weights, no
    temporary folders left behind."""
    from safetensors.torch import load_file

    from sat_cli.checkpoints.state import latest_checkpoint, read_loop_state

    assert not list(ckpt_root.glob(".step_*")), list(ckpt_root.glob(".step_*"))
    ck = latest_checkpoint(ckpt_root)
    assert ck is not None, f"no complete checkpoint in {ckpt_root}"
    st = read_loop_state(ck)
    assert st["step"] == int(ck.name.split("_")[1])
    w = load_file(str(ck / "trainer" / "model" / "model.safetensors"))
    assert w and all(bool(t.isfinite().all()) for t in w.values())
    opt = load_file(str(ck / "trainer" / "optimizer.safetensors"))
    assert "rng/torch" in opt
    return ck


def assert_resume_exact(root: Path, args: list[str], name: str, steps: int) -> None:
    """``resume=auto`` finishes the run; MLflow holds every step once with the prompts of an
    uninterrupted run."""
    out = sat("train", *args, "resume=auto", cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "resuming from step_" in out.stdout
    run = mlflow_run(root, name)
    assert run.info.status == "FINISHED"
    digests = history(root, run, "rollout/prompt_digest")
    assert [s for s, _ in digests] == list(range(1, steps + 1))  # no step lost or repeated
    assert digests == expected_digests(steps, [a for a in args if not a.startswith("resume")])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- default tests


def test_mlflow_unreachable_at_start_exits_2_quickly(tmp_path):
    """tracking.uri on a closed port: exit 2 with the URI and the fix, before any engine or
    trainer starts, and nothing but the (empty) run directory written."""
    port = closed_port()
    t0 = time.monotonic()
    out = sat(
        "train",
        *SMALL,
        "run.name=nostore",
        f"tracking.uri=http://user:PW123@127.0.0.1:{port}",
        cwd=tmp_path,
        timeout=300,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert f"cannot use the MLflow tracking store at http://user:***@127.0.0.1:{port}" in out.stderr
    assert "tracking.uri=none" in out.stderr and "PW123" not in out.stderr + out.stdout
    run_dir = tmp_path / "runs/sat/nostore"
    assert pids(run_dir) == {}  # no engine was started
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "weights").exists()
    assert elapsed < 120, elapsed  # ~10 s under load: 3.7 s imports, 0.4 s the refused connection


def test_sigterm_during_training_exits_143_killed(tmp_path, runs):
    """SIGTERM to the orchestrator alone while it trains: exit 143 within seconds, MLflow run
    KILLED, engine process gone, last checkpoint loadable. The run also carries a password URI
    in its config: the stored params mask it (engine.extra_args, SGLang's own, is masked in
    test_bad_input's secrets test)."""
    args = [
        *SMALL,
        "max_steps=400",
        "checkpoint.every=2",
        "run.name=term",
        "data.dir=https://user:DATAPW@example.org/d",
    ]
    seeded_store(tmp_path / "runs" / "mlflow.db")
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/term"
    ready = lambda: (run_dir / "checkpoints/step_2").is_dir() or r.proc.poll() is not None  # noqa: E731
    wait_for(ready, 300, "the first checkpoint")
    assert r.proc.poll() is None, r.stderr[-3000:]  # a refused run fails here, not at 300 s
    p = pids(run_dir)
    assert p["orchestrator"] == r.pid and alive(p["engine"])
    children = descendants(r.pid)
    assert p["engine"] in children
    t0 = time.monotonic()
    os.kill(r.pid, signal.SIGTERM)
    code = r.wait(60)
    assert code == 143, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert "sat: interrupted (SIGTERM)" in r.stderr and "Traceback" not in r.stderr
    assert_gone(children)
    assert_checkpoint_loadable(run_dir / "checkpoints")
    run = mlflow_run(tmp_path, "term")
    assert run.info.status == "KILLED"
    assert run.data.params["data.dir"] == "https://user:***@example.org/d"
    assert "DATAPW" not in json.dumps(run.data.params)


# ----------------------------------------------------------------------------- slow tests


@pytest.mark.slow
def test_engine_sigkill_mid_generation_stops_then_resumes(tmp_path, runs):
    """SIGKILL of the engine process while it generates: the run stops within seconds with
    exit 1 naming the dead engine (MLflow FAILED), nothing is left running, and resume=auto
    finishes with every step once and the prompts of an uninterrupted run."""
    args = [*SMALL, "max_steps=10", "checkpoint.every=2", "checkpoint.keep=5", "run.name=ek"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/ek"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    engine = pids(run_dir)["engine"]
    children = descendants(r.pid)
    t0 = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    code = r.wait(60)
    assert code == 1, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert f"engine process {engine} died" in r.stderr and "Traceback" not in r.stderr
    assert_gone(children)
    assert mlflow_run(tmp_path, "ek").info.status == "FAILED"
    assert_checkpoint_loadable(run_dir / "checkpoints")
    assert_resume_exact(tmp_path, args, "ek", 10)


@pytest.mark.slow
def test_orchestrator_sigkill_leaves_no_engine_behind(tmp_path, runs):
    """SIGKILL of the orchestrator alone (not its process group): its engine process notices
    the closed pipe and exits by itself within seconds (no orphan)."""
    args = [*SMALL, "max_steps=400", "checkpoint.every=2", "run.name=ok"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/ok"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    children = descendants(r.pid)
    assert pids(run_dir)["engine"] in children
    os.kill(r.pid, signal.SIGKILL)
    assert r.wait(30) == -signal.SIGKILL
    assert_gone(children, timeout=30)
    assert_checkpoint_loadable(run_dir / "checkpoints")


@pytest.mark.slow
def test_ctrl_c_during_training_exits_130_then_resumes(tmp_path, runs):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group, engine included):
    exit 130, MLflow KILLED, nothing left running; resume=auto continues exactly."""
    args = [*SMALL, "max_steps=12", "checkpoint.every=2", "checkpoint.keep=8", "run.name=ci"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/ci"
    wait_for(lambda: (run_dir / "checkpoints/step_4").is_dir(), 300, "the second checkpoint")
    children = descendants(r.pid)
    t0 = time.monotonic()
    os.killpg(r.pid, signal.SIGINT)
    assert r.wait(60) == 130, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert "sat: interrupted" in r.stderr
    assert_gone(children)
    assert mlflow_run(tmp_path, "ci").info.status == "KILLED"
    assert_checkpoint_loadable(run_dir / "checkpoints")
    assert_resume_exact(tmp_path, args, "ci", 12)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_while_writing_a_checkpoint(tmp_path, runs, sig):
    """The signal lands while ``checkpoints/.step_N.tmp-*`` is being written (polled for): the
    half-written folder is removed, the previous checkpoint is intact and resume=auto is exact."""
    name = f"cw{int(sig)}"
    args = [*SMALL, "max_steps=300", "checkpoint.every=1", "checkpoint.keep=3", f"run.name={name}"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    ck = tmp_path / f"runs/sat/{name}/checkpoints"

    def writing():
        try:
            return any(n.startswith(".step_") for n in os.listdir(ck))
        except OSError:
            return False

    wait_for(lambda: (ck / "step_2").is_dir(), 300, "the first checkpoints")
    children = descendants(r.pid)
    wait_for(writing, 120, "a checkpoint write in progress", poll=0.001)
    if sig == signal.SIGINT:
        os.killpg(r.pid, sig)
    else:
        os.kill(r.pid, sig)
    assert r.wait(60) == (130 if sig == signal.SIGINT else 143), r.stderr[-3000:]
    assert_gone(children)
    last = assert_checkpoint_loadable(ck)
    steps = int(last.name.split("_")[1]) + 2
    resume_args = [a if not a.startswith("max_steps") else f"max_steps={steps}" for a in args]
    out = sat("train", *resume_args, "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    digests = history(tmp_path, mlflow_run(tmp_path, name), "rollout/prompt_digest")
    assert [s for s, _ in digests[:steps]] == list(range(1, steps + 1))
    assert digests[:steps] == expected_digests(steps, args)


@pytest.mark.slow
def test_sigterm_during_in_training_evaluation(tmp_path, runs):
    """SIGTERM while the initial evaluation runs (eval.at_start, many samples): exit 143 and
    KILLED, nothing left running."""
    args = [
        *SMALL[:-2],
        "eval.every=2",
        "eval.at_start=true",
        "eval.n=64",
        "run.dir=runs",
        "max_steps=4",
        "run.name=ev",
    ]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/ev"
    wait_for(lambda: pids(run_dir), 300, "the engine to start")
    time.sleep(2.0)  # inside the start evaluation (64 samples x the held-out set)
    assert not (run_dir / "checkpoints").exists()
    children = descendants(r.pid)
    os.kill(r.pid, signal.SIGTERM)
    assert r.wait(60) == 143, r.stderr[-3000:]
    assert_gone(children)
    assert mlflow_run(tmp_path, "ev").info.status == "KILLED"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_during_sat_eval_keeps_partial_results(tmp_path, runs, sig):
    """`sat eval toy` interrupted: exit 130/143, the finished problems written and marked
    incomplete, the MLflow eval run KILLED."""
    r = Run(tmp_path, "eval", "toy", "eval.n=64", "eval.batch_size=8", "run.dir=runs")
    runs.append(r)
    wait_for(lambda: "samples per problem" in r.stdout, 300, "the evaluation to start")
    time.sleep(3.0)
    (out,) = list((tmp_path / "runs/eval").iterdir())
    engine = pids(out)["engine"]
    children = descendants(r.pid)
    assert engine in children
    if sig == signal.SIGINT:
        os.killpg(r.pid, sig)
    else:
        os.kill(r.pid, sig)
    assert r.wait(60) == (130 if sig == signal.SIGINT else 143), r.stderr[-3000:]
    assert "INCOMPLETE" in r.stdout
    assert_gone(children)
    summary = json.loads(next(out.glob("*summary*.json")).read_text())
    assert summary["complete"] is False
    (run,) = client(tmp_path).search_runs(
        [client(tmp_path).get_experiment_by_name("eval").experiment_id]
    )
    assert run.info.status == "KILLED"


@pytest.mark.slow
def test_checkpoint_write_failure_stops_with_exit_1_then_resumes(tmp_path, runs):
    """A checkpoint that cannot be written — ``checkpoints/step_4`` is a regular file, which
    stops root as well as anyone (rmtree/rename of a file where a folder must go): exit 1 with
    a message naming the checkpoint and the last good one; step_2 intact; once the file is
    removed, resume=auto finishes exactly."""
    args = [*SMALL, "max_steps=6", "checkpoint.every=2", "checkpoint.keep=5", "run.name=dw"]
    ck = tmp_path / "runs/sat/dw/checkpoints"
    ck.mkdir(parents=True)
    (ck / "step_4").write_text("not a folder")
    out = sat("train", *args, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "cannot write checkpoint" in out.stderr and "step_4" in out.stderr
    assert "NotADirectoryError" in out.stderr and "last complete checkpoint" in out.stderr
    assert "Traceback" not in out.stderr
    assert assert_checkpoint_loadable(ck).name == "step_2"
    assert mlflow_run(tmp_path, "dw").info.status == "FAILED"
    engine = pids(tmp_path / "runs/sat/dw")["engine"]
    assert not alive(engine)
    (ck / "step_4").unlink()
    assert_resume_exact(tmp_path, args, "dw", 6)


NAN_ARGS = [
    *SMALL,
    "max_steps=4",
    "lag=8",  # the engine keeps the initial weights; only the trainer's loss goes bad
    "trainer.lr=1e30",  # one Adam step moves weights by ~1e30: the next forward overflows
    "trainer.grad_clip=0",
    "checkpoint.every=1",
]


@pytest.mark.slow
def test_persistent_nonfinite_loss_stops_cleanly(tmp_path):
    """A real non-finite loss (lr=1e30: one update wrecks the weights, every later forward is
    NaN). The trainer skips each non-finite update and the loop counts it; after
    MAX_CONSECUTIVE_NONFINITE skipped steps in a row it stops with exit 1, naming the step and
    the last complete checkpoint, which stays loadable; the MLflow run is FAILED."""
    import re

    from sat_cli.loop.train import MAX_CONSECUTIVE_NONFINITE as K

    args = [a for a in NAN_ARGS if not a.startswith("max_steps=")] + ["max_steps=20"]
    out = sat("train", *args, "run.name=nan", cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    m = re.search(r"sat: error: non-finite loss at step (\d+) \(loss/", out.stderr)
    assert m, out.stderr[-3000:]
    stop = int(m.group(1))
    assert f"{K} non-finite steps in a row" in out.stderr
    assert "Traceback" not in out.stderr
    ck = assert_checkpoint_loadable(tmp_path / "runs/sat/nan/checkpoints")
    assert ck.name == f"step_{stop - 1}"  # nothing of the stopping step was saved
    assert f"Last complete checkpoint: runs/sat/nan/checkpoints/step_{stop - 1}." in out.stderr
    run = mlflow_run(tmp_path, "nan")
    assert run.info.status == "FAILED"
    counts = history(tmp_path, run, "loss/nonfinite_steps")
    first_bad = stop - K + 1
    assert counts == [(s, 0.0) for s in range(1, first_bad)] + [
        (s, float(s - first_bad + 1)) for s in range(first_bad, stop + 1)
    ]


@pytest.mark.slow
def test_nonfinite_loss_is_skipped_and_counted(tmp_path):
    out = sat("train", *NAN_ARGS, "run.name=nanskip", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = mlflow_run(tmp_path, "nanskip")
    last_step, count = history(tmp_path, run, "loss/nonfinite_steps")[-1]
    assert last_step == 4 and count >= 1.0
    assert_checkpoint_loadable(tmp_path / "runs/sat/nanskip/checkpoints")


def _serve(db: Path, port: int, log: Path) -> subprocess.Popen:
    from sat_cli.tracking import ui_command

    proc = subprocess.Popen(
        ui_command(f"sqlite:///{db}", port=port),
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def healthy():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(healthy, 180, "the mlflow server", poll=0.5)
    return proc


@pytest.mark.slow
def test_mlflow_server_dies_mid_run_training_finishes(tmp_path, runs):
    """The MLflow server is killed after the first checkpoint: training goes on (one warning,
    metrics buffered), finishes with exit 0 and complete checkpoints; the points logged before
    the outage are in the store. The outage never recovers during the run, so the run's final
    status is kept in the run.dir and set by the next command once the server is back."""
    db, port = tmp_path / "server" / "mlflow.db", closed_port()
    db.parent.mkdir()
    server = _serve(db, port, tmp_path / "server.log")
    try:
        args = [*SMALL, "max_steps=30", "checkpoint.every=2", "run.name=md"]
        r = Run(tmp_path, "train", *args, f"tracking.uri=http://127.0.0.1:{port}")
        runs.append(r)
        run_dir = tmp_path / "runs/sat/md"
        wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    assert r.wait(600) == 0, r.stderr[-3000:]
    assert "unreachable" in r.stderr and "training continues" in r.stderr
    assert "done: 30 steps" in r.stdout
    assert_checkpoint_loadable(run_dir / "checkpoints")
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = c.search_runs([c.get_experiment_by_name("sat").experiment_id])
    steps = [m.step for m in c.get_metric_history(run.info.run_id, "rollout/prompt_digest")]
    assert steps and steps == list(range(1, len(steps) + 1)) and math.isfinite(len(steps))
    # the outage never recovered during the run: its final status waits in the run.dir ...
    assert run.info.status == "RUNNING"
    (pending,) = (tmp_path / "runs/.mlflow_pending").glob("*.json")
    assert json.loads(pending.read_text())["status"] == "FINISHED"
    assert "set in the store by the next sat command" in r.stdout + r.stderr
    # ... and the next command that reaches the store sets it
    server = _serve(db, port, tmp_path / "server.log")
    try:
        uri = f"tracking.uri=http://127.0.0.1:{port}"
        out = sat("eval", "toy", "eval.n=1", "eval.limit=2", "run.dir=runs", uri, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "applied 1 pending MLflow final status" in out.stdout + out.stderr
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    assert c.get_run(run.info.run_id).info.status == "FINISHED"
    assert not pending.exists()


@pytest.mark.slow
def test_soak_short_run_memory_stays_flat(tmp_path):
    """bench/soak.py on 60 steps: both processes sampled every 0.2 s, the run exits 0 and
    neither the orchestrator's nor the engine's RSS grows by more than 10 % after warm-up."""
    repo = Path(__file__).resolve().parents[1]
    report = tmp_path / "soak.json"
    out = subprocess.run(
        [
            sys.executable,
            str(repo / "bench" / "soak.py"),
            "--steps=60",
            "--interval=0.2",  # >= 10 samples even when 60 steps take only a few seconds
            "--checkpoint-every=10",
            "--eval-every=20",
            f"--run-dir={tmp_path / 'soak'}",
            f"--out={report}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=repo,
        env=_env(),
    )
    rep = json.loads(report.read_text())
    assert rep["exit_code"] == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for role in ("orchestrator", "engine"):
        p = rep["processes"][role]
        assert p["samples"] >= 10, p
        rss = [kb for _, kb in p["series"]]
        assert (
            p["peak_rss_mib"] == round(max(rss) / 1024, 1) and p["vm_hwm_mib"] >= p["peak_rss_mib"]
        )
        assert p["growth"] <= 0.10, (role, p["baseline_rss_mib"], p["final_rss_mib"])
    assert rep["pass"] and out.returncode == 0
    assert (tmp_path / "soak/sat/soak/checkpoints/step_60/loop_state.json").is_file()


# ----------------------------------------------------------------------------- issue 16


def run_dir_files(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _flip_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(b)


@pytest.mark.slow
def test_sighup_stops_like_sigterm(tmp_path, runs):
    """A closed terminal (SIGHUP to the whole process group, engine included): the same orderly
    stop as SIGTERM — exit 129, MLflow KILLED, no process left, the last checkpoint loadable,
    the run folder's lock released."""
    args = [*SMALL, "max_steps=400", "checkpoint.every=2", "run.name=hup"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/hup"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    children = descendants(r.pid)
    assert pids(run_dir)["engine"] in children
    t0 = time.monotonic()
    os.killpg(r.pid, signal.SIGHUP)
    assert r.wait(60) == 129, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert "sat: interrupted (SIGHUP)" in r.stderr and "Traceback" not in r.stderr
    assert_gone(children)
    assert mlflow_run(tmp_path, "hup").info.status == "KILLED"
    assert_checkpoint_loadable(run_dir / "checkpoints")
    assert not (run_dir / ".sat.lock").exists()


@pytest.mark.slow
def test_second_live_run_of_a_folder_is_refused(tmp_path, runs):
    """Two `sat train` with one run.name at once: the second exits 2 naming the first (its pid)
    and writes nothing — the folder keeps the first run's config (seed 1), every checkpoint the
    first run's MLflow id, and the store one run."""
    r = Run(
        tmp_path, "train", *SMALL, "max_steps=400", "checkpoint.every=2", "seed=1", "run.name=tw"
    )
    runs.append(r)
    run_dir = tmp_path / "runs/sat/tw"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    config = (run_dir / "config.yaml").read_bytes()
    config_stat = (run_dir / "config.yaml").stat().st_mtime_ns
    for extra in ([], ["resume=auto"]):
        out = sat("train", *SMALL, "max_steps=3", "seed=2", "run.name=tw", *extra, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        assert f"run folder runs/sat/tw is in use by pid {r.pid}" in out.stderr
        assert "Traceback" not in out.stderr
    assert (run_dir / "config.yaml").read_bytes() == config and b"seed: 1" in config
    assert (run_dir / "config.yaml").stat().st_mtime_ns == config_stat
    os.kill(r.pid, signal.SIGTERM)
    assert r.wait(60) == 143
    run = mlflow_run(tmp_path, "tw")  # exactly one run of that name
    from sat_cli.checkpoints.state import list_checkpoints, read_loop_state

    assert_checkpoint_loadable(run_dir / "checkpoints")
    ids = {
        read_loop_state(p)["mlflow_run_id"] for _, p in list_checkpoints(run_dir / "checkpoints")
    }
    assert ids == {run.info.run_id}


@pytest.mark.slow
def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path, runs):
    """A run SIGKILLed (its lock file left behind, naming a dead pid) is continued by
    resume=auto: the stale lock is recognised by its pid and taken over."""
    args = [*SMALL, "max_steps=400", "checkpoint.every=2", "run.name=st"]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/st"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    os.killpg(r.pid, signal.SIGKILL)
    r.wait(30)
    rec = json.loads((run_dir / ".sat.lock").read_text())
    assert rec["pid"] == r.pid and not alive(r.pid)
    step = int(assert_checkpoint_loadable(run_dir / "checkpoints").name.split("_")[1])
    resume = [a for a in args if not a.startswith("max_steps")] + [f"max_steps={step + 1}"]
    out = sat("train", *resume, "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"taking over the stale lock of pid {r.pid}" in out.stdout
    assert not (run_dir / ".sat.lock").exists()


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """A byte flipped in the newest checkpoint's weights: resume=auto reports it, moves it aside
    and continues from the previous complete checkpoint; every step once, the prompts of an
    uninterrupted run, the MLflow run FINISHED."""
    args = [*SMALL, "checkpoint.every=1", "checkpoint.keep=5", "run.name=fb"]
    out = sat("train", *args, "max_steps=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ck = tmp_path / "runs/sat/fb/checkpoints"
    _flip_byte(ck / "step_4" / "trainer" / "model" / "model.safetensors")
    out = sat("train", *args, "max_steps=6", "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "checkpoint runs/sat/fb/checkpoints/step_4 is damaged (trainer/model/model.safetensors"
        in (out.stdout)
    )
    assert "does not match its SHA-256" in out.stdout and "resuming from step_3" in out.stdout
    assert (ck / "damaged_step_4").is_dir()
    run = mlflow_run(tmp_path, "fb")
    assert run.info.status == "FINISHED"
    digests = history(tmp_path, run, "rollout/prompt_digest")
    assert digests == expected_digests(6, [*args, "max_steps=6"])


def _small_run_dir(fsfault, tmp_path: Path, size: int, rlimit: int | None = None):
    """A run.dir on a file system of ``size`` bytes and an MLflow store beside it (not on it);
    without mount rights, files of the child limited to ``rlimit`` bytes instead."""
    disk = tmp_path / "disk"
    kind, preexec = fsfault.small_disk(disk, size, rlimit)
    store = f"tracking.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    args = [a for a in SMALL if not a.startswith("run.dir")] + [f"run.dir={disk}", store]
    return disk, args, preexec


def _store_run(tmp_path: Path, name: str):
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    (run,) = [
        r
        for r in c.search_runs([c.get_experiment_by_name("sat").experiment_id])
        if r.info.run_name == name
    ]
    return run


def _sat_with(preexec, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=_env(),
        preexec_fn=preexec,
    )


@pytest.mark.slow
def test_disk_full_while_publishing_weights(tmp_path, fsfault):
    """The run folder's disk is full when the first weights are published: exit 1 with one line
    naming the weights folder and the OS error, no traceback, MLflow FAILED, the lock released,
    no process left."""
    disk, args, preexec = _small_run_dir(fsfault, tmp_path, 2 << 20)
    out = _sat_with(preexec, "train", *args, "max_steps=4", "run.name=wf", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("sat: error:")]
    assert re.search(rf"cannot publish weights v0 to .*/wf/weights: {fs_faults.DISK_FULL}", line)
    assert _store_run(tmp_path, "wf").info.status == "FAILED"
    assert not (disk / "sat/wf/.sat.lock").exists()
    engine = pids(disk / "sat/wf").get("engine")
    assert engine and not alive(engine)


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint(tmp_path, fsfault):
    """Room for the weights but not for the checkpoint: exit 1 naming the checkpoint, its
    temporary folder removed, MLflow FAILED."""
    disk, args, preexec = _small_run_dir(fsfault, tmp_path, 14 << 20, rlimit=6 << 20)
    out = _sat_with(
        preexec, "train", *args, "max_steps=6", "checkpoint.every=2", "run.name=cf", cwd=tmp_path
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert re.search(
        rf"sat: error: cannot write checkpoint .*/cf/checkpoints/step_2: \w+: {fs_faults.DISK_FULL}",
        out.stderr,
    )
    assert not list((disk / "sat/cf/checkpoints").glob(".step_*"))
    assert _store_run(tmp_path, "cf").info.status == "FAILED"


@pytest.mark.slow
def test_disk_full_while_writing_eval_results(tmp_path, fsfault):
    """`sat eval` whose results do not fit: exit 1 naming the results folder, no traceback, the
    MLflow eval run FAILED."""
    disk = tmp_path / "disk"
    kind, preexec = fsfault.small_disk(disk, 32 << 10)
    if kind != "tmpfs":  # a 32 KiB file-size limit would stop the MLflow store first
        pytest.skip("needs a real small file system (tmpfs: root with mount rights)")
    store = f"tracking.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    out = _sat_with(preexec, "eval", "toy", "eval.n=1", f"run.dir={disk}", store, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert re.search(
        rf"sat: error: cannot write the evaluation results to .*/eval/toy-\S+: {fs_faults.DISK_FULL}",
        out.stderr,
    )
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("eval").experiment_id])
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_full_store_disk_keeps_the_final_status_for_later(tmp_path, fsfault):
    """The MLflow store's disk fills up mid-run (histogram images every step): training goes on
    and exits 0; the status that could not be written is kept in
    ``<run.dir>/.mlflow_pending/`` and set in the store by the next command once there is room
    (the disk grown here), so the run does not stay RUNNING."""
    disk = tmp_path / "store"
    kind, _ = fsfault.small_disk(disk, 1536 << 10)
    if kind != "tmpfs":
        pytest.skip("needs a real small file system (tmpfs: root with mount rights)")
    store = f"tracking.uri=sqlite:///{disk / 'mlflow.db'}"
    args = [*SMALL, "max_steps=20", "tracking.histogram_every=1", "run.name=sf", store]
    out = sat("train", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    pending = list((tmp_path / "runs/.mlflow_pending").glob("*.json"))
    assert len(pending) == 1, out.stderr[-3000:]
    rec = json.loads(pending[0].read_text())
    assert rec["status"] == "FINISHED" and "uri" not in rec
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    out = sat("eval", "toy", "eval.n=1", "eval.limit=2", "run.dir=runs", store, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "applied 1 pending MLflow final status" in out.stderr + out.stdout
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{disk / 'mlflow.db'}")
    assert c.get_run(rec["run_id"]).info.status == "FINISHED"
    assert not pending[0].exists()


@pytest.mark.slow
def test_sweep_jobs_2_uses_the_shipped_warm_start(tmp_path, runs):
    """`sat sweep --jobs 2` on a fresh run.dir prepares the warm start exactly as `--jobs 1` (and
    `sat train`) does — the shipped checkpoint — instead of training it from scratch."""
    (tmp_path / "s.yaml").write_text(
        "name: wj\nbase: [experiment=cpu_smoke, max_steps=1, eval.every=0, "
        "task.prompts_per_step=2, task.samples_per_prompt=2]\naxes: {lag: '0,1'}\n"
        "methods:\n  A: [algo=grpo]\nseeds: [0]\n"
    )
    r = Run(tmp_path, "sweep", "s.yaml", "run.dir=runs", "--jobs", "2")
    runs.append(r)
    log = tmp_path / "runs/wj/logs/pretrain.log"
    wait_for(lambda: log.is_file() and "warm start:" in log.read_text(), 300, "the warm start")
    text = log.read_text()
    assert "using the shipped checkpoint" in text and "training the tiny model" not in text
    assert r.wait(600) == 0, r.stdout[-3000:]
    assert not list((tmp_path / "runs").glob("cache/tiny_moe_warm-*"))


@pytest.mark.slow
def test_megatron_run_leaves_nothing_in_tmp(tmp_path):
    """`sat train trainer=megatron`: torchrun's log folder lives in the run folder and is removed
    at the end; the temporary directory gets no torchelastic_* folder."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**_env(), "TMPDIR": str(tmp)}
    out = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "train", *SMALL, "trainer=megatron", "max_steps=1"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())
    assert not list((tmp_path / "runs").glob("sat/*/megatron/torchelastic"))


@pytest.mark.slow
def test_finished_run_extended_with_a_larger_max_steps(tmp_path):
    """Found by the hostile pass: `resume=auto max_steps=5` over a finished 3-step run failed at
    step 5 (the weights of its last step were never published, the engine could not load them).
    Now the run goes on to step 5: every step once, checkpoints before the end not marked
    finished, the MLflow run FINISHED."""
    from sat_cli.checkpoints.state import read_loop_state

    args = [*SMALL, "checkpoint.every=1", "checkpoint.keep=5", "run.name=ex"]
    assert sat("train", *args, "max_steps=3", cwd=tmp_path).returncode == 0
    out = sat("train", *args, "max_steps=5", "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ck = tmp_path / "runs/sat/ex/checkpoints"
    assert read_loop_state(ck / "step_4")["finished"] is False
    assert read_loop_state(ck / "step_5")["finished"] is True
    run = mlflow_run(tmp_path, "ex")
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(tmp_path, run, "rollout/prompt_digest")] == [1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- issue 32


def _store_steps(db: Path, name: str, key: str = "rollout/prompt_digest") -> list[int]:
    """The steps of ``key`` in run ``name`` of the store (none before the run exists)."""
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = c.get_experiment_by_name("sat")
    found = (
        [r for r in c.search_runs([exp.experiment_id]) if r.info.run_name == name] if exp else []
    )
    assert len(found) <= 1, found
    if not found:
        return []
    return sorted(m.step for m in c.get_metric_history(found[0].info.run_id, key))


@pytest.mark.slow
def test_mlflow_server_stopped_30_s_mid_run_every_step_lands(tmp_path, runs):
    """The MLflow server is stopped for 30 s once step 3 is in the store and started again on
    the same store: training goes on, the points of the outage wait on disk
    (``runs/.mlflow_pending/<run>.metrics.jsonl``) and reach the store once it answers, so every
    step's metrics are there — none lost, none twice."""
    db, port = tmp_path / "server" / "mlflow.db", closed_port()
    db.parent.mkdir()
    server = _serve(db, port, tmp_path / "server.log")
    args = [*SMALL, "max_steps=300", "checkpoint.every=50", "run.name=ot"]
    uri = [f"tracking.uri=http://127.0.0.1:{port}", "tracking.retry_interval_s=2"]
    r = Run(tmp_path, "train", *args, *uri)
    runs.append(r)
    try:
        wait_for(lambda: _store_steps(db, "ot")[-1:] >= [3], 300, "step 3 in the store", poll=1)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        time.sleep(30)
        server = _serve(db, port, tmp_path / "server.log")
        assert r.wait(900) == 0, r.stderr[-3000:]
        assert "unreachable" in r.stderr and "Traceback" not in r.stderr
        spooled = list((tmp_path / "runs/.mlflow_pending").glob("*.metrics.jsonl"))
        if spooled:  # the run ended before the server was back: the next command sends them
            out = sat(
                "eval", "toy", "eval.n=1", "eval.limit=2", "run.dir=runs", uri[0], cwd=tmp_path
            )
            assert out.returncode == 0, out.stderr[-3000:]
        else:  # the run itself sent them once the server answered again
            assert "reachable again" in r.stderr and "kept on disk during the outage" in r.stderr
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    assert _store_steps(db, "ot") == list(range(1, 301))
    assert not list((tmp_path / "runs/.mlflow_pending").glob("*.metrics.jsonl"))


@pytest.mark.slow
def test_outage_past_the_timeout_stops_with_a_resumable_checkpoint(tmp_path, runs):
    """The server does not come back within tracking.outage_timeout_s: the run writes a
    checkpoint and stops (exit 1, one line saying where the metrics wait and how to continue);
    with the server back, resume=auto sends the waiting points first and finishes the run, every
    step once."""
    db, port = tmp_path / "server" / "mlflow.db", closed_port()
    db.parent.mkdir()
    server = _serve(db, port, tmp_path / "server.log")
    uri = f"tracking.uri=http://127.0.0.1:{port}"
    args = [*SMALL, "checkpoint.every=100", "run.name=to", uri, "tracking.retry_interval_s=1"]
    r = Run(tmp_path, "train", *args, "max_steps=400", "tracking.outage_timeout_s=8")
    runs.append(r)
    run_dir = tmp_path / "runs/sat/to"
    try:
        wait_for(lambda: (run_dir / "logs/pids.json").is_file(), 300, "the engine")
        wait_for(lambda: _store_steps(db, "to")[-1:] >= [3], 300, "step 3 in the store", poll=1)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        assert r.wait(300) == 1, r.stderr[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    err = r.stderr
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("sat: error:")]
    m = re.search(
        r"unreachable for \d+ s \(tracking\.outage_timeout_s=8\).*kept in \S+"
        r"\.metrics\.jsonl.*stopped after step (\d+) with the checkpoint \S+/step_\d+; "
        r".*resume=auto",
        line,
    )
    assert m, line
    stop = int(m.group(1))
    ck = assert_checkpoint_loadable(run_dir / "checkpoints")
    assert ck.name == f"step_{stop}" and not (run_dir / ".sat.lock").exists()
    from sat_cli.checkpoints.manifest import verify_checkpoint

    assert verify_checkpoint(ck) is None
    server = _serve(db, port, tmp_path / "server.log")
    try:
        out = sat("train", *args, f"max_steps={stop + 2}", "resume=auto", cwd=tmp_path)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _store_steps(db, "to") == list(range(1, stop + 3))  # the outage's steps included
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = c.search_runs([c.get_experiment_by_name("sat").experiment_id])
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, fsfault):
    """The run folder's disk fills up after the first checkpoint (a file takes the rest of a
    real tmpfs): the next weight export or checkpoint fails with exit 1 naming the disk, the
    run is FAILED, the previous checkpoint still verifies (manifest, schemas, weights) and
    resume=auto finishes the run once there is room again."""
    disk = tmp_path / "disk"
    kind, _ = fsfault.small_disk(disk, 96 << 20)
    if kind != "tmpfs":
        pytest.skip("needs a real small file system (tmpfs: root with mount rights)")
    store = f"tracking.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    args = [a for a in SMALL if not a.startswith("run.dir")]
    args += [f"run.dir={disk}", store, "checkpoint.every=1", "run.name=fd"]
    r = Run(tmp_path, "train", *args, "max_steps=200")
    run_dir = disk / "sat/fd"
    filler = disk / "filler"
    try:
        wait_for(lambda: (run_dir / "checkpoints/step_1/manifest.json").is_file(), 300, "step_1")
        with filler.open("wb") as f:  # every byte left, until the kernel says ENOSPC
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        assert r.wait(300) == 1, r.stderr[-3000:]
    finally:
        r.cleanup()
    assert "Traceback" not in r.stderr
    assert re.search(
        rf"sat: error: cannot (write checkpoint|publish weights) .*: .*{fs_faults.DISK_FULL}",
        r.stderr,
    ), r.stderr[-2000:]
    assert _store_run(tmp_path, "fd").info.status == "FAILED"
    from sat_cli.checkpoints.manifest import verify_checkpoint
    from sat_cli.checkpoints.state import list_checkpoints

    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert ckpts and all(verify_checkpoint(p) is None for _, p in ckpts)
    assert not list((run_dir / "checkpoints").glob(".step_*"))
    filler.unlink()
    last = ckpts[-1][0]
    out = _sat_with(None, "train", *args, f"max_steps={last + 2}", "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from step_{last}" in out.stdout


@pytest.mark.slow
def test_memory_running_out_mid_run_fails_the_run_cleanly(tmp_path, runs):
    """The orchestrator's address space is capped (prlimit) at what it uses after the first
    checkpoint: the next allocation fails; exit 1 with one `out of memory` line, no traceback,
    the MLflow run FAILED, the checkpoints verify, and resume=auto continues."""
    import resource

    args = [*SMALL, "checkpoint.every=2", "run.name=oom"]
    r = Run(tmp_path, "train", *args, "max_steps=200", "tracking.histogram_every=1")
    runs.append(r)
    run_dir = tmp_path / "runs/sat/oom"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
    status = Path(f"/proc/{r.pid}/status").read_text()
    vm = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) << 10
    resource.prlimit(r.pid, resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
    assert r.wait(300) == 1, r.stderr[-3000:]
    err = r.stderr
    assert "Traceback" not in err and re.search(r"sat: error: out of memory", err), err[-2000:]
    assert mlflow_run(tmp_path, "oom").info.status == "FAILED"
    from sat_cli.checkpoints.manifest import verify_checkpoint
    from sat_cli.checkpoints.state import list_checkpoints

    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert ckpts and all(verify_checkpoint(p) is None for _, p in ckpts)
    last = ckpts[-1][0]
    out = sat("train", *args, f"max_steps={last + 1}", "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
