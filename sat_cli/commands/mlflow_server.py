"""``sat mlflow-server``: one MLflow tracking server for every node of a cluster.

A thin wrapper over ``mlflow server``: the backend store is a database every run reaches
through the server (PostgreSQL, the case this is for; MySQL and sqlite are passed through), the
artifacts go under ``--artifacts-destination`` (a shared path) and are served by the server
(``--serve-artifacts``: runs on other nodes upload through HTTP). Before the server starts
(exit 2, one line): the port must be free, the database driver installed (``psycopg`` 3, the
``[postgres]`` extra) and the database reachable within ``--db-timeout`` seconds. A
``postgresql://`` URI is run with SQLAlchemy's psycopg 3 dialect (``postgresql+psycopg://``),
since the default dialect wants psycopg2. Passwords never appear in what it prints. It binds
127.0.0.1 unless ``--host`` says otherwise (a cluster: the head node's address), prints the
tracking URI for ``tracking=mlflow_server tracking.uri=…``, and stops with Ctrl-C, SIGTERM or
SIGHUP (the whole process group). MLflow's telemetry is off unless ``--telemetry``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlsplit

from sat_cli.errors import UserError

POSTGRES_INSTALL = "pip install -e '.[postgres]'  (psycopg 3; or pip install 'psycopg[binary]')"
SCHEMES = ("postgresql", "postgresql+psycopg", "mysql", "mysql+pymysql", "sqlite")
MYSQL_DRIVERS = {"mysql": ("MySQLdb", "mysqlclient"), "mysql+pymysql": ("pymysql", "pymysql")}


def backend_uri(uri: str) -> str:
    """The URI MLflow gets: ``postgresql://`` → ``postgresql+psycopg://``; others unchanged."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in SCHEMES:
        raise UserError(
            f"--backend-store-uri {_redacted(uri)!r}: expected a database URI such as "
            "postgresql://USER[:PASSWORD]@HOST:5432/DB (or mysql://…, sqlite:///…)"
        )
    try:  # every part of the URI read once here: a malformed one is one line, not a traceback
        parts = urlsplit(uri)
        _ = (parts.port, parts.hostname)  # ValueError for a bad port or IPv6 host
    except ValueError as exc:
        raise UserError(f"--backend-store-uri {_redacted(uri)!r}: malformed ({exc})") from None
    if scheme == "sqlite":
        _check_sqlite_path(uri)
    driver = MYSQL_DRIVERS.get(scheme)
    if driver and importlib.util.find_spec(driver[0]) is None:
        raise UserError(
            f"--backend-store-uri {scheme}://…: needs the {driver[0]} module, which is not "
            f"installed: pip install {driver[1]}"
        )
    if scheme == "postgresql":
        return "postgresql+psycopg://" + uri.split("://", 1)[1]
    return uri


def _check_sqlite_path(uri: str) -> None:
    """``sqlite:///path``: a file every worker of the server opens (not an in-memory store),
    whose folder exists or is created here (not under a regular file)."""
    path = uri.split("://", 1)[1].split("?", 1)[0]
    if not path.startswith("/") or path in ("/", "/:memory:"):
        raise UserError(
            f"--backend-store-uri {uri!r}: a sqlite store is a file, sqlite:///relative.db or "
            "sqlite:////absolute/path.db (an in-memory store would be one per server worker)"
        )
    folder = Path(path[1:]).parent  # sqlite:///rel.db -> rel.db; sqlite:////abs.db -> /abs.db
    for above in (folder, *folder.parents):
        if above.exists() and not above.is_dir():
            raise UserError(
                f"--backend-store-uri {uri!r}: {str(above)!r} is a file, not a folder for the store"
            )
    _make_folder(folder, f"--backend-store-uri {uri!r}: its folder {str(folder)!r}")
    from sat_cli.tracking.store import sqlite_store_problem

    db = Path(path[1:])
    why = sqlite_store_problem(db)
    if why is None and not db.exists():  # the server creates it: try a file there (root
        import tempfile  # passes os.access everywhere, /proc included)

        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            why = f"cannot be created in {str(folder)!r} ({exc.strerror or exc})"
    if why is not None:
        raise UserError(f"--backend-store-uri {uri!r}: {str(db)!r} {why}")


def _make_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{what}: cannot create it ({exc.strerror})") from None


def _unspecified(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _redacted(uri: str) -> str:
    from sat_cli.tracking.store import redact_uri

    return redact_uri(uri)


def check_database(uri: str, timeout_s: float) -> None:
    """Connect once (PostgreSQL) so that a wrong host, port, user or database is one clear
    line now, not a traceback of the server later."""
    if not uri.startswith("postgresql"):
        return
    try:
        import psycopg
    except ImportError:
        raise UserError(
            f"a PostgreSQL store needs psycopg, which is not installed: {POSTGRES_INSTALL}"
        ) from None
    plain = "postgresql://" + uri.split("://", 1)[1]
    try:
        with psycopg.connect(plain, connect_timeout=max(1, int(timeout_s))):
            pass
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        parts = urlsplit(plain)
        where = f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"
        raise UserError(f"cannot reach the PostgreSQL store at {where}: {first}") from None


def server_command(store: str, artifacts: str, *, host: str, port: int, workers: int) -> list[str]:
    from sat_cli.tracking.store import mlflow_executable

    return mlflow_executable() + [
        "server",
        "--backend-store-uri",
        store,
        "--artifacts-destination",
        artifacts,
        "--serve-artifacts",
        "--host",
        host,
        "--port",
        str(int(port)),
        "--workers",
        str(int(workers)),
    ]


def run_server(
    backend_store_uri: str,
    artifacts_destination: str,
    *,
    host: str,
    port: int,
    workers: int,
    telemetry: bool,
    db_timeout_s: float,
    env: dict[str, str] | None = None,
) -> int:
    """Check, start, print the tracking URI, serve until stopped (the module docstring)."""
    from sat_cli.commands.ui import base_url, check_port, serve, server_env

    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    store = backend_uri(backend_store_uri)
    check_port(host, port)
    artifacts = Path(artifacts_destination).expanduser()
    if "://" not in artifacts_destination:
        _make_folder(artifacts, f"--artifacts-destination {artifacts_destination}")
        artifacts_destination = str(artifacts.resolve())
    check_database(store, db_timeout_s)
    url = base_url(host, port)
    print(
        f"MLflow server starting on {url}: store {_redacted(store)}, artifacts "
        f"{artifacts_destination}",
        flush=True,
    )

    tracking = url
    if _unspecified(host):  # every address: other nodes use this machine's name
        import socket

        tracking = f"http://{socket.gethostname()}:{int(port)}"

    def ready() -> None:
        print(f"MLflow server ready: {url}", flush=True)
        print(f"runs log here with: tracking=mlflow_server tracking.uri={tracking}", flush=True)
        print("Ctrl-C to stop", flush=True)

    command = server_command(store, artifacts_destination, host=host, port=port, workers=workers)
    return serve(command, url, server_env(telemetry, env), ready)
