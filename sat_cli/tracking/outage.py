"""A tracking store that goes away mid-run: metrics wait on disk, the run waits a bounded time.

``Tracker.keep_on_disk(root, outage_timeout_s, retry_interval_s)`` (:class:`OutageGuard`, the part
of :class:`sat_cli.tracking.Tracker` kept here) turns on, for one run:

* **the spool** — metric points the store did not take (the server stopped or restarting, its
  database unreachable) are appended to ``<root>/<run id>.metrics.jsonl`` (``root`` is
  ``<run.dir>/.mlflow_pending``, beside the pending final statuses of
  ``sat_cli.tracking.final_status``), one JSON line per point, flushed and fsynced at every step:
  nothing is held in memory only, nothing is dropped. The first line names the run and a hash
  of the tracking URI (never the URI: it may hold a password). Every ``retry_interval_s`` the
  tracker tries the store again; when it answers, the spooled points are sent first, in order,
  then the new ones, and the file is removed. Points the store still lacks when the run ends
  stay in the file; the next `sat` command that reaches the same store from the same ``run.dir``
  sends them (:func:`send_spools`, called with the pending statuses), and a resumed run sends
  its own before it logs anything (so a step is never logged twice).
* **the outage limit** — :meth:`OutageGuard.expired` is true once the store has been
  unreachable for ``outage_timeout_s`` (one more attempt is made first); the training loop then
  writes a checkpoint and stops with :meth:`OutageGuard.message`, which says where
  the metrics wait and how to continue (``resume=auto``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from sat_cli.tracking.params import redact_uri

log = logging.getLogger("sat_cli.tracking")
SPOOL_SUFFIX = ".metrics.jsonl"
METRICS_PER_BATCH = 1000  # MLflow's MAX_METRICS_PER_BATCH (the tracker's batches too)


def uri_key(uri: str) -> str:
    """A short hash of a tracking URI: which store a pending record belongs to."""
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


class MetricSpool:
    """The metric points of one run that wait for the store, in a JSON-lines file."""

    def __init__(self, root: str | os.PathLike, run_id: str, uri: str):
        self.path = Path(root) / f"{run_id}{SPOOL_SUFFIX}"
        self.header = {"run_id": run_id, "uri_key": uri_key(uri)}

    def __len__(self) -> int:
        try:
            with self.path.open("rb") as f:
                return max(0, sum(1 for _ in f) - 1)
        except FileNotFoundError:
            return 0

    def append(self, points) -> None:
        """Append ``mlflow.entities.Metric`` points (the file is created with its header)."""
        from sat_cli.util.fsio import write_text_fsync

        if not points:
            return
        lines = [
            json.dumps({"k": m.key, "v": m.value, "t": m.timestamp, "s": m.step}) for m in points
        ]
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_fsync(self.path, json.dumps(self.header) + "\n")
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> list:
        """The points in the order they were logged (a line cut by a crash is skipped)."""
        if not (self.path.exists() or self.path.is_symlink()):
            return []
        return read_spool(self.path)[1]

    def rewrite(self, points) -> None:
        from sat_cli.util.fsio import atomic_write_text

        if not points:
            self.path.unlink(missing_ok=True)
            return
        lines = [json.dumps(self.header)]
        lines += [
            json.dumps({"k": m.key, "v": m.value, "t": m.timestamp, "s": m.step}) for m in points
        ]
        atomic_write_text(self.path, "\n".join(lines) + "\n")


def read_spool(path: Path) -> tuple[dict, list]:
    """(header, points) of a spool file."""
    from mlflow.entities import Metric

    from sat_cli.util.fsio import read_regular_bytes

    header, points = {}, []
    for i, line in enumerate(read_regular_bytes(path).decode("utf-8", "replace").splitlines()):
        try:
            rec = json.loads(line)
            if i == 0:
                header = rec
            else:
                points.append(Metric(str(rec["k"]), float(rec["v"]), int(rec["t"]), int(rec["s"])))
        except (ValueError, KeyError, TypeError):
            continue  # the last line of a run killed while writing it
    return header, points


def send_points(tracker, run_id: str, points) -> int:
    """Send ``points`` to ``run_id`` in batches; how many the store took before it failed."""
    sent = 0
    while sent < len(points):
        batch = points[sent : sent + METRICS_PER_BATCH]
        if not tracker.call("metrics", tracker.client.log_batch, run_id, metrics=batch):
            break
        sent += len(batch)
    return sent


def send_spools(root: Path, tracker, log_fn=print) -> int:
    """Send the spooled points of other runs of the tracker's store (see the module
    docstring); returns how many points went. The tracker's own run is left to itself."""
    done = 0
    if not tracker.enabled or tracker.uri is None or not Path(root).is_dir():
        return 0
    for path in sorted(Path(root).glob(f"*{SPOOL_SUFFIX}")):
        try:
            header, points = read_spool(path)
            run_id = header.get("run_id")
            if header.get("uri_key") != uri_key(tracker.uri) or run_id == tracker.run_id:
                continue
            sent = send_points(tracker, run_id, points)
            done += sent
            if sent < len(points):
                break  # the store failed again: the rest waits for the next command
            path.unlink()
        except Exception as exc:  # noqa: BLE001 - a bad file must not stop the command
            log_fn(f"WARNING: cannot send the spooled MLflow metrics {path.name}: {exc}")
    if done:
        log_fn(f"sent {done} spooled MLflow metric point(s) from {root}")
    return done


