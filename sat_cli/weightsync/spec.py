"""``engine.weight_sync`` / ``engine.verify_weights`` from the engine's settings (issue 28): the
local trainer's ``WeightSender``, the Megatron worker's sender spec and the checks that the
sender's port is free and the engine can take a broadcast. Torch-free until a sender is built
(``loop/weightsync.py`` has the policy, ``sender.py`` and ``group.py`` the broadcast)."""

from __future__ import annotations

import json
from pathlib import Path

from sat_cli.errors import UserError


def weight_sender(engine, device: str, path: str):
    """A trainer's weight sender in this process (``engine.weight_sync=distributed``), else
    None. ``engine``: the engine's settings; ``device``: where the trainer's weights live."""
    if engine.weight_sync != "distributed":
        return None
    from sat_cli.weightsync.sender import WeightSender

    config = Path(path) / "config.json"
    tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings"))
    bucket = engine.weight_sync_bucket_mb * 2**20
    return WeightSender(
        dtype=engine.dtype, device=device, source_dir=path, bucket_bytes=bucket, tied=tied
    )


def sender_spec(engine) -> dict | None:
    """The Megatron worker's rank-0 sender (``engine.weight_sync=distributed``), else None: the
    engine's dtype, and the device buckets are flattened on (a GPU for NCCL)."""
    if engine.weight_sync != "distributed":
        return None
    return {
        "dtype": engine.dtype,
        "device": "cuda" if engine.device == "cuda" else "cpu",
        "bucket_bytes": engine.weight_sync_bucket_mb * 2**20,
    }


def check_port(engine, in_process: bool) -> None:
    """An explicit ``engine.weight_sync_port`` already in use on this machine: exit 2 before
    anything is written (``in_process``: the trainer's sender listens in this process; 0 takes
    a free port)."""
    e = engine
    if e.weight_sync != "distributed" or not e.weight_sync_port or not in_process:
        return
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((e.weight_sync_master_addr, e.weight_sync_port))
    except OSError as exc:
        raise UserError(
            f"engine.weight_sync_port={e.weight_sync_port}: cannot listen on "
            f"{e.weight_sync_master_addr}:{e.weight_sync_port} for the weight-sync group "
            f"({exc.strerror or exc}); choose a free port, or 0 for any free one"
        ) from None


def check_support(engine_settings, engine) -> None:
    """``engine.weight_sync=distributed`` with an engine or server that cannot do it: exit 2
    naming why (asked once the engine runs: a server's routes are known only by asking it)."""
    if engine_settings.weight_sync != "distributed":
        return
    reason = engine.distributed_sync_unsupported()
    if reason:
        raise UserError(
            f"engine.weight_sync=distributed cannot be used: {reason}; use engine.weight_sync=disk"
        )
