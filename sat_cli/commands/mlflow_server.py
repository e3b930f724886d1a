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

**Host check.** MLflow's server answers only requests whose ``Host`` header it allows (its guard
against DNS rebinding; by default localhost and private IP addresses). ``sat mlflow-server``
passes MLflow's ``--allowed-hosts`` the list :func:`allowed_hosts` builds: MLflow's defaults,
the name in the tracking URI it prints (this machine's host name when ``--host`` is every
address, else ``--host``) and each ``--allowed-hosts`` item (``NAME`` or ``NAME:PORT``, ``*``
wildcards; a name without a port also matches it with any port). A bare ``*`` (every host) is
refused.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from urllib.parse import urlsplit

from sat_cli.errors import UserError

POSTGRES_INSTALL = "pip install -e '.[postgres]'  (psycopg 3; or pip install 'psycopg[binary]')"
SCHEMES = ("postgresql", "postgresql+psycopg", "mysql", "mysql+pymysql", "sqlite")
_HOST_ITEM = re.compile(r"[A-Za-z0-9.*\-\[\]:%_]{1,253}")
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


def _host_list(named: list[str], tracking_host: str) -> list[str]:
    hosts = allowed_hosts(named, tracking_host)
    if named:
        print(f"MLflow host check: also serving Host {', '.join(named)}", flush=True)
    return hosts


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


def parse_allowed_hosts(text: str | None) -> list[str]:
    """``--allowed-hosts a,b:5000,*.corp`` → its items; UserError (exit 2) for an empty item, a
    character no host name has, or a bare ``*``."""
    if text is None:
        return []
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not _HOST_ITEM.fullmatch(item):
            raise UserError(
                f"--allowed-hosts {text[:200]!r}: {item[:80]!r} is not a host name, NAME:PORT "
                "or a pattern with * (comma-separated, no spaces inside)"
            )
        if item.strip("*:") == "":
            raise UserError(
                f"--allowed-hosts {text[:200]!r}: {item!r} would accept every Host header (no "
                "DNS-rebinding protection); name the hosts clients use, e.g. head01,head01.corp"
            )
    return items


def allowed_hosts(items: list[str], tracking_host: str) -> list[str]:
    """What MLflow's ``--allowed-hosts`` gets (module docstring): its defaults, the tracking
    URI's host and ``items``, each name without a port also as ``NAME:*``; no repeats."""
    from mlflow.server.security_utils import get_default_allowed_hosts

    out = list(get_default_allowed_hosts())
    for item in [tracking_host, *items]:
        has_port = re.search(r":[0-9*]+$", item) and not item.endswith("]")
        bracketed = item.startswith("[") and not has_port
        out.append(item)
        if not has_port:  # fnmatch reads '[' as a set: an IPv6 literal's bracket escaped
            out.append(("[[]" + item[1:] if bracketed else item) + ":*")
    return list(dict.fromkeys(out))


def server_command(
    store: str,
    artifacts: str,
    *,
    host: str,
    port: int,
    workers: int,
    hosts: list[str] | None = None,
) -> list[str]:
    from sat_cli.tracking.store import mlflow_executable

    extra = ["--allowed-hosts", ",".join(hosts)] if hosts else []
    return (
        mlflow_executable()
        + [
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
        + extra
    )


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
    allowed_hosts: str | None = None,
) -> int:
    """Check, start, print the tracking URI, serve until stopped (the module docstring)."""
    from sat_cli.commands.ui import base_url, check_port, serve, server_env

    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    store = backend_uri(backend_store_uri)
    named = parse_allowed_hosts(allowed_hosts)
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

    tracking, tracking_host = url, host
    if _unspecified(host):  # every address: other nodes use this machine's name
        import socket

        tracking_host = socket.gethostname()
        tracking = f"http://{tracking_host}:{int(port)}"
    if ":" in tracking_host and not tracking_host.startswith("["):
        tracking_host = f"[{tracking_host}]"  # an IPv6 literal, as a Host header carries it
    hosts = _host_list(named, tracking_host)

    def ready() -> None:
        print(f"MLflow server ready: {url}", flush=True)
        print(f"runs log here with: tracking=mlflow_server tracking.uri={tracking}", flush=True)
        print("Ctrl-C to stop", flush=True)

    command = server_command(
        store, artifacts_destination, host=host, port=port, workers=workers, hosts=hosts
    )
    return serve(command, url, server_env(telemetry, env), ready)
