"""``sat worker --join HOST:PORT --config WORK/worker_config.json [--node-rank k]``: run the
megatron trainer's ranks of one more node of a multi-node job (``trainer.nnodes > 1``).

``sat train`` starts node 0 (torchrun's static rendezvous at ``trainer.master_addr:
master_port``, the TCP store on that node), writes ``worker_config.json`` into the run's
``megatron/`` folder and prints this command. Every other node runs it with its node rank:
it checks its input, waits until the rendezvous accepts connections (``--wait`` seconds) and
then runs torchrun with the same worker module and config in the foreground (its exit code is
this command's). The config holds the model path and the trainer settings; like the batch files,
it must be readable at the same path on every node (a shared filesystem). No shell is involved
(argument lists only); torch is not imported here.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.records import Int, Obj, Str, read_checked


class JoinError(UserError):
    """Bad input to ``sat worker --join`` or an unreachable rendezvous (exit code 2)."""


# the fields `sat worker` uses of the worker_config.json `sat train trainer=megatron` writes
WORKER_CONFIG = Obj(
    {"model_path": Str(), "nnodes": Int(1, 4096), "nproc_per_node": Int(1, 1024)},
    required=("protocol", "model_path", "nnodes"),
)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JoinError(
            f"--join {endpoint!r}: expected HOST:PORT, the rendezvous that `sat train` printed "
            "(e.g. 127.0.0.1:29500)"
        )
    return host.strip("[]"), int(port)


def read_config(path: str) -> dict:
    """The job's ``worker_config.json``, read through the bounded reader and checked against
    :data:`WORKER_CONFIG` (``JoinError`` naming the file otherwise)."""

    if not Path(path).exists():
        raise JoinError(
            f"--config {path}: no such file; give the worker_config.json in the run's megatron/ "
            "folder (it must be at the same path on every node: a shared filesystem)"
        )
    cfg = read_checked(path, WORKER_CONFIG, what=f"--config {path}", error=JoinError)
    if cfg["nnodes"] < 2:
        raise JoinError(f"--config {path}: the job has trainer.nnodes=1; there is nothing to join")
    return cfg


def wait_reachable(host: str, port: int, wait: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ``JoinError`` after ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise JoinError(
                    f"cannot reach the job's rendezvous at {host}:{port} ({exc.strerror or exc}) "
                    f"within {wait:.0f} s: is `sat train` with trainer.nnodes > 1 running, and "
                    "is trainer.master_addr an address this node can reach?"
                ) from None
            time.sleep(0.5)


def join(
    endpoint: str,
    config: str,
    *,
    node_rank: int = 1,
    nproc_per_node: int | None = None,
    wait: float = 60.0,
    python: str | None = None,
) -> int:
    """Run this node's ranks (module doc); returns torchrun's exit code."""
    from sat_cli.trainers.megatron.launch import launch_env, torchrun_command

    host, port = parse_endpoint(endpoint)
    cfg = read_config(config)
    nnodes = cfg["nnodes"]
    if not 1 <= node_rank < nnodes:
        raise JoinError(f"--node-rank {node_rank}: must be 1 .. {nnodes - 1} (node 0 is sat train)")
    nproc = int(nproc_per_node or cfg.get("nproc_per_node", 1))
    if nproc != int(cfg.get("nproc_per_node", nproc)):
        raise JoinError(
            f"--nproc-per-node {nproc}: the job runs {cfg['nproc_per_node']} processes per node "
            "(trainer.nproc_per_node)"
        )
    wait_reachable(host, port, wait)
    work = Path(config).resolve().parent
    log_dir = Path(tempfile.mkdtemp(prefix="sat_torchelastic_"))
    command = torchrun_command(
        python or sys.executable,
        nproc_per_node=nproc,
        nnodes=nnodes,
        endpoint=f"{host}:{port}",
        node_rank=node_rank,
        log_dir=log_dir,
        config=Path(config).resolve(),
        fifo=work / "reply.fifo",  # opened by global rank 0 only, which is on node 0
    )
    print(f"sat worker: node {node_rank} of {nnodes} joining {host}:{port}", file=sys.stderr)
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, env=launch_env()).returncode
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
