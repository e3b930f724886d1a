"""The guess environment (issue 43, item 6's second environment): feedback from a turn helps.

A row hides an integer ``target`` in ``[lo, hi]`` (``make_row(seed)``; 0..9 by default). Each
model turn is a guess: the last integer of the reply (``\\boxed{5}``, ``5`` or ``I guess 5``).
The right number ends the trajectory with reward 1.0; a wrong one gets the feedback ``higher``
or ``lower`` (the target is above / below the guess) and another turn, until ``max_turns``,
where the trajectory ends with reward 0.0. A reply without a number is told so and costs the
turn. The first turn can only be right by chance (1 in ``hi - lo + 1``): the prompt says
nothing about the target, so success within several turns above first-turn success is the
measure of a model using the feedback; a binary search finds any of 0..9 within 4 turns.

Two prompt styles, chosen by ``settings.parser`` as in the calculator: ``hermes`` (any chat
model) asks in a sentence; ``compact`` (the embedded character-level model) writes the prompt
``0-9=`` and the feedback ``higher=`` / ``lower=``, and the model answers ``\\boxed{5}`` as in
the toy task it was warm-started on.

``info`` of every step: ``turn``, ``guess`` (None without a number), ``correct``.
Rows: ``rows(split, n, start)`` (``base.split_rows``; 1 seed in 10 held out).
"""

from __future__ import annotations

import random
from typing import Any

from sat_cli.envs.base import Message, Step, TurnBasedEnv, split_rows
from sat_cli.envs.calculator import final_number
from sat_cli.validate import check_int

LO, HI = 0, 9
MAX_RANGE = 10**6
QUESTION = (
    "I picked an integer from {lo} to {hi}. Guess it: reply with your guess as \\boxed{{n}}. "
    "If it is wrong I will say higher or lower, and you can guess again."
)


def make_row(seed: int, lo: int = LO, hi: int = HI) -> dict[str, Any]:
    """The row of ``seed``: a target drawn uniformly from ``[lo, hi]``, the same for the seed."""
    for name, v in (("lo", lo), ("hi", hi)):
        check_int(f"guess {name}", v, 0, MAX_RANGE)
    if lo >= hi:
        raise ValueError(f"guess range lo={lo} must be below hi={hi}")
    target = random.Random(f"guess:{seed}").randint(lo, hi)
    return {"target": target, "lo": lo, "hi": hi, "answer": str(target)}


def rows(split: str, n: int, start: int = 0, lo: int = LO, hi: int = HI) -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (``train``/``heldout``) from seed ``start`` on."""
    return split_rows("guess", lambda seed: make_row(seed, lo, hi), split, n, start)


def teach(row: dict[str, Any], observations: list[Message], rng) -> str:
    """The format warm start's teacher: a uniform guess from the range every turn, ignoring
    the feedback (it teaches the format only, and leaves using the feedback to RL)."""
    return "\\boxed{" + str(rng.randint(row["lo"], row["hi"])) + "}"


class GuessEnv(TurnBasedEnv):
    needs = ("target", "lo", "hi")
    rows = staticmethod(rows)  # the environment's own rows: rows(split, n, start)
    teacher = staticmethod(teach)  # the format warm start's turns (envs/plain.py)
    # its format warm start (models/env_warmstart.EnvWarmStart): the format only (its teacher
    # guesses at random, which 30 steps imitate: success and turns those of random guessing)
    warm_start = {"target": None, "max_steps": 30}

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.start(row)
        row = self.row
        lo, hi = row["lo"], row["hi"]
        text = f"{lo}-{hi}=" if self.compact else QUESTION.format(lo=lo, hi=hi)
        return [{"role": "user", "content": text}]

    def _say(self, text: str) -> list[Message]:
        return [{"role": "user", "content": f"{text}=" if self.compact else text}]

    def step(self, action_text: str) -> Step:
        self.begin(action_text)
        guess = final_number(action_text)
        correct = guess == self.row["target"]
        info = {"turn": self.turn.turns, "guess": guess, "correct": correct}
        if correct or self.turn.last:
            self.turn.done = True
            return Step([], 1.0 if correct else 0.0, True, info)
        if guess is None:
            return Step(self._say("a number"), 0.0, False, info)
        return Step(
            self._say("higher" if self.row["target"] > guess else "lower"), 0.0, False, info
        )
