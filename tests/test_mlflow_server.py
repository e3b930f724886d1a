"""Integration tests: a real ``mlflow server`` subprocess, driven through ``Tracker`` over HTTP.

The server is started with the argument list of ``sat ui`` (``ui_command``: sqlite store,
artifacts served from ``<db dir>/mlartifacts``, bound to 127.0.0.1, one worker) in its own
process group, polled on ``/health`` (~20 s to come up on 2 cores), and killed by process group
in a ``finally``. The outage test stops and restarts the server mid-run and is marked ``slow``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from sat_cli.errors import UserError
from sat_cli.tracking import Tracker, TrackerSettings, ui_command

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

HEALTH_TIMEOUT_S = 120  # ~20 s on 2 idle cores; 50 s seen under load 9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


@contextmanager
def mlflow_server(db: Path, port: int) -> Iterator[str]:
    """Run ``sat ui``'s command for ``db`` on ``port``; yield its URL once /health answers."""
    db.parent.mkdir(parents=True, exist_ok=True)
    log_path = db.parent / f"server-{port}-{time.monotonic_ns()}.log"
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            ui_command(f"sqlite:///{db}", port=port),
            cwd=db.parent,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: uvicorn workers die with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        deadline = t0 + HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({proc.returncode}):\n{log_path.read_text()}")
            try:
                if _get(f"{url}/health")[0] == 200:
                    print(f"mlflow server healthy after {time.monotonic() - t0:.1f} s")
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]
                pytest.fail(f"mlflow server not healthy after {HEALTH_TIMEOUT_S} s:\n{tail}")
            time.sleep(0.5)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_tracker_over_http_server(tmp_path):
    db = tmp_path / "store" / "mlflow.db"
    rng = np.random.default_rng(1)
    lag = rng.integers(0, 9, size=300).astype(np.float64)

    # a run logged straight into the sqlite store, before the server exists
    with Tracker(TrackerSettings(f"sqlite:///{db}", "local"), "direct") as tr:
        tr.log_histogram("staleness/version_lag", lag, 0, bins=9)
        direct_run = tr.run_id

    with mlflow_server(db, _free_port()) as url:
        # uploads are slow on a loaded machine; failure paths: below
        store = TrackerSettings(url, "srv", http_timeout_s=60, http_max_retries=0)
        params = {"algo.name": "gspo", "lag": "8"}
        with Tracker(store, "r", params=params, tags={"sweep": "smoke"}) as tr:
            for step in range(3):
                tr.log_metrics({"loss/policy": 0.25 * step, "eval/aime24/avg@8": step / 4}, step)
            table = tr.log_histogram("staleness/version_lag", lag, 1, marks={"max": 8.0}, bins=9)
            tr.log_dict({"step": 2}, "state.json")
            run_id = tr.run_id

        client = MlflowClient(tracking_uri=url)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params == {"algo.name": "gspo", "lag": "8"}
        assert run.data.tags["sweep"] == "smoke"
        assert _history(client, run_id, "loss/policy") == [(0, 0.0), (1, 0.25), (2, 0.5)]
        assert _history(client, run_id, "eval/aime24/avg_at_8") == [(0, 0.0), (1, 0.25), (2, 0.5)]
        images = [f.path for f in client.list_artifacts(run_id, "images")]
        assert sorted(p.rsplit(".", 1)[1] for p in images) == ["png", "webp"]
        assert all(p.startswith("images/staleness~version_lag+step+1+") for p in images)

        # the table, downloaded through the server, holds numpy.histogram of the input
        dst = str(tmp_path / "dl")
        local = client.download_artifacts(run_id, "tables/staleness/version_lag/step_1.json", dst)
        got = json.loads(Path(local).read_text())
        counts, edges = np.histogram(lag, bins=9)
        assert got["counts"] == counts.tolist() == table["counts"]
        assert got["edges"] == edges.tolist()
        assert got["marks"] == {"max": 8.0}
        # uploads went through the server into <db dir>/mlartifacts (its artifacts destination)
        stored = sorted((db.parent / "mlartifacts").rglob("tables/staleness/version_lag/*.json"))
        # the direct run's local write (step 0) and this run's upload (step 1)
        assert [(p.name, run_id in str(p)) for p in stored] in (
            [("step_0.json", False), ("step_1.json", True)],
            [("step_1.json", True), ("step_0.json", False)],
        )

        # the UI can serve artifacts of runs that were logged straight into the sqlite store
        status, body = _get(
            f"{url}/get-artifact?path=tables/staleness/version_lag/step_0.json&run_uuid={direct_run}"
        )
        assert status == 200 and json.loads(body)["counts"] == counts.tolist()
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow
def test_server_outage_mid_run_buffers_and_recovers(tmp_path, caplog):
    db = tmp_path / "store" / "mlflow.db"
    port = _free_port()
    caplog.set_level(logging.WARNING, logger="sat_cli.tracking")
    with mlflow_server(db, port) as url:
        tr = Tracker(
            TrackerSettings(
                url, "outage", http_timeout_s=2, http_max_retries=0, retry_interval_s=0
            ),
            "r",
        )
        tr.log_metrics({"loss/policy": 0.0}, 0)
    # server is down: training must go on, metrics buffered, the histogram dropped and counted
    tr.log_metrics({"loss/policy": 1.0}, 1)
    tr.log_metrics({"loss/policy": 2.0, "rollout/reward_mean": 0.5}, 2)
    assert tr.log_histogram("staleness/abs_logratio", [0.1, 0.2], 2) is not None
    assert (tr.buffered_metrics, tr.dropped_artifacts) == (3, 2)  # 3 points; image + table
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 1, [r.getMessage() for r in caplog.records]

    with mlflow_server(db, port) as url:
        tr.log_metrics({"loss/policy": 3.0}, 3)  # reconnects and flushes the buffer first
        assert tr.buffered_metrics == 0
        tr.end()
        client = MlflowClient(tracking_uri=url)
        assert _history(client, tr.run_id, "loss/policy") == [
            (0, 0.0),
            (1, 1.0),
            (2, 2.0),
            (3, 3.0),
        ]
        assert _history(client, tr.run_id, "rollout/reward_mean") == [(2, 0.5)]
        assert _history(client, tr.run_id, "tracking/dropped_artifacts") == [(3, 2.0)]
        assert client.get_run(tr.run_id).info.status == "FINISHED"


