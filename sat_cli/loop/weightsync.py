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
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli import metric_names as M
from sat_cli.errors import EngineError, RunFailed, WeightsMismatch, WeightSyncError

MODES = ("disk", "distributed")
VERIFY = ("first", "every", "off")


class WeightSyncFailed(RunFailed):
    """A version reached the engine neither by broadcast nor from disk (or never verified):
    exit 1; the last checkpoint is intact."""


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
        self.layout = getattr(engine, "checksum_layout", None)
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
        path = self.weights_dir / f"v{int(version)}"
        if not path.is_dir():
            if self.sender is None or not self.sender.has(version):
                raise WeightSyncFailed(f"weights v{version} are neither on disk ({path}) nor held")
            self.sender.write_hf(version, path)
        return path

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
        if self.sender is not None and self.sender.has(version):
            try:
                self._record(version, self._distributed(version))
                return
            except (WeightSyncError, WeightsMismatch) as exc:
                first = exc
                self.fallbacks += 1
                self.log(f"WARNING: weights v{version}: {exc}; sending them from disk instead")
        try:
            self._record(version, self._disk(version, forced=first is not None))
        except (WeightSyncError, WeightsMismatch) as exc:
            if first is None:  # a disk load that failed: once more from disk
                first = exc
                self.fallbacks += 1
                self.log(f"WARNING: weights v{version}: {exc}; loading them from disk again")
                try:
                    self._record(version, self._disk(version, forced=True))
                    return
                except (WeightSyncError, WeightsMismatch) as again:
                    exc = again
            raise self._failed(version, first, exc) from None

    def _distributed(self, version: int) -> dict[str, float]:
        timing = self.engine.sync_weights(self.sender, version, self.s.group)
        if self._wants("distributed", False):
            timing["verify_s"] = self._verify(version, "distributed", self.sender.checksums)
        return timing

    def _disk(self, version: int, forced: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        path = self.to_disk(version)
        written = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            self.engine.update_weights(str(path), version)
        except EngineError as exc:
            if not self.engine.health():
                raise  # a dead engine is no sync failure: the run stops on it
            raise WeightSyncError(f"loading {path} failed: {exc}") from None
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        timing = {
            "pause_s": 0.0,
            "wire_s": time.perf_counter() - t1,
            "assemble_s": written,
            "bytes": float(nbytes),
        }
        if self._wants("disk", forced):
            # what the trainer sent: its sender's copy when it has one (a fallback), else the
            # published folder's files
            held = self.sender is not None and self.sender.has(version)
            expected_of = (
                self.sender.checksums
                if held
                else (lambda v, layout: _disk_sums(path, layout, self.s.dtype))
            )
            timing["verify_s"] = self._verify(version, "disk", expected_of)
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


def _disk_sums(path: Path, layout: str, dtype: str) -> dict[str, str]:
    """Expected checksums of a published folder (what the disk path sent)."""
    from sat_cli.models.hf_config import config_if_usable
    from sat_cli.trainers.megatron.hf_io import read_all
    from sat_cli.weightsync.layouts import expected_checksums

    cfg = config_if_usable(path, "published weights") or {}
    tied = bool(cfg.get("tie_word_embeddings", False))
    return expected_checksums(read_all(path).items(), layout, dtype, tied=tied)
