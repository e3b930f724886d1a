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
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cli_helpers import run_sat

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
    from sat_cli.config import load
    from sat_cli.loop.run import build_task
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

    from sat_cli.loop.state import latest_checkpoint, read_loop_state

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
    and an API key in its config: the stored params mask the password."""
    args = [
        *SMALL,
        "max_steps=400",
        "checkpoint.every=2",
        "run.name=term",
        "data.dir=https://user:DATAPW@example.org/d",
        "engine.extra_args=[--api-key,SECRET]",
    ]
    r = Run(tmp_path, "train", *args)
    runs.append(r)
    run_dir = tmp_path / "runs/sat/term"
    wait_for(lambda: (run_dir / "checkpoints/step_2").is_dir(), 300, "the first checkpoint")
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
    the outage are in the store."""
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
