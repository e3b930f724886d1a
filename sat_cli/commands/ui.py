"""`sat ui`: the MLflow UI for a local run store, opened where a trainer looks.

What it does, in order:

* **Checks before starting** (exit 2, ``sat: error:``): the store ``<run dir>/mlflow.db``
  exists and can be read; ``--port`` is a TCP port (1-65535) and free on ``--host``, checked by
  binding it the way the server will (``SO_REUSEADDR``), so a busy port fails at once instead of
  leaving a server that logs an error and exits 0; ``--host`` resolves and can be bound.
* **Telemetry off by default.** MLflow 3 collects usage data: the server process, and the browser
  UI through the server's ``/ajax-api/3.0/mlflow/ui-telemetry`` endpoint. The server runs with
  ``MLFLOW_DISABLE_TELEMETRY=true``, so it sends nothing and answers the UI's request with
  ``disable_ui_telemetry: true``. ``--telemetry`` passes the environment unchanged (MLflow's
  own default, or whatever the user's environment says). MLflow's home page keeps showing a
  notice about UI telemetry until it is dismissed: that notice is stored in the browser and
  does not mean data is sent.
* **The model-training view.** MLflow 3.17 opens experiments in its GenAI view (traces,
  "Evaluation runs") unless the URL carries ``workflowType=machine_learning``: its global
  "GenAI / Model training" switch decides, and the experiment tag ``mlflow.experimentKind``
  (which ``sat`` sets on its experiments, see :mod:`sat_cli.tracking`) is what versions without
  the switch read. Once the server answers ``/health``, ``sat ui`` prints the URL of each
  experiment in the store with that parameter (most recently updated first; MLflow's empty
  ``Default`` experiment is left out).
* **Stopping.** The server runs in its own process group; Ctrl-C, SIGTERM and SIGHUP stop the
  whole group and exit 130 / 143 / 129. A server that exits before it answers gives exit 1.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from sat_cli.errors import RunFailed, UserError

WORKFLOW_QUERY = "workflowType=machine_learning"
MAX_LISTED = 20


class _Stop(KeyboardInterrupt):
    """SIGTERM / SIGHUP while the UI runs: stop the server, exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__()
        self.code = 128 + signum
        self.signame = signal.Signals(signum).name  # `sat: interrupted (SIGTERM)` (cli.py)


def _raise_stop(signum, frame):  # pragma: no cover - exercised through a real process
    raise _Stop(signum)


def check_port(host: str, port: int) -> None:
    """Raise :class:`UserError` unless ``host:port`` can be listened on right now."""
    if not host.strip():
        raise UserError("--host must not be empty (default 127.0.0.1)")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port: use 1-65535")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} cannot be resolved: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {port} on {host} is already in use (another `sat ui` or MLflow "
                    "server?); stop it or choose another with --port"
                ) from None
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def base_url(host: str, port: int) -> str:
    """The URL a browser on this machine uses: a wildcard bind address shows as loopback."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port}"
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    return f"http://[{ip}]:{port}" if ip.version == 6 else f"http://{ip}:{port}"


def experiment_url(base: str, experiment_id: str) -> str:
    """The URL that opens an experiment's runs in MLflow's model-training view."""
    return f"{base}/#/experiments/{experiment_id}?{WORKFLOW_QUERY}"


def store_experiments(store_uri: str) -> list[tuple[str, str]]:
    """``(name, id)`` of the active experiments of a store, most recently updated first, without
    an empty ``Default``. Raises :class:`UserError` when the store cannot be read."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    try:
        client = MlflowClient(tracking_uri=store_uri)
        exps = client.search_experiments(
            view_type=ViewType.ACTIVE_ONLY, order_by=["last_update_time DESC"]
        )
        out = []
        for e in exps:
            if e.name == "Default" and not client.search_runs([e.experiment_id], max_results=1):
                continue
            out.append((e.name, e.experiment_id))
    except Exception as exc:  # a damaged or foreign file: user input
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"cannot read the MLflow store {store_uri}: {first}") from None
    return out


def server_env(telemetry: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's, which for a CLI command is
    the user's environment before `sat` set its own defaults) with MLflow telemetry disabled
    unless ``telemetry``."""
    env = dict(os.environ if base is None else base)
    if not telemetry:
        env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_ui(
    run_dir: str, *, host: str, port: int, telemetry: bool, env: dict[str, str] | None = None
) -> int:
    """Serve the UI until stopped; the exit code (the server's, 0 after a clean stop).

    ``env``: the environment the server starts from (see :func:`server_env`)."""
    from sat_cli.tracking import ui_command

    db = Path(run_dir) / "mlflow.db"
    if not db.is_file():
        raise UserError(f"no MLflow store at {db}: run `sat train` first or pass --run-dir")
    check_port(host, port)
    store = f"sqlite:///{db}"
    experiments = store_experiments(store)
    url = base_url(host, port)
    state = "on (--telemetry)" if telemetry else "off; --telemetry turns it on"
    print(f"MLflow UI starting on {url}  (MLflow usage telemetry {state})", flush=True)

    def ready() -> None:
        print(f"MLflow UI ready: {url}/#/?{WORKFLOW_QUERY}", flush=True)
        for name, exp_id in experiments[:MAX_LISTED]:
            print(f"  experiment {name!r}: {experiment_url(url, exp_id)}", flush=True)
        if len(experiments) > MAX_LISTED:
            print(f"  … and {len(experiments) - MAX_LISTED} more experiments", flush=True)
        print("Ctrl-C to stop", flush=True)

    return serve(ui_command(store, host=host, port=port), url, server_env(telemetry, env), ready)


def serve(command: list[str], url: str, env: dict[str, str], ready) -> int:
    """Run an MLflow server (its own process group) until it exits or is stopped (Ctrl-C,
    SIGTERM, SIGHUP stop the whole group); ``ready()`` runs once ``url/health`` answers. The
    exit code: the server's, 0 after a clean stop; exit 1 (``RunFailed``) if it dies first."""
    handlers = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        while not _healthy(url):
            if proc.poll() is not None:
                raise RunFailed(
                    f"the MLflow server exited (code {proc.returncode}) before it answered on "
                    f"{url}; its output is above"
                )
            time.sleep(0.5)
        ready()
        code = proc.wait()
        return code if code >= 0 else 1
    finally:
        _stop(proc)
        for s, h in handlers.items():
            signal.signal(s, h)
