"""A tracking store that goes away mid-run (issue 32): metrics wait on disk, nothing is lost,
the outage limit stops the run, the next command (or the resume) sends what waited.

In process, with a real sqlite store whose client is made to fail (an ``OSError`` from
``log_batch``, what a stopped server gives) for a while. The real-server version (an MLflow
server stopped for 30 s mid-run, and one that never returns) is in ``tests/test_faults.py``.
"""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import seeded_store

from sat_cli.tracking import Tracker, TrackerSettings
from sat_cli.tracking.outage import SPOOL_SUFFIX, send_spools

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


class _Outage:
    """Makes the tracker's store fail (as a stopped server does) while ``down`` is true."""

    def __init__(self, tracker: Tracker):
        self.down = False
        self.real = tracker.client.log_batch
        self.real_get = tracker.client.get_run
        tracker.client.log_batch = self.log_batch
        tracker.client.get_run = self.get_run

    def log_batch(self, *a, **kw):
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        return self.real(*a, **kw)

    def get_run(self, *a, **kw):
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        return self.real_get(*a, **kw)


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One sqlite store for the module (creating one takes seconds)."""
    return f"sqlite:///{seeded_store(tmp_path_factory.mktemp('store') / 'mlflow.db')}"


def _steps(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_wait_on_disk_and_are_sent_when_the_store_returns(tmp_path, uri):
    pending = tmp_path / ".mlflow_pending"
    tr = Tracker(TrackerSettings(uri, "e"), "r")
    tr.keep_on_disk(pending, outage_timeout_s=3600, retry_interval_s=0)
    out = _Outage(tr)
    tr.log_metrics({"loss": 1.0}, step=1)
    out.down = True
    for step in (2, 3, 4):
        tr.log_metrics({"loss": float(step)}, step=step)
    spool = pending / f"{tr.run_id}{SPOOL_SUFFIX}"
    lines = spool.read_text().splitlines()
    assert json.loads(lines[0])["run_id"] == tr.run_id and "uri" not in json.loads(lines[0])
    assert len(lines) == 4 and tr.buffered_metrics == 0  # on disk, not in memory
    assert tr.outage_s() > 0 and not tr.outage_expired()
    out.down = False
    tr.log_metrics({"loss": 5.0}, step=5)
    assert not spool.exists() and tr.outage_s() == 0
    tr.end()
    c = MlflowClient(tracking_uri=uri)
    assert _steps(c, tr.run_id) == [1, 2, 3, 4, 5]
    assert "tracking/dropped_metrics" not in c.get_run(tr.run_id).data.metrics


def test_outage_limit_and_the_next_command_sends_the_rest(tmp_path, uri):
    pending = tmp_path / ".mlflow_pending"
    tr = Tracker(TrackerSettings(uri, "e"), "r")
    tr.keep_on_disk(pending, outage_timeout_s=0.2, retry_interval_s=0)
    out = _Outage(tr)
    out.down = True
    tr.log_metrics({"loss": 1.0}, step=1)
    time.sleep(0.3)
    assert tr.outage_expired()
    msg = tr.outage_message()
    assert "unreachable for" in msg and "tracking.outage_timeout_s=0.2" in msg
    assert str(pending) in msg
    tr.end("FAILED")  # the store is still down: the points stay on disk
    assert (pending / f"{tr.run_id}{SPOOL_SUFFIX}").is_file()
    # a later command of the same store (another run) sends them
    other = Tracker(TrackerSettings(uri, "e"), "other")
    assert send_spools(pending, other, log_fn=lambda m: None) == 1
    other.end()
    assert _steps(MlflowClient(tracking_uri=uri), tr.run_id) == [1]
    assert not list(pending.glob(f"*{SPOOL_SUFFIX}"))


def test_a_resumed_run_sends_its_own_points_first_and_never_twice(tmp_path, uri):
    pending = tmp_path / ".mlflow_pending"
    tr = Tracker(TrackerSettings(uri, "e"), "r")
    tr.keep_on_disk(pending, outage_timeout_s=3600, retry_interval_s=3600)
    out = _Outage(tr)
    tr.log_metrics({"loss": 1.0}, step=1)
    out.down = True
    tr.log_metrics({"loss": 2.0}, step=2)
    tr.log_metrics({"loss": 3.0}, step=3)
    tr._ended = True  # the process died in the outage (no end())
    resumed = Tracker(TrackerSettings(uri, "e"), "r", run_id=tr.run_id)
    resumed.keep_on_disk(pending, outage_timeout_s=3600, retry_interval_s=30)
    resumed.log_metrics({"loss": 30.0}, step=3)  # re-run from an older checkpoint: skipped
    resumed.log_metrics({"loss": 4.0}, step=4)
    resumed.end()
    c = MlflowClient(tracking_uri=uri)
    hist = sorted((m.step, m.value) for m in c.get_metric_history(tr.run_id, "loss"))
    assert hist == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
