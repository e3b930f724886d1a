"""Supervised examples from a task's rows, for the warm start on a user's file (`sat pretrain`).

One row ``{problem, answer}`` becomes the prompt (the task's template) followed by the target
``\\boxed{<answer>}`` and EOS; the loss is taken on the target and EOS only (labels ``-100`` on
the prompt), the layout of the toy warm start, so the model answers in the ``\\boxed{}`` the
default grader reads.

* :func:`sft_example` — ``(input_ids, labels)`` of one row.
* :func:`check_charset` — refuses (``DataError``, exit 2) a row whose prompt or target holds a
  character the tokenizer has no token for (its ``<unk>``: the tiny model's character set is
  printable ASCII, newline and tab), naming the character and the row, before any training.
* :func:`data_digest` — SHA-256 of a data file's bytes (a ``datasets`` folder: of its files'
  names and bytes): the part of the warm start's cache key that changes with the data.

Torch-free.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from sat_cli.tasks.datafiles import DataError


def target_text(answer: str) -> str:
    """The response a row teaches: its answer in ``\\boxed{}`` (EOS is added as a token)."""
    return "\\boxed{" + answer + "}"


def sft_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``: the prompt's tokens, then the target's and EOS; ``labels`` is
    ``-100`` on the prompt and the token itself on the target and EOS."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(target_text(answer), add_special_tokens=False)["input_ids"]
    r = [*r, tokenizer.eos_token_id]
    return p + r, [-100] * len(p) + r


def _missing(tokenizer, ch: str, cache: dict[str, bool]) -> bool:
    """Whether the tokenizer maps ``ch`` to its unknown token (it has no token for it)."""
    if ch not in cache:
        ids = tokenizer(ch, add_special_tokens=False)["input_ids"]
        cache[ch] = tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids
    return cache[ch]


def check_charset(
    tokenizer, rows: Iterable[dict], render: Callable[[dict], str], source: str
) -> None:
    """``DataError`` naming the first row (its id) whose rendered prompt or target holds a
    character the tokenizer turns into its unknown token. A tokenizer without an unknown token
    (byte-level BPE) has a token for every character: nothing is refused."""
    if tokenizer.unk_token_id is None:
        return
    cache: dict[str, bool] = {}
    for row in rows:
        for part, text in (("prompt", render(row)), ("answer", target_text(row["answer"]))):
            for ch in text:
                if _missing(tokenizer, ch, cache):
                    raise DataError(
                        f"{source}: row {row['id']!r}: its {part} holds {ch!r} (U+{ord(ch):04X}), "
                        "a character the model's tokenizer has no token for (the tiny model's "
                        "character set is printable ASCII, newline and tab); replace it in the "
                        "data, or set model.path to a model whose tokenizer has it"
                    )


def data_digest(path: str | os.PathLike) -> str:
    """SHA-256 of the bytes of the file ``path``; of a folder, of each file's relative name
    and bytes in sorted order."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        if path.is_dir():
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as exc:
            raise DataError(f"{f}: cannot be read ({exc.strerror})") from None
        h.update(b"\0")
    return h.hexdigest()
