"""How a weight version reaches the engine, and the proof that it arrived (issue 28).

:class:`WeightSync` sits between the publisher (training thread) and the rollout thread:

* ``engine.weight_sync=disk`` (default): publishing writes ``weights/v<N>`` (an HF checkpoint)
  and the engine loads it (``update_weights``), as before.
* ``distributed``: publishing *captures* the version in the trainer's sender (in memory, in the
  engine's dtype; no disk) and the rollout thread has the engine receive it by broadcast
  (``engine.sync_weights``: the local engine's worker or SGLang's servers in one group with the
  sender). Version 0 is still written to disk (a restarted engine and a resume need it), and a
  checkpoint writes the versions its resume can ask for (:meth:`WeightSync.to_disk`).
* **Verification** (``engine.verify_weights=first|every|off``, both paths): after a load, the
  engine's own per-tensor checksums (SGLang's ``/weights_checker`` ``checksum``, the local
  worker's equivalent) must equal the checksums of what the trainer sent, computed on the
  trainer's side (``weightsync/layouts.py``); ``first``: the first load of each path and every
  fallback, ``every``: every load. A mismatch is an error (``WeightsMismatch``), never a warning.
* **Fallback**: a failed distributed sync (``success: false``, an HTTP error, a collective or
  group that timed out) or a mismatch sends that version through the disk path once (written
  from the sender's copy), counted in ``weights/sync_fallback``; if that fails too (or a disk
  load fails twice) the run ends FAILED (:class:`WeightSyncFailed`, exit 1) before the next
  step, so the last checkpoint stays complete and ``resume=auto`` continues.

Per loaded version the metrics ``weights/sync_s`` (= pause + wire + assemble),
``weights/sync_pause_s`` (group set-up, SGLang's begin/end and pauses), ``weights/sync_wire_s``
(broadcast and load, or the disk load), ``weights/sync_assemble_s`` (capture and flattening, or
the disk write), ``weights/sync_bytes`` and ``weights/verify_s`` are added to the next logged
step (:meth:`WeightSync.metrics`).

Each path is a transport (``loop/transports.py``: :class:`DiskTransport`,
:class:`DistributedTransport`, one interface); this module is the policy over them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli import metric_names as M
from sat_cli.engines.verification import checksum_layout
from sat_cli.errors import WeightsMismatch, WeightSyncError
from sat_cli.loop.transports import DiskTransport, DistributedTransport, WeightSyncFailed

MODES = ("disk", "distributed")
VERIFY = ("first", "every", "off")


@dataclass(frozen=True)
class GroupSpec:
    """The weight-update group: the sender's address, port (0: any free one), backend (gloo on
    CPU, nccl on GPU) and the deadline of every collective wait (the bucket size is the
    sender's: ``WeightSender(bucket_bytes=...)``)."""

    master_addr: str = "127.0.0.1"
    port: int = 0
    backend: str = "gloo"
    timeout_s: float = 120.0


@dataclass(frozen=True)
class SyncSettings:
    mode: str = "disk"
    verify: str = "first"
    dtype: str = "float32"  # the engine's: expected checksums of disk loads are cast to it
    group: GroupSpec = field(default_factory=GroupSpec)

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.verify not in VERIFY:
            raise ValueError(f"weight sync {self.mode!r}/{self.verify!r}: use {MODES} / {VERIFY}")


class WeightSync:
    """Publishing, loading, verifying and falling back (module docstring)."""

    def __init__(self, settings: SyncSettings, engine, trainer, weights_dir: Path, log=print):
        self.s, self.engine, self.trainer = settings, engine, trainer
        self.weights_dir, self.log = Path(weights_dir), log
        self.sender = trainer.weight_sender if settings.mode == "distributed" else None
        self.layout = checksum_layout(engine)  # its declared Checksums' layout, else None
        self.disk = DiskTransport(engine, self.sender, self.weights_dir, settings.dtype)
        self.distributed = None
        if self.sender is not None:
            self.distributed = DistributedTransport(engine, self.sender, settings.group)
        self.verified: set[str] = set()  # paths verified once ("distributed", "disk")
        self.fallbacks = 0
        self._assemble: dict[int, float] = {}  # version -> capture or write seconds
        self._metrics: dict[str, float] = {}
        self._lock = threading.Lock()

    # --- the training thread ---------------------------------------------------------------
    def write(self, version: int) -> None:
        """Publish ``version``: capture it (distributed; version 0 is also written to disk) or
        write ``weights/v<N>`` (disk)."""
        t0 = time.perf_counter()
        if self.sender is not None and version != 0:
            self.trainer.capture_weights(version)
        else:
            self.trainer.publish_weights(self.weights_dir, version)
        with self._lock:
            self._assemble[int(version)] = time.perf_counter() - t0

    def to_disk(self, version: int) -> Path:
        """``weights/v<N>`` on disk (written from the sender's copy when missing)."""
        return self.disk.to_disk(version)

    def keep(self, versions) -> None:
        """Drop the sender's copies of versions nothing needs any more."""
        if self.sender is not None:
            self.sender.keep(versions)

    def metrics(self) -> dict[str, float]:
        """The ``weights/*`` metrics of the loads since the last call."""
        with self._lock:
            out, self._metrics = self._metrics, {}
        return out

    # --- the rollout thread ------------------------------------------------------------------
    def load(self, version: int) -> None:
        """The engine serves ``version`` (verified as configured) when this returns."""
        version = int(version)
        first: Exception | None = None
        if self.distributed is not None and self.distributed.carries(version):
            try:
                self._record(version, self._send(self.distributed, version, False))
                return
            except (WeightSyncError, WeightsMismatch) as exc:
                first = exc
                self.fallbacks += 1
                self.log(f"WARNING: weights v{version}: {exc}; sending them from disk instead")
        try:
            self._record(version, self._send(self.disk, version, first is not None))
        except (WeightSyncError, WeightsMismatch) as exc:
            if first is None:  # a disk load that failed: once more from disk
                first = exc
                self.fallbacks += 1
                self.log(f"WARNING: weights v{version}: {exc}; loading them from disk again")
                try:
                    self._record(version, self._send(self.disk, version, True))
                    return
                except (WeightSyncError, WeightsMismatch) as again:
                    exc = again
            raise self._failed(version, first, exc) from None

    def _send(self, transport, version: int, forced: bool) -> dict[str, float]:
        """``version`` through ``transport``, verified as configured (``forced``: a fallback)."""
        timing = transport.send(version)
        if self._wants(transport.kind, forced):
            timing["verify_s"] = self._verify(version, transport.kind, transport.expected)
        return timing

    def _wants(self, kind: str, forced: bool) -> bool:
        if self.s.verify == "off" or self.layout is None:
            return False
        return forced or self.s.verify == "every" or kind not in self.verified

    def _verify(self, version: int, kind: str, expected_of) -> float:
        t0 = time.perf_counter()
        expected = expected_of(version, self.layout)
        from sat_cli.weightsync.layouts import compare

        for where, served in self.engine.served_checksums().items():
            problems = compare(expected, served)
            if problems:
                shown = "; ".join(problems[:3]) + (
                    f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
                )
                raise WeightsMismatch(
                    f"{where} does not serve the weights v{version} it was sent ({kind}): "
                    f"{len(problems)} of {len(expected)} tensors differ: {shown}"
                )
        self.verified.add(kind)
        return time.perf_counter() - t0

    def _record(self, version: int, timing: dict[str, float]) -> None:
        with self._lock:
            assemble = timing.get("assemble_s", 0.0) + self._assemble.pop(version, 0.0)
            m = self._metrics
            m[M.SYNC_PAUSE_S] = m.get(M.SYNC_PAUSE_S, 0.0) + timing.get("pause_s", 0.0)
            m[M.SYNC_WIRE_S] = m.get(M.SYNC_WIRE_S, 0.0) + timing.get("wire_s", 0.0)
            m[M.SYNC_ASSEMBLE_S] = m.get(M.SYNC_ASSEMBLE_S, 0.0) + assemble
            m[M.SYNC_S] = m[M.SYNC_PAUSE_S] + m[M.SYNC_WIRE_S] + m[M.SYNC_ASSEMBLE_S]
            m[M.SYNC_BYTES] = m.get(M.SYNC_BYTES, 0.0) + timing.get("bytes", 0.0)
            m[M.VERIFY_S] = m.get(M.VERIFY_S, 0.0) + timing.get("verify_s", 0.0)
            m[M.SYNC_FALLBACK] = float(self.fallbacks)

    @staticmethod
    def _failed(version: int, first: Exception, second: Exception) -> WeightSyncFailed:
        return WeightSyncFailed(
            f"weights v{version} did not reach the engine: {first}; then from disk: {second}. "
            "The checkpoints written so far are complete: continue with resume=auto once the "
            "cause is fixed."
        )
