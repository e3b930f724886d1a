"""One small registry per variation point: engines, trainers, launchers, sweep executors, task
and evaluation sources (``tasks/registry.py``), rewards (``rewards/registry.py``) and
environments (``envs/registry.py``).

A :class:`Component` is what a registered option brings: its **settings class** (torch-free; the
structured config of ``conf/<group>/<name>.yaml`` in Hydra's ConfigStore, bounds in its
``__post_init__``) and four functions, each with a neutral default:

* ``build(settings, runtime)`` — the running object (imports its heavy libraries inside);
* ``resources(settings)`` — what it asks of a cluster (:class:`Resources`: ``sat plan``, Ray
  bundles);
* ``environment(settings)`` — its ``env.*`` params of a run;
* ``check(run)`` — its rules across config sections (``run``: the whole typed config), at
  compose time;
* ``check_model(settings, path)`` — its rules on the model folder at ``path`` before a run
  starts (``UserError``: a model it cannot serve or train).

An unknown name is refused with the registered ones listed (``ConfigError``, exit 2). A new
option is one :meth:`Registry.add` call in the group's registry module (or, for a plugin or a
test, one call from its own file before the command runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sat_cli.validate import ConfigError


@dataclass(frozen=True)
class Resources:
    """What one option asks of a cluster: ``count`` bundles of ``bundle`` (Ray resource names:
    CPU, GPU, custom) and the GPUs it uses on this machine (``sat plan``)."""

    count: int = 0
    bundle: dict[str, float] | None = None
    gpus: int = 0


def no_resources(settings) -> Resources:
    return Resources()


def no_environment(settings) -> dict[str, str]:
    return {}


def no_check(run) -> None:
    return None


def no_model_check(settings, path: str) -> None:
    return None


def not_buildable(settings, runtime):
    raise ConfigError(f"{type(settings).__name__} builds nothing on its own")


@dataclass(frozen=True)
class Component:
    settings: type
    build: Callable[[Any, Any], Any] = not_buildable
    resources: Callable[[Any], Resources] = no_resources
    environment: Callable[[Any], dict[str, str]] = no_environment
    check: Callable[[Any], None] = no_check
    check_model: Callable[[Any, str], None] = no_model_check


class Registry:
    """Name → entry of one variation point (``group``: the config group): a :class:`Component`
    for engines, trainers and launchers; the group's own entry type elsewhere (sweep executors,
    task and evaluation sources, rewards; an environment's class)."""

    def __init__(self, group: str, what: str) -> None:
        self.group, self.what = group, what
        self._entries: dict[str, Component] = {}

    def add(self, name: str, component: Component) -> Component:
        if name in self._entries and self._entries[name] != component:
            raise ValueError(f"{self.group} {name!r} is registered already")
        self._entries[name] = component
        return component

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    __delitem__ = remove

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def find(self, name: str):
        """The entry of ``name``, or None when it is not registered."""
        return self._entries.get(name)

    def names(self) -> list[str]:
        """The registered names, in the order they were added."""
        return list(self._entries)

    def get(self, name: str) -> Component:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"{self.group}={name!r} is not a registered {self.what}; registered: "
                f"{', '.join(self.names())}"
            ) from None

    def of(self, settings) -> Component:
        """The component of a settings object (its ``name``), checked to be its class."""
        component = self.get(settings.name)
        if not isinstance(settings, component.settings):
            raise ConfigError(
                f"{self.group}.name={settings.name!r} names another {self.what} than the chosen "
                f"option's settings ({type(settings).__name__}); choose it with "
                f"{self.group}={settings.name}"
            )
        return component
