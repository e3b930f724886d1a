"""A training task over a fixed prompt set (DAPO-Math, GSM8K, a JSONL file), graded by the
math grader (`sat_cli.tasks.reward.grade`).

Prompts are drawn in a seeded order that is a pure function of the data cursor: batch ``k``
takes rows ``k·P .. k·P+P−1`` of an endless sequence of reshuffled epochs, so resume continues
exactly where the interrupted run stopped.
"""

from __future__ import annotations

import random

from sat_cli.tasks.prompts import render


class DatasetTask:
    def __init__(self, rows: list[dict], *, template: str, seed: int = 0):
        if not rows:
            raise ValueError("the training prompt set is empty")
        self.rows, self.template, self.seed = rows, template, seed
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_config(
        cls, kind: str, *, path: str | None, data_dir: str | None, template: str, seed: int
    ) -> DatasetTask:
        from sat_cli.tasks.data import load_jsonl, load_training_prompts

        rows = (
            load_jsonl(path)
            if kind == "jsonl" or (path and kind != "dapo_math")
            else (load_training_prompts(kind, data_dir))
        )
        return cls(rows, template=template, seed=seed)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            idx = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(idx)
            self._orders = {epoch: idx}  # keep one epoch in memory
        return self._orders[epoch]

    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        out = []
        for i in range(cursor, cursor + n):
            epoch, j = divmod(i, len(self.rows))
            row = self.rows[self._order(epoch)[j]]
            out.append({**row, "prompt": render(self.template, row["problem"])})
        return out

    @staticmethod
    def reward(response_text: str, answer: str) -> float:
        from sat_cli.tasks.reward import grade

        return 1.0 if grade(response_text, answer) else 0.0
