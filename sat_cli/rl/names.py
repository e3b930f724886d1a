"""The names of the policy-loss choices, defined once and torch-free.

The config schema validates against these tuples and ``sat_cli.rl.registry`` registers exactly
these algorithms and corrections (``tests/test_rl_config.py`` keeps all three in sync). Importing
this module imports nothing but the standard library, so the config layer can use it without
torch.
"""

from __future__ import annotations

ALGOS = ("ppo", "grpo", "gspo", "gspo_token", "dppo_tv", "decoupled_ppo", "m2po", "a3po", "vcpo")
UNCLIPPED_ALGOS = ("m2po", "vcpo")  # no clip interval: SAT (clip.adaptive) cannot apply
# clipped algorithms without a behaviour weight of their own: the sequence trust region
# (str_delta) and score centering compose with these only
TRUST_ALGOS = ("ppo", "grpo", "gspo", "gspo_token", "dppo_tv")
# score centering cancels the drift of a token weight that is a function of the token's own
# ratio k = p/mu (docs/algorithms.md §5); dppo_tv's keep-mask depends on |p - mu| instead, so
# on it the centred loss keeps a drift: score centering composes with these only
CENTERING_ALGOS = ("ppo", "grpo", "gspo", "gspo_token")
# sequence-level ratios: with the ratio against mu (no correction) score centering has no estimator
SEQUENCE_ALGOS = ("gspo", "gspo_token")
CORRECTIONS = ("none", "tis", "mis", "icepop")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DENOMINATORS = ("rollout", "recompute")
ANCHORS = ("q", "min_q_eps")
Q_SCOPES = ("batch", "micro_batch")
BEHAV_MODES = ("clip", "mask")
LEVELS = ("token", "sequence", "sequence_token")  # ratio levels (``rl.losses``)
