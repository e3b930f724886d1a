"""The edge of ``engine.weight_sync`` / ``engine.verify_weights`` (issue 28): the config in,
the loop's ``SyncSettings``, the local trainer's ``WeightSender`` and the check that the engine
can take a distributed sync out (``loop/weightsync.py`` has the policy, ``weightsync/`` the
sender and the group)."""

from __future__ import annotations

import json
from pathlib import Path

from sat_cli.errors import UserError


def weight_sender(obj, path: str):
    """The local trainer's weight sender (``engine.weight_sync=distributed``), else None."""
    if obj.engine.weight_sync != "distributed":
        return None
    from sat_cli.config.devices import device_plan
    from sat_cli.weightsync.sender import WeightSender

    device = device_plan(obj).find("local trainer").device  # the trainer's GPU (cuda:K)
    config = Path(path) / "config.json"
    tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings"))
    return WeightSender(dtype=obj.engine.dtype, device=device, source_dir=path,
                        bucket_bytes=obj.engine.weight_sync_bucket_mb * 2**20, tied=tied)  # fmt: skip


def sender_spec(obj) -> dict | None:
    """The Megatron worker's rank-0 sender (``engine.weight_sync=distributed``), else None: the
    engine's dtype, and the device buckets are flattened on (a GPU for NCCL)."""
    if obj.engine.weight_sync != "distributed":
        return None
    e = obj.engine
    return {"dtype": e.dtype, "device": "cuda" if e.device == "cuda" else "cpu",
            "bucket_bytes": e.weight_sync_bucket_mb * 2**20}  # fmt: skip


def weight_sync_settings(obj):
    """The loop's ``SyncSettings``: the weight path, verification and the group (gloo when the
    engine runs on the CPU, nccl on a GPU)."""
    from sat_cli.loop.weightsync import GroupSpec, SyncSettings

    e = obj.engine
    group = GroupSpec(
        master_addr=e.weight_sync_master_addr,
        port=e.weight_sync_port,
        backend="nccl" if e.device == "cuda" else "gloo",
        timeout_s=e.weight_sync_timeout_s,
    )
    return SyncSettings(mode=e.weight_sync, verify=e.verify_weights, dtype=e.dtype, group=group)


def check_port(obj) -> None:
    """An explicit ``engine.weight_sync_port`` already in use on this machine: exit 2 before
    anything is written (the local trainer's sender listens there; 0 takes a free port)."""
    e = obj.engine
    if e.weight_sync != "distributed" or not e.weight_sync_port or obj.trainer.name != "local":
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


def check_weight_sync_support(obj, engine) -> None:
    """``engine.weight_sync=distributed`` with an engine or server that cannot do it: exit 2
    naming why (asked once the engine runs: a server's routes are known only by asking it)."""
    if obj.engine.weight_sync != "distributed":
        return
    probe = getattr(engine, "distributed_sync_unsupported", None)
    reason = "it has no distributed weight sync" if probe is None else probe()
    if reason:
        raise UserError(f"engine.weight_sync=distributed cannot be used: {reason}; "
                        "use engine.weight_sync=disk")  # fmt: skip
