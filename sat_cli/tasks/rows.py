"""Row mapping of the data loaders (:mod:`sat_cli.tasks.data`): one JSON line parsed defensively
(:func:`parse_row`) and mapped to ``{id, problem, answer}`` (:func:`normalize_row`); the layouts it
understands and the errors it raises are described in :mod:`sat_cli.tasks.data`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from sat_cli.tasks.datafiles import DataError

_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


# --------------------------------------------------------------------------------------------
# Row mapping
# --------------------------------------------------------------------------------------------


def _first(raw: Mapping[str, Any], *keys: str) -> tuple[str | None, Any]:
    for k in keys:
        if k in raw and raw[k] is not None:
            return k, raw[k]
    return None, None


def as_text(value: Any, field: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: field {field!r} is {value}, not a usable value")
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: field {field!r} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone UTF-16 surrogate, e.g. "\ud800" in the JSON
        raise DataError(
            f"{where}: field {field!r} holds {text[err.start]!r} at character {err.start + 1}, "
            "a lone UTF-16 surrogate that is not valid Unicode text"
        ) from None
    return text


MAX_DEPTH = 32  # nesting levels of one row (the known layouts need 3)


def _depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_row(line: str, where: str) -> Any:
    """One JSON value of a JSONL line, parsed defensively: malformed JSON, nesting deeper than
    ``MAX_DEPTH`` (or than the parser's recursion limit), integers longer than Python's
    4300-digit conversion limit and the non-standard constants ``NaN`` / ``Infinity`` are all a
    ``DataError`` naming ``file:line``."""
    try:
        raw = json.loads(line, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None
    except ValueError as err:  # an integer beyond the digit limit, NaN / Infinity
        msg = str(err)
        if "digits" in msg:
            msg = f"an integer with more than {sys.get_int_max_str_digits()} digits"
        raise DataError(f"{where}: unusable JSON value ({msg[:120]})") from None
    if not _depth_ok(raw):
        raise DataError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep")
    return raw


def _strip_dapo_wrapper(text: str) -> str:
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX) :]
    if text.rstrip().endswith(_DAPO_SUFFIX):
        text = text.rstrip()[: -len(_DAPO_SUFFIX)]
    return text.strip()


def normalize_row(raw: Any, *, where: str, default_id: str) -> dict[str, str]:
    """Map one raw record of any known layout to ``{id, problem, answer}``.

    ``where`` (``file:line`` or ``hf:repo[row]``) prefixes every error message; ``default_id`` is
    used when the record has no id of its own.
    """
    if not isinstance(raw, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")

    # DAPO-Math-17k: chat-format prompt + reward_model.ground_truth, or prompt + label.
    prompt = raw.get("prompt")
    if prompt is not None and ("reward_model" in raw or "label" in raw):
        if isinstance(prompt, list):
            if not prompt or not isinstance(prompt[0], Mapping) or "content" not in prompt[0]:
                raise DataError(f"{where}: field 'prompt' must be a list of {{role, content}}")
            prompt = prompt[0]["content"]
        problem = _strip_dapo_wrapper(as_text(prompt, "prompt", where))
        if "reward_model" in raw:
            rm = raw["reward_model"]
            if not isinstance(rm, Mapping) or "ground_truth" not in rm:
                raise DataError(f"{where}: field 'reward_model' lacks 'ground_truth'")
            answer = as_text(rm["ground_truth"], "reward_model.ground_truth", where)
        else:
            answer = as_text(raw["label"], "label", where)
        extra = raw.get("extra_info")
        rid = raw.get("id") or (extra.get("index") if isinstance(extra, Mapping) else None)
        return {
            "id": as_text(rid, "id", where) if rid is not None else default_id,
            "problem": problem,
            "answer": answer,
        }

    pkey, problem = _first(raw, "problem", "Problem", "question", "Question")
    akey, answer = _first(raw, "answer", "Answer", "final_answer")
    missing = [name for name, key in (("problem", pkey), ("answer", akey)) if key is None]
    if missing:
        raise DataError(
            f"{where}: missing field(s) {missing} (have {sorted(raw)}); expected "
            "{id, problem, answer} or a known GSM8K/AIME/MATH-500/DAPO layout"
        )
    problem_text = as_text(problem, pkey, where)
    answer_text = as_text(answer, akey, where)
    if pkey in ("question", "Question") and "####" in answer_text:
        # GSM8K upstream: the answer field is the worked solution ending in "#### 72".
        answer_text = answer_text.rsplit("####", 1)[1].strip().replace(",", "")
        if not answer_text:
            raise DataError(f"{where}: nothing after '####' in the GSM8K answer")
    _, rid = _first(raw, "id", "ID", "unique_id", "idx")
    return {
        "id": as_text(rid, "id", where) if rid is not None else default_id,
        "problem": problem_text,
        "answer": answer_text,
    }


def check_unique(rows: list[dict[str, str]], wheres: list[str]) -> None:
    seen: dict[str, str] = {}
    for row, where in zip(rows, wheres, strict=True):
        if row["id"] in seen:
            raise DataError(f"{where}: duplicate id {row['id']!r} (first at {seen[row['id']]})")
        seen[row["id"]] = where
