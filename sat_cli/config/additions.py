"""Rules of the ``algo`` section's loss additions (docs/algorithms.md §5), torch-free.

* ``algo.str_delta`` (the sequence trust region) and ``algo.score_centering`` compose with the
  clipped algorithms that carry no behaviour weight of their own (``rl.names.TRUST_ALGOS``);
* score centering is not drift-free on ``dppo_tv`` (its keep-mask is not a function of the
  token's ratio; ``rl.names.CENTERING_ALGOS``), and has no estimator for a sequence-level
  ratio against ``mu`` (GSPO and
  GSPO-token with ``algo.correction=none`` and ``algo.ratio_denominator=rollout``;
  ``rl.score_centering.weight_for``), and needs the sampler's top-k
  (``algo.score_centering_topk >= 1``).

The loss (``rl.registry.compute``) refuses the same combinations with ``ValueError``; here they
fail at compose time, like every other setting.
"""

from __future__ import annotations

from sat_cli.rl.names import CENTERING_ALGOS, SEQUENCE_ALGOS, TRUST_ALGOS
from sat_cli.validate import ConfigError, check_range


def check_loss_additions(algo) -> None:
    """Refuse the combinations of the module docstring (``algo``: an ``AlgoConfig``)."""
    if algo.str_delta is not None:
        check_range("algo.str_delta", algo.str_delta, 0, lo_open=True)
    on = [k for k in ("str_delta", "score_centering") if getattr(algo, k) not in (None, False)]
    if on and algo.name not in TRUST_ALGOS:
        raise ConfigError(
            f"{' and '.join('algo.' + k for k in on)} compose with algo="
            f"{'|'.join(TRUST_ALGOS)} only; got algo={algo.name}"
        )
    if not algo.score_centering:
        return
    if algo.name not in CENTERING_ALGOS:
        raise ConfigError(
            f"algo.score_centering=true is not drift-free on algo={algo.name}: its keep-mask "
            "drops tokens by |pi - mu|, not by their own ratio, which the centering cannot "
            f"cancel; it composes with algo={'|'.join(CENTERING_ALGOS)} (docs/algorithms.md §5)"
        )
    seq_ratio = algo.name in SEQUENCE_ALGOS and algo.correction == "none"
    if seq_ratio and algo.ratio_denominator == "rollout":
        raise ConfigError(
            f"algo.score_centering=true has no estimator for algo={algo.name} with the ratio "
            "against mu (its token weight is the response's ratio); set "
            "algo.ratio_denominator=recompute or algo.correction=tis|mis|icepop"
        )
    if algo.score_centering_topk < 1:
        raise ConfigError(
            "algo.score_centering=true needs the sampler's top-k: set algo.score_centering_topk "
            "to K >= 1"
        )


def ledger_versions(on: bool, n: int, profile: str | None) -> int:
    """``algo.ledger``: how many versions' weights the trainer holds for the ledger, the largest
    lag a sample can have plus 2 (``lag.n``, or the lag profile's largest lag); 0 when off."""
    if not on:
        return 0
    if profile is None:
        return n + 2
    from sat_cli.loop.lag_profile import parse_profile

    return parse_profile(profile).max_lag + 2
