"""The trainer's side of a distributed weight sync: :class:`WeightSender`.

A sender holds weight versions in memory, each an ordered list of ``(HF name, tensor)`` in the
engine's dtype (``capture``: what the disk export would write, without the write), and is rank 0
of the weight-update group (``listen`` + ``connect``, ``group.py``). ``send(version, k)``
broadcasts bucket ``k`` of ``plan(version)`` while the engine receives it; ``checksums`` are the
expected engine checksums of a version (``layouts.py``); ``write_hf`` writes a version as an HF
checkpoint (the disk fallback, and the versions a checkpoint's resume needs); ``abort`` closes
the group so that the engine's pending receive fails at once.

The local trainer's sender lives in the driver process; the Megatron trainer's in its rank 0
(``service.py``), where the full tensors are gathered. Thread-safe: the training thread captures
while the rollout thread sends.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sat_cli.errors import WeightSyncError
from sat_cli.weightsync import buckets as B


class WeightSender:
    """Weight versions in memory and rank 0 of the weight-update group (module docstring).

    ``dtype``: the engine's (tensors are cast on capture); ``device``: where a bucket is
    broadcast from (``cuda`` for NCCL); ``bucket_bytes``: the bucket size
    (``engine.weight_sync_bucket_mb``); ``source_dir``: the model folder whose config and
    tokenizer files ``write_hf`` copies; ``tied``: tied embeddings (SGLang then serves no
    ``lm_head.weight``).

    A captured version is held as its buckets' flat byte buffers (one copy of each tensor,
    written straight into them; the broadcast sends them as they are); the buffers of dropped
    versions are reused by the next capture of the same size."""

    def __init__(
        self,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        bucket_bytes: int = 512 * 2**20,
        source_dir: str | None = None,
        max_shard_size: int | str = "5GB",
        tied: bool = False,
    ):
        self.dtype, self.device, self.bucket_bytes = dtype, device, int(bucket_bytes)
        self.source_dir, self.max_shard_size, self.tied = source_dir, max_shard_size, tied
        self._versions: dict[int, tuple[list[B.Bucket], list]] = {}
        self._spare: list = []  # flat buffers of dropped versions
        self._lock = threading.Lock()
        self._store = None
        self._group = None
        self.port: int | None = None
        self.last_send_s = 0.0  # the broadcast of the last bucket (wire time)
        self.last_flatten_s = 0.0  # its copy to the broadcast's device (assemble time)

    # --- versions ------------------------------------------------------------------------
    def capture(self, version: int, named) -> int:
        """Hold ``named`` (``(HF name, tensor)`` pairs or a dict) as ``version``: each tensor
        cast to the engine's dtype and copied into its bucket (the trainer goes on changing its
        own); returns the bytes."""
        import torch

        cast = getattr(torch, self.dtype)
        items = [(str(k), v) for k, v in (named.items() if isinstance(named, dict) else named)]
        metas = [
            B.TensorMeta(k, self.dtype, tuple(v.shape), v.numel() * cast.itemsize) for k, v in items
        ]
        plan = B.plan_metas(metas, self.bucket_bytes)
        flats, tensors = [], iter(v for _, v in items)
        with torch.no_grad():
            for bucket in plan:
                flat = self._buffer(bucket.nbytes)
                for (_, view), t in zip(B.unflatten(flat, bucket), tensors, strict=False):
                    view.copy_(t.detach())
                flats.append(flat)
        with self._lock:
            self._versions[int(version)] = (plan, flats)
        return sum(b.nbytes for b in plan)

    def _buffer(self, nbytes: int):
        import torch

        with self._lock:
            for i, flat in enumerate(self._spare):
                if flat.numel() == nbytes:
                    return self._spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def has(self, version: int) -> bool:
        with self._lock:
            return int(version) in self._versions

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def keep(self, versions) -> None:
        """Drop every held version not in ``versions`` (its buffers kept for reuse, at most one
        version's worth)."""
        keep = {int(v) for v in versions}
        with self._lock:
            for v in [v for v in self._versions if v not in keep]:
                self._spare = self._versions.pop(v)[1]

    def _held(self, version: int) -> tuple[list[B.Bucket], list]:
        with self._lock:
            if int(version) not in self._versions:
                raise WeightSyncError(f"weights v{version} are not held by the sender")
            return self._versions[int(version)]

    def _get(self, version: int) -> list[tuple[str, object]]:
        """``(HF name, tensor)`` of a held version (views into its buffers)."""
        plan, flats = self._held(version)
        return [pair for b, f in zip(plan, flats, strict=True) for pair in B.unflatten(f, b)]

    def named(self, version: int) -> list[tuple[str, object]]:
        return self._get(version)

    def nbytes(self, version: int) -> int:
        return sum(b.nbytes for b in self._held(version)[0])

    def plan(self, version: int) -> list[B.Bucket]:
        return list(self._held(version)[0])

    def checksums(self, version: int, layout: str) -> dict[str, str]:
        from sat_cli.weightsync.layouts import expected_checksums

        return expected_checksums(self._get(version), layout, tied=self.tied)

    def write_hf(self, version: int, folder: str | Path) -> Path:
        """``version`` as an HF checkpoint at ``folder`` (atomic; config and tokenizer files
        from ``source_dir``), as the disk export writes it."""
        from sat_cli.models.hf_checkpoint import save_hf_checkpoint

        state = dict(self._get(version))
        return save_hf_checkpoint(state, folder, self.source_dir or folder, self.max_shard_size)

    # --- the group ---------------------------------------------------------------------------
    def listen(self, master_addr: str, port: int, world_size: int, timeout_s: float) -> int:
        """Bind the group's store (before any engine is told the port); returns the port."""
        from sat_cli.weightsync.group import listen

        self.abort()
        self._store = listen(master_addr, port, world_size, timeout_s)
        self._addr, self._world, self._timeout = master_addr, int(world_size), float(timeout_s)
        self.port = int(self._store.port)
        return self.port

    def connect(self, group_name: str, backend: str) -> None:
        """Join as rank 0; returns when every engine rank joined (``WeightSyncError`` after the
        timeout given to :meth:`listen`)."""
        from sat_cli.weightsync.group import open_group

        if self._store is None:
            raise WeightSyncError("WeightSender.connect before listen")
        self._group = open_group(
            store=self._store,
            master_addr=self._addr,
            port=self.port,
            rank=0,
            world_size=self._world,
            group_name=group_name,
            backend=backend,
            timeout_s=self._timeout,
        )

    @property
    def connected(self) -> bool:
        return self._group is not None and self._group.pg is not None

    def send(self, version: int, index: int) -> int:
        """Broadcast bucket ``index`` of ``plan(version)``; returns its bytes.
        ``WeightSyncError`` when the broadcast fails or outlives the group's timeout."""
        import torch.distributed as dist

        group = self._group
        pg = group.pg if group is not None else None  # abort() may close it meanwhile
        if pg is None:
            raise WeightSyncError("the weight-sync group is not open (closed after a failure)")
        t0 = time.perf_counter()
        flat = self._on_wire(self._held(version)[1][index].to(self.device))
        t1 = time.perf_counter()
        try:
            dist.broadcast(flat, src=0, group=pg)
        except (RuntimeError, ValueError) as exc:
            raise WeightSyncError(
                f"broadcast of weights v{version} bucket {index} ({flat.numel()} bytes) failed: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        self.last_flatten_s, self.last_send_s = t1 - t0, time.perf_counter() - t1
        return int(flat.numel())

    def _on_wire(self, flat):
        """The bytes that leave (fault tests damage them here)."""
        return flat

    def abort(self) -> None:
        """Close the group (the engine's pending receives fail now); a later sync listens anew."""
        group, self._group, self._store = self._group, None, None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.abort()
        with self._lock:
            self._versions.clear()
