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

The registry of environments is ``envs/registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

Message = dict[str, str]  # {"role": "system"|"user"|"assistant"|"tool", "content": …}
MAX_TURNS = 64
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class EnvSettings:
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 4096  # tokens per trajectory, prompt and observations included
    parser: str = "hermes"  # tool-call format (toolcalls.PARSERS)

    def __post_init__(self):
        for name, hi in (("max_turns", MAX_TURNS), ("max_tokens", MAX_TOKENS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ValueError(f"env.{name}={v!r} must be an integer in [1, {hi}]")
        from sat_cli.envs.toolcalls import get_parser

        get_parser(self.parser)


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
