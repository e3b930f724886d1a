"""The registry of environments: ``make(name, settings)``.

``register_env("name")`` on a factory ``(EnvSettings) -> Environment`` (``base.Environment``)
adds one, from this package or from the user's own module; ``make`` refuses an unknown name
with a one-line ``ValueError`` listing the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable

from sat_cli.envs.base import Environment, EnvSettings
from sat_cli.envs.calculator import CalculatorEnv

ENVIRONMENTS: dict[str, Callable[[EnvSettings], Environment]] = {"calculator": CalculatorEnv}


def register_env(name: str):
    def deco(factory):
        ENVIRONMENTS[name] = factory
        return factory

    return deco


def make(name: str, settings: EnvSettings | None = None) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; valid: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name](settings or EnvSettings())
