"""The example's reward: ``score(prompt, response, row) -> dict`` with two components.

* ``exact``: 1 when the last ``\\boxed{...}`` holds the sum, else 0;
* ``digits``: the share of the sum's digits that the boxed answer has right, place by place
  (partial credit: a dense signal while exact answers are rare).

`sat train reward=python reward.fn=examples/sum_digits/reward.py:score` logs each component
as ``reward/exact`` and ``reward/digits`` and combines them with ``reward.weights`` (the
experiment config: exact 1.0, digits 0.5). Any exception here counts as a failed reward
(``reward/error_frac``) and gives the sample ``reward.on_error``; it never stops the run unless
more than ``reward.max_error_frac`` of a step fail.
"""

from __future__ import annotations

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def score(prompt: str, response: str, row: dict) -> dict[str, float]:
    found = BOXED.findall(response)
    got = found[-1].strip() if found else ""
    gold = row["answer"]  # the column task.fields.answer names ("sum")
    digits = sum(x == y for x, y in zip(got.zfill(len(gold))[::-1], gold[::-1], strict=False))
    return {"exact": float(got == gold), "digits": digits / len(gold) if got.isdigit() else 0.0}
