"""The registry of environments: ``make(name, settings)``.

``ENVIRONMENTS`` is a :class:`sat_cli.registry.Registry` of factories
``(EnvSettings) -> Environment`` (``base.Environment``); ``register_env("name")`` on a factory adds
one, from this package or from the user's own module; ``make`` refuses an unknown name with a
one-line ``ConfigError`` (a ``ValueError``; exit 2) listing the registered ones. A factory with
``uses_sandbox = True`` (it runs tools through ``sandbox.call_tool``) starts only where its
``settings.sandbox`` mode can run: with ``strict`` (the default) where the kernel permits every
layer of the strict sandbox, else ``make`` refuses with a one-line ``ConfigError`` that names the
refused step and ``env.sandbox=unsafe_local``.
"""

from __future__ import annotations

from sat_cli.envs.base import Environment, EnvSettings
from sat_cli.envs.calculator import CalculatorEnv
from sat_cli.envs.guess import GuessEnv
from sat_cli.registry import Registry
from sat_cli.validate import ConfigError

ENVIRONMENTS = Registry("environment", "environment")
ENVIRONMENTS.add("calculator", CalculatorEnv)
ENVIRONMENTS.add("guess", GuessEnv)


def register_env(name: str):
    def deco(factory):
        ENVIRONMENTS.add(name, factory)
        return factory

    return deco


def make(name: str, settings: EnvSettings | None = None) -> Environment:
    if name not in ENVIRONMENTS:
        valid = ", ".join(sorted(ENVIRONMENTS.names()))
        raise ConfigError(f"unknown environment {name!r}; valid: {valid}")
    settings = settings or EnvSettings()
    factory = ENVIRONMENTS.get(name)
    if getattr(factory, "uses_sandbox", False):
        from sat_cli.envs.sandbox import refusal

        if (why := refusal(settings.sandbox)) is not None:
            raise ConfigError(f"env={name} runs tools and cannot start: {why}")
    return factory(settings)