class OutageGuard:
    """The spool and the outage limit of one :class:`sat_cli.tracking.tracker.Tracker` (the
    module docstring); the tracker asks it where unsent points go and whether to stop."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.spool: MetricSpool | None = None
        self.timeout_s: float | None = None
        self.down_since: float | None = None  # monotonic time of the first failed call
        self._warned = False

    def mark_down(self, what: str, exc: BaseException) -> None:
        """A call failed: the store is down (since the first failure; warned once)."""
        t = self.tracker
        if self.down_since is None:
            self.down_since = time.monotonic()
        if not self._warned:
            self._warned = True
            kept = (
                f"kept on disk in {self.spool.path}"
                if self.spool is not None
                else f"buffered (up to {t.buffer_limit} points)"
            )
            log.warning(
                "MLflow store %s unreachable while logging %s (%s: %s); training continues, "
                "metrics are %s and retried every %.0f s, images/artifacts are dropped and counted",
                redact_uri(t.uri or ""),
                what,
                type(exc).__name__,
                redact_uri(str(exc))[:300],
                kept,
                t.retry_interval_s,
            )

    def mark_up(self) -> None:
        """A call went through: the store is back (said once)."""
        if self.down_since is not None:
            log.warning("MLflow store %s reachable again", redact_uri(self.tracker.uri or ""))
            self.down_since = None
            self._warned = False

    def outage_s(self) -> float:
        """Seconds the store has been unreachable (0 when it answers)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def keep_on_disk(
        self, root: str | os.PathLike, outage_timeout_s: float | None, retry_interval_s: float
    ) -> None:
        """Spool unsent metrics under ``root`` and stop after ``outage_timeout_s`` of outage
        (see the module docstring); sends what an earlier process of this run left there."""
        t = self.tracker
        if not t.active() or t.run_id is None:
            return
        self.timeout_s = outage_timeout_s
        t.retry_interval_s = float(retry_interval_s)
        self.spool = MetricSpool(root, t.run_id, t.uri)
        with t.lock:
            left = self.spool.load()
            if left:  # a run that stopped in an outage: its missing points go first
                t.skip_on_resume(left)  # and are never logged again by this resume
                t.flush()

    def send_spool(self) -> bool:
        """Send the spooled points first; True when none is left."""
        t = self.tracker
        points = self.spool.load()
        if not points:
            return True
        if not t.store_answers():
            return False
        sent = send_points(t, t.run_id, points)
        if sent:
            self.spool.rewrite(points[sent:])
            if sent == len(points):
                log.warning("sent %d metric points kept on disk during the outage", sent)
        return sent == len(points)

    def spill(self, buffer) -> None:
        """Move the points the store did not take from ``buffer`` (memory) to the spool file."""
        try:
            self.spool.append(list(buffer))
        except OSError as exc:  # the disk refuses too: keep them in memory (bounded buffer)
            log.warning("cannot keep metrics on disk in %s: %s", self.spool.path, exc)
            return
        buffer.clear()

    def expired(self) -> bool:
        """True once the store has been unreachable for ``timeout_s`` (checked again with one
        more attempt first)."""
        t = self.tracker
        if self.timeout_s is None or self.outage_s() < self.timeout_s:
            return False
        with t.lock:
            t.retry_now()
            if self.spool is not None and len(self.spool):
                t.flush()
            else:
                t.call("metrics", t.client.get_run, t.run_id)
        return self.outage_s() >= self.timeout_s

    def message(self) -> str:
        t = self.tracker
        where = f" are kept in {self.spool.path} and" if self.spool is not None else ""
        return (
            f"the MLflow store {redact_uri(t.uri or '')} has been unreachable for "
            f"{self.outage_s():.0f} s (tracking.outage_timeout_s={self.timeout_s:g}); "
            f"the metrics it missed{where} are sent once it is back"
        )
