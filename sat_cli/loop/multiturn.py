"""Multi-turn rollouts in the training loop (issue 43; ``env=<name>``, docs/environments.md).

With an environment each rollout is a trajectory (``sat_cli.envs.trajectory``): the rollout
thread runs ``EnvRun.generate`` instead of one engine request, so a batch's trajectories are
generated on the rollout thread like single-turn batches (same late binding, same in-flight
updates: the engine may take a new version between turns, or inside one, and every token keeps
its own). The environment's reward is the sample's reward (``rewards``); a group with an
aborted trajectory is dropped, as a single-turn group with an aborted sample is.

Per-turn staleness (names in ``sat_cli.metric_names``, ``k`` the turn from 0): every step
``staleness/turn_<k>/tokens`` and ``staleness/turn_<k>/token_version_lag_mean`` over the model's
tokens of turn ``k``; on histogram steps ``staleness/turn_<k>/abs_logratio_mean_mu`` (d̄π
against ``mu``, from the loss's own per-token diagnostics) and the histogram
``staleness/turn_<k>/token_version_lag``. Also ``rollout/turns_mean`` and
``rollout/env_token_frac``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sat_cli import metric_names as M
from sat_cli.envs.base import EnvSettings
from sat_cli.envs.trajectory import TrajectorySettings, run_trajectories, tool_totals
from sat_cli.samples import Sample, SamplingParams


@dataclass(frozen=True)
class EnvRun:
    """The environment of a run (plain values, built at the edge from the ``env`` section)."""

    name: str
    settings: EnvSettings
    trajectory: TrajectorySettings

    def generate(
        self, engine, tokenizer, rows: list[dict], n: int, sampling: SamplingParams, versions=None
    ) -> list[list[Sample]]:
        """``n`` trajectories per row, each with a fresh environment, as groups in row order;
        ``versions`` (a lag profile's ``TurnVersions``): each generation call's version."""
        from sat_cli.envs.registry import make

        envs = [make(self.name, self.settings) for _ in rows for _ in range(n)]
        flat = [row for row in rows for _ in range(n)]
        samples = run_trajectories(
            engine, envs, tokenizer, flat, sampling, self.trajectory, versions
        )
        return [samples[i * n : (i + 1) * n] for i in range(len(rows))]


def log_trajectories(tracker, env: EnvRun, batch, tokenizer, step: int) -> None:
    """The samples table of the batch trained at ``step`` (``loop.trajectory_table``): every
    turn of its trajectories, as ``samples/train_step_<step>.json``."""
    from sat_cli.loop.trajectory_table import trajectory_table

    table = trajectory_table(
        batch.groups, batch.rows, batch.rewards, tokenizer, env.settings.parser
    )
    tracker.log_dict(table, M.samples_artifact("train", step))


def rewards(groups: list[list[Sample]]) -> list[list[float] | None]:
    """The environment's reward of every sample per group (None: a group to drop, it has an
    aborted trajectory) in ``score_batch``'s ``scored["rewards"]`` form."""
    return [
        None if any(s.finish_reason == "abort" for s in g) else [float(s.meta["reward"]) for s in g]
        for g in groups
    ]


def turn_lags(samples: list[Sample], t: int) -> dict[int, list[int]]:
    """``{turn: [version lag of each of its model tokens]}`` of the batch trained at step ``t``."""
    out: dict[int, list[int]] = {}
    for s in samples:
        for k, v in zip(s.model_turns(), s.model_token_versions(), strict=True):
            out.setdefault(k, []).append(t - v)
    return out


def call_lags(samples: list[Sample], t: int) -> list[int]:
    """The version lag of every generation call (a model turn: one version, without in-flight
    updates) of the batch trained at step ``t``: what a lag profile's draws are compared to."""
    out = []
    for s in samples:
        first: dict[int, int] = {}
        for k, v in zip(s.model_turns(), s.model_token_versions(), strict=True):
            first.setdefault(k, v)
        out += [t - first[k] for k in sorted(first)]
    return out


def turn_metrics(samples: list[Sample], lags: dict[int, list[int]]) -> dict[str, float]:
    """The step's per-turn token counts and lags, mean turns and environment-token fraction."""
    metrics = {}
    for k, values in sorted(lags.items()):
        metrics[M.TURN_TOKENS.format(k)] = float(len(values))
        metrics[M.TURN_TOKEN_LAG_MEAN.format(k)] = sum(values) / len(values)
    n = max(len(samples), 1)
    # turns from the tokens (a replayed sample has no meta): the last model turn's index + 1
    metrics[M.TURNS_MEAN] = sum(max(s.model_turns(), default=0) + 1 for s in samples) / n
    total = sum(s.response_len for s in samples)
    model = sum(len(s.model_positions()) for s in samples)
    metrics[M.ENV_TOKEN_FRAC] = (total - model) / total if total else 0.0
    tools = tool_totals(samples)
    if tools is not None:  # a replayed batch has no infos: nothing was called
        calls, failed = tools
        metrics[M.ENV_TOOL_CALLS] = float(calls)
        metrics[M.ENV_TOOL_ERROR_FRAC] = failed / calls if calls else 0.0
    return metrics


def turn_logratio(diag: dict, batch) -> dict[str, float]:
    """``staleness/turn_<k>/abs_logratio_mean_mu`` from the loss's per-token ``abs_d_mu`` (the
    trained tokens in row-major order, minibatches in row order) and the batch's turn ids."""
    if batch.turn_ids is None or "abs_d_mu" not in diag:
        return {}
    turns = batch.turn_ids[batch.loss_mask.bool()]
    abs_mu = diag["abs_d_mu"]
    if turns.numel() != abs_mu.numel():  # a minibatch without tokens left nothing: no split
        return {}
    out = {}
    for k in sorted(set(turns.tolist())):
        sel = abs_mu[turns == k].double()
        out[M.TURN_DPI_MU.format(k)] = float(sel.mean())
    return out


def log_turn_histograms(tracker, lags: dict[int, list[int]], step: int) -> None:
    """``staleness/turn_<k>/token_version_lag``: one histogram per turn, one bin per lag."""
    for k, values in sorted(lags.items()):
        key = M.HIST_TURN_TOKEN_VERSION_LAG.format(k)
        tracker.log_histogram(key, values, step=step, bins=max(values) + 1 or 1)