@pytest.mark.parametrize(
    "uri, pattern",
    [
        ("sqlite:///regfile/x.db", r"'regfile' is a file, not a folder for the store"),
        ("sqlite:///regfile/a/b/x.db", r"'regfile' is a file"),
        ("sqlite://", r"a sqlite store is a file"),
        ("sqlite:///:memory:", r"a sqlite store is a file"),
        ("postgresql://u:secret@[::1/db", r"malformed \(Invalid IPv6 URL\)"),
        ("postgresql://u@h:99999/db", r"malformed \(Port out of range"),
        ("postgresql://u@h:port/db", r"malformed"),
        ("foo://bar", r"expected a database URI"),
    ],
)
def test_malformed_backend_uris_are_one_line_before_anything_starts(
    tmp_path, monkeypatch, uri, pattern
):
    """`sat mlflow-server --backend-store-uri`: each of these was a traceback (urlsplit's
    ValueError, or the server's own FileExistsError) or a server on a store no worker shares."""
    from sat_cli.commands.mlflow_server import backend_uri

    monkeypatch.chdir(tmp_path)
    (tmp_path / "regfile").write_text("")
    with pytest.raises(UserError, match=pattern) as err:
        backend_uri(uri)
    assert "secret" not in str(err.value)


def test_a_sqlite_store_gets_its_folder_and_mysql_needs_its_driver(tmp_path, monkeypatch):
    import importlib.util

    from sat_cli.commands.mlflow_server import backend_uri

    monkeypatch.chdir(tmp_path)
    assert backend_uri("sqlite:///sub/dir/x.db") == "sqlite:///sub/dir/x.db"
    assert (tmp_path / "sub" / "dir").is_dir()
    absolute = f"sqlite:///{tmp_path}/abs/x.db"
    assert backend_uri(absolute) == absolute and (tmp_path / "abs").is_dir()
    assert backend_uri("postgresql://u@h:5432/db") == "postgresql+psycopg://u@h:5432/db"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "MySQLdb" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"needs the MySQLdb module.*pip install mysqlclient"):
        backend_uri("mysql://a:b@h/db")


