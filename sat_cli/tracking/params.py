"""MLflow names and params: legal keys (``mlflow_key``), secret keys and URI passwords
redacted, a nested config flattened into params (``flatten_config``), and the one secret policy
every output goes through: the name rules (``is_secret_key``, ``redact_uri``, ``redact_text``,
``redact_config``) and the values known to be secret (``remember_secrets``, ``mask_known``;
environment variables by ``is_secret_env_name``).
"""

from __future__ import annotations

import json
import os
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


# ----------------------------------------------------------------------- values known to be secret
# The one policy's second half: besides the rules above (by a key's, a flag's or a query key's
# name, a URL's userinfo), the *values* they mask in the run's composed config
# (:func:`remember_secrets`, called by ``config.compose``) and the values of this process's
# environment variables named like secrets (:func:`is_secret_env_name`) are masked wherever they
# appear verbatim: params, tags, ``config.yaml``, messages, `sat plan`, samples tables, the run
# folder's logs. Values shorter than MIN_SECRET_CHARS are not (``true``, ``1``, ``none`` would
# mask ordinary text); the name rules still mask them where a name is next to them.
MIN_SECRET_CHARS = 6
_KNOWN: set[str] = set()  # remembered from composed configs (the process's inputs)
_ENV_KNOWN: list[frozenset[str]] = []  # this process's secret environment values, read once
_ENV_SECRET_LAST = frozenset({"key", "keys", "token", "tokens", "pat"})
_ENV_NOT_SECRET = frozenset({"PWD", "OLDPWD"})  # the shell's folders ("pwd" names a password)


def is_secret_env_name(name: str) -> bool:
    """True for an environment variable named like a secret: ``*_TOKEN``, ``*_KEY``,
    ``*SECRET*``, ``*PASSWORD*`` and every name :func:`is_secret_key` names (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``OPENAI_API_KEY``, ``PGPASSWORD``)."""
    words = _key_words(name)
    upper = name.upper()
    if upper in _ENV_NOT_SECRET:
        return False
    return bool(
        is_secret_key(name)
        or (words and words[-1] in _ENV_SECRET_LAST)
        or any(w in upper for w in ("SECRET", "PASSWORD", "PASSWD"))
    )


def _env_secrets() -> frozenset[str]:
    if not _ENV_KNOWN:
        _ENV_KNOWN.append(
            frozenset(
                v
                for k, v in os.environ.items()
                if len(v) >= MIN_SECRET_CHARS and is_secret_env_name(k)
            )
        )
    return _ENV_KNOWN[0]


def remember_secrets(config: Any) -> None:
    """Remember every value :func:`redact_config` masks in ``config`` (a plain nested config),
    so that it is masked wherever it appears (module comment above)."""

    def found(value: str) -> None:
        if len(value) >= MIN_SECRET_CHARS and value != REDACTED:
            _KNOWN.add(value)

    _redact_nested(config, found)
    _ENV_KNOWN.clear()  # read the environment again: a command sets its variables before


def mask_known(text: str) -> str:
    """``text`` with every value known to be secret (module comment above) replaced by ``***``."""
    known = _KNOWN | _env_secrets()
    for value in sorted((v for v in known if v in text), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def mask_known_in(value: Any) -> Any:
    """A copy of a nested value (dicts, lists, strings) with :func:`mask_known` applied to every
    string: what a samples table's cells get (model text is data: only known values go)."""
    if isinstance(value, str):
        return mask_known(value)
    if isinstance(value, Mapping):
        return {k: mask_known_in(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_known_in(v) for v in value]
    return value


_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_QUERY_PAIR = re.compile(r"(?P<sep>[?&;])(?P<key>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")
_QUERY_SECRET_KEYS = frozenset({"key", "sig", "signature", "code", "x-amz-signature"})


def _is_secret_query_key(key: str) -> bool:
    return key.lower() in _QUERY_SECRET_KEYS or is_secret_key(key)


def _masked(found, value: str) -> str:
    if found is not None:
        found(value)
    return REDACTED


def _redact_query(url: str, found=None) -> str:
    head, q, rest = url.partition("?")
    if not q:
        return url
    return head + _QUERY_PAIR.sub(
        lambda m: (
            f"{m.group('sep')}{m.group('key')}={_masked(found, m.group('value'))}"
            if _is_secret_query_key(m.group("key")) and m.group("value")
            else m.group(0)
        ),
        "?" + rest,
    )


def redact_uri(text: str, found=None) -> str:
    """Mask the password of every ``scheme://user:password@host`` inside ``text``, and the value
    of every query parameter named like a secret (``?api_key=…``, ``&token=…``, ``key``,
    ``sig``, ``signature``, ``code``); also every value known to be secret (:func:`mask_known`).
    ``found``: called with each value masked by the URI rules (:func:`remember_secrets`)."""
    text = mask_known(text)
    text = _URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{_masked(found, m.group('pw'))}@", text)
    return _URI.sub(lambda m: _redact_query(m.group(0), found), text)


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


def masked_print(*values: Any, **kwargs: Any) -> None:
    """``print`` with :func:`redact_text` applied: a command's lines on the terminal."""
    print(*(redact_text(str(v)) for v in values), **kwargs)


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


def _scalars(value: Any) -> Iterable[str]:
    """Every scalar under ``value`` as text (what a secret-named key's value holds)."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _scalars(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _scalars(v)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _secret(found, value: Any) -> str:
    for text in _scalars(value) if found is not None else ():
        found(text)
    return REDACTED


def _redact_nested(value: Any, found=None) -> Any:
    """Copy of a list/dict value with secret keys masked and URI passwords removed; ``found``
    is called with every value masked."""
    if isinstance(value, Mapping):
        return {
            k: (_secret(found, v) if is_secret_key(str(k)) else _redact_nested(v, found))
            for k, v in value.items()
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
                out.append(_secret(found, v))
            elif (
                isinstance(v, str)
                and v.startswith("-")
                and "=" in v
                and is_secret_key(v.split("=", 1)[0].lstrip("-"))
            ):
                flag, secret = v.split("=", 1)
                out.append(flag + "=" + _secret(found, secret))
            else:
                out.append(_redact_nested(v, found))
        return out
    if isinstance(value, str):
        return redact_uri(value, found)
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
