"""The trainers ``trainer=<name>`` can choose: name → settings class and functions
(:class:`sat_cli.registry.Component`). Torch-free. A new trainer: its module(s) with a settings
class, and one ``TRAINERS.add`` line here (docs/ARCHITECTURE.md, "How to add")."""

from __future__ import annotations

from sat_cli.registry import Component, Registry
from sat_cli.trainers import settings as local
from sat_cli.trainers.megatron import checks
from sat_cli.trainers.megatron import settings as megatron

TRAINERS = Registry("trainer", "trainer")
TRAINERS.add(
    "local", Component(local.LocalTrainerSettings, local.build_local, check=local.check_local)
)
TRAINERS.add(
    "megatron",
    Component(
        megatron.MegatronTrainerSettings,
        megatron.build,
        resources=megatron.resources,
        check=checks.check,
        check_model=megatron.check_model,
    ),
)
