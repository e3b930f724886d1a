"""SAT's scope rule, torch-free: refuse SAT on a sequence-level ratio whose ``q`` is taken over
one response (a silent no-op; the paper preset used to do it)."""

from __future__ import annotations

import math

# SEQUENCE_ALGOS: ratio level "sequence" / "sequence_token" in sat_cli/rl/registry.py (a test
# keeps them in step)
from sat_cli.rl.names import SEQUENCE_ALGOS, UNCLIPPED_ALGOS
from sat_cli.validate import ConfigError

__all__ = ["SEQUENCE_ALGOS", "check_sat_scope"]


def check_sat_scope(algo: str, clip) -> None:
    """Refuse SAT on an algorithm without a clip interval, and on a sequence-level ratio with
    ``q`` taken over one response (``clip``: a ``ClipConfig``).

    With ``clip.q_scope=micro_batch`` and ``clip.micro_batch_size=1``, SAT-GSPO's ``q`` is the
    order statistic of one response, whose tokens all carry the same ``|d| = |log s_b|``: so
    ``q = |d|`` and the strict gate ``|d| > q`` never fires (docs/algorithms.md §4), and the
    anchored variant then contracts only a response PPO has already clipped. Either way no
    gradient changes: a run labelled SAT-GSPO would train exactly like GSPO, silently."""
    if algo in UNCLIPPED_ALGOS and clip.adaptive:
        raise ConfigError(f"algo={algo} has no clip interval for SAT to contract; use clip=ppo")
    if algo in UNCLIPPED_ALGOS and clip.radius_scale != 1.0:
        raise ConfigError(
            f"clip={clip.name} scales the clip radii by clip.radius_scale={clip.radius_scale:g}, "
            f"but algo={algo} has no clip interval; use clip=ppo"
        )
    if not (clip.adaptive and algo in SEQUENCE_ALGOS):
        return
    if clip.q_scope == "micro_batch" and clip.micro_batch_size == 1:
        # responses of equal length: the gate can fire from ceil(1 / (1 - alpha)) per block on
        rows = math.ceil(1 / (1 - clip.quantile) - 1e-9)
        anchored = " (the anchored variant gates only a response PPO already clips)"
        raise ConfigError(
            f"clip={clip.name} with algo={algo} and clip.q_scope=micro_batch, "
            "clip.micro_batch_size=1 is a no-op: q is taken over one response, whose tokens all "
            "share one |d| = q, so SAT's strict gate |d| > q never fires"
            f"{anchored if clip.anchor != 'q' else ''} and the run trains like plain {algo}. "
            "Use clip.q_scope=batch (one q over the optimizer batch), or a larger "
            "clip.micro_batch_size (with responses of equal length the gate can fire only from "
            f"{rows} responses per micro-batch at clip.quantile={clip.quantile:g}), or clip=ppo "
            f"for plain {algo}"
        )
