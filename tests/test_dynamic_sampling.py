"""Dynamic sampling (issue 57 item 1, ``algo.dynamic_sampling``; ``sat_cli/loop/dynamic.py``):
a group whose rewards are equal is never trained on; a step refills its batch to
``prompts_per_step`` groups or says why not; the kept/dropped split adds up to the totals; a
resumed run and a replay of a recording give the same losses as the uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sat_cli import metric_names as M
from sat_cli.engines.base import Sample, SamplingParams
from sat_cli.loop.dynamic import DynamicSampling, fill, metrics, refill_cursor, reward_std
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.loop.stream import Batch
from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
from sat_cli.replay.store import StreamWriter, open_recording
from tests.test_loop import Recorder
from tests.test_replay import SpyTrainer, stream_of

P, G = 2, 4


class ParityTask:
    """Prompts ``NNN+`` with their id; rewards: :func:`_scorer`."""

    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        return [
            {"id": str(i), "prompt": f"{i % 1000:03d}+", "answer": "7"}
            for i in range(cursor, cursor + n)
        ]


def _scorer():
    """An even id's responses all get 0.5 (a zero-variance group, every time), an odd id's a
    number from the response's characters (equal only for equal-scoring responses)."""
    from sat_cli.rewards import Scorer

    def reward(prompt, response, row):
        return 0.5 if int(row["id"]) % 2 == 0 else (sum(map(ord, response)) % 7) / 6

    return Scorer(reward)


# ----------------------------------------------------------------------------- hand cases


def _smp(v: int, n: int = 2) -> Sample:
    return Sample(
        prompt_ids=[1],
        response_ids=[5] * n,
        rollout_logp=[-0.5] * n,
        finish_reason="stop",
        weight_version=v,
    )


def _batch(rewards: list, v: int = 0, wait: float = 0.0) -> Batch:
    groups = [[_smp(v), _smp(v)] for _ in rewards]
    rows = [{"id": str(i), "prompt": "p"} for i in range(len(rewards))]
    return Batch(groups, rows, {"gen_s": 1.0, "update_s": 0.0}, wait, list(rewards), v)


def _fill(d, first, refills):
    return fill(
        d,
        2,
        first,
        lambda j: refills[j - 1] if j <= len(refills) else None,
        lambda b: (b.rewards, None),
        lambda g: True,
    )


def test_reward_std_and_refill_cursor_hand_cases():
    from sat_cli.config.dynamic import MAX_GEN_BATCHES
    from sat_cli.loop.dynamic import REFILL_SLOTS

    assert MAX_GEN_BATCHES == REFILL_SLOTS  # every batch a step may draw has its reserved slot
    assert reward_std([1.0, 1.0, 1.0]) == 0.0
    assert reward_std([0.0, 1.0]) == 0.5  # population std
    assert refill_cursor(0, 1, 4) == 1 << 40 and refill_cursor(1, 2, 4) == (1 << 40) + 65 * 4


def test_equal_reward_groups_are_dropped_and_the_batch_refilled_without_splitting_groups():
    d = DynamicSampling(std_tol=0.0, max_gen_batches=3)
    first = _batch([[1.0, 1.0], [0.0, 1.0]], v=3)  # one zero-variance group, one kept
    second = _batch([[0.0, 0.0], None, [1.0, 0.0], [0.0, 0.5]], v=3, wait=0.25)
    f = _fill(d, first, [second])
    assert f.gen_batches == 2 and f.zero_var == 2 and f.surplus == 1 and f.short == 0
    assert f.batch.keep == [False, True, False, False, True, False]  # the aborted one: False
    assert f.batch.rewards == first.rewards + second.rewards
    assert f.batch.timing["gen_s"] == 2.0 and f.refill_s == 0.25 and f.first == 2
    # std_tol: a group whose std is at or below it is dropped too
    f2 = _fill(
        DynamicSampling(std_tol=0.25, max_gen_batches=1), _batch([[0.0, 0.5], [0.0, 1.0]]), []
    )
    assert f2.batch.keep == [False, True] and f2.zero_var == 1 and f2.short == 1


def test_at_the_bound_the_step_keeps_what_it_has_and_says_how_many_are_missing():
    d = DynamicSampling(max_gen_batches=2)
    f = _fill(d, _batch([[1.0, 1.0], [0.0, 0.0]]), [_batch([[0.0, 1.0], [2.0, 2.0]])] * 5)
    assert f.gen_batches == 2 and f.short == 1 and f.zero_var == 3
    assert f.batch.keep == [False, False, True, False]
    # a replay's recording holds fewer batches: the fill stops there
    assert _fill(DynamicSampling(max_gen_batches=9), _batch([[1.0, 1.0]] * 2), []).gen_batches == 1


