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

A multi-turn trajectory (docs/environments.md) is one sample: ``response_ids`` is everything
after the first prompt, the model's turns and the environment's answers between them, exactly
as the engine returned and the environment's text was tokenised. Then ``loss_mask`` says, per
response token, whose it is (1: the model's, it trains; 0: the environment's, no loss and no
log-prob: ``rollout_logp`` is 0.0 there and every loss, correction and staleness statistic
leaves it out), ``turn_ids`` the model turn (0, 1, ...) each token belongs to (an
environment token: the turn it answers) and ``token_versions`` the weight version of each
token (an environment token carries the version of the turn it answers). A single-turn sample
leaves ``loss_mask`` and ``turn_ids`` None: all its response tokens are the model's, turn 0.
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
    # multi-turn (module docstring): [response_len] 1 = model token, 0 = environment token
    loss_mask: list[int] | None = None
    turn_ids: list[int] | None = None  # [response_len] the model turn of each token, from 0

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    def model_positions(self) -> list[int]:
        """Indices of the model's response tokens (all of them for a single-turn sample)."""
        if self.loss_mask is None:
            return list(range(self.response_len))
        return [i for i, m in enumerate(self.loss_mask) if m]

    def model_token_versions(self) -> list[int]:
        """The weight version of each of the model's response tokens, in order."""
        if self.token_versions is None:
            return [self.weight_version] * (
                self.response_len if self.loss_mask is None else sum(map(bool, self.loss_mask))
            )
        if self.loss_mask is None:
            return list(self.token_versions)
        return [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]

    def model_turns(self) -> list[int]:
        """The turn index of each of the model's response tokens, in order (0 single-turn)."""
        if self.turn_ids is None:
            return [0] * len(self.model_positions())
        return [self.turn_ids[i] for i in self.model_positions()]

    def oldest_version(self) -> int:
        """The oldest version among the model's tokens (the sample's version lag)."""
        versions = self.model_token_versions()
        return min(versions) if versions else self.weight_version
