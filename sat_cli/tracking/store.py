"""Tracking stores: URIs (disabled, http, sqlite paths, artifact roots), the ``mlflow`` CLI and
the `sat ui` command, MLflow's HTTP timeout variables, which exceptions mean "the store
failed", and the start-up lock of a sqlite store.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from sat_cli.tracking.params import redact_uri

log = logging.getLogger("sat_cli.tracking")


class TrackingError(RuntimeError):
    """The tracking store cannot be used (unreachable, unknown run, deleted experiment)."""


# --------------------------------------------------------------------------- store URIs


def is_disabled_uri(uri: str | None) -> bool:
    return uri is None or str(uri).strip().lower() in ("", "none", "off", "disabled")


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///path`` URI (relative to the cwd), else None."""
    m = re.match(r"^sqlite:///(?P<path>.+)$", uri)
    if not m or m.group("path") == ":memory:":
        return None
    return Path(m.group("path").split("?", 1)[0])


SQLITE_MAX_PATHNAME = 512  # sqlite's unix VFS: a longer absolute path cannot be opened


def check_sqlite_path(uri: str) -> None:
    """``TrackingError`` (exit 2) for a ``sqlite:///`` store whose absolute path is longer than
    sqlite can open (MLflow would retry it for minutes before failing), or that is not a usable
    database (:func:`sqlite_store_problem`: a damaged file left the run's folder and
    ``config.yaml`` behind, then a multi-line error)."""
    db = sqlite_db_path(uri)
    if db is not None and len(str(db.resolve())) >= SQLITE_MAX_PATHNAME:
        raise TrackingError(
            f"the MLflow store {db} is {len(str(db.resolve()))} characters long as an absolute "
            f"path; sqlite opens at most {SQLITE_MAX_PATHNAME - 1}: choose a shorter run.dir "
            "or tracking.uri"
        )
    why = sqlite_store_problem(db) if db is not None else None
    if why is not None:
        raise TrackingError(
            f"the MLflow store {db} {why}: move it away, choose another tracking.uri, or disable "
            "tracking with tracking.uri=none"
        )


SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def sqlite_store_problem(db: Path) -> str | None:
    """Why the sqlite store file ``db`` cannot be used (None: it can, or it does not exist yet
    and its folder is writable): a folder, not a regular file, not an SQLite database, a
    damaged one, or a folder sqlite cannot write its database and journal in. Reads only: the
    file's first bytes (``O_NONBLOCK``, a FIFO is never waited on), then a read-only query of
    its schema (a database locked by a live writer counts as usable)."""
    import sqlite3

    from sat_cli.util.fsio import NotRegularFile, open_regular

    folder = db.parent
    if os.path.lexists(db):
        if db.is_dir():
            return "is a folder, not a database file"
        try:
            with open_regular(db) as fh:
                head = fh.read(len(SQLITE_MAGIC))
        except NotRegularFile:
            return "is not a regular file"
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        if head and head != SQLITE_MAGIC:
            return "is not an SQLite database (another file, or a damaged one)"
        if head:
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
                try:
                    con.execute("SELECT count(*) FROM sqlite_master").fetchone()
                finally:
                    con.close()
            except sqlite3.OperationalError:
                pass  # locked by a live writer, or a path sqlite's URI form cannot name
            except sqlite3.DatabaseError as exc:
                return f"is a damaged SQLite database ({exc})"
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        return f"is in {folder}, where sqlite cannot write (a database needs its folder)"
    return None


def default_artifact_root(uri: str) -> str | None:
    """``<directory of the db>/mlartifacts`` (absolute) for a sqlite URI, else None."""
    db = sqlite_db_path(uri)
    return str((db.parent / "mlartifacts").resolve()) if db is not None else None


def mlflow_executable() -> list[str]:
    """Command prefix that runs the ``mlflow`` CLI of this environment."""
    exe = Path(sys.executable).with_name("mlflow")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mlflow")
    return [found] if found else [sys.executable, "-m", "mlflow"]


