"""The training loop: lag arithmetic, clip schedules, and lag 0 == a plain synchronous loop."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sat_cli.engines.base import SamplingParams
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.loop.train import (
    ClipSchedule,
    EvalScores,
    Evaluators,
    LoopSettings,
    RunParts,
    TrainLoop,
    request_seed,
)
from sat_cli.tracking.sink import NullSink

# ----------------------------------------------------------------------------- lag policy


def staleness(policy: LagPolicy, steps: int) -> list[int]:
    # batch k is requested one step ahead (at trainer version k-1) and consumed at step k
    return [k - policy.version_for(k, max(k - 1, 0)) for k in range(steps)]


def test_interval_staleness_cycles_through_1_to_n():
    # paper / slime: weights pushed every n steps; batch k>=1 from version n*floor((k-1)/n)
    assert staleness(LagPolicy(8, "interval"), 25) == [0] + list(range(1, 9)) * 3
    assert staleness(LagPolicy(1, "interval"), 6) == [0, 1, 1, 1, 1, 1]
    p = LagPolicy(4, "interval")
    assert [v for v in range(1, 13) if p.publish_after(v, 100)] == [4, 8, 12]


def test_fixed_mode_is_exactly_n_after_warmup():
    assert staleness(LagPolicy(3, "fixed"), 8) == [0, 1, 2, 3, 3, 3, 3, 3]
    p = LagPolicy(3, "fixed")
    assert all(p.publish_after(v, 100) for v in range(1, 10))


@pytest.mark.parametrize("n,mode", [(3, "fixed"), (8, "fixed"), (1, "fixed"), (4, "interval")])
def test_pruning_keeps_every_version_a_later_batch_needs(n, mode):
    """After each step ``v`` the publisher keeps the version of every batch not yet requested
    whose version already exists (batch ``k`` is requested at trainer version ``>= k - n``).
    Fixed mode used to keep only the next two batches' versions, so ``lag=8 lag.mode=fixed``
    pruned v1 at step 2 and failed when batch 9 asked for it."""
    from sat_cli.loop.publisher import future_versions

    lag = LagPolicy(n, mode)
    for v in range(0, 30):
        keep = future_versions(lag, v) | {0}
        for k in range(v, v + 2 * n + 2):  # batches requested at version v or later
            need = lag.version_for(k, v)
            if need <= v:
                assert need in keep, (v, k, need, sorted(keep))


def test_lag0_is_synchronous():
    p = LagPolicy(0, "interval")
    assert staleness(p, 5) == [0, 0, 0, 0, 0]
    # batch t+1 cannot be requested before step t has produced version t+1
    assert not any(p.can_submit(t + 1, t) for t in range(5))
    assert all(p.can_submit(t, t) for t in range(5))


def test_versions_requested_ahead_already_exist():
    for mode in ("interval", "fixed"):
        for n in (1, 2, 4, 8):
            p = LagPolicy(n, mode)
            for t in range(30):
                assert p.can_submit(t + 1, t)
                assert p.version_for(t + 1, t) <= t


def test_bounded_admission():
    p = LagPolicy(2, "bounded")
    assert p.can_submit(7, 5) and not p.can_submit(8, 5)
    assert p.version_for(7, 5) == 5  # the newest weights


def test_bad_lag():
    with pytest.raises(ValueError):
        LagPolicy(-1)
    with pytest.raises(ValueError):
        LagPolicy(1, "sometimes")


# ----------------------------------------------------------------------------- clip schedule


def test_clip_schedules():
    c = ClipSchedule(0.2, 0.28, "constant")
    assert c.radii(0, 10) == (0.2, 0.28) and c.radii(9, 10) == (0.2, 0.28)
    lin = ClipSchedule(0.2, 0.2, "linear", final_scale=0.5)
    assert lin.radii(0, 11) == (0.2, 0.2)
    assert lin.radii(10, 11) == pytest.approx((0.1, 0.1))
    assert lin.radii(5, 11) == pytest.approx((0.15, 0.15))  # halfway: 1 + (0.5-1)*0.5 = 0.75
    cos = ClipSchedule(0.2, 0.2, "cosine", final_scale=0.5)
    assert cos.radii(0, 11) == pytest.approx((0.2, 0.2))
    assert cos.radii(10, 11) == pytest.approx((0.1, 0.1))
    # cosine at 1/4: 0.5 + 0.5*0.5*(1+cos(pi/4)) = 0.5 + 0.25*(1.7071) = 0.926777
    assert cos.scale(2.5, 11) == pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 4)))


# ----------------------------------------------------------------------------- loop vs reference


class SevensTask:
    """Prompts "NNN+" with reward = share of '7's in the response: a non-degenerate signal
    for a randomly initialised model, so advantages and updates are non-zero."""

    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        return [
            {"id": str(i), "prompt": f"{i % 1000:03d}+", "answer": "7"}
            for i in range(cursor, cursor + n)
        ]

    @staticmethod
    def reward(text: str, answer: str) -> float:
        return text.count("7") / max(len(text), 1)


class Recorder(NullSink):
    """A metrics sink that keeps what the loop logs (the MLflow store is tested in test_train_cli)."""

    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.histograms: list[tuple[str, int]] = []
        self.values: dict[tuple[str, int], list] = {}
        self.dicts: dict[str, object] = {}

    def log_metrics(self, m: dict, step: int) -> None:
        self.metrics.setdefault(step, {}).update(m)

    def log_histogram(self, key, values, step, **kw) -> None:
        self.histograms.append((key, step))
        self.values[(key, step)] = [float(v) for v in values]

    def log_dict(self, obj, artifact_file: str) -> None:
        self.dicts[artifact_file] = obj


P, G, STEPS = 4, 4, 3


def test_the_tracker_and_the_test_sinks_are_what_the_loop_logs_to():
    """The loop calls its sink's five methods unconditionally (no ``hasattr`` probes): the MLflow
    Tracker, NullSink and this module's Recorder all have them; an object without
    ``outage_expired`` is not a sink."""
    from sat_cli.tracking import Tracker, TrackerSettings
    from sat_cli.tracking.sink import MetricSink

    disabled = Tracker(TrackerSettings(None, "e"), "r")
    assert isinstance(disabled, MetricSink) and disabled.outage_expired() is False
    assert isinstance(NullSink(), MetricSink) and isinstance(Recorder(), MetricSink)

    class Partial:
        def log_metrics(self, m, step): ...

        def log_histogram(self, key, values, step, **kw): ...

    assert not isinstance(Partial(), MetricSink)


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def _trainer(path):
    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    return LocalTrainer(str(path), lr=1e-2, seed=0, loss=LossConfig(algo="grpo", adaptive=True))


def _settings(sampling, lag, run_dir, **kw) -> LoopSettings:
    """STEPS steps of P prompts x G samples, seed 5, no histograms."""
    return LoopSettings(
        max_steps=STEPS,
        prompts_per_step=P,
        group_size=G,
        sampling=sampling,
        lag=lag,
        run_dir=run_dir,
        seed=5,
        histograms=Every(0),
        **kw,
    )


@pytest.mark.xdist_group("tiny_engine")
def test_lag0_loop_equals_plain_synchronous_loop(tiny_dir, tmp_path, tiny_engine):
    from sat_cli.rl.advantages import group_advantages
    from sat_cli.trainers.batch import collate

    task = SevensTask()
    # the loop at lag 0
    trainer = _trainer(tiny_dir)
    rec = Recorder()
    sampling = replace(SAMPLING, stop_token_ids=(trainer.tokenizer.eos_token_id,))
    settings = _settings(sampling, LagPolicy(0), tmp_path / "loop")
    # one engine for both loops (the worker's, on the initial weights as version 0; starting
    # one was most of this test's time): the reference loop loads them into it again
    engine = tiny_engine
    TrainLoop(settings, RunParts(engine, trainer, rec, task, trainer.tokenizer)).run()
    loop_params = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    # the plain synchronous loop, written out by hand
    ref = _trainer(tiny_dir)
    tok = ref.tokenizer
    ref_rewards, ref_loss = [], []
    engine.update_weights(str(tiny_dir), 0)
    for t in range(STEPS):
        rows = task.sample_prompts(P, cursor=t * P)
        ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        groups = engine.generate(ids, G, replace(sampling, seed=request_seed(5, "rollout", t)))
        samples = [s for g in groups for s in g]
        assert all(s.weight_version == t for s in samples)  # lag 0: fresh weights
        texts = tok.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        rewards = torch.tensor([task.reward(x, "7") for x in texts])
        adv = group_advantages(rewards, G, std_norm=True)
        m = ref.step(collate(samples, adv, tok.pad_token_id))
        ref_rewards.append(float(rewards.mean()))
        ref_loss.append(m["loss/policy"])
        path = ref.publish_weights(tmp_path / "ref_weights", t + 1)
        engine.update_weights(str(path), t + 1)

    assert [rec.metrics[t + 1]["rollout/reward_mean"] for t in range(STEPS)] == ref_rewards
    assert [rec.metrics[t + 1]["loss/policy"] for t in range(STEPS)] == ref_loss
    assert [rec.metrics[t + 1]["staleness/version_lag_max"] for t in range(STEPS)] == [0.0] * STEPS
    assert any(r > 0 for r in ref_rewards) and any(abs(x) > 0 for x in ref_loss)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, loop_params[k]), k
    # the weights moved: the comparison is not between two untouched models
    from sat_cli.models.tiny_moe import load_model

    init = load_model(str(tiny_dir)).state_dict()
    assert any(not torch.equal(init[k], loop_params[k]) for k in init)


@pytest.mark.slow  # ~18 s; the other lag modes stay
def test_interval_lag2_realised_staleness_and_resume(tiny_dir, tmp_path):
    """Interval lag 2: staleness 0,1,2,1,2; a run resumed from its step-2 checkpoint ends with the
    same weights and per-step metrics as the uninterrupted run."""
    from sat_cli.checkpoints.state import latest_checkpoint, list_checkpoints
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    task = SevensTask()

    def run(run_dir: Path, steps: int, resume=None) -> tuple[Recorder, dict]:
        trainer = _trainer(tiny_dir)
        rec = Recorder()
        sampling = replace(SAMPLING, stop_token_ids=(trainer.tokenizer.eos_token_id,))
        s = LoopSettings(
            max_steps=steps,
            prompts_per_step=P,
            group_size=G,
            sampling=sampling,
            lag=LagPolicy(2, "interval"),
            run_dir=run_dir,
            seed=1,
            checkpoints=Every(2),
            checkpoint_keep=5,
            histograms=Every(0),
        )
        with LocalEngine(
            LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0)
        ) as engine:
            TrainLoop(s, RunParts(engine, trainer, rec, task, trainer.tokenizer)).run(resume)
        return rec, {k: v.clone() for k, v in trainer.model.state_dict().items()}

    full, w_full = run(tmp_path / "full", 5)
    lags = [full.metrics[t]["staleness/version_lag_max"] for t in range(1, 6)]
    assert lags == [0.0, 1.0, 2.0, 1.0, 2.0]
    ckpts = [s for s, _ in list_checkpoints(tmp_path / "full" / "checkpoints")]
    assert ckpts == [2, 4, 5]

    # interrupted after step 3 (checkpoint at 2), then resumed from that checkpoint
    run(tmp_path / "cut", 3)
    import shutil

    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_3")
    ck = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ck.name == "step_2"
    resumed, w_res = run(tmp_path / "cut", 5, resume=ck)
    assert sorted(resumed.metrics) == [3, 4, 5]
    for t in (3, 4, 5):
        for key in ("rollout/reward_mean", "loss/policy", "staleness/version_lag_max"):
            assert resumed.metrics[t][key] == full.metrics[t][key], (t, key)
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k


def _bounded_run(tiny_dir, run_dir, inflight: bool, steps=6, n=2, tokens=6) -> Recorder:
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    trainer = _trainer(tiny_dir)
    rec = Recorder()
    sampling = replace(
        SAMPLING, max_new_tokens=tokens, stop_token_ids=(trainer.tokenizer.eos_token_id,)
    )
    s = LoopSettings(
        max_steps=steps,
        prompts_per_step=P,
        group_size=G,
        sampling=sampling,
        lag=LagPolicy(n, "bounded"),
        run_dir=run_dir,
        seed=2,
        histograms=Every(1),
        inflight_updates=inflight,
    )
    with LocalEngine(
        LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0, inflight_updates=inflight)
    ) as engine:
        TrainLoop(s, RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer)).run()
    return rec


def _digests(steps: int) -> list[float]:
    """The prompt digest of every batch: batch k holds prompts k*P .. k*P+P-1, whatever the
    mode (each prompt consumed once, in order)."""
    from sat_cli.loop.steps import digest

    task = SevensTask()
    return [
        digest([r["prompt"] for r in task.sample_prompts(P, cursor=k * P)]) for k in range(steps)
    ]


@pytest.mark.slow  # ~6 s; the in-flight bounded run below keeps the class (late binding alone:
# test_loop_parts.py::test_bounded_requests_bind_their_version_when_generation_starts)
def test_bounded_mode_keeps_staleness_within_n(tiny_dir, tmp_path):
    """Bounded (AReaL-style) lag 2, serial engine: each batch is generated from the newest
    weights published when its generation starts (late binding), so realised staleness depends
    on timing, never above 2; batch 0 is fresh and the engine really runs ahead of the trainer."""
    rec = _bounded_run(tiny_dir, tmp_path / "b", inflight=False)
    m = [rec.metrics[t] for t in range(1, 7)]
    lags = [x["staleness/version_lag_max"] for x in m]
    assert lags[0] == 0.0 and all(0.0 <= x <= 2.0 for x in lags), lags
    # batch t+1 starts when batch t is done, before the trainer finished step t: version <= t
    assert all(x >= 1.0 for x in lags[1:]), lags
    assert [x["rollout/prompt_digest"] for x in m] == _digests(6)
    assert all(x["staleness/mixed_version_frac"] == 0.0 for x in m)  # one version per response
    assert all(x["rollout/stale_dropped"] == 0.0 for x in m)


def test_bounded_inflight_updates_span_versions_within_the_bound(tiny_dir, tmp_path):
    """lag.inflight_updates: the trainer hands every new version to the engine at once, which
    takes it at the next token boundary. No token is consumed more than n versions after the
    one that sampled it, the per-token staleness histogram has more than one value, and every
    prompt is consumed exactly once, in order."""
    steps, n = 6, 2
    # 64 new tokens: a batch takes longer to generate than a step to train, so the versions the
    # trainer publishes land mid-generation
    rec = _bounded_run(tiny_dir, tmp_path / "f", inflight=True, steps=steps, n=n, tokens=64)
    m = [rec.metrics[t] for t in range(1, steps + 1)]
    assert [x["rollout/prompt_digest"] for x in m] == _digests(steps)
    token_lags = [
        v for t in range(1, steps + 1) for v in rec.values[("staleness/token_version_lag", t)]
    ]
    sample_lags = [v for t in range(1, steps + 1) for v in rec.values[("staleness/version_lag", t)]]
    assert max(token_lags) <= n and min(token_lags) >= 0
    assert len(set(token_lags)) > 1 and len(set(sample_lags)) > 1  # a distribution, not one value
    # a sample's lag is its oldest token's: never below any of its tokens' lags
    assert max(sample_lags) == max(token_lags)
    for x in m:
        assert x["staleness/token_version_lag_mean"] <= x["staleness/version_lag_mean"] + 1e-12
        assert 0.0 <= x["staleness/mixed_version_frac"] <= 1.0
    assert any(x["staleness/mixed_version_frac"] > 0 for x in m)  # responses span versions


@pytest.mark.xdist_group("tiny_engine")
def test_final_evaluation_runs_once_on_the_final_weights(tiny_dir, tmp_path, tiny_engine):
    """``final_evaluator`` runs once, after the last step, with the engine holding the final
    weights; its metrics are logged at step max_steps beside the last in-training evaluation."""
    trainer = _trainer(tiny_dir)
    rec = Recorder()
    calls = {"eval": [], "final": []}
    sampling = replace(SAMPLING, stop_token_ids=(trainer.tokenizer.eos_token_id,))
    settings = _settings(sampling, LagPolicy(1), tmp_path / "loop", eval=Every(2))
    engine = tiny_engine  # the worker's engine, on the initial weights as version 0

    def evaluator():
        calls["eval"].append(engine.weight_version)
        m = {"eval/x/pass@1": 1.0, "eval/x/avg@2": float(engine.weight_version)}
        return EvalScores(m, headline="eval/x/avg@2")

    def final():
        calls["final"].append(engine.weight_version)
        return EvalScores({"final/x/avg@8": 42.0})

    evals = Evaluators(evaluator, final)
    parts = RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer, evals)
    st = TrainLoop(settings, parts).run()
    assert calls == {"eval": [2, STEPS], "final": [STEPS]}
    # the headline the evaluator names is kept (not the first metric): best and last
    assert (st.eval.key, st.eval.best, st.eval.best_step) == ("eval/x/avg@2", 3.0, 3)
    assert (st.eval.last, st.eval.last_step) == (3.0, 3)
    assert rec.metrics[STEPS]["final/x/avg@8"] == 42.0
    assert all("final/x/avg@8" not in rec.metrics[t] for t in range(1, STEPS))


@pytest.mark.xdist_group("tiny_engine")
def test_failed_rewards_stop_the_loop_with_a_checkpoint(tiny_dir, tmp_path, tiny_engine):
    """A step whose rewards fail above ``max_reward_error_frac`` is logged, checkpointed, and
    ends the run with ``RewardFailed`` naming the first error; the steps before are untouched."""
    from types import SimpleNamespace

    from sat_cli import metric_names as M
    from sat_cli.checkpoints.state import latest_checkpoint
    from sat_cli.rewards import RewardFailed, Scorer

    trainer = _trainer(tiny_dir)
    rec, task, calls = Recorder(), SevensTask(), []

    def one(prompt, response, row):
        calls.append(prompt)
        if len(calls) > P * G:  # step 1: one error (the NaN) in 16; step 2 on: all fail
            raise ValueError("broken")
        if len(calls) == 1:
            return math.nan
        return {"sevens": task.reward(response, row["answer"]), "one": 1.0}

    scorer = Scorer(one, SimpleNamespace(weights={"sevens": 1.0}, on_error=0.0))
    sampling = replace(SAMPLING, stop_token_ids=(trainer.tokenizer.eos_token_id,))
    settings = _settings(sampling, LagPolicy(1), tmp_path / "loop", max_reward_error_frac=0.5)
    with pytest.raises(
        RewardFailed,
        match=r"100% of step 2's rewards failed \(reward\.max_error_"
        r"frac=0\.5\); the first: ValueError: broken\. The run stopped with the "
        r"checkpoint .*step_2",
    ):
        parts = RunParts(tiny_engine, trainer, rec, task, trainer.tokenizer, scorer=scorer)
        TrainLoop(settings, parts).run()
    assert rec.metrics[1][M.REWARD_ERROR_FRAC] == 1 / 16
    assert rec.metrics[2][M.REWARD_ERROR_FRAC] == 1.0
    assert rec.metrics[1][M.reward_key("one")] == 1.0  # 15 samples with components
    assert M.reward_key("one") not in rec.metrics[2]
    assert latest_checkpoint(tmp_path / "loop" / "checkpoints").name == "step_2"
