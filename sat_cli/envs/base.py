"""The environment interface (issue 43, item 1), torch-free, and the registry of environments.

An environment runs one trajectory at a time::

    env = registry.make("calculator", EnvSettings(max_turns=4))
    messages = env.reset(row)                        # the prompt: chat messages
    obs, reward, done, info = env.step(model_text)   # one model turn → the environment's answer

``step`` takes the model's text of one turn and returns a ``Step``: the observation messages to
append (e.g. a ``{"role": "tool", …}`` message with a tool's result; empty when done), the reward
of this turn, whether the trajectory ended and ``info`` (plain values: what happened, for
metrics). A single-turn task is the one-step case: ``step`` grades and returns ``done=True``.
An environment ends the trajectory itself at ``settings.max_turns``. The per-trajectory token
budget (``settings.max_tokens``) is counted by the caller, which holds the tokenizer.

Rows: a shipped environment draws its problems from seeds, ``rows(split, n, start)`` (a static
method of its class, so ``registry.ENVIRONMENTS.get(name).rows`` finds them): a seed is
held out iff a hash of it falls in the lowest ``1/HELDOUT_MOD`` of the range (``is_heldout``), so
the train and held-out rows are disjoint by construction and the same on every machine.

The registry of environments is ``envs/registry.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from sat_cli.validate import check_int

Message = dict[str, str]  # {"role": "system"|"user"|"assistant"|"tool", "content": …}
MAX_TURNS = 64
MAX_TOKENS = 1 << 20
HELDOUT_MOD = 10
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class EnvSettings:
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 4096  # tokens per trajectory, prompt and observations included
    parser: str = "hermes"  # tool-call format (toolcalls.PARSERS)
    sandbox: str = "strict"  # how tools are confined (sandbox.MODES)

    def __post_init__(self):
        for name, hi in (("max_turns", MAX_TURNS), ("max_tokens", MAX_TOKENS)):
            check_int(f"env.{name}", getattr(self, name), 1, hi)
        from sat_cli.envs.sandbox import MODES
        from sat_cli.envs.toolcalls import get_parser

        get_parser(self.parser)
        if self.sandbox not in MODES:
            raise ValueError(f"env.sandbox={self.sandbox!r} must be one of {', '.join(MODES)}")


class Step(NamedTuple):
    observation: list[Message]
    reward: float
    done: bool
    info: dict[str, Any]


class Environment(Protocol):
    settings: EnvSettings

    @property
    def max_turns(self) -> int: ...

    def reset(self, row: dict[str, Any]) -> list[Message]: ...

    def step(self, action_text: str) -> Step: ...


@dataclass
class TurnCounter:
    """The turn bookkeeping every environment shares."""

    max_turns: int
    turns: int = 0
    done: bool = False

    def begin(self, action_text: str) -> None:
        if self.done:
            raise RuntimeError("step() after the trajectory ended; call reset()")
        self.turns += 1

    @property
    def last(self) -> bool:
        return self.turns >= self.max_turns


class TurnBasedEnv:
    """What the shipped environments share: settings, the prompt style (``compact`` when the
    parser is, for small character-level models), the current row and the turn count."""

    needs: tuple[str, ...] = ()  # the keys a row must have
    uses_sandbox = False  # True: runs tools in the sandbox (registry.make checks it can)

    def __init__(self, settings: EnvSettings):
        self.settings = settings
        self.compact = settings.parser == "compact"
        self.row: dict[str, Any] | None = None
        self.turn = TurnCounter(settings.max_turns)

    @property
    def max_turns(self) -> int:
        return self.settings.max_turns

    @classmethod
    def own_row(cls, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` when it has this environment's keys; else (a row of the run's task, e.g. the
        toy task's ``{"id", "prompt", …}`` that the training loop hands every environment) the
        environment's own training row at a seed hashed from the row's ``id`` (or ``prompt``):
        the same task row always plays the same problem, never a held-out one."""
        if all(k in row for k in cls.needs) or not hasattr(cls, "rows"):
            return row
        key = str(row.get("id", row.get("prompt", "")))
        seed = int.from_bytes(hashlib.sha256(f"task-row:{key}".encode()).digest()[:5], "little")
        return cls.rows("train", 1, start=seed)[0]

    def start(self, row: dict[str, Any]) -> None:
        """``reset``'s common part: check and keep the row (``own_row``), count turns anew."""
        row = self.own_row(row)
        if not all(k in row for k in self.needs):
            name = type(self).__name__
            raise ValueError(f"a {name} row needs {', '.join(map(repr, self.needs))}")
        self.row = row
        self.turn = TurnCounter(self.settings.max_turns)

    def begin(self, action_text: str) -> None:
        """``step``'s common part: one more turn of a started, unfinished trajectory."""
        if self.row is None:
            raise RuntimeError("step() before reset()")
        self.turn.begin(action_text)


def is_heldout(env: str, seed: int) -> bool:
    """Whether ``seed`` of environment ``env`` is in the held-out split (module docstring)."""
    h = hashlib.sha256(f"{env}-split:{seed}".encode()).digest()
    return int.from_bytes(h[:8], "little") % HELDOUT_MOD == 0


def split_rows(
    env: str, make: Callable[[int], dict[str, Any]], split: str, n: int, start: int = 0
) -> list[dict[str, Any]]:
    """The first ``n`` rows of ``split`` among seeds ``start, start+1, …`` (``make(seed)``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of rows must be an integer >= 0, not {n!r}")
    out, seed = [], start
    while len(out) < n:
        if is_heldout(env, seed) == (split == "heldout"):
            out.append({**make(seed), "seed": seed})
        seed += 1
    return out