def test_the_kept_and_dropped_split_adds_up_to_the_totals():
    d = DynamicSampling(max_gen_batches=3)
    first = _batch([[1.0, 1.0], [0.0, 1.0]], v=1)
    f = _fill(d, first, [_batch([[0.0, 1.0], [1.0, 0.0]], v=4)])
    trained = [s for g, k in zip(f.batch.groups, f.batch.keep, strict=True) if k for s in g]
    out, hist = metrics(5, f, trained)
    for q in M.DYN_SPLIT_QUANTITIES:
        kept, dropped, total = (out[M.DYN_SPLIT.format(q, p)] for p in M.DYN_SPLIT_PARTS)
        assert kept + dropped == total, q
    # hand values: 8 samples, kept: first batch's group 1 (lag 4) and refill group 0 (lag 1)
    assert out[M.DYN_SPLIT.format("n_samples", "total")] == 8
    assert out[M.DYN_SPLIT.format("n_groups", "kept")] == 2
    assert out[M.DYN_SPLIT.format("version_lag_sum", "kept")] == 2 * 4 + 2 * 1
    assert out[M.DYN_SPLIT.format("version_lag_sum", "dropped")] == 2 * 4 + 2 * 1
    assert out[M.DYN_SPLIT.format("token_lag_sum", "total")] == 2 * 2 * (4 + 4 + 1 + 1)
    assert out[M.DYN_SPLIT_MEANS.format("kept")] == 2.5
    assert out[M.DYN_EXTRA_LAG] == 2.5 - 4.0  # kept vs the first batch alone (lag 4)
    assert out[M.DYN_KEPT_FRAC] == 0.5 and out[M.DYN_GEN_BATCHES] == 2
    assert sorted(hist[M.HIST_VERSION_LAG_SPLIT.format("kept")]) == [1, 1, 4, 4]
    assert len(hist[M.HIST_TOKEN_VERSION_LAG_SPLIT.format("dropped")]) == 8


def test_the_dapo_preset_and_its_plan_line():
    """algo=dapo composes DAPO's settings; `sat plan` says how many samples a step may draw."""
    from sat_cli.config import load
    from sat_cli.config.dynamic import plan_line

    _, obj = load(["algo=dapo", "task.prompts_per_step=8", "task.samples_per_prompt=4"])
    a = obj.algo
    assert (a.name, a.eps_low, a.eps_high, a.loss_agg, a.kl_coef) == (
        "grpo",
        0.2,
        0.28,
        "token-mean",
        0.0,
    )
    d = a.dynamic_sampling
    assert (d.enabled, d.std_tol, d.max_gen_batches) == (True, 0.0, 10)
    line = plan_line(obj.task, d)
    assert "up to 9 more generation batches of 8 prompts (320 samples at most per step)" in line
    assert plan_line(obj.task, load([])[1].algo.dynamic_sampling) is None  # off: no line


def test_bad_settings_are_refused_with_one_line():
    from sat_cli.config.dynamic import DynamicSamplingConfig
    from sat_cli.validate import ConfigError

    for kw, says in (
        ({"std_tol": -1.0}, "std_tol"),
        ({"max_gen_batches": 0}, "max_gen_batches"),
        ({"max_gen_batches": 65}, "max_gen_batches"),
    ):
        with pytest.raises(ConfigError, match=says):
            DynamicSamplingConfig(**kw)


# ----------------------------------------------------------------------------- the real loop


def _loop(
    tiny_dir,
    run_dir: Path,
    steps: int,
    lag: LagPolicy,
    *,
    resume=None,
    recorder=None,
    replay=None,
    dynamic=DynamicSampling(0.0, 3),
    env=None,
    **kw,
):
    """``steps`` steps of P prompts x G samples on the tiny model with the real local engine
    (none for a replay); returns the metrics recorder, the spy trainer."""
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    trainer = SpyTrainer(
        LocalTrainer(
            str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo="grpo", adaptive=True), **kw
        )
    )
    rec = Recorder()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=4, stop_token_ids=(trainer.tokenizer.eos_token_id,)
    )
    s = LoopSettings(
        max_steps=steps,
        prompts_per_step=P,
        group_size=G,
        sampling=sampling,
        lag=lag,
        run_dir=run_dir,
        seed=3,
        histograms=Every(1),
        checkpoints=Every(2),
        checkpoint_keep=5,
        dynamic=dynamic,
        env=env,
    )
    engine = None
    if replay is None:
        engine = LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0))
    stream = stream_of(recorder, replay)
    try:
        parts = RunParts(
            engine, trainer, rec, ParityTask(), trainer.tokenizer, scorer=_scorer(), stream=stream
        )
        TrainLoop(s, parts).run(resume)
    finally:
        if engine is not None:
            engine.close()
    return rec, trainer


