"""Test shorthand for the loss's one entry point, ``registry.compute(cfg, LossInputs(...))``."""

from __future__ import annotations

from sat_cli.rl import registry
from sat_cli.rl.config import LossConfig
from sat_cli.rl.loss_io import LossInputs
from sat_cli.rl.losses import policy_loss


def loss_of(cfg: LossConfig, **tensors):
    """``(loss, metrics)`` of ``registry.compute(cfg, LossInputs(**tensors))``."""
    out = registry.compute(cfg, LossInputs(**tensors))
    return out.loss, out.metrics


def policy_loss_kw(logp, denom, adv, mask, **kw):
    """``losses.policy_loss`` with ``level``, ``token_weights`` and ``diag`` passed on and the
    other keywords as its ``LossConfig`` (for keyword dicts shared with a float64 reference)."""
    own = {k: kw.pop(k) for k in ("level", "token_weights", "diag") if k in kw}
    return policy_loss(logp, denom, adv, mask, LossConfig(**kw), **own)
