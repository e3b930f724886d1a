"""The config groups whose options are registered components (engine, trainer, launcher:
``sat_cli.registry``), and the components a typed config chose."""

from __future__ import annotations


def registries() -> dict:
    """Config group → its registry (imported here: the registries import no torch)."""
    from sat_cli.cluster.registry import LAUNCHERS
    from sat_cli.engines.registry import ENGINES
    from sat_cli.trainers.registry import TRAINERS

    return {"trainer": TRAINERS, "launcher": LAUNCHERS, "engine": ENGINES}


def components(cfg) -> list:
    """The trainer, launcher and engine components of a typed config (``SatConfig``), each
    checked to be the class its ``name`` is registered with (an unknown name: ``ConfigError``
    listing the registered ones)."""
    return [reg.of(getattr(cfg, group)) for group, reg in registries().items()]


_STORED: set = set()


def register(schema, conf_dir=None) -> None:
    """Register the schema in Hydra's ConfigStore (idempotent): ``schema`` (``SatConfig``) as
    ``sat_schema``, and each
    registered component's settings class as ``schema/<group>/<name>`` (the structured config
    that ``conf/<group>/<name>.yaml`` names first in its defaults) and, where ``conf_dir`` has no
    such file, as the option ``<group>/<name>`` itself (its class defaults)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "sat_schema.yaml" not in cs.repo:  # storing it again rebuilds the node: ~15 % of a load
        cs.store(name="sat_schema", node=schema)
    for group, reg in registries().items():
        for name in reg.names():
            cls = reg.get(name).settings
            if ("schema", group, name, cls) not in _STORED:
                cs.store(group=f"schema/{group}", name=name, node=cls)
                _STORED.add(("schema", group, name, cls))
            own = conf_dir is not None and (conf_dir / group / f"{name}.yaml").is_file()
            if not own and (group, name, cls) not in _STORED:
                cs.store(group=group, name=name, node=cls)
                _STORED.add((group, name, cls))
