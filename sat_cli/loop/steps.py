"""The pieces of one training-loop step: score a batch, step the trainer, log histograms.

* :func:`score_batch` — rewards per response, the bounded-lag admission control, group
  advantages, dropped groups, and the ``rollout/*`` / ``staleness/version_lag_*`` metrics.
* :func:`trainer_step` — ``trainer.step`` with the non-finite policy of the loop (see
  :mod:`sat_cli.loop.train`): a step whose ``loss/*`` metrics are NaN/inf is counted; if the
  trainer skipped that update the run goes on, unless ``MAX_CONSECUTIVE_NONFINITE`` steps in a
  row were non-finite; otherwise :class:`NonFiniteLoss` stops the run before anything of the
  step is written.
* :func:`log_histograms` — the staleness and SAT histograms of a step (from
  :func:`staleness_probe`, a no-grad forward on the step's batch).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from sat_cli.engines.base import Sample
from sat_cli.errors import RunFailed
from sat_cli.loop.state import latest_checkpoint

MAX_CONSECUTIVE_NONFINITE = 5


class NonFiniteLoss(RunFailed):
    """The trainer applied an update with a NaN/inf loss: its weights cannot be trusted."""


def _score(groups: list[list[Sample]], rows: list[dict], tokenizer, reward_fn) -> tuple[list, list]:
    """Rewards per response; groups with an aborted sample are dropped whole."""
    kept, rewards = [], []
    for group, row in zip(groups, rows, strict=True):
        if any(s.finish_reason == "abort" for s in group):
            continue
        texts = tokenizer.batch_decode([s.response_ids for s in group], skip_special_tokens=True)
        kept.append(group)
        rewards.append([float(reward_fn(text, row["answer"])) for text in texts])
    return kept, rewards


def score_batch(s, t: int, groups, rows, tokenizer, task, counters: dict, timing: dict):
    """``(samples, advantages, lags, metrics)`` of batch ``t``; ``s`` is the LoopSettings."""
    import torch

    from sat_cli.rl.advantages import group_advantages

    kept, rewards = _score(groups, rows, tokenizer, task.reward)
    if s.lag.mode == "bounded":  # admission control (not expected with a serial engine)
        fresh = [i for i, g in enumerate(kept) if t - g[0].weight_version <= s.lag.n]
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

    lags = [t - smp.weight_version for smp in samples] or [0]
    resp_lens = [smp.response_len for smp in samples] or [0]
    n_tokens = sum(smp.response_len for g in groups for smp in g)
    metrics = {
        "rollout/batch_index": float(t),
        "rollout/prompt_digest": digest([r["prompt"] for r in rows]),
        "rollout/reward_mean": float(flat_rewards.mean()) if len(flat_rewards) else 0.0,
        "rollout/response_len_mean": sum(resp_lens) / len(resp_lens),
        "rollout/truncated_frac": (
            sum(smp.finish_reason == "length" for smp in samples) / max(len(samples), 1)
        ),
        "rollout/tokens_per_s": n_tokens / max(timing["gen_s"], 1e-9),
        "staleness/version_lag_mean": sum(lags) / len(lags),
        "staleness/version_lag_max": float(max(lags)),
        "perf/gen_s": timing["gen_s"],
    }
    return samples, adv, lags, metrics


def trainer_step(trainer, batch, t: int, counters: dict, guard: dict, metrics: dict, tracker,
                 ckpt_root) -> None:  # fmt: skip
    """``trainer.step(batch)`` into ``metrics``, with the non-finite policy (module docstring).
    ``guard["bad"]`` counts non-finite steps in a row (per process, not saved in checkpoints)."""
    tm = trainer.step(batch)
    bad = sorted(k for k, v in tm.items() if k.startswith("loss/") and not math.isfinite(v))
    guard["bad"] = guard["bad"] + 1 if bad else 0
    if bad:
        counters["nonfinite_steps"] += 1
        skipped = bool(tm.get("loss/nonfinite_skipped"))
        if not skipped or guard["bad"] >= MAX_CONSECUTIVE_NONFINITE:
            metrics.update(tm)
            metrics["loss/nonfinite_steps"] = float(counters["nonfinite_steps"])
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
    if "sat/active" in tm:
        metrics.update(sat_active_fractions(counters, tm))


def sat_active_fractions(counters: dict, tm: dict) -> dict[str, float]:
    """Running fractions of steps where SAT can act (``sat/active``, either side) and per side.
    A step's ``sat/active`` is 0/1 with one ``q``, a fraction with several minibatches or
    per-micro-batch ``q``: the counters add it as it is."""
    counters["sat_steps"] = counters.get("sat_steps", 0) + 1
    out = {}
    for key, name in (
        ("sat/active", "sat_active_steps"),
        ("sat/active_low", "sat_active_low_steps"),
        ("sat/active_high", "sat_active_high_steps"),
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


def log_histograms(tracker, probe: dict, lags: list[int], step: int) -> None:
    tracker.log_histogram("staleness/version_lag", lags, step=step, bins=max(lags) + 1 or 1)
    tracker.log_histogram(
        "staleness/abs_logratio", probe["abs_d"], step=step, marks={"q": probe["q"]}, logy=True
    )
    if probe["c"] is not None and len(probe["c"]):
        tracker.log_histogram("sat/contraction", probe["c"], step=step, bins=20)
    tracker.log_metrics(probe["stats"], step=step)


def staleness_probe(trainer, batch, sat: dict[str, Any], eps_low: float, eps_high: float) -> dict:
    """|d| per token and SAT contraction factors for the histograms (one extra no-grad forward).
    ``sat``: the SAT settings of the loss (``LoopSettings.sat_probe``)."""
    import torch

    from sat_cli.rl.sat import sat_clip_bounds
    from sat_cli.rl.staleness import logratio_stats

    logp = trainer.logprobs(batch)  # [B, S]
    mask = batch.loss_mask
    d = torch.where(mask.bool(), logp - batch.rollout_logp, torch.zeros_like(logp))
    # percentiles of |log pi_theta - log mu| (the mean is the loss's own metric; with a recompute
    # denominator, e.g. TIS, the loss measures against pi_old, so it is not logged twice here)
    stats = logratio_stats(logp, batch.rollout_logp, mask)
    stats.pop("staleness/abs_logratio_mean", None)
    abs_d = d.abs()[mask.bool()]
    q, c = float("nan"), None
    p = sat
    if p.get("adaptive"):
        proxy = d
        if p.get("level") == "sequence":
            seq = (d * mask).sum(1) / mask.sum(1).clamp_min(1)
            proxy = seq[:, None].expand_as(d) * mask
        lower, upper, sst = sat_clip_bounds(
            proxy,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            quantile=p["quantile"],
            exponent=p["exponent"],
            **({"anchor": p["anchor"]} if p.get("anchor") else {}),
        )
        q = sst["q"]
        m = mask.bool()
        c_hi = (upper - 1.0) / eps_high
        c_lo = (1.0 - lower) / eps_low
        c_all = torch.minimum(c_hi, c_lo)[m]
        c = c_all[c_all < 1.0]
    else:
        k = max(1, math.ceil(0.9 * abs_d.numel()))
        q = float(abs_d.kthvalue(k).values) if abs_d.numel() else 0.0
    return {"abs_d": abs_d.numpy(), "q": q, "c": None if c is None else c.numpy(), "stats": stats}
