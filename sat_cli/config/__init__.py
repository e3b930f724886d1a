"""Compose and validate `sat` configs.

``compose(overrides)`` runs Hydra's compose API over ``conf/`` with the typed schema of
:mod:`sat_cli.config.schema` first in the defaults list; ``load(overrides)`` also turns the
result into dataclasses, which runs every bound check. Every failure — unknown group option,
bad override syntax, unknown key (also one added with ``+``/``++``), a config group given a
non-string value or an option outside ``conf/<group>/`` (:mod:`sat_cli.config.grammar`), wrong
type, out-of-range value — is raised as
:class:`ConfigError` with a one-paragraph message naming the key and, where there is a choice,
the valid options; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sat_cli.config.schema import ConfigError, SatConfig

__all__ = ["ConfigError", "SatConfig", "compose", "load", "conf_dir", "group_options", "to_yaml"]

GROUPS = (
    "model",
    "task",
    "algo",
    "clip",
    "lag",
    "engine",
    "trainer",
    "eval",
    "reward",
    "env",
    "tracking",
    "experiment",
    "launcher",
)


def conf_dir() -> Path:
    """The config tree: $SAT_CONF_DIR, else the `conf/` shipped inside the package."""
    env = os.environ.get("SAT_CONF_DIR")
    if env:
        return Path(env).resolve()
    return (Path(__file__).resolve().parent.parent / "conf").resolve()


def group_options(group: str) -> list[str]:
    """The options of a config group: its files in ``conf/<group>/`` and, for the engine,
    trainer and launcher groups, the names registered there (``sat_cli.registry``)."""
    d = conf_dir() / group
    names = {p.stem for p in d.glob("*.yaml")} if d.is_dir() else set()
    from sat_cli.config.options import registries

    reg = registries().get(group)
    return sorted(names | set(reg.names() if reg is not None else ()))


def _owners(key: str) -> list[str]:
    """``group=option`` of the registered options whose settings have ``key`` (``trainer.tp``:
    ``trainer=megatron``): for a key unknown to the chosen option of an engine, trainer or
    launcher."""
    import dataclasses

    from sat_cli.config.options import registries

    group, _, name = key.partition(".")
    reg = registries().get(group)
    if reg is None or not name or "." in name:
        return []
    return [
        f"{group}={option}"
        for option in reg.names()
        if name in {f.name for f in dataclasses.fields(reg.get(option).settings)}
    ]


def _preprocess(overrides: list[str]) -> list[str]:
    """`lag=3` (no such option file) means `lag.n=3` with the default mode;
    `lag.profile=geometric:0.5,max=8` is taken as one string (quoted for Hydra)."""
    out = []
    for ov in overrides:
        m = re.fullmatch(r"lag=(-?\d+)", ov.strip())
        if m:  # an option file (quoted: Hydra wants a string group choice) or any other n
            n = m.group(1)
            out.append(f"lag='{n}'" if n in group_options("lag") else f"lag.n={n}")
            continue
        m = re.fullmatch(r"(\+{0,2}lag\.profile)=([^'\"].*)", ov.strip())
        if m and "," in m.group(2):  # geometric:P,max=M: a comma is a sweep to Hydra; quote it
            out.append(f"{m.group(1)}='{m.group(2)}'")
            continue
        out.append(ov)
    return out


def _other_top_keys() -> list[str]:
    """The schema's top-level keys that are not config groups (``run.*`` for a section)."""
    import dataclasses

    return [
        f.name
        + (
            ".*"
            if dataclasses.is_dataclass(f.type) or f.default_factory is not dataclasses.MISSING
            else ""
        )
        for f in dataclasses.fields(SatConfig)
        if f.name not in GROUPS
    ]


