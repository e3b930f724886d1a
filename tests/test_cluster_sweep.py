"""``sat sweep --executor slurm|ray``: the runs of a grid as cluster jobs, killed and resumed.

- ``--executor slurm --slurm-cluster local``: submitit's own local executor runs the jobs (the
  same submission, state and adoption code as on SLURM). The sweep is SIGKILLed mid-way together
  with one running job (what preemption looks like); the re-run resubmits none of the finished
  runs, adopts the job that still runs and resumes the killed run from its checkpoint.
- ``--executor ray`` on the two-node loopback cluster, logging into ``sat mlflow-server`` on a
  real PostgreSQL: the same kill and re-run; two runs log into the server at once; the parent
  run's ``sweep/runs_finished`` is the number of runs and every child points at it.
- What a cluster sweep refuses before it submits anything (exit 2): a sqlite store, a run.dir
  on a node-local folder, a missing extra, bad executor options.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_sat

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "sweeps" / "smoke.yaml")
# three steps with a checkpoint each, so that a killed run has something to resume from
LONGER = ["max_steps=3", "checkpoint.every=1", "eval.every=3"]


def _state(root: Path) -> dict:
    try:
        return json.loads((root / "sweep_state.json").read_text())
    except (OSError, ValueError):
        return {}


def _finished(run_dir: Path) -> bool:
    from sat_cli.sweep import checkpoint_status

    return checkpoint_status(run_dir)[0]


def _has_step(run_dir: Path) -> bool:
    return (run_dir / "checkpoints" / "step_1").is_dir()


def _sweep(*args, cwd, log):
    return subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "sweep", SMOKE, *args],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def _kill_tree(pid: int) -> None:
    from sat_cli.cluster.guard import tree

    for p in tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _train_pid(run_name: str) -> int | None:
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmd and f"run.name={run_name}".encode() in cmd:
            return int(entry)
    return None


def _interrupt(root: Path, proc, timeout_s: float = 600) -> tuple[str, str]:
    """Wait until one run finished and two others run, one of them past a checkpoint; then
    SIGKILL the sweep and that run's `sat train` (preempted), and SIGSTOP the other run, so that
    it still runs when the sweep is re-run (SIGCONT once adopted). Returns (killed, stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        runs = _state(root).get("runs", {})
        done = [n for n in runs if _finished(root / n)]
        running = [n for n, r in runs.items() if r.get("status") == "running" and n not in done]
        ready = [n for n in running if _has_step(root / n)]
        if done and len(running) >= 2 and ready and all(_train_pid(n) for n in running):
            victim = ready[0]
            other = next(n for n in running if n != victim)
            os.kill(_train_pid(other), signal.SIGSTOP)
            os.kill(proc.pid, signal.SIGKILL)  # the sweep itself, not its jobs
            proc.wait()
            _kill_tree(_train_pid(victim))
            return victim, other
        time.sleep(0.3)
    raise AssertionError("no moment with a finished run and two running ones")


def _rerun(args, cwd: Path, other: str, timeout_s: float = 600) -> tuple[int, str]:
    """The same sweep again; the stopped run continues once the sweep adopted it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "sweep", SMOKE, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, resumed = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"adopt  {other}") or line.startswith("sweep "):
                if not resumed and (pid := _train_pid(other)):
                    os.kill(pid, signal.SIGCONT)
                    resumed = line.startswith("adopt")
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid := _train_pid(other):
            os.kill(pid, signal.SIGCONT)
    return code, "".join(lines)


def _check_rerun(root: Path, out: str, victim: str, other: str, done_before: list[str]) -> None:
    assert f"adopt  {other}" in out, out[-3000:]
    assert f"submit {victim}" in out
    assert done_before and not [n for n in done_before if f"submit {n}" in out]  # not resubmitted
    log = (root / victim / "logs" / "sweep_child.log").read_text()
    assert "(resuming from step_" in log
    assert all(_finished(root / n) for n in _state(root)["runs"])


@pytest.mark.slow  # ~2 min on 2 cores: the default suite keeps the class in the Ray sweep below
@pytest.mark.xdist_group("sweep_slurm")
def test_slurm_sweep_through_submitit_survives_a_kill(tmp_path):
    pytest.importorskip("submitit", reason="the [slurm] extra is not installed")
    args = ["--executor", "slurm", "--slurm-cluster", "local", "--jobs", "2", *LONGER]
    root = tmp_path / "runs" / "smoke"
    with open(tmp_path / "first.out", "w") as log:
        proc = _sweep(*args, cwd=tmp_path, log=log)
        try:
            victim, other = _interrupt(root, proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    before = _state(root)
    assert before["runs"][victim]["executor"] == "slurm"
    assert before["runs"][victim]["job_id"].isdigit()  # the local job's controller pid
    done_before = [n for n in before["runs"] if _finished(root / n)]
    code, out = _rerun(args, tmp_path, other)
    assert code == 0, out[-3000:]
    _check_rerun(root, out, victim, other, done_before)
    assert "4/4 runs finished" in out
    # the runs' MLflow records: one per run, nested under one parent
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sat.sweep_role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    hist = client.get_metric_history(parent.info.run_id, "sweep/runs_finished")
    assert max(m.value for m in hist) == 4


@pytest.mark.parametrize(
    "args,message",
    [
        # the local store cannot be shared by the cluster's nodes
        (["--executor", "slurm"], "lives on this machine's disk"),
        pytest.param(  # the slurm case above keeps the class (a store on this machine's disk)
            ["--executor", "ray", "--ray-address", "127.0.0.1:1"],
            "sat mlflow-server",
            marks=pytest.mark.slow,
        ),
        (
            ["--executor", "slurm", "tracking=mlflow_server", "tracking.uri=http://127.0.0.1:1"],
            "is not shared (it is under /tmp",
        ),
        (["--executor", "ray"], "--executor ray needs the cluster's address"),
        (
            ["--executor", "mpi"],
            "--executor='mpi' is not a registered sweep executor; registered: local, slurm, ray",
        ),
        # option values: the two above keep the class; these run in make test-full
        pytest.param(
            ["--executor", "slurm", "--slurm-option", "account"],
            "expected KEY=VALUE",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--executor", "slurm", "--slurm-cluster", "pbs"],
            "choose one of slurm, local",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--executor", "ray", "--ray-address", "h:1", "--ray-resource", "x=-1"],
            "> 0",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_cluster_sweep_refuses_before_submitting(tmp_path, args, message):
    pytest.importorskip("submitit", reason="the [slurm] extra is not installed")
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    run_dir = tempfile_run_dir(tmp_path)
    res = run_sat("sweep", SMOKE, *args, f"run.dir={run_dir}", cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not (Path(run_dir) / "smoke" / "sweep_state.json").exists()  # nothing submitted


def tempfile_run_dir(tmp_path: Path) -> str:
    return str(tmp_path / "runs")  # under /tmp: node-local for a real SLURM cluster


def test_sweep_file_executor_sections_are_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\naxes: {}\nmethods: {A: [algo=grpo]}\nseeds: [0]\nslurm: {partitio: gpu}\n"
    )
    res = run_sat("sweep", str(bad), "--dry-run", cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    assert "slurm: unknown key(s) 'partitio'; known: cluster, partition" in res.stderr


@pytest.mark.parametrize("module,executor", [("submitit", "slurm"), ("ray", "ray")])
def test_without_the_extra_exit_2_names_the_install_line(tmp_path, module, executor):
    fake = tmp_path / "site"
    (fake / module).mkdir(parents=True)
    (fake / module / "__init__.py").write_text(f"raise ImportError('No module named {module}')\n")
    env = {**os.environ, "PYTHONPATH": str(fake)}
    extra = ["--ray-address", "127.0.0.1:1"] if executor == "ray" else []
    res = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "sweep", SMOKE, "--executor", executor, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"pip install -e '.[{'slurm' if executor == 'slurm' else 'ray'}]'" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.fixture
def mlflow_on_postgres(tmp_path):
    """``sat mlflow-server`` on a real PostgreSQL (tests/postgres_server.py); its URL."""
    pytest.importorskip("psycopg", reason="the [postgres] extra is not installed")
    from postgres_server import PostgresServer, pg_bin

    from sat_cli.util.procs import free_port

    if pg_bin() is None:
        pytest.skip("no PostgreSQL binaries (initdb, postgres) on this machine")
    pg = PostgresServer().start()
    port = free_port()
    log = open(tmp_path / "mlflow-server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "mlflow-server", "--backend-store-uri", pg.uri]
        + ["--artifacts-destination", str(tmp_path / "mlartifacts"), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C to stop" not in (tmp_path / "mlflow-server.log").read_text():
            assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "sat mlflow-server did not come up"
            time.sleep(0.5)
        text = (tmp_path / "mlflow-server.log").read_text()
        assert f"tracking=mlflow_server tracking.uri=http://127.0.0.1:{port}" in text
        assert "postgresql+psycopg://sat@127.0.0.1" in text  # the store, no password
        yield f"http://127.0.0.1:{port}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        log.close()
        pg.stop()


@pytest.mark.slow  # ~2 min; the default suite keeps the refusals and the Ray launcher on the cluster
@pytest.mark.xdist_group("ray")
def test_ray_sweep_into_postgres_mlflow_server_survives_a_kill(
    ray_cluster, mlflow_on_postgres, tmp_path
):
    """`sat sweep --executor ray` on the two-node cluster, runs logging into `sat mlflow-server`
    on PostgreSQL: killed mid-way and re-run as on SLURM; two runs logged at once; the parent's
    runs_finished is 4 and every child is nested under it."""
    uri = mlflow_on_postgres
    args = ["--executor", "ray", "--ray-address", ray_cluster.address, "--jobs", "2"]
    args += [*LONGER, "tracking=mlflow_server", f"tracking.uri={uri}"]
    root = tmp_path / "runs" / "smoke"
    with open(tmp_path / "first.out", "w") as log:
        proc = _sweep(*args, cwd=tmp_path, log=log)
        try:
            victim, other = _interrupt(root, proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    before = _state(root)
    assert before["runs"][other]["executor"] == "ray"
    assert before["runs"][other]["job_id"].endswith(f"/{other}")  # the actor's name
    done_before = [n for n in before["runs"] if _finished(root / n)]
    code, out = _rerun(args, tmp_path, other)
    assert code == 0, out[-3000:]
    _check_rerun(root, out, victim, other, done_before)
    assert "4/4 runs finished" in out

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sat.sweep_role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    assert {r.info.run_name for r in children} == set(before["runs"])
    hist = client.get_metric_history(parent.info.run_id, "sweep/runs_finished")
    assert max(m.value for m in hist) == 4
    spans = sorted((r.info.start_time, r.info.end_time) for r in children)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))  # two at once
    for r in children:  # every step's metrics arrived through the server
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "loss/grad_norm")]
        assert sorted(set(steps)) == [1, 2, 3], (r.info.run_name, steps)


@pytest.mark.slow
def test_sweep_on_a_real_slurm(mlflow_on_postgres, tmp_path):
    """`sat sweep --executor slurm` on a real one-node SLURM (munged + slurmctld + slurmd of the
    distribution, tests/slurm_cluster.py): two runs as sbatch jobs, finished, logged into the
    PostgreSQL-backed server; the run.dir is outside the node-local folders, as a real cluster's
    shared filesystem would be."""
    pytest.importorskip("submitit", reason="the [slurm] extra is not installed")
    import shutil
    import uuid

    from slurm_cluster import SlurmCluster, missing

    if missing():
        pytest.skip(
            f"no SLURM here ({', '.join(missing())} missing: Debian's slurmctld slurmd munge)"
        )
    cluster = SlurmCluster().start()
    shared = REPO / "build" / f"test-slurm-{uuid.uuid4().hex[:8]}"
    sweep = tmp_path / "two.yaml"
    sweep.write_text(
        "name: two\nbase: [experiment=cpu_smoke, max_steps=2, eval.every=2, eval.n=2,"
        " eval.limit=8]\naxes: {}\nmethods: {GRPO: [algo=grpo, clip=ppo],"
        " SAT-GRPO: [algo=grpo, clip=sat]}\nseeds: [0]\n"
    )
    try:
        res = subprocess.run(
            [sys.executable, "-m", "sat_cli.cli", "sweep", str(sweep), "--executor", "slurm"]
            + ["--slurm-partition", "debug", "--slurm-cpus", "1", "--slurm-time", "30"]
            + [f"run.dir={shared}", "tracking=mlflow_server", f"tracking.uri={mlflow_on_postgres}"],
            cwd=tmp_path,
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert res.stdout.count("slurm job ") == 2 and "2/2 runs finished" in res.stdout
        state = json.loads((shared / "two" / "sweep_state.json").read_text())
        assert {r["job_id"] for r in state["runs"].values()} <= {"1", "2", "3", "4"}
    finally:
        cluster.stop()
        shutil.rmtree(shared, ignore_errors=True)
