"""Launch pieces shared by the client (node 0) and ``sat worker --join`` (the other nodes).

Torch-free, so that ``sat worker`` starts without importing torch. Multi-node jobs use
torchrun's *static* rendezvous (``--node-rank k --master-addr HOST --master-port PORT``): node
ranks are fixed, so global rank 0, which reads the client's commands and replies on the FIFO,
is always on the node of ``sat train``. The TCP store listens on ``HOST:PORT`` of that node.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

WORKER_MODULE = "sat_cli.trainers.megatron.worker"


def node_rendezvous(endpoint: str, node_rank: int) -> list[str]:
    """torchrun's static rendezvous arguments for node ``node_rank`` of a multi-node job."""
    host, _, port = endpoint.rpartition(":")
    return ["--node-rank", str(node_rank), "--master-addr", host, "--master-port", port]


def join_command(endpoint: str, config_path: os.PathLike) -> str:
    """The command that joins another node to the job (``sat worker --join``)."""
    return f"sat worker --join {endpoint} --config {config_path}"


def launch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: this project importable, unbuffered output, ``env`` on top."""
    run_env = dict(os.environ)
    project_root = str(Path(__file__).resolve().parents[3])
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (project_root, run_env.get("PYTHONPATH")) if p
    )
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env.update(env or {})
    return run_env


def torchrun_command(
    python: str,
    *,
    nproc_per_node: int,
    nnodes: int,
    endpoint: str,
    node_rank: int,
    log_dir: os.PathLike,
    config: os.PathLike,
    fifo: os.PathLike,
) -> list[str]:
    """torchrun running the worker on one node (an argument list: no shell)."""
    if nnodes == 1:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        rendezvous += ["--rdzv-id", uuid.uuid4().hex[:12]]
    else:  # static: node ranks are fixed, so global rank 0 (which replies) is on node 0
        rendezvous = node_rendezvous(endpoint, node_rank)
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc_per_node),
        "--nnodes",
        str(nnodes),
        *rendezvous,
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        # torchrun's own log folder: by default a /tmp/torchelastic_* folder that it never
        # removes; here it lives in the run-local work dir and is removed on close
        "--log-dir",
        str(log_dir),
        "-m",
        WORKER_MODULE,
        "--config",
        str(config),
        "--reply-fifo",
        str(fifo),
    ]