def _translate(exc: Exception, overrides: list[str]) -> ConfigError:
    """Turn a Hydra/OmegaConf exception into a short message naming the key."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    key_errors = (ConfigKeyError, ConfigAttributeError)

    msg = str(exc).strip()
    m = re.search(r"Could not find '([^/']+)/([^']*)'", msg)
    if m:
        group, opt = m.groups()
        opts = group_options(group)
        extra = " (or lag.n=<int> for any other value >= 0)" if group == "lag" else ""
        return ConfigError(
            f"{group}={opt!r} is not a known option. Valid options for '{group}': "
            f"{', '.join(opts)}{extra}"
        )
    if msg.startswith("LexerNoViableAltException"):
        what = msg.split(":", 1)[1].strip().splitlines()[0] if ":" in msg else " ".join(overrides)
        return ConfigError(
            f"cannot parse override {what!r}: it has a character that Hydra's grammar does not "
            "allow unquoted; quote the value, e.g. key='value'"
        )
    if (
        "Error parsing override" in msg
        or "mismatched input" in msg
        or "no viable alternative" in msg
    ):
        first = msg.splitlines()[0]
        bad = re.search(r"Error parsing override '([^']*)'", msg)
        what = bad.group(1) if bad else " ".join(overrides)
        return ConfigError(
            f"cannot parse override {what!r}: {first}. Use key=value (Hydra syntax)."
        )
    cause = exc.__cause__
    if (
        cause is not None
        and cause is not exc
        and not isinstance(exc, (*key_errors, ValidationError))
    ):
        if isinstance(cause, (*key_errors, ValidationError)):
            return _translate(cause, overrides)
    full_key = getattr(exc, "full_key", None)
    if isinstance(exc, key_errors) or "not in struct" in msg:
        key = full_key or "?"
        hint = ""
        if "." not in key and key not in GROUPS:
            hint = (
                " Top-level keys are the groups ("
                + ", ".join(GROUPS)
                + ") and "
                + ", ".join(_other_top_keys())
                + "."
            )
        owners = _owners(key)
        if owners:
            text = next((o for o in overrides if o.lstrip("+").startswith(f"{key}=")), key)
            return ConfigError(
                f"{text} needs {' or '.join(owners)}: {key} is not a setting of the chosen "
                f"{key.split('.')[0]} (to list every key: sat config)"
            )
        return ConfigError(f"unknown config key {key!r}.{hint} To list every key: sat config")
    if isinstance(exc, ValidationError):
        key = full_key or "?"
        vm = re.search(r"Value '([^']*)'", msg)
        got = vm.group(1) if vm else "?"
        low = msg.lower()
        if "is not a subclass of" in msg or re.search(r"cannot assign \w+ to dict", low):
            return ConfigError(  # `replay=x`: a section given a value
                f"{key} is a section of settings ({key}.<name>=…), not a value; "
                "to list every key: sat config"
            )
        if "bool" in low:
            return ConfigError(f"{key}: expected a boolean (true or false), got {got!r}")
        if "integer" in low or "type int" in low:
            return ConfigError(f"{key}: expected an integer, got {got!r}")
        if "float" in low:
            return ConfigError(f"{key}: expected a number, got {got!r}")
        return ConfigError(f"{key}: {msg.splitlines()[0]}")
    return ConfigError(msg.splitlines()[0] if msg else type(exc).__name__)


def _heldout_by_default(cfg, overrides: list[str]) -> bool:
    """True when no evaluation was chosen (``eval`` is the default ``toy``, no ``eval=`` override)
    and the task is a data task (``task.kind`` other than ``toy``, or ``task.path`` set): its
    evaluation is then ``eval=heldout``, the task's own held-out split."""
    from sat_cli.tasks.registry import TASK_SOURCES, eval_source

    named = any(re.match(r"[+~]*eval(=|$)", ov.strip()) for ov in overrides)
    source = TASK_SOURCES.find(cfg.task.kind)  # an unknown kind is refused later
    data_task = source is None or source.data or cfg.task.get("path") is not None
    return not named and data_task and eval_source(cfg.eval.benchmark).generator


def compose(overrides: list[str] | None = None):
    """Compose the config (an OmegaConf DictConfig, interpolations resolved) or raise ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from sat_cli.config.grammar import check_overrides, unknown_keys
    from sat_cli.config.options import register

    overrides = _preprocess(list(overrides or []))
    check_overrides(overrides, GROUPS, conf_dir())
    register(SatConfig, conf_dir())
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
            if _heldout_by_default(cfg, overrides):  # a data task evaluates its own held-out rows
                cfg = hydra_compose(config_name="config", overrides=[*overrides, "eval=heldout"])
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _translate(exc, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    extra = unknown_keys(cfg)
    if extra:  # added with +key / ++key, or by a YAML file in conf/: the typed config drops them
        raise ConfigError(
            f"unknown config key {extra[0]!r}"
            + (f" (and {', '.join(map(repr, extra[1:4]))})" if len(extra) > 1 else "")
            + ": not in the schema, so it would be silently ignored. To list every key: sat config"
        )
    from sat_cli.validate import check_durations, check_finite

    container = OmegaConf.to_container(cfg, resolve=True)
    check_finite(container)  # one rule for every number
    check_durations(container)  # and one for every duration
    from sat_cli.tracking.params import remember_secrets

    remember_secrets(container)  # masked wherever they appear (one secret policy)
    return cfg


def load(overrides: list[str] | None = None, command: str | None = None) -> tuple[Any, SatConfig]:
    """Compose, then build the dataclasses (runs every bound check). Returns (DictConfig, SatConfig).
    ``command`` (``train``, ``eval``, ...): refuse top-level settings only another command uses
    (:func:`sat_cli.config.grammar.check_command_keys`)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if command is not None:
        from sat_cli.config.grammar import check_command_keys

        check_command_keys(list(overrides or []), command)
    cfg = compose(overrides)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise _translate(exc, list(overrides or [])) from None
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None
    # values the schema derives (null = automatic) go back into the config that runs record
    for key, value in vars(obj.trainer).items():
        if cfg.trainer.get(key, 0) is None and value is not None:
            cfg.trainer[key] = value
    if cfg.engine.get("dtype") is None:  # null: by engine.device (engines/settings.py)
        cfg.engine.dtype = obj.engine.dtype
    cfg.task.kind = obj.task.kind  # task.path with kind=toy: kind=file
    _scale_radii(cfg, obj)
    return cfg, obj


def _scale_radii(cfg, obj) -> None:
    """``clip.radius_scale``: the algorithm's radii (``algo.eps_low``, ``algo.eps_high``, as
    composed: the algorithm's, or given on the command line) times the factor, once, here, so
    the config a run records and logs holds the radii it trains with. 12 significant digits:
    0.2 x 0.75 is 0.15, not 0.15000000000000002."""
    scale = obj.clip.radius_scale
    if scale == 1.0:
        return
    for key in ("eps_low", "eps_high"):
        value = float(f"{getattr(obj.algo, key) * scale:.12g}")
        setattr(obj.algo, key, value)
        cfg.algo[key] = value


def to_yaml(cfg) -> str:
    """``cfg`` as YAML with its secrets masked (``tracking.params.redact_config``: secret-named
    keys, URI passwords, secret query values, values after secret flags): what ``sat config``
    prints and a run's ``config.yaml`` holds."""
    from omegaconf import OmegaConf

    from sat_cli.tracking.params import redact_config

    return OmegaConf.to_yaml(OmegaConf.create(redact_config(OmegaConf.to_container(cfg))))
