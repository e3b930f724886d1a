"""Dynamic sampling (DAPO; ``algo.dynamic_sampling``, docs/algorithms.md §2, "Dynamic sampling"): groups whose
rewards do not vary are never trained on, and a step refills its batch with more generation
batches, up to a bound, with the staleness of what is kept and what is dropped accounted apart.

One step ``t`` with dynamic sampling:

1. its first generation batch is batch ``t`` exactly as without it (same prompts, seed and
   weight version: the lag policy's), requested ahead as usual;
2. each group is scored; a group is *usable* when no sample was aborted, bounded mode admits
   it, and the population standard deviation of its rewards is ``> std_tol`` (a group at or
   below it has zero advantages: it is dropped, ``dynamic/groups_dropped``). Usable groups are
   taken whole, in order, until ``task.prompts_per_step`` are kept; the usable groups after
   that are surplus (``dynamic/groups_surplus``, not trained: a group is never split);
3. while fewer are kept and fewer than ``max_gen_batches`` generation batches were drawn, the
   step draws generation batch ``j`` (``j = 1, 2, …``): ``prompts_per_step`` prompts from the
   refill region of the data order (:func:`refill_cursor`: ``REFILL_SLOTS`` batches reserved
   per step, far past the primary batches, so the primary batches stay those of a run without
   dynamic sampling), seeded by ``("refill", t, j)``, generated from the **same weight version
   as batch t** (a lag profile: the same per-sample draws; bounded mode: late-bound, the newest
   published, like every bounded request). A refill is never drawn from a newer version than
   the batch it tops up, except in bounded mode, where every request takes the newest;
4. at the bound the step trains on the groups it kept (``dynamic/groups_short`` =
   ``prompts_per_step`` minus them, > 0) and the console says so; with none kept it is a
   skipped step, as any step whose groups were all dropped.

Deterministic per seed: every generation batch is a pure function of ``(seed, t, j)`` and its
version, so the refill decisions are too. Exact across resume: a checkpoint falls between
steps, and a resumed step draws the same generation batches again (nothing of a refill is
pending at a checkpoint). The recording (``replay.record=true``) stores a step's generation
batches one after the other with their rewards; ``sat replay`` reads them back as the
generation batches of that step and the same filter keeps the same groups.

Metrics (``metric_names``): ``dynamic/gen_batches``, ``…/groups_dropped``, ``…/groups_surplus``,
``…/groups_short``, ``…/kept_frac`` (trained / generated groups), ``…/refill_s``, and the split
of the step's generated samples into **kept** (trained) and **dropped** (all others): groups,
samples, tokens, the sums of their per-sample and per-token version lags (``kept + dropped =
total`` exactly) and the mean sample lag of each part; ``dynamic/extra_lag`` is the mean lag of
the trained samples minus that of the first generation batch's samples (what the step would
have trained on without refills and filter: the lag dynamic sampling adds). On histogram steps
``staleness/version_lag_{kept,dropped}`` and ``staleness/token_version_lag_{kept,dropped}``.
With ``algo.ledger`` the three-log-prob ledger is split too (:func:`ledger_split`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sat_cli import metric_names as M
from sat_cli.loop.stream import Batch
from sat_cli.samples import Sample

# refill prompts: data-order positions far past any run's primary batches (step t's batch is at
# cursor t * prompts_per_step), REFILL_SLOTS generation batches reserved per step (the bound of
# algo.dynamic_sampling.max_gen_batches: config.dynamic.MAX_GEN_BATCHES, tested equal)
REFILL_BASE = 1 << 40
REFILL_SLOTS = 64


@dataclass(frozen=True)
class DynamicSampling:
    """The loop's side of ``algo.dynamic_sampling`` (None in ``LoopSettings``: off)."""

    std_tol: float = 0.0
    max_gen_batches: int = 3


def refill_cursor(t: int, j: int, per_step: int) -> int:
    """The data cursor of generation batch ``j >= 1`` of step ``t``."""
    assert 1 <= j < REFILL_SLOTS
    return REFILL_BASE + (t * REFILL_SLOTS + j - 1) * per_step


