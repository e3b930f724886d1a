"""The rollout engines ``engine=<name>`` can choose: name → settings class and functions
(:class:`sat_cli.registry.Component`). Torch-free. A new engine: its package with a settings
module, and one ``ENGINES.add`` line here (docs/ARCHITECTURE.md, "How to add")."""

from __future__ import annotations

from sat_cli.engines.local import settings as local
from sat_cli.engines.sglang import settings as sglang
from sat_cli.registry import Component, Registry

ENGINES = Registry("engine", "rollout engine")
ENGINES.add("local", Component(local.LocalEngineSettings, local.build, check=local.check))
ENGINES.add(
    "sglang",
    Component(
        sglang.SGLangEngineSettings,
        sglang.build,
        resources=sglang.resources,
        environment=sglang.environment,
        check=sglang.check,
        check_model=sglang.check_model,
    ),
)
