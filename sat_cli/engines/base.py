"""The rollout-engine interface shared by the local engine and SGLang: the ``RolloutEngine``
protocol. Its data (``SamplingParams``, ``Sample``) live in ``sat_cli.samples`` and its errors
(``EngineError``, ``EngineStartError``, ``WeightSyncError``, ``WeightsMismatch``) in
``sat_cli.errors``, below every package that uses them; both are re-exported here as the
engine's interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from sat_cli.engines.verification import Verification
from sat_cli.errors import EngineError, EngineStartError, WeightsMismatch, WeightSyncError
from sat_cli.samples import Sample, SamplingParams

__all__ = [
    "EngineError",
    "EngineStartError",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "WeightSyncError",
    "WeightsMismatch",
]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training loop needs from a rollout engine.

    ``generate_async`` returns at once; the future resolves to one list of ``n`` samples per
    prompt, in prompt order. ``update_weights`` loads a published HF checkpoint directory and
    tags later samples with ``version``; it is applied between requests, or, where the engine
    takes in-flight updates (``LocalEngineRuntime(inflight_updates=True)``, SGLang paused in place),
    between decode steps, and the samples then carry ``token_versions``.

    ``weight_verification`` has no default: every engine declares how the weights it serves
    are verified (``engines/verification.py``: ``Checksums(layout)`` with
    ``served_checksums()``, ``OnArrival(how)`` or ``Unverified(reason)``); a run refuses an
    engine that declares none (``tests/test_architecture.py`` checks every registered one).

    Capabilities with defaults here (an engine that subclasses this protocol overrides what it
    has): ``pid`` (its own process, ``logs/pids.json``), ``numerics`` (its worker's numeric
    paths, ``machine.engine.*`` tags) and ``distributed_sync_unsupported()`` with
    ``sync_weights(sender, version, group)`` (``engine.weight_sync=distributed``).
    """

    pid: int | None = None
    weight_verification: Verification | None = None  # None: undeclared, refused by a run
    numerics: Mapping[str, str] = MappingProxyType({})

    def distributed_sync_unsupported(self) -> str | None:
        """Why this engine cannot take ``engine.weight_sync=distributed`` (None: it can)."""
        return "it has no distributed weight sync"

    def generate_async(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> Future[list[list[Sample]]]: ...

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]: ...

    def update_weights(self, path: str, version: int) -> None: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...
