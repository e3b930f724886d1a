"""What a rollout engine returns and is asked for: ``SamplingParams`` and ``Sample``, torch-free.

The data contract between the engines (which make samples), the trainers (which collate them:
``trainers/batch.py``), the replay store and the loop; it lives below all of them so that none
imports ``engines/`` for it (docs/ARCHITECTURE.md, "Layers").

A sample is exactly what the trainer needs from the engine: the token ids, the per-token
log-probs of the distribution the engine actually sampled from (``rollout_logp``, the behaviour
policy ``mu`` of ALGORITHMS.md §1), the finish reason, the weight version that produced it and,
with R3 on, the routed expert indices in SGLang's layout ``[prompt_len + response_len - 1,
num_layers, top_k]`` (int32). When the request asks (``SamplingParams.sampling_mask``,
``topk_logprobs``), also each token's kept set under top-p/top-k and the top-k of ``mu``: what
``algo.replay_sampling_mask`` and score centering train on (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
