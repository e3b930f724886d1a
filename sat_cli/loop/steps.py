"""The pieces of one training-loop step: score a batch, step the trainer, log histograms.

* :func:`score_batch` — rewards per response, the bounded-lag admission control, group
  advantages, dropped groups, and the ``rollout/*`` / ``staleness/version_lag_*`` metrics, as
  a :class:`Scored` value.
* :func:`nonfinite_losses` / :func:`nonfinite_error` — the non-finite policy of the loop (see
  :mod:`sat_cli.loop.train`): a step whose ``loss/*`` metrics are NaN/inf is counted; if the
  trainer skipped that update the run goes on, unless ``MAX_CONSECUTIVE_NONFINITE`` steps in a
  row were non-finite; otherwise :class:`NonFiniteLoss` stops the run before anything of the
  step is written.
* :func:`log_histograms` — the staleness and SAT histograms of a step, from the per-token
  diagnostics its loss returned (no extra forward).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sat_cli import metric_names as M
from sat_cli.errors import RunFailed
from sat_cli.samples import Sample
from sat_cli.tracking.sink import MetricSink

if TYPE_CHECKING:
    import torch

MAX_CONSECUTIVE_NONFINITE = 5


class NonFiniteLoss(RunFailed):
    """The trainer applied an update with a NaN/inf loss: its weights cannot be trusted."""


def _score(groups: list[list[Sample]], rows: list[dict], tokenizer, scorer):
    """``(kept groups, rewards per kept group, Scores)``; groups with an aborted sample are
    dropped whole. One ``scorer.score`` call for the batch (a plugin's pool works in parallel)."""
    kept, prompts, texts, rws, versions = [], [], [], [], []
    for group, row in zip(groups, rows, strict=True):
        if any(s.finish_reason == "abort" for s in group):
            continue
        kept.append(group)
        decoded = tokenizer.batch_decode([s.response_ids for s in group], skip_special_tokens=True)
        texts.extend(decoded)
        prompts.extend([row["prompt"]] * len(group))
        rws.extend([row] * len(group))
        versions.extend(_oldest(s) for s in group)
    scores = scorer.score(prompts, texts, rws)
    scorer.first_error = scores.first_error()  # named when the loop stops for failed rewards
    scorer.last_batch = (prompts, texts, rws, versions, scores)  # for the samples table
    it = iter(scores.values)
    return kept, [[float(next(it)) for _ in g] for g in kept], scores


def group_rewards(groups: list[list[Sample]], rows: list[dict], tokenizer, scorer):
    """``(rewards per group, Scores)``: None for a group dropped for an aborted sample."""
    kept, rewards, scores = _score(groups, rows, tokenizer, scorer)
    it = iter(rewards)
    return [next(it) if any(g is k for k in kept) else None for g in groups], scores


def task_scorer(task):
    """The task's own grader as a scorer (a run without a reward plugin: tests, benchmarks)."""
    from sat_cli.rewards import Scorer

    return Scorer(lambda prompt, response, row: task.reward(response, row["answer"]))


def log_samples(tracker: MetricSink, scorer, step: int) -> None:
    """The samples table of the batch scored last (``samples/train_step_<step>.json``)."""
    from sat_cli.rewards.grading import samples_table

    last = getattr(scorer, "last_batch", None)
    if last is None:  # a replay: its rewards were recorded, nothing was scored
        return
    prompts, texts, rows, versions, sc = last
    samples = [
        {
            "id": str(row.get("id")),
            "version": v,
            "prompt": p,
            "response": t,
            "reward": r,
            "error": e,
            "components": c,
        }
        for p, t, row, v, r, e, c in zip(
            prompts, texts, rows, versions, sc.values, sc.errors, sc.components, strict=True
        )
    ]
    tracker.log_dict(samples_table(samples), M.samples_artifact("train", step))


def reward_failure(s, scorer, metrics: dict, step: int):
    """The :class:`RewardFailed` of a step whose rewards failed above the allowed fraction."""
    from sat_cli.rewards import RewardFailed

    first = getattr(scorer, "first_error", None) or "?"
    return RewardFailed(
        f"{metrics[M.REWARD_ERROR_FRAC]:.0%} of step {step}'s rewards failed (reward."
        f"max_error_frac={s.max_reward_error_frac:g}); the first: {first}. The run stopped with "
        f"the checkpoint {s.run_dir / 'checkpoints' / f'step_{step}'}; once the reward is fixed, continue it "
        f"with the same command and resume=auto ({s.run_dir})"
    )


def reward_metrics(scores, metrics: dict) -> None:
    """``reward/error_frac`` and the mean of each component (``reward/<name>``) of a batch."""
    metrics[M.REWARD_ERROR_FRAC] = scores.error_frac
    sums: dict[str, list[float]] = {}
    for parts in scores.components:
        for name, value in parts.items():
            sums.setdefault(name, []).append(value)
    for name, values in sums.items():
        metrics[M.reward_key(name)] = sum(values) / len(values)


@dataclass
class Lags:
    """A batch's version lags: per sample (its oldest token), per model token and, multi-turn,
    per turn (``{turn: [lag of each of its model tokens]}``)."""

    sample: list[int]
    token: list[int]
    turns: dict[int, list[int]] | None = None
    # algo.dynamic_sampling: the lags of the kept and the dropped samples, by histogram name
    split: dict[str, list[int]] | None = None


@dataclass
class Scored:
    """A scored batch: the samples kept with their advantages, their lags, the step's
    ``rollout/*`` and ``staleness/*`` metrics, the rewards per group of the batch as it came
    (None: a dropped group; what a recording stores) and the groups dropped at this step."""

    samples: list[Sample]
    adv: torch.Tensor  # [len(samples)], float32
    lags: Lags
    metrics: dict[str, float]
    rewards: list
    stale_dropped: int  # over the bounded lag
    dropped_groups: int  # aborted, or zero-advantage with drop_zero_adv_groups


def score_batch(s, t: int, batch, tokenizer, scorer) -> Scored:
    """Score batch ``t`` (a ``loop.stream.Batch``; ``s`` is the LoopSettings): its rewards
    (those it came with, else ``scorer``'s), the bounded-lag admission control, group
    advantages and the batch's metrics (the run's counters are the caller's)."""
    import torch

    from sat_cli.rl.advantages import group_advantages

    groups, rows, timing = batch.groups, batch.rows, batch.timing
    scores = None  # a replay brings its rewards: no reward metrics
    if batch.rewards is not None:
        per_group = batch.rewards
        kept = [g for g, r in zip(groups, per_group, strict=True) if r is not None]
        rewards = [r for r in per_group if r is not None]
    else:
        per_group, scores = group_rewards(groups, rows, tokenizer, scorer)
        kept = [g for g, r in zip(groups, per_group, strict=True) if r is not None]
        rewards = [r for r in per_group if r is not None]
    stale = dropped = 0
    if s.lag.mode == "bounded":  # admission control on each group's oldest token
        fresh = [i for i, g in enumerate(kept) if admitted(s, t, g)]
        stale = len(kept) - len(fresh)
        kept, rewards = [kept[i] for i in fresh], [rewards[i] for i in fresh]
    admitted_groups = len(kept)  # the dropped count: aborted and stale, not dynamic sampling's
    if batch.keep is not None:  # algo.dynamic_sampling: the groups its filter left out
        selected = {id(g) for g, k in zip(groups, batch.keep, strict=True) if k}
        chosen = [i for i, g in enumerate(kept) if id(g) in selected]
        kept, rewards = [kept[i] for i in chosen], [rewards[i] for i in chosen]
    flat_rewards = torch.tensor([r for rs in rewards for r in rs], dtype=torch.float32)
    samples = [smp for g in kept for smp in g]
    adv = (
        group_advantages(flat_rewards, s.group_size, std_norm=s.adv_std_norm)
        if samples
        else flat_rewards
    )
    if s.drop_zero_adv_groups and samples:
        keep = (adv.view(-1, s.group_size).abs().sum(1) > 0).repeat_interleave(s.group_size)
        dropped += int((~keep).sum()) // s.group_size
        samples = [smp for smp, k in zip(samples, keep.tolist(), strict=True) if k]
        adv = adv[keep]
    dropped += len(groups) - admitted_groups

    lags = [t - _oldest(smp) for smp in samples] or [0]
    tok_lags = [t - v for smp in samples for v in _token_versions(smp)] or [0]
    mixed = sum(len(set(_token_versions(smp))) > 1 for smp in samples)
    resp_lens = [smp.response_len for smp in samples] or [0]
    n_tokens = sum(smp.response_len for g in groups for smp in g)
    gen_s = timing["gen_s"]
    metrics = {
        M.BATCH_INDEX: float(t),
        M.PROMPT_DIGEST: digest([r["prompt"] for r in rows]),
        M.REWARD_MEAN: float(flat_rewards.mean()) if len(flat_rewards) else 0.0,
        M.RESPONSE_LEN_MEAN: sum(resp_lens) / len(resp_lens),
        M.TRUNCATED_FRAC: (
            sum(smp.finish_reason == "length" for smp in samples) / max(len(samples), 1)
        ),
        M.TOKENS_PER_S: n_tokens / gen_s if gen_s > 0 else 0.0,  # replay: 0
        M.VERSION_LAG_MEAN: sum(lags) / len(lags),
        M.VERSION_LAG_MAX: float(max(lags)),
        M.TOKEN_LAG_MEAN: sum(tok_lags) / len(tok_lags),
        M.MIXED_VERSION_FRAC: mixed / max(len(samples), 1),
        M.PERF_GEN_S: gen_s,
    }
    if scores is not None:
        reward_metrics(scores, metrics)
    return Scored(samples, adv, Lags(lags, tok_lags), metrics, per_group, stale, dropped)


def admitted(s, t: int, group: list[Sample]) -> bool:
    """Bounded mode's admission control: the group's oldest token is at most ``lag.n`` versions
    behind step ``t`` (every group in the other modes)."""
    return s.lag.mode != "bounded" or t - min(map(_oldest, group)) <= s.lag.n


def _token_versions(smp: Sample) -> list[int]:
    """The weight version of every model token (one version unless updated in flight;
    a multi-turn sample's environment tokens are left out)."""
    return smp.model_token_versions()


def _oldest(smp: Sample) -> int:
    return smp.oldest_version()


def nonfinite_losses(tm: dict[str, float]) -> list[str]:
    """The ``loss/*`` metrics of a trainer step that are NaN or infinite, sorted."""
    return sorted(k for k, v in tm.items() if k.startswith(M.LOSS_GROUP) and not math.isfinite(v))


def nonfinite_error(step: int, tm: dict, bad: list[str], in_row: int, skipped: bool, last):
    """The :class:`NonFiniteLoss` that stops the run at ``step`` (module docstring): ``bad``
    the non-finite ``loss/*`` names, ``in_row`` non-finite steps in a row, ``skipped`` whether
    the trainer skipped the update, ``last`` the last complete checkpoint (or None)."""
    return NonFiniteLoss(
        f"non-finite loss at step {step} ({', '.join(bad[:4])}"
        f"{' …' if len(bad) > 4 else ''} = "
        f"{', '.join(str(tm[k]) for k in bad[:4])}); "
        + (
            f"{in_row} non-finite steps in a row (updates skipped): the weights do not recover. "
            if skipped
            else "the trainer applied the update, so its weights are no longer "
            "usable and nothing of this step was saved. "
        )
        + (f"Last complete checkpoint: {last}. " if last else "No checkpoint was written yet. ")
        + "Lower trainer.lr, keep trainer.grad_clip > 0, or check the data."
    )


def digest(texts: list[str]) -> float:
    """A 24-bit fingerprint of the batch's prompts (exact in MLflow's float storage): resume
    tests compare it step by step to show that no prompt is lost or repeated."""
    h = hashlib.sha256("\n".join(texts).encode()).digest()
    return float(int.from_bytes(h[:3], "little"))


def log_histograms(tracker: MetricSink, diag: dict, lags: Lags, step: int) -> None:
    """The step's histograms and ``|d|`` percentiles, from the per-token diagnostics the loss
    itself produced (``trainer.step(batch, diag)``; no second SAT computation, no extra
    forward):

    * ``staleness/version_lag``: per sample (its oldest token); ``staleness/token_version_lag``:
      per token (``lags``: ``score_batch``'s :class:`Lags`); with ``algo.dynamic_sampling``
      both also for the kept and the dropped samples (``…_kept``, ``…_dropped``);
    * ``staleness/abs_logratio``: ``|log pi_theta - log mu|`` of every trained token (the
      behaviour-policy mismatch, comparable across algorithms), marked with the batch reference
      ``q`` when the loss's ratio is against ``mu`` (with a recomputed ``pi_old`` denominator
      the loss's own ``|d|`` goes to ``sat/abs_logratio``, marked with ``q``);
    * ``sat/contraction``: ``c`` of the tokens SAT contracted;
    * with ``algo.ledger``, ``staleness/ledger_mismatch`` and ``staleness/ledger_staleness``: the
      per-token ``m = log pi_old - log mu`` and ``s = log pi - log pi_old`` (``rl/ledger.py``).

    ``q`` is SAT's own (token-weighted over minibatches); without SAT, the mark is the p90 of
    ``|d|`` (the reference SAT would take at its default quantile). The percentiles
    ``staleness/abs_logratio_p50/_p90/_p99`` use SAT's order statistic on the mismatch.
    """
    import torch

    from sat_cli.rl.sat import order_statistic_k
    from sat_cli.rl.staleness import PERCENTILES

    abs_mu, abs_d = diag["abs_d_mu"], diag["abs_d"]
    n = abs_mu.numel()
    stats = {
        M.ABS_LOGRATIO_PCT.format(name): (
            float(abs_mu.kthvalue(order_statistic_k(level, n)).values) if n else 0.0
        )
        for name, level in PERCENTILES
    }
    own = abs_d is abs_mu or torch.equal(abs_d, abs_mu)
    if diag["q"].numel():
        w = diag["n_active"].double()
        q = float((diag["q"] * w).sum() / w.sum().clamp_min(1))
    else:
        q = float(abs_d.kthvalue(order_statistic_k(0.9, abs_d.numel())).values) if n else 0.0
    for key, values in ((M.HIST_VERSION_LAG, lags.sample), (M.HIST_TOKEN_VERSION_LAG, lags.token)):
        tracker.log_histogram(key, values, step=step, bins=max(values) + 1 or 1)
    for key, values in (lags.split or {}).items():  # dynamic sampling: kept | dropped
        if values:
            tracker.log_histogram(key, values, step=step, bins=max(values) + 1)
    tracker.log_histogram(
        M.HIST_ABS_LOGRATIO,
        abs_mu.numpy(),
        step=step,
        marks={"q": q} if own else None,
        logy=True,
    )
    if not own:
        tracker.log_histogram(
            M.HIST_SAT_ABS_LOGRATIO, abs_d.numpy(), step=step, marks={"q": q}, logy=True
        )
    c = diag["contraction"][diag["gate"]]
    if c.numel():
        tracker.log_histogram(M.HIST_CONTRACTION, c.numpy(), step=step, bins=20)
    for key, name in ((M.HIST_LEDGER_MISMATCH, "ledger_m"), (M.HIST_LEDGER_STALENESS, "ledger_s")):
        if name in diag and diag[name].numel():  # algo.ledger: m and s per token
            tracker.log_histogram(key, diag[name].numpy(), step=step)
    tracker.log_metrics(stats, step=step)