def _check_steps(rec: Recorder, trainer: SpyTrainer, steps: range) -> None:
    """Every trained group has non-zero advantages (no equal-reward group, and the even ids
    give one every step); each step trained prompts_per_step groups or says how many short."""
    for batch in trainer.batches:
        adv = batch["advantages"].abs().sum(1).view(-1, G)  # [groups, G]
        assert (adv.sum(1) > 0).all()
    for t in steps:
        m = rec.metrics[t]
        assert m[M.DYN_GEN_BATCHES] >= 2  # batch t's even prompt is always dropped
        assert m[M.DYN_GROUPS_DROPPED] >= 1
        assert m[M.DYN_SPLIT.format("n_groups", "kept")] + m[M.DYN_GROUPS_SHORT] == P
        assert m[M.DYN_SPLIT.format("n_groups", "total")] == P * m[M.DYN_GEN_BATCHES]
        for q in M.DYN_SPLIT_QUANTITIES:
            parts = [m[M.DYN_SPLIT.format(q, p)] for p in M.DYN_SPLIT_PARTS]
            assert parts[0] + parts[1] == parts[2], (t, q)
        # the step's samples histograms split as the counts do
        kept = rec.values[(M.HIST_VERSION_LAG_SPLIT.format("kept"), t)]
        assert len(kept) == m[M.DYN_SPLIT.format("n_samples", "kept")]
        assert sum(kept) == m[M.DYN_SPLIT.format("version_lag_sum", "kept")]


@pytest.mark.slow  # two runs of 4 steps and a resumed one with the real engine
def test_resume_mid_refill_gives_the_uninterrupted_losses(tiny_dir, tmp_path):
    """Fixed lag 2 with packing: refills every step; a run cut after step 3 and resumed from
    its step-2 checkpoint ends with the uninterrupted run's losses, lags and weights."""
    from sat_cli.checkpoints.state import latest_checkpoint

    lag, pack = LagPolicy(2, "fixed"), {"max_tokens_per_row": 64}
    full, t_full = _loop(tiny_dir, tmp_path / "full", 4, lag, **pack)
    _check_steps(full, t_full, range(1, 5))
    _loop(tiny_dir, tmp_path / "cut", 3, lag, **pack)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_3")
    ck = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ck.name == "step_2"
    resumed, t_res = _loop(tiny_dir, tmp_path / "cut", 4, lag, resume=ck, **pack)
    assert sorted(resumed.metrics) == [3, 4]
    for t in (3, 4):
        for key in (
            M.LOSS_POLICY,
            M.REWARD_MEAN,
            M.VERSION_LAG_MEAN,
            M.DYN_GEN_BATCHES,
            M.DYN_EXTRA_LAG,
            M.PROMPT_DIGEST,
        ):
            assert resumed.metrics[t][key] == full.metrics[t][key], (t, key)
    for k, v in t_full.model.state_dict().items():
        assert torch.equal(v, t_res.model.state_dict()[k]), k


def test_interval_lag_run_and_its_replay_are_bit_identical(tiny_dir, tmp_path):
    """Interval lag 2, refills every step: a recording's replay (no engine) trains on the same
    groups and gives the same losses, metrics and weights bit for bit."""
    run = tmp_path / "orig"
    writer = StreamWriter(run / "replay", {}, prompts_per_step=P, group_size=G)
    lag = LagPolicy(2, "interval")
    orig, t_orig = _loop(tiny_dir, run, 3, lag, recorder=writer)
    _check_steps(orig, t_orig, range(1, 4))
    assert [orig.metrics[t][M.VERSION_LAG_MAX] for t in (1, 2, 3)] == [0, 1, 2]
    same, t_same = _loop(tiny_dir, tmp_path / "same", 3, lag, replay=open_recording(run, 3))
    for t in (1, 2, 3):
        for key, value in orig.metrics[t].items():
            # timings and the reward metrics (a replay brings its rewards) aside
            if not key.startswith(("perf/", M.DYN_REFILL_S, M.TOKENS_PER_S, M.REWARD + "/")):
                assert same.metrics[t][key] == value, (t, key)
    for k, v in t_orig.model.state_dict().items():
        assert torch.equal(v, t_same.model.state_dict()[k]), k
    # without dynamic sampling the replay trains on each step's first generation batch only,
    # with its zero-variance group (all-zero advantages)
    off, t_off = _loop(
        tiny_dir, tmp_path / "off", 3, lag, replay=open_recording(run, 3), dynamic=None
    )
    assert all(b["advantages"].shape[0] == P * G for b in t_off.batches)
    assert any((b["advantages"].abs().sum(1).view(-1, G).sum(1) == 0).any() for b in t_off.batches)