def reward_std(rewards: list[float]) -> float:
    """Population standard deviation of a group's rewards (float64, exact sums)."""
    mean = math.fsum(rewards) / len(rewards)
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


@dataclass
class Filled:
    """A step's generation batches joined into one :class:`Batch` (``keep`` set) and what the
    filter did."""

    batch: Batch
    gen_batches: int
    zero_var: int  # groups the filter dropped
    surplus: int  # usable groups past prompts_per_step
    short: int  # prompts_per_step - kept groups
    first: int  # groups of the first generation batch
    refill_s: float
    scores: list = field(default_factory=list)  # the Scores of each scored generation batch


def fill(
    d: DynamicSampling,
    per_step: int,
    first: Batch,
    refill: Callable[[int], Batch | None],
    rewards_of: Callable[[Batch], tuple[list, object]],
    usable: Callable[[list[Sample]], bool],
) -> Filled:
    """Draw generation batches ``first``, ``refill(1)``, … until ``per_step`` groups are kept or
    ``d.max_gen_batches`` were drawn (``refill`` None: no more, a replay's recording);
    ``rewards_of(batch)`` gives its rewards per group (None: aborted) and its ``Scores`` (None:
    they came with it); ``usable(group)``: bounded mode's admission."""
    parts, keep, per_group, scores = [], [], [], []
    kept = zero = surplus = 0
    batch: Batch | None = first
    refill_s = 0.0
    while batch is not None:
        rewards, sc = rewards_of(batch)
        if sc is not None:
            scores.append(sc)
        for group, r in zip(batch.groups, rewards, strict=True):
            ok = r is not None and usable(group)
            if ok and reward_std(r) <= d.std_tol:
                zero, ok = zero + 1, False
            elif ok and kept >= per_step:
                surplus, ok = surplus + 1, False
            kept += int(ok)
            keep.append(ok)
        parts.append(batch)
        per_group += rewards
        if kept >= per_step or len(parts) >= d.max_gen_batches:
            break
        batch = refill(len(parts))
        if batch is not None:
            refill_s += batch.wait_s
    timing = {k: sum(b.timing[k] for b in parts) for k in ("gen_s", "update_s")}
    joined = replace(
        first,
        groups=[g for b in parts for g in b.groups],
        rows=[r for b in parts for r in b.rows],
        timing=timing,
        rewards=per_group,
        keep=keep,
    )
    short = max(per_step - kept, 0)
    return Filled(joined, len(parts), zero, surplus, short, len(first.groups), refill_s, scores)


@dataclass
class _Part:
    """The counts and lag sums of one side of the split (kept, dropped or the total)."""

    n_groups: int = 0
    n_samples: int = 0
    n_tokens: int = 0
    version_lag_sum: int = 0
    token_lag_sum: int = 0

    def add(self, lag: int, tok: list[int]) -> None:
        self.n_samples += 1
        self.n_tokens += len(tok)
        self.version_lag_sum += lag
        self.token_lag_sum += sum(tok)


