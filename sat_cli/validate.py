"""Generic validators every settings class uses, config sections and component settings alike
(so a component's settings never import ``sat_cli.config``): :class:`ConfigError`, the
range/choice helpers and the one rule for numbers: :func:`non_finite` walks a composed config
and finds every NaN or infinity (which pass any ``x < lo or x > hi`` test), whatever the field."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config value is out of range or not one of the allowed choices."""


def check_choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(options)}")


def check_int(key: str, value: Any, lo: int, hi: int) -> None:
    """``value`` is an integer (not a bool) in ``[lo, hi]``; else ``ValueError`` naming ``key``
    (the settings classes of environments and warm starts, built from plain values)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{key}={value!r} must be an integer in [{lo}, {hi}]")


def check_range(
    key: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number")
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if bad:
        lo_s = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
        hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
        raise ConfigError(f"{key}={value} is out of range: need {lo_s}{key}{hi_s}")


def non_finite(node: Any, key: str = "") -> tuple[str, float] | None:
    """(dotted key, value) of the first NaN or infinite number in ``node`` (a composed config as
    plain containers: dicts and lists are walked), or None."""
    if isinstance(node, float):
        return None if math.isfinite(node) else (key, node)
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, v in items:
        found = non_finite(
            v, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else str(k)
        )
        if found:
            return found
    return None


def check_finite(container: dict) -> None:
    """Refuse a composed config with a NaN or infinite number in any setting (ConfigError)."""
    found = non_finite(container)
    if found:
        key, value = found
        raise ConfigError(
            f"{key}={value} is not a finite number: every numeric setting must be finite "
            "(NaN and infinity pass no range check)"
        )


MAX_DURATION_S = 30 * 86400.0  # a timeout or interval longer than 30 days is a typo


def check_durations(container: dict, prefix: str = "") -> None:
    """Refuse a duration in seconds (a key ending in ``_s``) outside ``[0, 30 days]``: 1e300 s
    passed every check and overflowed later (a socket's timeval, a ``timedelta`` of the process
    group, a thread's wait) in the middle of a run."""
    for k, v in container.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            check_durations(v, key + ".")
        elif key.endswith("_s") and isinstance(v, int | float) and not isinstance(v, bool):
            if not 0 <= v <= MAX_DURATION_S:
                raise ConfigError(
                    f"{key}={v}: a duration in seconds must lie in [0, {MAX_DURATION_S:.0f}] "
                    "(30 days)"
                )
