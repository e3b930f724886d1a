"""Multi-turn rollouts in the training loop (issue 43; sat_cli/loop/multiturn.py): the ``env``
config section and its bounds, the loop's settings built from it, and a bounded-lag run with
in-flight updates in which turns of one trajectory come from different weight versions, each
token keeping its own, and the per-turn staleness metrics and histograms are logged."""

from __future__ import annotations

import pytest
import torch
from test_loop import Recorder, SevensTask

from sat_cli import metric_names as M
from sat_cli.config import load
from sat_cli.config.env import MAX_TURNS, PARTIAL_MODES
from sat_cli.envs import base, trajectory
from sat_cli.envs.base import EnvSettings, Step, TurnCounter
from sat_cli.envs.registry import ENVIRONMENTS, register_env
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
from sat_cli.samples import SamplingParams
from sat_cli.validate import ConfigError


def test_config_env_section_builds_the_loops_env_run():
    from sat_cli.build.run import env_run

    _, obj = load([])
    assert obj.env.name == "none" and env_run(obj) is None  # the single-turn path
    _, obj = load(["env=calculator", "env.max_turns=3", "env.max_tokens=256", "env.partial=abort"])
    run = env_run(obj)
    assert run.name == "calculator"
    assert run.settings == EnvSettings(max_turns=3, max_tokens=256, parser="hermes")
    assert run.trajectory == trajectory.TrajectorySettings(3, 256, "abort")
    # the section's bounds are the driver's
    assert PARTIAL_MODES == trajectory.PARTIAL_MODES and MAX_TURNS == base.MAX_TURNS


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["env=nope"], "env"),
        (["env=calculator", "env.max_turns=0"], "env.max_turns"),
        (["env=calculator", "env.max_turns=65"], "env.max_turns"),
        (["env=calculator", "env.max_tokens=0"], "env.max_tokens"),
        (["env=calculator", "env.max_tokens=2097152"], "env.max_tokens"),
        (["env=calculator", "env.partial=drop"], "env.partial"),
        (["env=calculator", "env.parser=xml"], "env.parser"),
        (["env=calculator", "env.partial=abort", "lag.profile=fixed:1"], "lag.profile"),
    ],
)
def test_env_section_refuses_bad_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(overrides)


def test_per_turn_metrics_hand_case():
    """Turn lags, counts and d̄π per turn, by hand: the loss's ``abs_d_mu`` comes in row-major
    order of the trained tokens, and the batch's turn ids tell them apart."""
    from sat_cli.loop.multiturn import turn_lags, turn_logratio, turn_metrics
    from sat_cli.samples import Sample
    from sat_cli.trainers.batch import collate

    a = Sample(
        [1],
        [5, 6, 7, 8, 9],
        [-0.1, -0.2, 0.0, -0.3, -0.4],
        "stop",
        3,
        token_versions=[3, 3, 3, 4, 4],
        loss_mask=[1, 1, 0, 1, 1],
        turn_ids=[0, 0, 0, 1, 1],
        meta={"turns": 2},
    )
    b = Sample([1], [5], [-0.5], "stop", 4, loss_mask=[1], turn_ids=[0], meta={"turns": 1})
    lags = turn_lags([a, b], t=5)
    assert lags == {0: [2, 2, 1], 1: [1, 1]}
    m = turn_metrics([a, b], lags)
    assert m[M.TURN_TOKENS.format(0)] == 3 and m[M.TURN_TOKEN_LAG_MEAN.format(0)] == 5 / 3
    assert m[M.TURN_TOKEN_LAG_MEAN.format(1)] == 1.0 and m[M.TURNS_MEAN] == 1.5
    assert m[M.ENV_TOKEN_FRAC] == 1 / 6
    assert M.ENV_TOOL_ERROR_FRAC not in m  # no infos (a replayed batch): nothing was called
    a.meta["info"] = {"tool_calls_total": 3, "tool_errors_total": 2}  # crash, hang, one good
    b.meta["info"] = {"tool_calls_total": 1, "tool_errors_total": 0}
    m = turn_metrics([a, b], lags)
    assert (m[M.ENV_TOOL_CALLS], m[M.ENV_TOOL_ERROR_FRAC]) == (4.0, 0.5)
    b.meta["info"], a.meta["info"] = {"correct": True}, {}  # an environment without tools
    assert turn_metrics([a, b], lags)[M.ENV_TOOL_ERROR_FRAC] == 0.0
    batch = collate([a, b], [1.0, -1.0], pad_id=0)
    # trained tokens in row-major order: a's 5, 6 (turn 0), 8, 9 (turn 1), then b's 5 (turn 0)
    diag = {"abs_d_mu": torch.tensor([0.1, 0.3, 0.5, 0.7, 0.2], dtype=torch.float64)}
    d = turn_logratio(diag, batch)
    assert d[M.TURN_DPI_MU.format(0)] == pytest.approx(0.2, rel=1e-12)
    assert d[M.TURN_DPI_MU.format(1)] == pytest.approx(0.6, rel=1e-12)
    assert turn_logratio({"abs_d_mu": torch.zeros(3)}, batch) == {}  # does not line up: none


