"""The toy task: zero-padded ``digits``-digit addition, answered in ``\\boxed{}``.

A problem is ``"123+456="``; the expected response is ``"\\boxed{579}"`` followed by EOS. It is
procedurally generated, exactly checkable and cheap, so the embedded tiny model can learn it on
two CPU cores. The difficulty knob is ``digits`` (1..9).

Splits: a problem ``a+b`` is held out iff a hash of its text falls in the lowest ``1/heldout_mod``
of the hash range (10% by default), independently of any seed, so the train and held-out sets are
disjoint by construction. ``heldout()`` is the first ``heldout_size`` held-out problems of a
fixed seeded stream; ``sample_prompts(n, cursor)`` returns training problems ``cursor ..
cursor+n-1``, each a pure function of ``(seed, index)``, so a resumed run continues exactly from its
saved data cursor. Prompts are rendered with ``sat_cli.tasks.prompts.render`` (template
``plain``: the bare problem).

``reward`` is 1.0 when the last ``\\boxed{...}`` of the response holds exactly the sum (as an
integer; leading zeros and surrounding spaces are tolerated), else 0.0. The general math grader
lives in ``sat_cli/tasks/reward.py``.
"""

from __future__ import annotations

import hashlib
import re

from sat_cli.tasks.prompts import render

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def boxed_answer(response_text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in the text, or None."""
    found = _BOXED.findall(response_text)
    return found[-1] if found else None


class ToyTask:
    """Seeded zero-padded addition problems with disjoint train / held-out splits."""

    def __init__(
        self,
        digits: int = 3,
        seed: int = 0,
        heldout_size: int = 200,
        template: str = "plain",
        heldout_mod: int = 10,
    ):
        if not 1 <= digits <= 9:
            raise ValueError(f"toy task digits must be in 1..9, got {digits}")
        if heldout_mod < 2:
            raise ValueError(f"heldout_mod must be >= 2, got {heldout_mod}")
        n_problems = 10 ** (2 * digits)
        if heldout_size > n_problems // (2 * heldout_mod):
            raise ValueError(f"heldout_size {heldout_size} too large for {digits}-digit problems")
        self.digits = digits
        self.seed = seed
        self.heldout_size = heldout_size
        self.template = template
        self.heldout_mod = heldout_mod
        self._heldout: list[dict] | None = None

    # --- problems -------------------------------------------------------------------------
    def problem_text(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def is_heldout(self, problem: str) -> bool:
        return _hash64("toy-split:" + problem) % self.heldout_mod == 0

    def _draw(self, stream: str, index: int, attempt: int) -> tuple[int, int]:
        h = hashlib.sha256(f"{stream}:{self.seed}:{index}:{attempt}".encode()).digest()
        top = 10**self.digits
        a = int.from_bytes(h[:8], "little") % top
        b = int.from_bytes(h[8:16], "little") % top
        return a, b

    def _item(self, a: int, b: int, split: str, index: int) -> dict:
        problem = self.problem_text(a, b)
        return {
            "id": f"toy{self.digits}-{split}-{index}",
            "problem": problem,
            "prompt": render(self.template, problem),
            "answer": str(a + b),
        }

    def train_problem(self, index: int) -> dict:
        """Training problem number ``index`` (deterministic in ``seed`` and ``index``)."""
        for attempt in range(1000):
            a, b = self._draw("train", index, attempt)
            if not self.is_heldout(self.problem_text(a, b)):
                return self._item(a, b, "train", index)
        raise RuntimeError("could not draw a training problem")  # probability ~ 0.1**1000

    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        """Training problems ``cursor .. cursor+n-1``: dicts ``{id, problem, prompt, answer}``.

        The caller advances its data cursor by ``n``; the same cursor always gives the same problems.
        """
        return [self.train_problem(i) for i in range(cursor, cursor + n)]

    def heldout(self) -> list[dict]:
        """The held-out evaluation set: ``heldout_size`` distinct problems, disjoint from training."""
        if self._heldout is None:
            items: list[dict] = []
            seen: set[str] = set()
            draw = 0
            while len(items) < self.heldout_size:
                a, b = self._draw("heldout", draw, 0)
                draw += 1
                problem = self.problem_text(a, b)
                if problem in seen or not self.is_heldout(problem):
                    continue
                seen.add(problem)
                items.append(self._item(a, b, "heldout", len(items)))
            self._heldout = items
        return [dict(item) for item in self._heldout]

    # --- targets and reward ---------------------------------------------------------------
    @staticmethod
    def target(answer: str) -> str:
        """The reference response (without EOS) used by the supervised warm start."""
        return "\\boxed{" + answer + "}"

    @staticmethod
    def reward(response_text: str, answer: str) -> float:
        got = boxed_answer(response_text)
        if got is None:
            return 0.0
        got = got.strip()
        if not got.isdigit():
            return 0.0
        return 1.0 if int(got) == int(answer) else 0.0
