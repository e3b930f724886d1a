"""``engine.weight_sync`` / ``engine.verify_weights`` from the engine's settings (issue 28): the
local trainer's ``WeightSender``, the Megatron worker's sender spec and the checks that the
sender's port is free and the engine can take a broadcast. Torch-free until a sender is built
(``loop/weightsync.py`` has the policy, ``sender.py`` and ``group.py`` the broadcast)."""

from __future__ import annotations

import errno

from sat_cli.errors import UserError


def weight_sender(engine, device: str, path: str):
    """A trainer's weight sender in this process (``engine.weight_sync=distributed``), else
    None. ``engine``: the engine's settings; ``device``: where the trainer's weights live."""
    if engine.weight_sync != "distributed":
        return None
    from sat_cli.models.hf_config import config_if_usable
    from sat_cli.weightsync.sender import WeightSender

    tied = bool((config_if_usable(path) or {}).get("tie_word_embeddings"))
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
    """Where the trainer's sender listens in this process (``in_process``), the group's address
    (``engine.weight_sync_master_addr``) must resolve and be this machine's, and an explicit
    ``engine.weight_sync_port`` be free: exit 2 before anything is written. An address that does
    not resolve used to fail every version's broadcast, each after the timeout, then go through
    the disk: a run as slow as the disk path and twice the timeout per version."""
    e = engine
    if e.weight_sync != "distributed" or not in_process:
        return
    import socket

    addr, port = e.weight_sync_master_addr, e.weight_sync_port
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[
            0
        ]
    except (OSError, UnicodeError) as exc:  # socket.gaierror, an over-long or odd name
        raise UserError(
            f"engine.weight_sync_master_addr={addr!r} does not resolve "
            f"({getattr(exc, 'strerror', None) or exc}): the weight-sync group listens there; "
            "set an address of this machine (127.0.0.1 when the engine runs here)"
        ) from None
    try:
        with socket.socket(family, kind, proto) as s:
            s.bind(sockaddr)
    except OSError as exc:
        if port and exc.errno == errno.EADDRINUSE:
            which, fix = (
                f"engine.weight_sync_port={port}",
                "choose a free port, or 0 for any free one",
            )
        else:  # EADDRNOTAVAIL: another machine's address
            which = f"engine.weight_sync_master_addr={addr!r}"
            fix = "set an address of this machine (127.0.0.1 when the engine runs here)"
        raise UserError(
            f"{which}: cannot listen on {addr}:{port} for the weight-sync group "
            f"({exc.strerror or exc}); {fix}"
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
