"""The task sources ``task.kind`` can choose and the evaluation sources of ``eval=<benchmark>``,
each a :class:`sat_cli.registry.Registry` whose entries say what differs between options (what
the config checks, the builders and ``sat eval`` ask of them; nothing compares their names).

``TASK_SOURCES``: the toy generator (``toy``), a user's file (``file``, ``jsonl``: ``task.path``)
and the known data sets (``dapo_math``, ``gsm8k``: their rows from the data directory, or a
user's copy at ``task.path``). A new source: its :class:`TaskSource` and one ``add`` line here.

``EVAL_SOURCES``: the training task's own held-out problems (``toy``: the toy generator's;
``heldout``: a data task's split), a user's file (``jsonl``: ``eval.path``); any other name is a
shipped benchmark read by name (``tasks/data.load_benchmark``: :data:`BENCHMARK`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sat_cli.registry import Registry


@dataclass(frozen=True)
class TaskSource:
    """One ``task.kind``: ``build(task, data_dir, seed, heldout)`` makes the training task of a
    ``TaskConfig`` (``heldout``: split off its held-out rows, ``eval=heldout``); ``rows(data_dir,
    allow_hub)`` reads its rows when no ``task.path`` is given (None: ``task.path`` is needed).
    ``data``: a fixed set of rows (False: a generator, with its own held-out problems, no chat
    template and only its own evaluation); ``with_path``: the kind a ``task.path`` makes it;
    ``dedupe``: a user's copy repeats problems (DAPO's parquet) and is deduplicated."""

    build: Callable[[Any, str | None, int, bool], Any]
    rows: Callable[[str | None, bool], list[dict]] | None = None
    data: bool = True
    with_path: str | None = None
    dedupe: bool = False

    @property
    def needs_path(self) -> bool:
        return self.data and self.rows is None


@dataclass(frozen=True)
class EvalSource:
    """One ``eval.benchmark``: ``own``: the training task's held-out problems (graded by its own
    reward); ``task_template``: rendered with ``task.template`` (else ``eval.template``);
    ``generator``: the toy generator's problems (only with the toy task, no chat template);
    ``user_file``: ``eval.path`` is its file; ``data_file(eval, task, data_dir)``: the file its
    problems come from, for the record (None: generated)."""

    data_file: Callable[[Any, Any, str | None], str | None]
    own: bool = False
    task_template: bool = False
    generator: bool = False
    user_file: bool = False

    @property
    def splits_task(self) -> bool:
        """The training task's rows are split into training and held-out (``eval=heldout``)."""
        return self.own and not self.generator


def _toy(task, data_dir, seed: int, heldout: bool):
    from sat_cli.tasks.toy import ToyTask

    # the problems' seed is 0 whatever the run's
    return ToyTask(
        digits=task.digits, seed=0, heldout_size=task.heldout_size, template=task.template
    )


def _dataset(task, data_dir, seed: int, heldout: bool):
    from sat_cli.tasks.dataset import DatasetTask

    source = TASK_SOURCES.get(task.kind)
    return DatasetTask.from_config(task, source, data_dir=data_dir, seed=seed, heldout=heldout)


def _dapo_rows(data_dir, allow_hub: bool) -> list[dict]:
    from sat_cli.tasks.data import load_dapo_math

    return load_dapo_math(data_dir, allow_hub)


def _gsm8k_rows(data_dir, allow_hub: bool) -> list[dict]:
    from sat_cli.tasks.data import load_benchmark

    return load_benchmark("gsm8k_train", data_dir)


TASK_SOURCES = Registry("task.kind", "task source")
TASK_SOURCES.add("toy", TaskSource(_toy, data=False, with_path="file"))
TASK_SOURCES.add("file", TaskSource(_dataset))
TASK_SOURCES.add("jsonl", TaskSource(_dataset))  # = file
TASK_SOURCES.add("dapo_math", TaskSource(_dataset, _dapo_rows, dedupe=True))
TASK_SOURCES.add("gsm8k", TaskSource(_dataset, _gsm8k_rows))


def load_training_prompts(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
    seed: int | None = None,
    allow_hub: bool = True,
) -> list[dict[str, str]]:
    """Training rows for ``task=<name>``: ``dapo_math``, ``gsm8k``, ``deepmath`` or a JSONL path.

    ``dapo_math`` reads a DAPO-Math-17k copy from the data directory (one of
    ``dapo_math_17k.jsonl``, ``dapo-math-17k.jsonl``, ``dapo_math.jsonl``), else the hub when
    ``datasets`` is installed and ``allow_hub``; it is deduplicated by problem text (the hub parquet
    repeats each prompt many times). ``gsm8k`` is ``gsm8k_train.jsonl``. With ``seed`` the rows
    are shuffled deterministically (``random.Random(seed)``); ``limit`` is applied after that.
    """
    from sat_cli.tasks.data import DataError, load_benchmark, load_jsonl

    source = TASK_SOURCES.find(name)
    if source is not None and source.rows is not None:  # dapo_math, gsm8k
        rows = source.rows(data_dir, allow_hub)
    elif name in ("deepmath", "gsm8k_train"):
        rows = load_benchmark(name, data_dir)
    elif name.endswith(".jsonl") or Path(name).is_file():
        rows = load_jsonl(name)
    else:
        raise DataError(
            f"unknown training task {name!r}: use dapo_math, gsm8k, deepmath or a .jsonl path"
        )
    if seed is not None:
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    if limit is not None:
        rows = rows[:limit]
    return rows


def _no_file(e, task, data_dir) -> None:
    return None


def _split_file(e, task, data_dir) -> str | None:
    return task.heldout_path or task.path


def _user_file(e, task, data_dir) -> str | None:
    return e.path


def _shipped_file(e, task, data_dir) -> str | None:
    from sat_cli.tasks.datafiles import BENCHMARK_FILES, benchmark_file

    if e.benchmark in BENCHMARK_FILES:
        return str(benchmark_file(e.benchmark, data_dir))
    return None


EVAL_SOURCES = Registry("eval", "evaluation source")
EVAL_SOURCES.add("toy", EvalSource(_no_file, own=True, task_template=True, generator=True))
EVAL_SOURCES.add("heldout", EvalSource(_split_file, own=True))
EVAL_SOURCES.add("jsonl", EvalSource(_user_file, user_file=True))
BENCHMARK = EvalSource(_shipped_file)  # a shipped benchmark (or one in the data directory)


def eval_source(benchmark: str) -> EvalSource:
    """The entry of ``eval.benchmark``: a registered source, else a benchmark read by name."""
    return EVAL_SOURCES.find(benchmark) or BENCHMARK
