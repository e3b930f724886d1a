"""The ways a weight version reaches the engine, one class each behind :class:`Transport`; the
policy that chooses between them (order, verification, the disk fallback, metrics) is
``loop/weightsync.py``'s :class:`~sat_cli.loop.weightsync.WeightSync`.

- :class:`DiskTransport` (``engine.weight_sync=disk``, and every fallback): ``weights/v<N>`` on
  disk — an HF folder, or ``trainer.lora``'s adapter folder — loaded by the engine's
  ``update_weights``; the folder is written from the trainer's sender when only it holds the
  version.
- :class:`DistributedTransport` (``engine.weight_sync=distributed``): the trainer's sender
  broadcasts the version to the engine in one process group (gloo on the CPU, nccl on GPUs;
  ``engine.sync_weights``: the local worker's or SGLang's half).

Each says which versions it carries, sends one (returning its timing: ``pause_s``, ``wire_s``,
``assemble_s``, ``bytes``) and names what it sent, as the engine's checksum layout would see it
(``expected``), for the verification the engine declares (``engines/verification.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from sat_cli.errors import EngineError, RunFailed, WeightSyncError


class WeightSyncFailed(RunFailed):
    """A version reached the engine neither by broadcast nor from disk (or never verified):
    exit 1; the last checkpoint is intact."""


class Transport(Protocol):
    kind: str  # in messages, and the key of "verified once" (engine.verify_weights=first)

    def carries(self, version: int) -> bool:
        """Whether it can send ``version`` now."""
        ...

    def send(self, version: int) -> dict[str, float]:
        """The engine serves ``version`` when this returns (``WeightSyncError`` if not)."""
        ...

    def expected(self, version: int, layout: str) -> dict[str, str]:
        """The checksums an engine of ``layout`` must serve after ``send(version)``."""
        ...


class DistributedTransport:
    """The trainer's ``sender`` broadcasting to the engine in ``group`` (a ``GroupSpec``)."""

    kind = "distributed"

    def __init__(self, engine, sender, group) -> None:
        self.engine, self.sender, self.group = engine, sender, group

    def carries(self, version: int) -> bool:
        return self.sender.has(version)

    def send(self, version: int) -> dict[str, float]:
        return self.engine.sync_weights(self.sender, version, self.group)

    def expected(self, version: int, layout: str) -> dict[str, str]:
        return self.sender.checksums(version, layout)


class DiskTransport:
    """``weights/v<N>`` in ``weights_dir``, loaded by ``engine.update_weights``; ``sender``: the
    trainer's copies in memory (None: the disk path alone), ``dtype``: the engine's."""

    kind = "disk"

    def __init__(self, engine, sender, weights_dir: Path, dtype: str) -> None:
        self.engine, self.sender = engine, sender
        self.weights_dir, self.dtype = Path(weights_dir), dtype

    def carries(self, version: int) -> bool:
        return True

    def to_disk(self, version: int) -> Path:
        """``weights/v<N>`` on disk (written from the sender's copy when missing)."""
        path = self.weights_dir / f"v{int(version)}"
        if not path.is_dir():
            if self.sender is None or not self.sender.has(version):
                raise WeightSyncFailed(f"weights v{version} are neither on disk ({path}) nor held")
            self.sender.write_hf(version, path)
        return path

    def send(self, version: int) -> dict[str, float]:
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
        return {
            "pause_s": 0.0,
            "wire_s": time.perf_counter() - t1,
            "assemble_s": written,
            "bytes": float(nbytes),
        }

    def expected(self, version: int, layout: str) -> dict[str, str]:
        """What the trainer sent: its sender's copy when it has one (a fallback), else the
        published folder's files."""
        if self.sender is not None and self.sender.has(version):
            return self.sender.checksums(version, layout)
        return disk_checksums(self.weights_dir / f"v{int(version)}", layout, self.dtype)


def disk_checksums(path: Path, layout: str, dtype: str) -> dict[str, str]:
    """Expected checksums of a published folder (what the disk path sent)."""
    from sat_cli.models.hf_config import config_if_usable
    from sat_cli.trainers.megatron.hf_io import read_all
    from sat_cli.weightsync.layouts import expected_checksums

    cfg = config_if_usable(path, "published weights") or {}
    tied = bool(cfg.get("tie_word_embeddings", False))
    return expected_checksums(read_all(path).items(), layout, dtype, tied=tied)
