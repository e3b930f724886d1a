"""What goes into the policy loss and what comes out of it: ``registry.compute(cfg, inputs)``.

``LossInputs`` holds the tensors of one (mini)batch, ``LossConfig`` (``sat_cli.rl.config``) the
settings; ``LossOutputs`` the loss, its detached metrics and, when asked for, the per-token
diagnostics the step's histograms are drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one (mini)batch, aligned ``[B, T]`` unless said otherwise.

    ``versions`` (``[B]`` or ``[B, T]``), ``current_version`` and ``seq_score_sqnorm`` (``[B]``)
    are read only by the algorithms that need them (``registry.AlgoSpec.needs``);
    ``diagnostics=True`` fills ``LossOutputs.diag``."""

    logp: torch.Tensor  # log pi_theta of the sampled tokens, with grad
    rollout_logp: torch.Tensor  # log mu, the behaviour policy's (detached)
    advantages: torch.Tensor  # [B] or [B, T], detached
    mask: torch.Tensor  # nonzero on tokens that count in the loss
    old_logp: torch.Tensor | None = None  # recomputed log pi_old (the recompute pass)
    versions: torch.Tensor | None = None  # the tokens' weight versions (a3po)
    current_version: int | None = None  # the trainer's weight version (a3po)
    seq_score_sqnorm: torch.Tensor | None = None  # ||grad sum_t log pi||^2 per response (vcpo)
    # score centering (``LossConfig.score_centering``): the sampler's top-k ids per position,
    # the trainer policy's log-probs there (``[B, T, K]``, with grad), the sampler's (detached)
    # and which of the K entries are real (``[B, T, K]`` bool; padding is False)
    policy_topk_logp: torch.Tensor | None = None
    sampler_topk_logp: torch.Tensor | None = None
    topk_valid: torch.Tensor | None = None
    diagnostics: bool = False


@dataclass
class LossOutputs:
    """``loss``: 0-dim tensor to minimise; ``metrics``: detached Python floats (names in
    ``sat_cli.metric_names``); ``diag``: with ``LossInputs.diagnostics``, the detached
    per-token quantities the loss used (``clip_metrics.token_diagnostics``) plus ``abs_d_mu``
    (``[N]`` float32, ``|logp - rollout_logp|`` of the active tokens), else ``None``."""

    loss: torch.Tensor
    metrics: dict[str, float]
    diag: dict[str, torch.Tensor] | None = None