def ui_command(store_uri: str, host: str = "127.0.0.1", port: int = 5000) -> list[str]:
    """Argument list that serves the MLflow UI for a local sqlite store on ``host:port``.

    Runs ``mlflow server`` (the venv's executable beside ``sys.executable``, else
    ``python -m mlflow``) with one worker, artifacts served from ``<db dir>/mlartifacts``.
    Runs logged straight into the sqlite store keep their absolute artifact paths, which the
    server reads directly; experiments created through the server store under the same folder.
    """
    db = sqlite_db_path(store_uri)
    if db is None:
        raise ValueError(
            f"`sat ui` serves a local sqlite store (sqlite:///path/mlflow.db); got {redact_uri(store_uri)!r}"
        )
    return mlflow_executable() + [
        "server",
        "--backend-store-uri",
        f"sqlite:///{db.resolve()}",
        "--artifacts-destination",
        str(default_artifact_root(store_uri)),
        "--host",
        host,
        "--port",
        str(int(port)),
        "--workers",
        "1",
    ]


# --------------------------------------------------------------------------- HTTP timeout env

_ENV_LOCK = threading.Lock()
_ENV_USERS = 0
_ENV_SET_BY_US: list[str] = []


def acquire_http_env(timeout_s: float, max_retries: int) -> None:
    global _ENV_USERS
    wanted = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(math.ceil(timeout_s)))),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(int(max_retries)),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    with _ENV_LOCK:
        if _ENV_USERS == 0:
            for name, value in wanted.items():
                if name not in os.environ:
                    os.environ[name] = value
                    _ENV_SET_BY_US.append(name)
        _ENV_USERS += 1


def release_http_env() -> None:
    global _ENV_USERS
    with _ENV_LOCK:
        _ENV_USERS -= 1
        if _ENV_USERS == 0:
            for name in _ENV_SET_BY_US:
                os.environ.pop(name, None)
            _ENV_SET_BY_US.clear()


def store_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the store failed", as opposed to a bug in the caller."""
    from mlflow.exceptions import MlflowException

    errors: tuple[type[BaseException], ...] = (MlflowException, OSError)
    try:
        from sqlalchemy.exc import SQLAlchemyError

        errors += (SQLAlchemyError,)
    except ImportError:  # mlflow-skinny has no sqlalchemy; sqlite stores need the full package
        pass
    return errors


def check_step(step: Any) -> int:
    """MLflow steps are int64; a bad one would be rejected by the store at every retry."""
    value = int(step)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"MLflow step must fit in int64, got {step!r}")
    return value


def is_caller_error(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE"


class store_lock:
    """An exclusive ``flock`` on ``<db>.lock`` beside a sqlite store (no-op for other stores)."""

    def __init__(self, db: Path | None):
        self.path = None if db is None else db.with_name(db.name + ".lock")
        self.fd = None

    def __enter__(self):
        if self.path is not None:
            import fcntl

            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# MLflow 3's experiment kind: the UI opens such experiments in the model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def experiment_id(client, name: str, artifact_root: str | None, errors) -> str:
    """The id of the experiment ``name``, created (at ``artifact_root``, as model training) when
    absent; a deleted one is a ``TrackingError``; one without a kind is tagged as model training.
    ``errors``: the store's exception types (:func:`store_errors`)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(
                name,
                artifact_location=artifact_root,
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        except errors as exc:
            # another process (e.g. a parallel sweep job) created it in the meantime
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {exp.experiment_id}) is deleted; "
            f"restore it (`mlflow experiments restore --experiment-id {exp.experiment_id}`) "
            "or choose another experiment name."
        )
    kind = exp.tags.get(EXPERIMENT_KIND_TAG)
    if kind is None or kind.endswith("_inferred") or kind == "no_inferred_type":
        try:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except errors as exc:  # e.g. a server that lets this user log runs only
            log.warning("could not tag MLflow experiment %r as model training: %s", exp.name, exc)
    return exp.experiment_id
