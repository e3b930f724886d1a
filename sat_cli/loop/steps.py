"""The pieces of one training-loop step: score a batch, step the trainer, log histograms.

* :func:`score_batch` — rewards per response, the bounded-lag admission control, group
  advantages, dropped groups, and the ``rollout/*`` / ``staleness/version_lag_*`` metrics.
* :func:`trainer_step` — ``trainer.step`` with the non-finite policy of the loop (see
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

from sat_cli import metric_names as M
from sat_cli.checkpoints.state import latest_checkpoint
from sat_cli.errors import RunFailed
from sat_cli.samples import Sample
from sat_cli.tracking.sink import MetricSink

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


def task_scorer(task):
    """The task's reward plugin (``task.scorer``, set by `sat train`), else its own grader."""
    if getattr(task, "scorer", None) is None:
        from sat_cli.rewards import Scorer

        task.scorer = Scorer(lambda prompt, response, row: task.reward(response, row["answer"]))
    return task.scorer


def log_samples(tracker: MetricSink, task, step: int) -> None:
    """The samples table of the batch scored last (``samples/train_step_<step>.json``)."""
    from sat_cli.rewards.grading import samples_table

    last = getattr(getattr(task, "scorer", None), "last_batch", None)
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


def reward_failure(s, task, metrics: dict, step: int):
    """The :class:`RewardFailed` of a step whose rewards failed above the allowed fraction."""
    from sat_cli.rewards import RewardFailed

    first = getattr(getattr(task, "scorer", None), "first_error", None) or "?"
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


def score_batch(
    s,
    t: int,
    groups,
    rows,
    tokenizer,
    task,
    counters: dict,
    timing: dict,
    scored: dict | None = None,
):
    """``(samples, advantages, lags, metrics)`` of batch ``t``; ``s`` is the LoopSettings.
    ``scored``: ``{"rewards": per group a list or None}`` — given (a replay), those rewards are
    used; an empty dict (a recording) receives them."""
    import torch

    from sat_cli.rl.advantages import group_advantages

    scores = None  # a replay brings its rewards: no reward metrics
    if scored and "rewards" in scored:
        kept = [g for g, r in zip(groups, scored["rewards"], strict=True) if r is not None]
        rewards = [r for r in scored["rewards"] if r is not None]
    else:
        kept, rewards, scores = _score(groups, rows, tokenizer, task_scorer(task))
        if scored is not None:
            it = iter(rewards)
            scored["rewards"] = [next(it) if any(g is k for k in kept) else None for g in groups]
    if s.lag.mode == "bounded":  # admission control on each group's oldest token
        fresh = [i for i, g in enumerate(kept) if t - min(map(_oldest, g)) <= s.lag.n]
        counters["stale_dropped"] += len(kept) - len(fresh)
        kept, rewards = [kept[i] for i in fresh], [rewards[i] for i in fresh]
    flat_rewards = torch.tensor([r for rs in rewards for r in rs], dtype=torch.float32)
    samples = [smp for g in kept for smp in g]
    adv = (
        group_advantages(flat_rewards, s.group_size, std_norm=s.adv_std_norm)
        if samples
        else flat_rewards
    )
    if s.drop_zero_adv_groups and samples:
        keep = (adv.view(-1, s.group_size).abs().sum(1) > 0).repeat_interleave(s.group_size)
        counters["dropped_groups"] += int((~keep).sum()) // s.group_size
        samples = [smp for smp, k in zip(samples, keep.tolist(), strict=True) if k]
        adv = adv[keep]
    counters["dropped_groups"] += len(groups) - len(kept)

    lags = [t - _oldest(smp) for smp in samples] or [0]
    tok_lags = [t - v for smp in samples for v in _token_versions(smp)] or [0]
    mixed = sum(len(set(_token_versions(smp))) > 1 for smp in samples)
    resp_lens = [smp.response_len for smp in samples] or [0]
    n_tokens = sum(smp.response_len for g in groups for smp in g)
    metrics = {
        M.BATCH_INDEX: float(t),
        M.PROMPT_DIGEST: digest([r["prompt"] for r in rows]),
        M.REWARD_MEAN: float(flat_rewards.mean()) if len(flat_rewards) else 0.0,
        M.RESPONSE_LEN_MEAN: sum(resp_lens) / len(resp_lens),
        M.TRUNCATED_FRAC: (
            sum(smp.finish_reason == "length" for smp in samples) / max(len(samples), 1)
        ),
        M.TOKENS_PER_S: n_tokens / timing["gen_s"] if timing["gen_s"] > 0 else 0.0,  # replay: 0
        M.VERSION_LAG_MEAN: sum(lags) / len(lags),
        M.VERSION_LAG_MAX: float(max(lags)),
        M.TOKEN_LAG_MEAN: sum(tok_lags) / len(tok_lags),
        M.MIXED_VERSION_FRAC: mixed / max(len(samples), 1),
        M.STALE_DROPPED: float(counters["stale_dropped"]),
        M.PERF_GEN_S: timing["gen_s"],
    }
    if scores is not None:
        reward_metrics(scores, metrics)
    return samples, adv, {"sample": lags, "token": tok_lags}, metrics


