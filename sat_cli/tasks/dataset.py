"""A training task over a fixed prompt set (a user's file, GSM8K, DAPO-Math), graded by the math
grader (`sat_cli.tasks.reward.grade`).

Prompts are drawn in a seeded order that is a pure function of the data cursor: batch ``k``
takes rows ``k·P .. k·P+P−1`` of an endless sequence of reshuffled epochs, so resume continues
exactly where the interrupted run stopped.

Held-out split (``eval=heldout``, a data task's default evaluation): the rows of
``task.heldout_path``, else ``round(heldout_frac · N)`` rows (at least one) chosen by a hash of
their problem text — the same rows whatever the file order or the seed — taken out of the
training rows. :meth:`DatasetTask.heldout` gives the first ``heldout_size`` of them.
"""

from __future__ import annotations

import hashlib
import random

from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.prompts import render


def split_heldout(rows: list[dict], frac: float, where: str) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)``: ``round(frac·N)`` rows (at least 1, at most N−1) with the lowest
    SHA-256 of their problem text are held out; both lists keep the file order."""
    if len(rows) < 2:
        raise DataError(f"{where}: {len(rows)} row; a held-out split needs at least 2")
    n = min(max(1, round(frac * len(rows))), len(rows) - 1)
    ranked = sorted(
        range(len(rows)),
        key=lambda i: (hashlib.sha256(rows[i]["problem"].encode("utf-8")).digest(), i),
    )
    held = set(ranked[:n])
    return (
        [r for i, r in enumerate(rows) if i not in held],
        [r for i, r in enumerate(rows) if i in held],
    )


class DatasetTask:
    def __init__(
        self,
        rows: list[dict],
        *,
        template: str,
        seed: int = 0,
        heldout: list[dict] | None = None,
        heldout_size: int = 256,
        system_prompt: str | None = None,
    ):
        if not rows:
            raise ValueError("the training prompt set is empty")
        self.rows, self.template, self.seed = rows, template, seed
        self._heldout, self.heldout_size = heldout, heldout_size
        self.system_prompt = system_prompt  # template=chat: rows without their own system field
        self.tokenizer = None  # template=chat renders through it (set by `sat train`)
        self.source: str | None = None  # a user's file: prompts too long are refused, not dropped
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_config(
        cls, task, source, *, data_dir: str | None, seed: int, heldout: bool = False
    ) -> DatasetTask:
        """The task of a ``TaskConfig`` and its kind's ``source`` (``tasks/registry.TaskSource``);
        ``heldout``: split off the held-out rows (``eval=heldout``)."""
        from sat_cli.tasks.data import dedupe_by_problem
        from sat_cli.tasks.sources import read_rows

        if task.path:  # a user's file, whatever the kind (GSM8K and DAPO layouts are known)
            rows = read_rows(task.path, task.fields)
            if source.dedupe:
                rows = dedupe_by_problem(rows)
        else:
            rows = source.rows(data_dir, True)
        held = None
        if heldout and task.heldout_path:
            held = read_rows(task.heldout_path, task.fields)
        elif heldout:
            rows, held = split_heldout(rows, task.heldout_frac, task.path or f"task={task.kind}")
        size = task.heldout_size
        made = cls(
            rows,
            template=task.template,
            seed=seed,
            heldout=held,
            heldout_size=size,
            system_prompt=task.system_prompt,
        )
        made.source = task.path
        return made

    def render(self, row: dict) -> str:
        """The prompt of ``row`` (its own system field wins over ``task.system_prompt``)."""
        system = row.get("system") or self.system_prompt
        return render(self.template, row["problem"], self.tokenizer, system)

    def heldout(self) -> list[dict]:
        """The held-out rows (at most ``heldout_size``), for ``eval=heldout``."""
        if self._heldout is None:
            raise DataError("this task was built without a held-out split (eval is not heldout)")
        system = {"system": self.system_prompt} if self.system_prompt else {}
        return [{**system, **r} for r in self._heldout[: self.heldout_size]]

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
            out.append({**row, "prompt": self.render(row)})
        return out

    @staticmethod
    def reward(response_text: str, answer: str) -> float:
        from sat_cli.tasks.reward import grade

        return 1.0 if grade(response_text, answer) else 0.0
