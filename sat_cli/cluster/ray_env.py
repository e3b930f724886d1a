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
- **The run's environment reaches the actors.** A Ray actor starts with its node's environment,
  not the driver's: every actor sat creates gets a ``runtime_env`` whose ``env_vars`` are the
  variables of this process on the allow-list (:func:`forwarded_env`: ``NCCL_*``, ``GLOO_*``,
  ``HF_*``, ``CUDA_*`` but ``CUDA_VISIBLE_DEVICES`` (Ray sets it per bundle), ``TORCH_*``,
  ``SAT_*``, … and ``OMP_NUM_THREADS``-like names). A name that looks like a secret (``TOKEN``,
  ``SECRET``, ``PASSWORD``, ``KEY``, ``CREDENTIAL`` in it) is never forwarded unless
  ``$SAT_RAY_ENV`` names it (``SAT_RAY_ENV=HF_TOKEN,WANDB_API_KEY``); the names forwarded are
  logged, never the values.
- **A placement the cluster cannot hold is refused before anything starts** (:func:`unmet`):
  a bundle larger than every live node (CPUs, GPUs, memory, custom resources), more
  ``STRICT_SPREAD`` bundles than nodes that can hold them, a ``STRICT_PACK`` group larger than
  any node.
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

FORWARD_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "CUDA_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "SAT_",
    "SGLANG_",
    "UCX_",
    "FI_",
)
FORWARD_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TZ")
NEVER_FORWARD = ("CUDA_VISIBLE_DEVICES",)  # Ray gives each bundle its own
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
RAY_INSTALL = "pip install -e '.[ray]'  (in a clone; or pip install 'sat-cli[ray]')"


class ClusterError(RunFailed):
    """The cluster cannot run this (unreachable, infeasible, a lost node): exit 1."""


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that Ray actors get (module
    docstring): the allow-list without secret-looking names, plus every name ``$SAT_RAY_ENV``
    lists (comma-separated) that is set."""
    from sat_cli.util.options import env

    environ = dict(os.environ if environ is None else environ)
    named = {n.strip() for n in str(env("SAT_RAY_ENV", "") or "").split(",") if n.strip()}
    out = {}
    for name, value in environ.items():
        allowed = name.startswith(FORWARD_PREFIXES) or name in FORWARD_NAMES
        secret = any(word in name.upper() for word in SECRET_WORDS)
        if name in named or (allowed and not secret and name not in NEVER_FORWARD):
            out[name] = value
    return dict(sorted(out.items()))


def runtime_env(log=None, what: str = "Ray actors") -> dict:
    """The ``runtime_env`` of an actor sat creates; ``log`` gets the names (never values)."""
    env = forwarded_env()
    if log is not None:
        names = ", ".join(env) if env else "none"
        log(f"ray: environment forwarded to the {what}: {names}")
    return {"env_vars": env} if env else {}


def unmet(bundles: list[dict], strategy: str, nodes: list[dict]) -> str | None:
    """Why no live node set can hold ``bundles`` under ``strategy``, or None. ``nodes``: each
    live node's total resources (Ray's names: CPU, GPU, memory in bytes, custom)."""

    def fits(bundle: dict, node: dict) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in bundle.items())

    def show(res: dict) -> str:
        keys = sorted(k for k in res if not k.startswith(("node:", "object_store")))
        return ", ".join(
            f"{k}: {res[k] / 1e9:.1f} GB" if k == "memory" else f"{k}: {res[k]:g}" for k in keys
        )

    if not nodes:
        return "the cluster has no live node"
    biggest = "; ".join(f"[{show(n)}]" for n in nodes)
    for b in bundles:
        if not any(fits(b, n) for n in nodes):
            return f"a bundle [{show(b)}] is larger than every live node ({biggest})"
    if strategy == "STRICT_PACK":
        total: dict = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        if not any(fits(total, n) for n in nodes):
            return f"STRICT_PACK needs [{show(total)}] on one node, and none has it ({biggest})"
    if strategy == "STRICT_SPREAD":

        def size(res: dict) -> tuple:
            return (res.get("GPU", 0.0), res.get("CPU", 0.0), res.get("memory", 0.0))

        free = sorted(nodes, key=size)  # each bundle its own node: the biggest bundle first,
        for b in sorted(bundles, key=size, reverse=True):  # on the smallest node that holds it
            match = next((n for n in free if fits(b, n)), None)
            if match is None:
                return (
                    f"STRICT_SPREAD puts each of the {len(bundles)} bundles on its own node, "
                    f"and only {len(nodes) - len(free)} of the {len(nodes)} live nodes can "
                    f"hold them ({biggest})"
                )
            free.remove(match)
    return None


def live_nodes(ray) -> list[dict]:
    """The total resources of every live node of the connected cluster."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


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
