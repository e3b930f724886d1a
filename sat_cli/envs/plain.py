"""Multi-turn trajectories of a model whose tokenizer has no chat template (the embedded
character-level model): the environments' scripted teachers and the token sequence of a
trajectory, for the format warm start (``sat_cli/models/env_warmstart.py``).

The token sequence is the multi-turn driver's (``trajectory.py``, ``render.PlainRenderer``):
``"<content>\\n"`` per prompt or observation message, tokenised once; a model turn is its
sampled ids, the closing ``<eos>`` included. So the trajectory ``123*456=`` → ``[calc:123*456]``
→ ``56088=`` → ``\\boxed{56088}`` is ``ids("123*456=\\n") + ids("[calc:123*456]") + [eos] +
ids("56088=\\n") + ids("\\boxed{56088}") + [eos]``, the model's tokens (the two turns with
their ``<eos>``) trained, the others not.

The teachers (an environment class's ``teacher``) write the turns a format warm start imitates:
``calculator`` calls the tool with the problem's operands, then answers the tool's value;
``guess`` guesses uniformly at random from the range every turn, ignoring the feedback, so it
teaches the format only and leaves using the feedback to RL.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from sat_cli.envs import registry
from sat_cli.envs.base import EnvSettings, Message
from sat_cli.envs.render import PlainRenderer

# an environment's teacher: its class's ``teacher(row, observations, rng)`` (static method)
Teacher = Callable[[dict[str, Any], list[Message], random.Random], str]


def text_ids(tokenizer, messages: list[Message]) -> list[int]:
    """The ids of prompt or observation messages, as the driver renders them (``PlainRenderer``)."""
    return PlainRenderer(tokenizer).prompt_ids(messages)


def teacher_example(
    env_name: str, row: dict[str, Any], settings: EnvSettings, tokenizer, rng: random.Random
) -> tuple[list[int], list[int], float]:
    """One trajectory of the environment's teacher: ``(ids, train_mask, reward)``; the mask is
    1 on the model's tokens (its turns and their ``<eos>``), 0 on the prompt and observations."""
    env = registry.make(env_name, settings)
    teacher: Teacher = registry.ENVIRONMENTS.get(env_name).teacher
    ids = text_ids(tokenizer, env.reset(row))
    mask = [0] * len(ids)
    seen: list[Message] = []
    reward, done = 0.0, False
    while not done:
        turn = teacher(row, seen, rng)
        t = tokenizer(turn)["input_ids"] + [tokenizer.eos_token_id]
        ids += t
        mask += [1] * len(t)
        obs, reward, done, _ = env.step(turn)
        seen += obs
        o = text_ids(tokenizer, obs)
        ids += o
        mask += [0] * len(o)
    return ids, mask, reward
