"""The multi-turn driver (sat_cli/envs/trajectory.py) on the real local engine: token in, token
out (the trainer's sequence is exactly the engine's ids plus the environment's ids), masks,
turns, the token budget, versions across turns and partial trajectories; and the renderers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sat_cli.envs.base import EnvSettings, Step, TurnCounter
from sat_cli.envs.render import ChatRenderer, PlainRenderer, renderer_for
from sat_cli.envs.trajectory import TrajectorySettings, run_trajectories, run_trajectory
from sat_cli.models.tiny_moe import build_char_tokenizer, load_model, save_hf
from sat_cli.samples import SamplingParams
from sat_cli.trainers.batch import collate

pytestmark = pytest.mark.xdist_group("tiny_engine")

TOK = build_char_tokenizer()
# stop at every other character: the random tiny model ends its turns after a few tokens
STOPS = tuple(range(3, len(TOK), 2))
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=STOPS, seed=3)


class EchoEnv:
    """A real environment (the ``Environment`` protocol): answers every turn with a tool
    message naming the turn and the text's length, and ends at ``max_turns``; reward 1 per
    turn whose text holds a vowel. It keeps what it was given."""

    def __init__(self, settings: EnvSettings):
        self.settings = settings
        self.seen: list[str] = []
        self.resets = 0

    @property
    def max_turns(self) -> int:
        return self.settings.max_turns

    def reset(self, row):
        self.turn, self.seen, self.resets = TurnCounter(self.max_turns), [], self.resets + 1
        return [{"role": "user", "content": row["question"]}]

    def step(self, text):
        self.turn.begin(text)
        self.seen.append(text)
        reward = float(any(v in text for v in "aeiou"))
        if self.turn.last:
            self.turn.done = True
            return Step([], reward, True, {"turn": self.turn.turns})
        obs = [{"role": "tool", "content": f"turn {self.turn.turns}: {len(text)}"}]
        return Step(obs, reward, False, {"turn": self.turn.turns})


class Recorder:
    """The real engine, with every request and reply kept (and, optionally, a weight update
    handed to it before request ``k``: what the loop's in-flight push does between turns)."""

    def __init__(self, engine, update_before: dict | None = None):
        self.engine, self.requests, self.replies = engine, [], []
        self.update_before = update_before or {}

    def generate(self, prompts, n, sampling):
        k = len(self.requests)
        if k in self.update_before:
            self.engine.update_weights(*self.update_before[k])
        self.requests.append([list(p) for p in prompts])
        out = self.engine.generate(prompts, n, sampling)
        self.replies.append([g[0] for g in out])
        return out


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_trainer_tokens_are_the_engine_ids_plus_the_environment_ids(tiny_engine):
    rec = Recorder(tiny_engine)
    envs = [EchoEnv(EnvSettings(max_turns=3)) for _ in range(2)]
    rows = [{"question": "What is 12 * 34?"}, {"question": "hello"}]
    samples = run_trajectories(rec, envs, TOK, rows, SAMPLING, TrajectorySettings(max_turns=3))
    for i, (s, env, row) in enumerate(zip(samples, envs, rows, strict=True)):
        assert s.prompt_ids == ids(row["question"] + "\n")
        turns = [reply[i] for reply in rec.replies if i < len(reply)]
        expected, mask, turn_ids, logp = [], [], [], []
        for k, t in enumerate(turns):
            # token in: request k is the trajectory so far, as ids
            assert rec.requests[k][i] == s.prompt_ids + expected
            expected += t.response_ids
            mask += [1] * t.response_len
            turn_ids += [k] * t.response_len
            logp += t.rollout_logp
            assert env.seen[k] == TOK.decode(t.response_ids, skip_special_tokens=True)
            if k < len(turns) - 1:  # the observation, tokenised once
                obs = ids(f"turn {k + 1}: {len(env.seen[k])}\n")
                expected += obs
                mask += [0] * len(obs)
                turn_ids += [k] * len(obs)
                logp += [0.0] * len(obs)
        assert len(turns) == 3 and s.finish_reason == "stop"
        assert s.response_ids == expected  # token for token
        assert s.loss_mask == mask and s.turn_ids == turn_ids and s.rollout_logp == logp
        assert s.meta["turns"] == 3
        assert s.meta["reward"] == sum(float(any(v in x for v in "aeiou")) for x in env.seen)
        assert s.weight_version == 0 and s.token_versions is None
    batch = collate(samples, [1.0, -1.0], pad_id=0)  # the trainer's sequence
    P = len(samples[0].prompt_ids)
    T = P + samples[0].response_len
    assert batch.input_ids[0, :T].tolist() == samples[0].prompt_ids + samples[0].response_ids
    assert batch.loss_mask[0, P:T].tolist() == samples[0].loss_mask


def test_trainer_recompute_equals_the_engine_logp_on_every_turn(tiny_engine, tiny_dir):
    """The trainer's log-probs of the collated trajectories, same weights, equal the engine's on
    every model token of every turn (positions and context line up across turns)."""
    from sat_cli.trainers.local import LocalTrainer

    envs = [EchoEnv(EnvSettings(max_turns=3)) for _ in range(3)]
    rows = [{"question": q} for q in ("12+34=", "hello there", "7")]
    samples = run_trajectories(tiny_engine, envs, TOK, rows, SAMPLING, TrajectorySettings(3))
    batch = collate(samples, [1.0, -1.0, 0.5], pad_id=0)
    lp = LocalTrainer(str(tiny_dir), temperature=1.0).logprobs(batch)
    m = batch.loss_mask.bool()
    assert batch.turn_ids[m].max() == 2  # later turns are in it
    assert (lp - batch.rollout_logp)[m].abs().max() <= 1e-5
    assert batch.rollout_logp[m].mean() < -1.0  # real log-probs, not zeros


def test_one_turn_trajectory_is_the_single_turn_request(tiny_engine):
    env = EchoEnv(EnvSettings(max_turns=1))
    s = run_trajectory(tiny_engine, env, TOK, {"question": "7+8="}, SAMPLING)
    (direct,) = tiny_engine.generate([ids("7+8=\n")], 1, SAMPLING)[0]
    assert s.response_ids == direct.response_ids and s.rollout_logp == direct.rollout_logp
    assert s.loss_mask == [1] * direct.response_len and s.finish_reason == "stop"


def test_token_budget_ends_the_trajectory(tiny_engine):
    rec = Recorder(tiny_engine)
    env = EchoEnv(EnvSettings(max_turns=8))
    sampling = SamplingParams(max_new_tokens=12, seed=1)  # no stop ids: every turn runs long
    s = run_trajectory(rec, env, TOK, {"question": "abc"}, sampling, TrajectorySettings(8, 20))
    assert len(s.prompt_ids) + s.response_len <= 20
    assert s.finish_reason == "length"
    assert max(len(r[0]) for r in rec.requests) < 20  # every request left room to generate


@pytest.fixture(scope="module")
def v1(tiny_dir, tmp_path_factory):
    """A perturbed copy of the tiny checkpoint, loaded as version 1."""
    model = load_model(tiny_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
    return str(save_hf(model, build_char_tokenizer(), tmp_path_factory.mktemp("v1") / "m"))


def test_turns_of_one_trajectory_keep_the_versions_that_made_them(tiny_engine, v1):
    rec = Recorder(tiny_engine, update_before={1: (v1, 1)})  # new weights after turn 0
    env = EchoEnv(EnvSettings(max_turns=3))
    s = run_trajectory(rec, env, TOK, {"question": "q"}, SAMPLING, TrajectorySettings(3))
    assert [r[0].weight_version for r in rec.replies] == [0, 1, 1]
    expected = [0 if k == 0 else 1 for k in s.turn_ids]  # observation 0 answers turn 0
    assert s.token_versions == expected and s.weight_version == 0
    assert s.model_token_versions() == [v for v, m in zip(expected, s.loss_mask, strict=True) if m]
    assert s.oldest_version() == 0


def test_partial_abort_runs_the_trajectory_again_from_the_new_version(tiny_engine, v1):
    rec = Recorder(tiny_engine, update_before={1: (v1, 1)})
    env = EchoEnv(EnvSettings(max_turns=2))
    settings = TrajectorySettings(max_turns=2, partial="abort")
    s = run_trajectory(rec, env, TOK, {"question": "q"}, SAMPLING, settings)
    assert s.meta["requeues"] == 1 and env.resets == 2
    # the first attempt (turn 0 at v0, turn 1 at v1) was dropped; the kept one is all v1
    assert [r[0].weight_version for r in rec.replies] == [0, 1, 1, 1]
    assert s.token_versions is None and s.weight_version == 1 and s.finish_reason == "stop"
    assert s.response_ids[: rec.replies[2][0].response_len] == rec.replies[2][0].response_ids


def test_kept_sets_and_sampler_topk_cover_every_token(tiny_engine):
    """Mask replay and score centering on trajectories: each model token keeps the kept set and
    top-k its turn reported; environment tokens have an empty kept set and top-k ids -1."""
    rec = Recorder(tiny_engine)
    sampling = SamplingParams(
        top_p=0.9,
        max_new_tokens=12,
        stop_token_ids=STOPS,
        seed=4,
        sampling_mask=True,
        topk_logprobs=2,
    )
    s = run_trajectory(rec, EchoEnv(EnvSettings(max_turns=2)), TOK, {"question": "q"}, sampling)
    assert len(s.sampling_mask) == s.topk_ids.shape[0] == s.response_len
    turns = [r[0] for r in rec.replies]
    at = 0
    for t in turns:
        for j in range(t.response_len):
            assert np.array_equal(s.sampling_mask[at + j], t.sampling_mask[j])
        assert np.array_equal(s.topk_ids[at : at + t.response_len], t.topk_ids)
        assert np.array_equal(s.topk_logp[at : at + t.response_len], t.topk_logp)
        at += t.response_len
        while at < s.response_len and not s.loss_mask[at]:  # the observation after the turn
            assert len(s.sampling_mask[at]) == 0 and (s.topk_ids[at] == -1).all()
            at += 1
    assert at == s.response_len and len(turns) == 2
    batch = collate([s], [1.0], pad_id=0, need_mask=True, need_topk=2)
    env = ~batch.loss_mask.bool() & batch.attention_mask.bool()
    assert (batch.sampling_mask[env] == -1).all() and (batch.topk_ids[env] == -1).all()


@pytest.fixture(scope="module")
def r3_engine(tiny_dir):
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    runtime = LocalEngineRuntime(str(tiny_dir), seed=0, r3=True)
    with LocalEngine(LocalEngineSettings(), runtime) as engine:
        yield engine


def test_routed_experts_across_turns_are_each_positions_first_feed(r3_engine, tiny_dir):
    """R3: row ``s`` of a trajectory's routes is the routing of position ``s`` in the first
    request that fed it, and (one weight version) equals a plain forward's of the whole
    trajectory: the rows line up with the trainer's positions."""
    from sat_cli.models.r3 import RouteCapture

    rec = Recorder(r3_engine)
    env = EchoEnv(EnvSettings(max_turns=3))
    s = run_trajectory(rec, env, TOK, {"question": "12+34="}, SAMPLING, TrajectorySettings(3))
    T = len(s.prompt_ids) + s.response_len
    assert s.routed_experts.shape[0] == T - 1 and len(rec.replies) == 3
    held = 0
    for (reply,) in rec.replies:  # each request's rows beyond those held: new positions
        rows = len(reply.routed_experts)
        assert np.array_equal(s.routed_experts[held:rows], reply.routed_experts[held:rows])
        held = rows
    assert held == T - 1
    model = load_model(tiny_dir)
    with torch.no_grad(), RouteCapture(model) as cap:
        model(input_ids=torch.tensor([s.prompt_ids + s.response_ids]))
        routes = cap.last_call()[: T - 1].numpy()
    assert (np.sort(routes, -1) == np.sort(s.routed_experts, -1)).all()
    batch = collate([s], [1.0], pad_id=0, need_routes=True)
    assert batch.routed_experts.shape[1] == T


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_renderer_cuts_the_observation_piece_out_of_the_template():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    r = renderer_for(tok)
    assert isinstance(r, ChatRenderer) and isinstance(renderer_for(TOK), PlainRenderer)
    msgs = [{"role": "user", "content": "hi"}]
    assert r.prompt_ids(msgs) == ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # after a model turn ending in '>' (the last char of <|im_end|> here, used as stop id):
    # ChatML's closing newline, the tool message and the next generation prompt
    obs = r.observation_ids([{"role": "tool", "content": "42"}], stop_ids=ids(">"))
    assert obs == ids("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = "{{ messages | length }}"  # no prefix property
    with pytest.raises(ValueError, match="prefix"):
        ChatRenderer(tok).observation_ids([{"role": "tool", "content": "42"}])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_turns=0), "env.max_turns"),
        (dict(max_turns=65), "env.max_turns"),
        (dict(max_turns=True), "env.max_turns"),
        (dict(max_tokens=0), "env.max_tokens"),
        (dict(max_tokens=2.5), "env.max_tokens"),
        (dict(partial="drop"), "env.partial"),
    ],
)
def test_trajectory_settings_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        TrajectorySettings(**kw)
