"""Checks of the override grammar that Hydra itself does not make (run before composing).

Hydra accepts some overrides that `sat` must refuse, or fails on them with a raw exception:

* a **config group given a non-string value** — ``lag=2.5``, ``lag=1e9``, ``lag=null``,
  ``algo=1``, ``'lag=[1,2]'`` — raises a ``ValueError`` inside Hydra. A group takes one option
  name; the only number a group accepts is the ``lag=<int>`` shorthand for ``lag.n``
  (:func:`sat_cli.config._preprocess`), so every other non-string value is refused here;
* ``+key=value`` / ``++key=value`` **add keys the schema does not know**, which the typed config
  then silently drops (``+trainer.lrr=1e-4`` was accepted and ignored). Adding is allowed for
  the config groups (``+experiment=…``) and for keys the schema has; anything else is refused;
* a **group option that climbs out of its folder** (``algo=../../x``, ``algo=/abs/x``) would
  load any YAML file on the machine. Options are names of files in ``conf/<group>/``: ``..``,
  absolute paths and backslashes are refused, and the resolved file must lie in that folder;
* ``~key`` **deleting a key of the schema** (``~seed``) silently fell back to the default:
  deleting is for config groups (``~experiment``);
* a group option given as an **interpolation** (``algo='${oc.env:X}'``) is resolved first and
  the result checked as above: Hydra resolves it when it loads the file, so ``X=../../x``
  climbed out of ``conf/algo/``. An interpolation that cannot be resolved before composing is
  refused; the option file must be a regular file (a FIFO would block the composition);
* ``hydra.*`` settings (``hydra.run.dir=…``, ``hydra.verbose=true``) were **silently
  ignored**: `sat` composes with Hydra's compose API and never runs Hydra's app; refused;
* **a top-level setting of another command** (``sat train ckpt=…``, ``sat eval resume=auto``)
  was silently ignored: :func:`check_command_keys` names the command that takes it.

Every refusal is a :class:`ConfigError` naming the override and the key (exit code 2).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from sat_cli.config.schema import ConfigError


def _schema_has(key: str) -> bool:
    """True if the dotted ``key`` is a field of :class:`SatConfig` (nested dataclasses walked;
    under ``engine``, ``trainer`` and ``launcher``: a field of any registered option's settings)."""
    from sat_cli.config.options import registries
    from sat_cli.config.schema import SatConfig

    group, *rest = key.split(".")
    reg = registries().get(group)
    if reg is not None and rest:
        return any(_class_has(reg.get(n).settings, rest) for n in reg.names())
    return _class_has(SatConfig, [group, *rest])


def _class_has(cls: Any, parts: list[str]) -> bool:
    import dataclasses
    import typing

    node = cls
    for part in parts:
        if node is dict:  # a free-form map of the schema (tracking.tags): any key
            return True
        if not dataclasses.is_dataclass(node) or part not in {
            f.name for f in dataclasses.fields(node)
        }:
            return False
        hint = typing.get_type_hints(node)[part]
        node = dict if typing.get_origin(hint) is dict else hint
    return True


def unknown_keys(cfg, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config that the schema does not have (``+key`` additions)."""
    from omegaconf import DictConfig

    out: list[str] = []
    for k in cfg.keys():
        key = f"{prefix}.{k}" if prefix else str(k)
        if not _schema_has(key):
            out.append(key)
            continue
        value = cfg._get_node(k)
        if isinstance(value, DictConfig) and not value._is_none():
            out.extend(unknown_keys(value, key))
    return out


def _resolve(option: str, text: str) -> str:
    """``option`` with its interpolations resolved (``${oc.env:X}``) as Hydra would resolve them."""
    if "${" not in option:
        return option
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        value = OmegaConf.create({"option": option}).option
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(
            f"{text!r}: a config group option may be an interpolation only if it resolves on "
            f"its own ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        ) from None
    if not isinstance(value, str):  # ${oc.decode:'1'}: Hydra asserts on a non-string option
        raise ConfigError(f"{text!r} resolves to {value!r}: a config group takes an option name")
    return value


def _check_option(group: str, option: str, text: str, conf_dir: Path) -> None:
    resolved = _resolve(option, text)
    shown = repr(text) + (f" (resolves to {resolved!r})" if resolved != option else "")
    option = resolved
    path = PurePosixPath(option)
    if (
        not option
        or option.startswith(("/", "~"))
        or "\\" in option
        or "\0" in option
        or ".." in path.parts
    ):
        raise ConfigError(
            f"{shown}: a {group!r} option is the name of a file in conf/{group}/ "
            "(no '..', no absolute path)"
        )
    try:
        folder = (conf_dir / group).resolve()
        target = (folder / f"{option}.yaml").resolve()
        if folder not in target.parents:
            raise ConfigError(f"{shown}: the option resolves outside conf/{group}/")
        if target.exists() and not target.is_file():
            raise ConfigError(f"{shown}: conf/{group}/{option}.yaml is not a regular file")
    except OSError as exc:  # a name too long, a link loop
        raise ConfigError(f"{shown[:200]}: not a {group!r} option ({exc.strerror})") from None


# Top-level settings that only some commands use (the others would silently ignore them): the
# key -> the commands that take it. `sat config` prints any config; `plan` is `sat plan` and
# `sat train --dry-run`; `pretrain` gets a sweep run's overrides (its warm start).
COMMAND_KEYS = {
    "ckpt": ("eval",),
    "resume": ("train", "plan"),
    "checkpoint": ("train", "plan", "pretrain"),
    "max_steps": ("train", "plan", "pretrain"),
    "algo": ("train", "plan", "pretrain"),
    "clip": ("train", "plan", "pretrain"),
    "lag": ("train", "plan", "pretrain"),
    "r3": ("train", "plan", "pretrain"),
    "replay": ("train", "plan", "pretrain"),
}


def check_command_keys(overrides: list[str], command: str) -> None:
    """Refuse a top-level setting that ``command`` does not use (``ConfigError`` naming the
    command(s) that take it); unparsable overrides are left to the composition."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if command == "config":
        return
    parser = OverridesParser.create()
    for text in overrides:
        try:
            key = parser.parse_override(text).key_or_group
        except HydraException:
            continue
        except ValueError as exc:  # Hydra's own int() of a 5000-digit number
            raise ConfigError(
                f"cannot parse override {text[:80]!r}…: {exc}".split(";")[0]
            ) from None
        takers = COMMAND_KEYS.get(key.split(".")[0])
        if takers is not None and command not in takers:
            names = " and ".join(f"`sat {c}`" for c in takers if c != "pretrain")
            raise ConfigError(
                f"{text!r}: {key.split('.')[0]} is a setting of {names}; `sat {command}` does "
                "not use it (it would be silently ignored)"
            )


def _check_ints(text: str, value: Any) -> None:
    """An integer beyond 64 bits (a float key given 10**400 overflows inside OmegaConf)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**63:
            raise ConfigError(f"{text[:80]!r}: {str(v)[:20]}… is beyond a 64-bit integer")
        if isinstance(v, list | dict):
            stack.extend(v.values() if isinstance(v, dict) else v)


def check_overrides(overrides: list[str], groups: tuple[str, ...], conf_dir: Path) -> None:
    """Refuse the overrides described in the module docstring (``ConfigError``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except HydraException:
            continue  # a syntax error: Hydra's own message is translated by the caller
        except ValueError as exc:  # Hydra's own int() of a 5000-digit number
            raise ConfigError(
                f"cannot parse override {text[:80]!r}…: {exc}".split(";")[0]
            ) from None
        key = ov.key_or_group
        _check_ints(text, ov.value() if not ov.is_delete() else None)
        if key.split(".")[0].lstrip("~+") == "hydra":
            raise ConfigError(
                f"{text!r}: sat composes its config with Hydra but does not run Hydra's app, so "
                "hydra.* settings would be silently ignored (the run folder is run.dir/run.name)"
            )
        if ov.is_delete():
            if key not in groups and _schema_has(key):
                raise ConfigError(
                    f"{text!r} deletes {key!r}, a key every config has; set it instead "
                    f"({key}=…). '~' removes a config group, e.g. ~experiment"
                )
            continue
        if key in groups:
            if ov.is_sweep_override():
                continue  # refused by compose ("requires --multirun"), translated there
            value = ov.value()
            if not isinstance(value, str):
                shown = "null" if value is None else repr(value)
                extra = " (for lag: lag=<integer> or lag.n=<integer>)" if key == "lag" else ""
                opts = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
                raise ConfigError(
                    f"{text!r}: the config group {key!r} takes one option name, not "
                    f"{shown}{extra}. Valid options for {key!r}: {', '.join(opts)}"
                )
            _check_option(key, value, text, conf_dir)
            continue
        if (ov.is_add() or ov.is_force_add()) and not _schema_has(key):
            raise ConfigError(
                f"unknown config key {key!r} in {text!r}: '+' and '++' may only add a config "
                "group or set a key the schema has; to list every key: sat config"
            )
