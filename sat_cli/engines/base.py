"""The rollout-engine interface shared by the local engine and SGLang.

A sample is exactly what the trainer needs from the engine: the token ids, the per-token
log-probs of the distribution the engine actually sampled from (``rollout_logp``, the behaviour
policy ``mu`` of ALGORITHMS.md §1), the finish reason, the weight version that produced it and,
with R3 on, the routed expert indices in SGLang's layout ``[prompt_len + response_len - 1,
num_layers, top_k]`` (int32). When the request asks (``SamplingParams.sampling_mask``,
``topk_logprobs``), also each token's kept set under top-p/top-k and the top-k of ``mu``: what
``algo.replay_sampling_mask`` and score centering train on (docs/algorithms.md).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter (SGLang's convention)
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # engine-side RNG seed for this request (reproducible sampling)
    # record each sampled token's kept set (Sample.sampling_mask) when top-p/top-k filter
    sampling_mask: bool = False
    topk_logprobs: int = 0  # > 0: record the sampled distribution's top-k (Sample.topk_*)

    @property
    def filtering(self) -> bool:
        """True when top-p or top-k cuts the distribution sampled from (then it is not the
        full softmax at the temperature, and the engines report what they kept)."""
        return self.top_p < 1.0 or self.top_k >= 1


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logp: list[float]  # [response_len], log mu(y_t | ...) as sampled (temperature applied)
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # version of the weights that generated the sample (first token)
    routed_experts: np.ndarray | None = None  # int32 [prompt_len + response_len - 1, L, K]
    token_versions: list[int] | None = None  # [response_len], only when versions mix in-flight
    # with SamplingParams.sampling_mask and filtering: per response token, the int32 ids the
    # filters kept (the support of mu at that position), most probable first
    sampling_mask: list[np.ndarray] | None = None
    # with SamplingParams.topk_logprobs = K: the K most probable ids of mu at each position and
    # their log mu (int32 / float32 [response_len, K]; id -1 and log-prob 0 pad a shorter support)
    topk_ids: np.ndarray | None = None
    topk_logp: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


class EngineError(RuntimeError):
    """The rollout engine failed (process died, server unreachable, bad response): exit 1."""


class EngineStartError(EngineError):
    """The engine process started but reported that its model failed to load: the user's input
    (`sat train` / `sat eval` say "cannot load the model", exit 2)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training loop needs from a rollout engine.

    ``generate_async`` returns at once; the future resolves to one list of ``n`` samples per
    prompt, in prompt order. ``update_weights`` loads a published HF checkpoint directory and
    tags later samples with ``version``; it is applied between requests, or, where the engine
    takes in-flight updates (``LocalEngine(inflight_updates=True)``, SGLang paused in place),
    between decode steps, and the samples then carry ``token_versions``.

    Optional (``sat_cli.loop.weightsync``): ``served_checksums()`` and ``checksum_layout``
    (``engine.verify_weights``); ``sync_weights(sender, version, group)`` and
    ``distributed_sync_unsupported()`` (``engine.weight_sync=distributed``).
    """

    def generate_async(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> Future[list[list[Sample]]]: ...

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]: ...

    def update_weights(self, path: str, version: int) -> None: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...


class WeightSyncError(EngineError):
    """A weight sync that did not complete: an HTTP error or ``success: false`` from a server, a
    collective that did not finish in time, a group that did not form. The training loop sends
    that version again through the disk path once (``sat_cli.loop.weightsync``)."""


class WeightsMismatch(EngineError):
    """The weights an engine serves differ from what the trainer sent (``engine.verify_weights``):
    never a warning, the version is sent again from disk once, then the run fails."""
