"""What a run asks of its task and its tokenizer: the two protocols the run's objects are typed
with (``commands/run.RunInputs``, ``loop/parts.RunParts``). Typing only, no behaviour.

The shipped tasks are :class:`sat_cli.tasks.toy.ToyTask` and
:class:`sat_cli.tasks.dataset.DatasetTask` (``task.kind``: the registry, ``tasks/registry.py``);
the tokenizer is the model's (HF ``AutoTokenizer``, or the tiny models' character tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """Training prompts by cursor, the held-out problems, and the task's own grader."""

    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        """``n`` problems (``{"prompt", "answer", ...}``) from position ``cursor`` on."""
        ...

    def heldout(self) -> list[dict]:
        """The held-out problems, in a fixed order."""
        ...

    def reward(self, response_text: str, answer: str) -> float:
        """The task's grade of a response (used when no ``reward=`` scorer is set)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a tokenizer the loop uses: its pad id and decoding."""

    pad_token_id: int | None

    def decode(self, token_ids: Sequence[int], **kwargs) -> str: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs) -> list[str]: ...
