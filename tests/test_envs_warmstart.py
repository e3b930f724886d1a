"""The environments' teachers and the format warm start's batches (sat_cli/envs/plain.py,
sat_cli/models/env_warmstart.py): token for token what the multi-turn driver would build."""

from __future__ import annotations

import random

import pytest

from sat_cli.envs.base import EnvSettings
from sat_cli.envs.calculator import make_problem
from sat_cli.envs.plain import teacher_example
from sat_cli.envs.render import PlainRenderer
from sat_cli.models.env_warmstart import EnvWarmStart, batch, defaults
from sat_cli.models.tiny_moe import build_char_tokenizer

COMPACT = EnvSettings(max_turns=4, max_tokens=512, parser="compact")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_calculator_teacher_trajectory_token_for_token(tok):
    row = {**make_problem(3, digits=3), "seed": 3}
    a, b, p = row["a"], row["b"], row["a"] * row["b"]
    seq, mask, reward = teacher_example("calculator", row, COMPACT, tok, random.Random(0))
    eos = [tok.eos_token_id]
    r = PlainRenderer(tok)
    turn1, turn2 = ids(tok, f"[calc:{a}*{b}]") + eos, ids(tok, "\\boxed{" + str(p) + "}") + eos
    prompt = r.prompt_ids([{"role": "user", "content": f"{a}*{b}="}])
    obs = r.observation_ids([{"role": "tool", "content": f"{p}="}])
    assert prompt == ids(tok, f"{a}*{b}=\n") and obs == ids(tok, f"{p}=\n")
    assert seq == prompt + turn1 + obs + turn2 and reward == 1.0
    assert mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)


def test_guess_teacher_guesses_at_random_and_ignores_feedback(tok):
    row = {"target": 7, "lo": 0, "hi": 9, "answer": "7"}
    rng, ref = random.Random(5), random.Random(5)
    seq, mask, reward = teacher_example("guess", row, COMPACT, tok, rng)
    guesses = [ref.randint(0, 9) for _ in range(4)]
    text = tok.decode(seq)
    assert text.startswith("0-9=\n\\boxed{" + str(guesses[0]) + "}<eos>")
    first_hit = guesses.index(7) + 1 if 7 in guesses else None
    assert reward == (1.0 if first_hit else 0.0)
    assert (
        text.count("<eos>")
        == (first_hit or 4)
        == sum(m and t == tok.eos_token_id for m, t in zip(mask, seq, strict=True))
    )


def test_batch_labels_are_the_model_tokens_only(tok):
    ws = EnvWarmStart(batch_size=3)
    input_ids, att, labels = batch("calculator", ws, tok, step=1)
    for b in range(3):
        n = int(att[b].sum())
        seq = input_ids[b, :n].tolist()
        trained = [t for t, lab in zip(seq, labels[b, :n].tolist(), strict=True) if lab != -100]
        text = tok.decode(trained)
        assert text.startswith("[calc:") and text.count("<eos>") == 2 and "\\boxed{" in text
        assert (labels[b, n:] == -100).all() and (input_ids[b, n:] == tok.pad_token_id).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"lr": 2.0}, "lr"),
        ({"target": 1.5}, "target"),
        ({"max_turns": True}, "max_turns"),
    ],
)
def test_warm_start_settings_are_bounded(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnvWarmStart(**kwargs)


def test_every_shipped_environment_has_a_warm_start():
    from sat_cli.envs.registry import ENVIRONMENTS

    assert {n: defaults(n) for n in ENVIRONMENTS.names()} == {
        "calculator": EnvWarmStart(target=0.2, eval_every=5),
        "guess": EnvWarmStart(target=None, max_steps=30),
    }