class SevensEnv:
    """Every turn is rewarded with its share of '7's; the tool answers "ok" until the last
    turn. A real environment of the ``Environment`` protocol."""

    def __init__(self, settings: EnvSettings):
        self.settings = settings

    @property
    def max_turns(self) -> int:
        return self.settings.max_turns

    def reset(self, row):
        self.turn = TurnCounter(self.max_turns)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turn.begin(text)
        reward = text.count("7") / max(len(text), 1) / self.max_turns
        self.turn.done = self.turn.last
        obs = [] if self.turn.done else [{"role": "tool", "content": "ok"}]
        return Step(obs, reward, self.turn.done, {})


@pytest.fixture
def sevens_env():
    register_env("sevens_test")(SevensEnv)
    yield "sevens_test"
    ENVIRONMENTS.remove("sevens_test")


def test_bounded_inflight_turns_of_one_trajectory_span_versions(tiny_dir, tmp_path, sevens_env):
    """lag.mode=bounded, lag.n=2, in-flight updates: the engine takes each new version at the
    next token boundary, between turns too. Some trajectory's turns come from different
    versions; every model token's version is recorded (the batch the trainer got), never more
    than n behind, never going back within a trajectory; the per-turn metrics and histograms
    are logged."""
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.loop.multiturn import EnvRun
    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    class KeepingTrainer(LocalTrainer):  # the real trainer, keeping the batches it trained on
        batches: list = []

        def step(self, batch, diag=None):
            self.batches.append(batch)
            return super().step(batch, diag)

    trainer = KeepingTrainer(
        str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo="grpo", adaptive=True)
    )
    steps, n, turns = 4, 2, 3
    # a stop at every 8th character: turns of about 8 tokens that end with "stop"
    stops = tuple(range(3, len(trainer.tokenizer), 8))
    settings = trajectory.TrajectorySettings(max_turns=turns, max_tokens=512)
    s = LoopSettings(
        max_steps=steps,
        prompts_per_step=2,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=32, stop_token_ids=stops),
        lag=LagPolicy(n, "bounded"),
        run_dir=tmp_path / "run",
        seed=2,
        histograms=Every(1),
        inflight_updates=True,
        env=EnvRun(sevens_env, EnvSettings(max_turns=turns, max_tokens=512), settings),
    )
    rec = Recorder()
    runtime = LocalEngineRuntime(str(tiny_dir), seed=0, inflight_updates=True)
    with LocalEngine(LocalEngineSettings(), runtime) as engine:
        TrainLoop(s, RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer)).run()
    spans = 0
    for t, batch in enumerate(trainer.batches):
        assert batch.turn_ids is not None
        model = batch.loss_mask.bool()
        tv = batch.token_versions  # None: every trajectory of the batch from one version each
        tv = batch.versions[:, None].expand_as(model) if tv is None else tv
        for b in range(batch.batch_size):
            v = tv[b][model[b]].tolist()
            k = batch.turn_ids[b][model[b]].tolist()
            assert v == sorted(v)  # versions only go forward along a trajectory
            assert all(0 <= t - x <= n for x in v)  # admitted within the bound
            per_turn = {turn: {x for x, kk in zip(v, k, strict=True) if kk == turn} for turn in k}
            spans += len(set().union(*per_turn.values())) > 1 and min(per_turn[0]) < max(
                per_turn[max(k)]
            )
        assert int(model.sum()) < int((batch.attention_mask.bool()).sum())  # env tokens exist
    assert spans > 0  # some trajectory's later turns came from newer weights than its first
    for t in range(1, steps + 1):
        m = rec.metrics[t]
        assert 1 < m[M.TURNS_MEAN] <= turns  # most trajectories run their 3 turns
        assert 0 < m[M.ENV_TOKEN_FRAC] < 1
        for k in range(turns):
            assert 0 <= m[M.TURN_TOKEN_LAG_MEAN.format(k)] <= n
            assert m[M.TURN_TOKENS.format(k)] > 0
            assert m[M.TURN_DPI_MU.format(k)] >= 0
            assert (M.HIST_TURN_TOKEN_VERSION_LAG.format(k), t) in rec.histograms
    later = [
        v
        for t in range(1, steps + 1)
        for v in rec.values[(M.HIST_TURN_TOKEN_VERSION_LAG.format(turns - 1), t)]
    ]
    first = [
        v
        for t in range(1, steps + 1)
        for v in rec.values[(M.HIST_TURN_TOKEN_VERSION_LAG.format(0), t)]
    ]
    assert sum(later) / len(later) < sum(first) / len(first)  # later turns: newer weights


