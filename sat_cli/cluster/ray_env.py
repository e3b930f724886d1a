"""Importing Ray (an optional extra) and connecting to a running cluster with deadlines.

- Ray is imported only here, inside functions: ``sat --help`` and the default install never
  touch it. Without it, ``launcher=ray`` and ``--executor ray`` exit 2 naming the install line.
- **Loopback clusters stay on loopback.** Ray rewrites a 127.0.0.1 address to the machine's
  own IP (and then cannot reach a cluster that listens on loopback only) unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray is imported; for a loopback
  ``address`` sat sets it, and the driver's node IP to 127.0.0.1. Usage statistics are off.
- **A quiet console.** The driver prints every error the cluster publishes (e.g. a lost raylet's
  state dump, dozens of lines) on its standard output; with ``log_path`` those go to that file
  instead (the one place sat reaches into Ray's private module; left alone if it moved).
- **Deadlines.** ``ray.init`` to an address nobody answers retries for a long time: the address
  is probed with a TCP connection first (``connect_timeout_s``), and ``ray.init`` itself runs
  under the same deadline.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

from sat_cli.errors import RunFailed, UserError

RAY_INSTALL = "pip install -e '.[ray]'  (in a clone; or pip install 'sat-cli[ray]')"


class ClusterError(RunFailed):
    """The cluster cannot run this (unreachable, infeasible, a lost node): exit 1."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def import_ray(loopback: bool, what: str = "launcher=ray"):
    """``import ray`` (set up for a loopback cluster when ``loopback``); UserError without it."""
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's core worker aborts the whole process (no cleanup, the MLflow run left RUNNING) when
    # the head's GCS has been gone for 60 s; sat's own health checks end the run instead.
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(365 * 24 * 3600))
    try:
        import ray
    except ImportError:
        raise UserError(f"{what} needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.strip().rpartition(":")
    return host.strip("[]"), int(port)


def _errors_to_file(log_path) -> None:
    from pathlib import Path

    from ray._private import worker

    if not hasattr(worker, "print_to_stdstream"):
        return
    path = Path(log_path)

    def to_file(data, ignore_prefix=False) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write("\n".join(str(x) for x in data.get("lines", [])) + "\n")
        except OSError:
            pass

    worker.print_to_stdstream = to_file


def connect(
    address: str,
    timeout_s: float,
    namespace: str,
    what: str = "launcher=ray",
    log_path=None,
):
    """Connect this process to the cluster at ``address`` (never start one); returns ``ray``."""
    host, port = split_address(address)
    ray = import_ray(is_loopback(host), what)
    if ray.is_initialized():
        return ray
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"cannot reach the Ray cluster at {address} within {timeout_s:g} s "
                    f"({exc.strerror or exc}): is `ray start --head --port={port}` running on "
                    f"{host}, and can this machine reach it?"
                ) from None
            time.sleep(0.5)
    done: dict = {}

    def init() -> None:
        try:
            kw = {"_node_ip_address": "127.0.0.1"} if is_loopback(host) else {}
            ray.init(
                address=f"{host}:{port}",
                namespace=namespace,
                log_to_driver=False,
                logging_level="ERROR",  # not its "SIGTERM handler is not set" (sat handles it)
                configure_logging=True,
                **kw,
            )
            done["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported below, in one line
            done["error"] = exc

    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 1.0))
    if "error" in done:
        exc = done["error"]
        raise ClusterError(
            f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}"
        )
    if not done.get("ok"):
        raise ClusterError(
            f"the Ray cluster at {address} accepted a TCP connection but `ray.init` did not "
            f"complete within {timeout_s:g} s: is that port a Ray head node's GCS port?"
        )
    if log_path is not None:
        _errors_to_file(log_path)
    return ray