def metrics(t: int, f: Filled, trained: list[Sample]) -> tuple[dict[str, float], dict]:
    """The step's ``dynamic/*`` metrics and its kept/dropped lag histograms (by name):
    ``trained`` the samples the trainer got (after every filter)."""
    ids = {id(s) for s in trained}
    groups = f.batch.groups
    kept, dropped, total = parts = (_Part(), _Part(), _Part())
    hist: dict[str, list[int]] = {}
    for group in groups:
        for side in (kept if any(id(s) in ids for s in group) else dropped, total):
            side.n_groups += 1
        for smp in group:
            name = "kept" if id(smp) in ids else "dropped"
            lag = t - smp.oldest_version()
            tok = [t - v for v in smp.model_token_versions()]
            hist.setdefault(M.HIST_VERSION_LAG_SPLIT.format(name), []).append(lag)
            hist.setdefault(M.HIST_TOKEN_VERSION_LAG_SPLIT.format(name), []).extend(tok)
            (kept if name == "kept" else dropped).add(lag, tok)
            total.add(lag, tok)
    out = {
        M.DYN_SPLIT.format(q, name): float(getattr(part, q))
        for name, part in zip(M.DYN_SPLIT_PARTS, parts, strict=True)
        for q in M.DYN_SPLIT_QUANTITIES
    }
    for name, part in (("kept", kept), ("dropped", dropped)):
        mean = part.version_lag_sum / part.n_samples if part.n_samples else 0.0
        out[M.DYN_SPLIT_MEANS.format(name)] = mean
    first = [t - s.oldest_version() for g in groups[: f.first] for s in g]
    kept_lag = out[M.DYN_SPLIT_MEANS.format("kept")]
    out.update(
        {
            M.DYN_GEN_BATCHES: float(f.gen_batches),
            M.DYN_GROUPS_DROPPED: float(f.zero_var),
            M.DYN_GROUPS_SURPLUS: float(f.surplus),
            M.DYN_GROUPS_SHORT: float(f.short),
            M.DYN_KEPT_FRAC: kept.n_groups / max(len(groups), 1),
            M.DYN_EXTRA_LAG: kept_lag - sum(first) / len(first) if trained and first else 0.0,
            M.DYN_REFILL_S: f.refill_s,
        }
    )
    return out, hist


def ledger_split(trainer, f: Filled, trained: list[Sample], pad_id: int, r3: bool) -> dict:
    """``algo.ledger`` with dynamic sampling: the three-log-prob ledger (``rl/ledger.py``) over
    the kept, the dropped and all generated samples' tokens, as sums with their token counts
    (kept + dropped = total), under the weights before the step's update: ``log pi`` the
    trainer's current weights, ``log pi_old`` each token's generating version as the trainer's
    ledger holds it (tokens of a version it no longer holds are left out, as in the loss's)."""
    import torch

    from sat_cli.trainers.batch import collate

    ids = {id(s) for s in trained}
    samples = [s for g in f.batch.groups for s in g]
    batch = collate(samples, torch.zeros(len(samples)), pad_id, need_routes=r3)
    gen, held = trainer.ledger.logprobs(trainer, batch)  # [B, S] log pi_old, held versions
    logp = trainer.logprobs(batch)  # [B, S] log pi
    f64 = torch.float64
    lp, g, mu = logp.to(f64), gen.to(f64), batch.rollout_logp.to(f64)
    delta = lp - mu  # [B, S]
    sign = torch.sign(delta)
    values = (
        None,
        delta.abs(),
        sign * (g - mu),  # the mismatch part of |delta|
        sign * (lp - g),  # the staleness part
    )
    mask = batch.loss_mask.bool() & held.bool()  # [B, S]
    kept = torch.tensor([id(s) in ids for s in samples], dtype=torch.bool)[:, None]  # [B, 1]
    out = {}
    for side, rows in (("kept", kept), ("dropped", ~kept), ("total", torch.ones_like(kept))):
        m = mask & rows
        for q, v in zip(M.DYN_LEDGER_QUANTITIES, values, strict=True):
            out[M.DYN_LEDGER.format(q, side)] = float(m.sum() if v is None else v[m].sum())
    return out


def join_scores(scores: list):
    """One ``Scores`` of several generation batches' (in order)."""
    from sat_cli.rewards import Scores

    return Scores(
        [v for sc in scores for v in sc.values],
        [c for sc in scores for c in sc.components],
        [e for sc in scores for e in sc.errors],
    )


def join_tables(tables: list[tuple]) -> tuple:
    """The scorer's ``last_batch`` (prompts, texts, rows, versions, Scores) of several
    generation batches, joined: the step's samples table shows every sample it scored."""
    lists = tuple([x for tb in tables for x in tb[i]] for i in range(4))
    return (*lists, join_scores([tb[4] for tb in tables]))