def _env_loop(tiny_dir, run_dir, env_name, recorder=None, replay=None):
    """test_replay's 4-step loop at fixed lag 1, with 2 prompts x 4 trajectories of
    ``env_name`` (3 turns of up to 8 tokens)."""
    from test_replay import _loop

    from sat_cli.loop.multiturn import EnvRun
    from sat_cli.models.tiny_moe import build_char_tokenizer

    stops = tuple(range(3, len(build_char_tokenizer()), 4))
    env = EnvRun(env_name, EnvSettings(max_turns=3), trajectory.TrajectorySettings(max_turns=3))
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=stops)
    lag = LagPolicy(1, "fixed")
    return _loop(tiny_dir, run_dir, "grpo", recorder, replay, lag, sampling=sampling, env=env)


@pytest.mark.slow  # ~18 s; the store's round trip of multi-turn samples stays in the default
# suite (tests/test_env_masks.py::test_replay_recording_keeps_masks_turns_and_versions)
def test_a_multiturn_recording_replays_bit_for_bit(tiny_dir, tmp_path, sevens_env):
    """replay.record=true with an environment: the recording keeps the trajectories' masks,
    turns and versions, and replaying it trains on the same batches with the same losses and
    weights, bit for bit."""
    from sat_cli.replay.store import StreamWriter, open_recording

    writer = StreamWriter(tmp_path / "orig" / "replay", {}, prompts_per_step=2, group_size=4)
    orig, t_orig = _env_loop(tiny_dir, tmp_path / "orig", sevens_env, recorder=writer)
    rec = open_recording(tmp_path / "orig", 4)
    same, t_same = _env_loop(tiny_dir, tmp_path / "same", sevens_env, replay=rec)
    assert len(t_orig.batches) == len(t_same.batches) == 4
    for a, b in zip(t_orig.batches, t_same.batches, strict=True):
        assert a.keys() == b.keys() and "turn_ids" in a
        assert (a["loss_mask"] == 0).logical_and(a["attention_mask"] == 1).any()  # env tokens
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for t in range(1, 5):
        for key in ("loss/policy", "loss/grad_norm", "rollout/reward_mean", M.TURNS_MEAN):
            assert same.metrics[t][key] == orig.metrics[t][key], (t, key)
    for k, v in t_orig.model.state_dict().items():
        assert torch.equal(v, t_same.model.state_dict()[k]), k
