"""The weight-update process group between the trainer's sender (rank 0) and the engine ranks.

SGLang 0.5.23 joins with ``init_custom_process_group`` (``srt/utils/common.py``): a TCP store
at ``master_address:master_port`` from ``rendezvous``, wrapped in a ``PrefixStore`` named after
the group, then ``_new_process_group_helper``; a plain ``init_process_group`` never meets it.
:func:`open_group` makes the same group on either side. The sender listens first
(:func:`listen`: the port is bound before any engine is told about it, so a port in use is a
clear error and no engine waits on a stranger's port), then every side calls :func:`open_group`,
which returns once all ranks have joined or raises after ``timeout_s``.

:meth:`Group.close` destroys the group and drops every reference to it: gloo then closes its
sockets, and a peer blocked in a receive fails at once ("Connection closed by peer") instead of
waiting for its own timeout (SGLang's is 30 minutes) — checked with a real server.
"""

from __future__ import annotations

import gc

from sat_cli.errors import WeightSyncError


def listen(master_addr: str, port: int, world_size: int, timeout_s: float):
    """The group's TCP store, master side (``port`` 0: a free port; ``store.port`` says which).
    A port in use raises ``WeightSyncError`` naming it."""
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(
            master_addr,
            int(port),
            int(world_size),
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        why = "in use" if "EADDRINUSE" in str(exc) or "in use" in str(exc) else "not usable"
        raise WeightSyncError(
            f"cannot listen on {master_addr}:{port} for the weight-sync group (port {why}: "
            f"{str(exc).splitlines()[0]}); set engine.weight_sync_port to a free port, or 0 "
            "for any free one"
        ) from None


class Group:
    """One joined group: ``pg`` (for ``torch.distributed.broadcast``) until :meth:`close`."""

    def __init__(self, pg, name: str, store=None):
        self.pg, self.name, self._store = pg, name, store

    def close(self) -> None:
        """Destroy the group and drop every reference to it (module docstring)."""
        import torch.distributed as dist

        pg, self.pg, self._store = self.pg, None, None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError, KeyError):
            pass  # already gone
        del pg
        gc.collect()


def open_group(
    *,
    store=None,
    master_addr: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> Group:
    """Join the group as ``rank`` (the sender passes the store :func:`listen` made). Blocks until
    every rank has joined; ``WeightSyncError`` after ``timeout_s``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(
                master_addr, int(port), int(world_size), is_master=False, timeout=timeout
            )
        pg, _ = _new_process_group_helper(
            int(world_size),
            int(rank),
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    except (RuntimeError, OSError, ValueError) as exc:
        raise WeightSyncError(
            f"weight-sync group {group_name} ({backend}, {master_addr}:{port}, rank {rank} of "
            f"{world_size}) did not form within {timeout_s:g} s: {str(exc).splitlines()[0]}"
        ) from None
    _world.pg_group_ranks[pg] = {i: i for i in range(int(world_size))}
    return Group(pg, group_name, store)
