"""MLflow names and params: legal keys (``mlflow_key``), secret keys and URI passwords
redacted, a nested config flattened into params (``flatten_config``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# tracking.tags keys that `sat sweep` sets, and the MLflow tags they become
SWEEP_TAG_NAMES = {
    "sweep_id": "sat.sweep_id",
    "override_hash": "sat.override_hash",
    "method": "sat.method",
    "parent_run_id": "mlflow.parentRunId",
}

MAX_PARAM_VALUE_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_LEN = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
REDACTED = "***"
_TRUNCATED = "...[truncated]"


# --------------------------------------------------------------------------- names and params

_INVALID_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(name: str) -> str:
    """The MLflow-legal form of a metric/param/tag name: ``@`` → ``_at_``, other bad chars → ``_``.

    MLflow accepts only alphanumerics, ``_ - . : /`` and spaces, and at most 250 characters.
    """
    key = _INVALID_KEY_CHARS.sub("_", name.replace("@", "_at_"))
    return key[:MAX_KEY_LEN]


# Words (split on non-alphanumerics and camelCase) that mark a config key as secret. "token" counts
# only as the last word and not after a tokenizer special-token word, so `hf_token` and
# `auth.token` are secret but `max_new_tokens`, `pad_token` and `eos_token_id` are not.
_SECRET_WORDS = frozenset(
    {"secret", "password", "passwd", "pwd", "apikey", "auth", "authorization", "credential"}
    | {"credentials", "passphrase", "bearer"}
)
_SPECIAL_TOKEN_WORDS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special"})
_SPECIAL_TOKEN_WORDS |= {"start", "end", "stop", "image", "audio", "video", "think"}
_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s]*):(?P<pw>[^@/?#\s]*)@")


def _key_words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """True if a config key names a credential (see the word rules above)."""
    words = _key_words(key)
    if any(w in _SECRET_WORDS for w in words):
        return True
    if any(a == "api" and b == "key" for a, b in zip(words, words[1:], strict=False)):
        return True
    if words and words[-1] == "token":
        return not (len(words) > 1 and words[-2] in _SPECIAL_TOKEN_WORDS)
    return False


_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_QUERY_PAIR = re.compile(r"(?P<sep>[?&;])(?P<key>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")
_QUERY_SECRET_KEYS = frozenset({"key", "sig", "signature", "code", "x-amz-signature"})


def _is_secret_query_key(key: str) -> bool:
    return key.lower() in _QUERY_SECRET_KEYS or is_secret_key(key)


def _redact_query(url: str) -> str:
    head, q, rest = url.partition("?")
    if not q:
        return url
    return head + _QUERY_PAIR.sub(
        lambda m: (
            f"{m.group('sep')}{m.group('key')}={REDACTED}"
            if _is_secret_query_key(m.group("key")) and m.group("value")
            else m.group(0)
        ),
        "?" + rest,
    )


def redact_uri(text: str) -> str:
    """Mask the password of every ``scheme://user:password@host`` inside ``text``, and the value
    of every query parameter named like a secret (``?api_key=…``, ``&token=…``, ``key``,
    ``sig``, ``signature``, ``code``)."""
    text = _URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    return _URI.sub(lambda m: _redact_query(m.group(0)), text)


_ASSIGNMENT = re.compile(r"(?P<key>[A-Za-z_][\w.\-]*)=(?P<q>['\"]?)(?P<value>[^\s,'\"\]}&;]+)")
_FLAG_VALUE = re.compile(
    r"(?<![\w-])(?P<flag>--?[A-Za-z][\w\-]*)(?P<sep>[ ,=])(?P<value>[^\s,'\"\]}-][^\s,'\"\]}]*)"
)


def redact_text(text: str) -> str:
    """``text`` for a message (the terminal, a log): :func:`redact_uri`, and the value of every
    ``key=value`` whose key names a secret (an override ``engine.api_key=…``) and after every
    secret-named flag (``--api-key VALUE``, ``--token=VALUE``) masked."""
    text = redact_uri(text)
    text = _ASSIGNMENT.sub(
        lambda m: (
            f"{m.group('key')}={m.group('q')}{REDACTED}"
            if is_secret_key(m.group("key"))
            else m.group(0)
        ),
        text,
    )
    return _FLAG_VALUE.sub(
        lambda m: (
            f"{m.group('flag')}{m.group('sep')}{REDACTED}"
            if is_secret_key(m.group("flag").lstrip("-"))
            else m.group(0)
        ),
        text,
    )


def truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    return value[: limit - len(_TRUNCATED)] + _TRUNCATED


def scalar_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)  # YAML-like: null, true, 1e-06
    return str(value)


def _redact_nested(value: Any) -> Any:
    """Copy of a list/dict value with secret keys masked and URI passwords removed."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if is_secret_key(str(k)) else _redact_nested(v)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        # argument lists: mask the value after a secret-named flag (`--api-key SECRET`) and the
        # `--api-key=SECRET` form
        out: list[Any] = []
        for i, v in enumerate(value):
            prev = value[i - 1] if i else None
            if (
                isinstance(prev, str)
                and prev.startswith("-")
                and "=" not in prev
                and is_secret_key(prev.lstrip("-"))
            ):
                out.append(REDACTED)
            elif (
                isinstance(v, str)
                and v.startswith("-")
                and "=" in v
                and is_secret_key(v.split("=", 1)[0].lstrip("-"))
            ):
                out.append(v.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(_redact_nested(v))
        return out
    if isinstance(value, str):
        return redact_uri(value)
    return value


def redact_config(config: Mapping[str, Any]) -> Any:
    """A copy of a plain nested config with what :func:`flatten_config` masks masked: secret
    keys (a whole secret section too), URI passwords and secret query values in every string,
    the value after a secret-named flag in argument lists. What ``config.yaml`` (in the run
    folder and the MLflow artifact) holds, and what a resume compares it with."""
    return _redact_nested(config)


def flatten_config(d: Mapping[str, Any], sep: str = ".") -> dict[str, str]:
    """Flatten a nested config into MLflow params ``{"a.b.c": "value"}``.

    Values are strings: ``str`` as is, numbers/bools/None JSON-style (``1e-06``, ``true``,
    ``null``), lists as JSON. Secret keys (:func:`is_secret_key`) become ``"***"`` (a secret
    section is collapsed to one ``"***"`` entry); passwords inside URIs are masked everywhere.
    Values are truncated to MLflow's 6000-character limit and keys made MLflow-legal.
    Pass plain containers (e.g. ``OmegaConf.to_container(cfg, resolve=True)``).
    """
    out: dict[str, str] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{sep}{k}" if prefix else str(k)
            if is_secret_key(str(k)):
                out[mlflow_key(key)] = REDACTED
            elif isinstance(v, Mapping) and v:
                walk(v, key)
            else:
                if isinstance(v, Mapping):
                    text = "{}"
                elif isinstance(v, list | tuple):
                    text = json.dumps(_redact_nested(list(v)), default=str)
                else:
                    text = redact_uri(scalar_str(v))
                out[mlflow_key(key)] = truncate(text, MAX_PARAM_VALUE_LEN)

    walk(d, "")
    return out


def chunked(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
