"""The checks every config section uses: :class:`ConfigError` and the range/choice helpers."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is out of range or not one of the allowed choices."""


def _choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(options)}")


def _template(key: str, value: str) -> None:
    from sat_cli.tasks.prompts import TEMPLATES

    if value not in TEMPLATES and "{problem}" not in value:
        raise ConfigError(
            f"{key}={value!r} is neither a template name ({', '.join(sorted(TEMPLATES))}) nor a "
            "literal holding {problem}"
        )


def _range(
    key: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if bad:
        lo_s = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
        hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
        raise ConfigError(f"{key}={value} is out of range: need {lo_s}{key}{hi_s}")
