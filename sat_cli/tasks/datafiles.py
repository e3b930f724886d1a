"""Where data files are found: the data directory, then the evaluation sets shipped with `sat`.

* The data directory is ``data.dir`` (the ``data_dir`` argument), else ``$SAT_DATA_DIR`` (empty
  means unset). One that does not exist is an error: a typo must not silently fall back.
* The evaluation sets the CLI names (``aime24``, ``aime25``, ``math500``, ``gsm8k`` test) are
  shipped as package data in ``sat_cli/assets/benchmarks`` (``provenance.json`` there gives
  source, revision, licence, row count and SHA-256 of each). A file of the same name in the data
  directory wins; a data directory without it falls back to the shipped copy.
* Training sets (GSM8K train, DeepMath, DAPO-Math-17k) are not shipped: DAPO-Math-17k is large,
  and the stand-ins follow it. Asking for one without a data directory that holds it raises
  :class:`DataError` saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SAT_DATA_DIR"

# The evaluation sets shipped inside the package (package data; see its README.md).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "benchmarks"

BENCHMARK_FILES: dict[str, str] = {
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "math500": "math500.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "gsm8k_test": "gsm8k_test.jsonl",
    "gsm8k_train": "gsm8k_train.jsonl",
    "deepmath": "deepmath_subset.jsonl",
}

# Local file names a DAPO-Math-17k copy may have in the data directory (see the data README).
DAPO_FILES = ("dapo_math_17k.jsonl", "dapo-math-17k.jsonl", "dapo_math.jsonl")
# The offline stand-ins for DAPO-Math-17k, named in its error message.
STAND_INS = (
    "task=gsm8k (gsm8k_train.jsonl in the data directory) or the DeepMath subset as a JSONL file "
    "(task.kind=jsonl task.path=<deepmath_subset.jsonl>)"
)


class DataError(ValueError):
    """A data file or row that cannot be turned into ``{id, problem, answer}``."""


def data_dir_from(data_dir: str | os.PathLike | None) -> Path | None:
    """The data directory: the argument, else ``$SAT_DATA_DIR``, else None."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else None


def shipped_names() -> list[str]:
    """The benchmark names whose file ships with `sat` (without the alias ``gsm8k_test``)."""
    return [
        n for n, f in BENCHMARK_FILES.items() if (SHIPPED_DIR / f).is_file() and n != "gsm8k_test"
    ]


def benchmark_file(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The JSONL file of a benchmark name: ``<data dir>/<file>`` if present, else the shipped copy.

    Raises :class:`DataError` for a data directory that does not exist, and for a set that is
    neither in the data directory nor shipped (the training sets).
    """
    fname = BENCHMARK_FILES[name]
    root = data_dir_from(data_dir)
    if root is not None:
        if not root.is_dir():
            source = "data.dir" if data_dir is not None else f"${DATA_DIR_ENV}"
            raise DataError(f"data directory {root} ({source}) does not exist or is not a folder")
        if (root / fname).is_file():
            return root / fname
        if (root / fname).exists():  # a FIFO, a device, a folder: never read, never skipped
            raise DataError(f"{root / fname} is not a regular file")
    shipped = SHIPPED_DIR / fname
    if shipped.is_file():
        return shipped
    where = f"not in data directory {root}" if root is not None else "no data directory is set"
    raise DataError(
        f"benchmark {name!r}: {fname} is a training set, not shipped with sat (only the "
        f"evaluation sets {', '.join(shipped_names())} are); {where}. Set data.dir=<folder> "
        f"(or pass data_dir) or {DATA_DIR_ENV} to a folder holding {fname}"
    )


def dapo_missing(root: Path | None) -> str:
    """Why no local DAPO-Math-17k copy was found (the start of the error message)."""
    files = " / ".join(DAPO_FILES)
    where = (
        f"none of {files} in data directory {root}"
        if root is not None
        else f"no data directory is set to look for {files} in"
    )
    return (
        f"DAPO-Math-17k is a training set, not shipped with sat: {where} "
        f"(data.dir=<folder> or {DATA_DIR_ENV})"
    )