def test_a_store_under_a_regular_file_exits_2_without_a_traceback(tmp_path):
    (tmp_path / "regfile").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "mlflow-server"]
        + ["--backend-store-uri", "sqlite:///regfile/x.db"]
        + ["--artifacts-destination", str(tmp_path / "art"), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "'regfile' is a file" in out.stderr


def _status(url: str, host: str) -> int:
    """The HTTP status of a GET of ``url`` sent with ``Host: host``."""
    req = urllib.request.Request(url, headers={"Host": host})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_allowed_hosts_reach_mlflows_host_check(tmp_path):
    """`sat mlflow-server --allowed-hosts head01.example` against the real server: a request
    whose Host header names head01.example (with the port, as a client sends it) is served, one
    naming another host is rejected by MLflow's DNS-rebinding guard, localhost still works."""
    port = _free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "sat_cli.cli", "mlflow-server"]
    cmd += ["--backend-store-uri", f"sqlite:///{tmp_path}/store.db"]
    cmd += ["--artifacts-destination", str(tmp_path / "art"), "--port", str(port)]
    cmd += ["--workers", "1", "--allowed-hosts", "head01.example,*.corp.example"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    api = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while "MLflow server ready" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        assert _status(api, f"head01.example:{port}") == 200
        assert _status(api, "head01.example") == 200
        assert _status(api, f"gpu7.corp.example:{port}") == 200
        assert _status(api, f"127.0.0.1:{port}") == 200
        assert _status(api, f"evil.example:{port}") == 403
        assert _status(api, f"head01.example.evil:{port}") == 403
        assert "also serving Host head01.example, *.corp.example" in log_path.read_text()
    finally:
        _stop_group(proc)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("*", r"would accept every Host header"),
        ("a,,b", r"'' is not a host name"),
        ("a b", r"'a b' is not a host name"),
        ("a/b", r"'a/b' is not a host name"),
    ],
)
def test_bad_allowed_hosts_are_one_line(text, error):
    from sat_cli.commands.mlflow_server import parse_allowed_hosts

    with pytest.raises(UserError, match=error):
        parse_allowed_hosts(text)


def test_allowed_hosts_list_adds_ports_and_keeps_mlflows_defaults():
    from mlflow.server.security_utils import get_default_allowed_hosts, is_allowed_host_header

    from sat_cli.commands.mlflow_server import allowed_hosts, parse_allowed_hosts

    hosts = allowed_hosts(parse_allowed_hosts("head01,10.1.2.3:5000,[fd00::1]"), "node9")
    assert hosts[: len(get_default_allowed_hosts())] == get_default_allowed_hosts()
    assert hosts[len(get_default_allowed_hosts()) :] == [
        "node9",
        "node9:*",
        "head01",
        "head01:*",
        "10.1.2.3:5000",
        "[fd00::1]",
        "[[]fd00::1]:*",
    ]
    for ok in ("node9:5000", "head01", "head01:80", "[fd00::1]:5000", "localhost:5000"):
        assert is_allowed_host_header(hosts, ok), ok
    for bad in ("head02:5000", "8.8.8.8:5000", "[fd00::2]:5000"):
        assert not is_allowed_host_header(hosts, bad), bad
