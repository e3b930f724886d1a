"""The multi-turn driver (sat_cli/envs/trajectory.py) on a REAL SGLang 0.5.23 server on this CPU
(tier ``sglang``, as tests/test_sglang_real.py): each turn is one ``/generate`` request with
``input_ids`` (the trajectory so far), and the trainer's sequence is exactly the engine's
returned ids plus the environment's ids, token for token; the model tokens' log-probs are the
engine's, the environment's 0 and masked. A weight update between turns: each turn's tokens keep
the version that made them, and R3's rows are each position's first feed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_real import MODEL, launch
from test_trajectory import EchoEnv, Recorder

from sat_cli.envs.base import EnvSettings
from sat_cli.envs.trajectory import TrajectorySettings, run_trajectories, run_trajectory
from sat_cli.models.tiny_moe import load_model, save_hf
from sat_cli.samples import SamplingParams
from sat_cli.trainers.batch import collate

# slow: its own R3 server costs ~85 s of the sglang worker's time, the critical path of make test;
# the class (trainer tokens = engine ids + environment ids, versions across an update) stays in
# the default suite on the local engine (tests/test_trajectory.py); make test-full runs this file
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.xdist_group("sglang")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = launch(log_dir=tmp_path_factory.mktemp("sglang-logs"), r3=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def turn_sampling(tok) -> SamplingParams:
    stops = tuple(range(3, len(tok), 2))  # turns of a few tokens that end with "stop"
    return SamplingParams(max_new_tokens=12, stop_token_ids=stops, seed=3)


def test_sglang_trajectory_tokens_are_the_engine_ids_plus_the_environment_ids(engine, tok):
    sampling = turn_sampling(tok)
    rec = Recorder(engine)
    envs = [EchoEnv(EnvSettings(max_turns=3)) for _ in range(2)]
    rows = [{"question": "123+456="}, {"question": "7+8="}]
    samples = run_trajectories(rec, envs, tok, rows, sampling, TrajectorySettings(max_turns=3))
    for i, (s, env) in enumerate(zip(samples, envs, strict=True)):
        expected, logp = [], []
        for k, reply in enumerate(rec.replies):
            turn = reply[i]
            assert rec.requests[k][i] == s.prompt_ids + expected  # token in
            expected += turn.response_ids  # token out
            logp += turn.rollout_logp
            assert env.seen[k] == tok.decode(turn.response_ids, skip_special_tokens=True)
            if k < len(rec.replies) - 1:
                obs = tok(f"turn {k + 1}: {len(env.seen[k])}\n", add_special_tokens=False)
                expected += obs["input_ids"]
                logp += [0.0] * len(obs["input_ids"])
        assert len(rec.replies) == 3 and s.finish_reason == "stop"
        assert s.response_ids == expected and s.rollout_logp == logp
        assert sum(s.loss_mask) == sum(r[i].response_len for r in rec.replies)
    batch = collate(samples, [1.0, -1.0], pad_id=tok.pad_token_id)
    for b, s in enumerate(samples):
        P, T = len(s.prompt_ids), len(s.prompt_ids) + s.response_len
        assert batch.input_ids[b, :T].tolist() == s.prompt_ids + s.response_ids
        assert batch.loss_mask[b, P:T].tolist() == s.loss_mask


def test_sglang_turns_keep_their_versions_and_routes_across_an_update(engine, tok, tmp_path):
    model = load_model(str(MODEL), "float32", torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
    save_hf(model, tok, tmp_path / "v1")
    base = engine.version
    rec = Recorder(engine, update_before={1: (str(tmp_path / "v1"), base + 1)})
    env = EchoEnv(EnvSettings(max_turns=3))
    try:
        s = run_trajectory(rec, env, tok, {"question": "5+6="}, turn_sampling(tok))
    finally:
        engine.update_weights(str(MODEL), base + 2)  # back to the base weights
    assert [r[0].weight_version for r in rec.replies] == [base, base + 1, base + 1]
    assert s.token_versions == [base if k == 0 else base + 1 for k in s.turn_ids]
    T = len(s.prompt_ids) + s.response_len
    assert s.routed_experts.shape[0] == T - 1
    held = 0
    for (reply,) in rec.replies:  # R3: each request's new rows, in order
        rows = len(reply.routed_experts)
        assert np.array_equal(s.routed_experts[held:rows], reply.routed_experts[held:rows])
        held = rows
    assert held == T - 1