@pytest.mark.slow  # ~15 s: a third real run; the replay test covers the refill in the default suite
def test_the_refill_comes_from_the_batchs_version_and_reserved_prompts(tiny_dir, tmp_path):
    """Fixed lag 1: every trained sample of step t comes from version t - 1 (the refill's
    too: it adds no lag), and the step's prompts are batch t's then the reserved refill ones."""
    from sat_cli.loop.steps import digest

    rec, trainer = _loop(tiny_dir, tmp_path / "r", 2, LagPolicy(1, "fixed"))
    task = ParityTask()
    for t, batch in enumerate(trainer.batches):
        assert set(batch["versions"].tolist()) == {max(0, t - 1)}
        m = rec.metrics[t + 1]
        assert m[M.DYN_EXTRA_LAG] == 0.0
        rows = task.sample_prompts(P, t * P)
        for j in range(1, int(m[M.DYN_GEN_BATCHES])):
            rows += task.sample_prompts(P, refill_cursor(t, j, P))
        assert m[M.PROMPT_DIGEST] == digest([r["prompt"] for r in rows])


class ParityEnv:
    """Trajectories of up to 2 turns: an even id's get 0.5 at their first turn and nothing
    after (every trajectory the same: zero variance), an odd id's turns a number from the
    text (they vary)."""

    def __init__(self, settings):
        self.settings = settings

    @property
    def max_turns(self) -> int:
        return self.settings.max_turns

    def reset(self, row):
        from sat_cli.envs.base import TurnCounter

        self.turn, self.even, self.n = TurnCounter(self.max_turns), int(row["id"]) % 2 == 0, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        from sat_cli.envs.base import Step

        self.turn.begin(text)
        self.n += 1
        reward = (0.5 if self.n == 1 else 0.0) if self.even else (sum(map(ord, text)) % 7) / 6
        self.turn.done = self.turn.last
        obs = [] if self.turn.done else [{"role": "tool", "content": "ok"}]
        return Step(obs, reward, self.turn.done, {})


@pytest.mark.slow  # ~15 s: trajectories with the real engine
def test_environment_rewards_are_filtered_and_refills_are_trajectories(tiny_dir, tmp_path):
    """env=<name> at fixed lag 1: the environment's zero-variance groups are dropped, refills
    are trajectories of the same environment (turns, environment tokens) and every trained
    group has non-zero advantages."""
    from sat_cli.envs import trajectory
    from sat_cli.envs.base import EnvSettings
    from sat_cli.envs.registry import ENVIRONMENTS, register_env
    from sat_cli.loop.multiturn import EnvRun

    register_env("parity_test")(ParityEnv)
    try:
        env = EnvRun(
            "parity_test", EnvSettings(max_turns=2), trajectory.TrajectorySettings(max_turns=2)
        )  # noqa
        rec, trainer = _loop(tiny_dir, tmp_path / "env", 2, LagPolicy(1, "fixed"), env=env)
    finally:
        ENVIRONMENTS.remove("parity_test")
    _check_steps(rec, trainer, range(1, 3))
    for batch in trainer.batches:
        assert batch["turn_ids"] is not None
        assert (batch["loss_mask"] == 0).logical_and(batch["attention_mask"] == 1).any()


@pytest.mark.slow  # ~19 s: a real run with the ledger's extra forwards
def test_the_ledger_splits_into_kept_and_dropped_tokens(tiny_dir, tmp_path):
    """algo.ledger (the trainer holds 3 versions) at fixed lag 1: the ledger's sums split into
    kept + dropped = total (token counts exactly), and the kept side's mean |delta| is the
    trainer's own ledger over the tokens it trained on (the same weights, before the update)."""
    rec, trainer = _loop(tiny_dir, tmp_path / "l", 2, LagPolicy(1, "fixed"), ledger_keep=3)
    for t in (1, 2):
        m = rec.metrics[t]

        def part(q, side, m=m):
            return m[M.DYN_LEDGER.format(q, side)]

        assert part("n_tokens", "kept") + part("n_tokens", "dropped") == part("n_tokens", "total")
        assert part("n_tokens", "kept") == m[M.DYN_SPLIT.format("n_tokens", "kept")]  # all held
        for q in M.DYN_LEDGER_QUANTITIES[1:]:
            total = part(q, "kept") + part(q, "dropped")
            assert total == pytest.approx(part(q, "total"), rel=1e-12, abs=1e-12), (t, q)
        # |delta| = mismatch part + staleness part, per side
        for side in M.DYN_SPLIT_PARTS:
            parts = part("mismatch_part_sum", side) + part("staleness_part_sum", side)
            assert parts == pytest.approx(part("abs_logratio_sum", side), rel=1e-9)
        kept_mean = part("abs_logratio_sum", "kept") / part("n_tokens", "kept")
        assert kept_mean == pytest.approx(m[M.LEDGER_DPI], rel=1e-5)
    assert rec.metrics[2][M.DYN_LEDGER.format("staleness_part_sum", "dropped")] != 0  # lag 1