def _token_versions(smp: Sample) -> list[int]:
    """The weight version of every model token (one version unless updated in flight;
    a multi-turn sample's environment tokens are left out)."""
    return smp.model_token_versions()


def _oldest(smp: Sample) -> int:
    return smp.oldest_version()


def trainer_step(
    trainer,
    batch,
    t: int,
    counters: dict,
    guard: dict,
    metrics: dict,
    tracker: MetricSink,
    ckpt_root,
    diag: dict | None = None,
) -> None:
    """``trainer.step(batch, diag)`` into ``metrics``, with the non-finite policy (module
    docstring). ``guard["bad"]`` counts non-finite steps in a row (per process, not saved in
    checkpoints); ``diag``: see ``log_histograms``."""
    tm = trainer.step(batch) if diag is None else trainer.step(batch, diag)
    bad = sorted(k for k, v in tm.items() if k.startswith(M.LOSS_GROUP) and not math.isfinite(v))
    guard["bad"] = guard["bad"] + 1 if bad else 0
    if bad:
        counters["nonfinite_steps"] += 1
        skipped = bool(tm.get(M.NONFINITE_SKIPPED))
        if not skipped or guard["bad"] >= MAX_CONSECUTIVE_NONFINITE:
            metrics.update(tm)
            metrics[M.NONFINITE_STEPS] = float(counters["nonfinite_steps"])
            tracker.log_metrics(metrics, step=t + 1)
            last = latest_checkpoint(ckpt_root)
            raise NonFiniteLoss(
                f"non-finite loss at step {t + 1} ({', '.join(bad[:4])}"
                f"{' …' if len(bad) > 4 else ''} = "
                f"{', '.join(str(tm[k]) for k in bad[:4])}); "
                + (
                    f"{guard['bad']} non-finite steps in a row (updates skipped): "
                    "the weights do not recover. "
                    if skipped
                    else "the trainer applied the update, so its weights are no longer "
                    "usable and nothing of this step was saved. "
                )
                + (
                    f"Last complete checkpoint: {last}. "
                    if last
                    else "No checkpoint was written yet. "
                )
                + "Lower trainer.lr, keep trainer.grad_clip > 0, or check the data."
            )
    metrics.update(tm)
    if M.SAT_ACTIVE in tm:
        metrics.update(sat_active_fractions(counters, tm))


def sat_active_fractions(counters: dict, tm: dict) -> dict[str, float]:
    """Running fractions of steps where SAT can act (``sat/active``, either side) and per side.
    A step's ``sat/active`` is 0/1 with one ``q``, a fraction with several minibatches or
    per-micro-batch ``q``: the counters add it as it is."""
    counters["sat_steps"] = counters.get("sat_steps", 0) + 1
    out = {}
    for key, name in (
        (M.SAT_ACTIVE, "sat_active_steps"),
        (M.SAT_ACTIVE_LOW, "sat_active_low_steps"),
        (M.SAT_ACTIVE_HIGH, "sat_active_high_steps"),
    ):
        if key in tm:
            counters[name] = counters.get(name, 0) + float(tm[key])
            out[key + "_frac"] = counters[name] / counters["sat_steps"]
    return out


def digest(texts: list[str]) -> float:
    """A 24-bit fingerprint of the batch's prompts (exact in MLflow's float storage): resume
    tests compare it step by step to show that no prompt is lost or repeated."""
    h = hashlib.sha256("\n".join(texts).encode()).digest()
    return float(int.from_bytes(h[:3], "little"))


def log_histograms(tracker: MetricSink, diag: dict, lags: dict, step: int) -> None:
    """The step's histograms and ``|d|`` percentiles, from the per-token diagnostics the loss
    itself produced (``trainer.step(batch, diag)``; no second SAT computation, no extra
    forward):

    * ``staleness/version_lag``: per sample (its oldest token); ``staleness/token_version_lag``:
      per token (``lags``: ``score_batch``'s ``{"sample": …, "token": …}``);
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
    for key, values in (
        (M.HIST_VERSION_LAG, lags["sample"]),
        (M.HIST_TOKEN_VERSION_LAG, lags["token"]),
    ):
        tracker.log_histogram(key, values, step=step, bins=max(values) + 1 or 1)
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
