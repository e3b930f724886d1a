"""A resumed run continues the experiment it started: ``resume=auto`` (or ``resume=<run>``)
with a config that differs from the run's ``config.yaml`` in anything but what may change
between the parts of one run (:data:`MAY_CHANGE`) is refused, naming the differing keys, before
anything is written; ``resume=force`` continues anyway (the tracker still records the changed
params in the MLflow tag ``sat.resume.changed_params``). ``config.yaml`` holds the config with
its secrets masked (:func:`config_yaml`), and a resume compares it with the new config masked
the same way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError

# keys (or sections, ending in '.') a resumed run may change: its length, where it logs, how
# often it checkpoints, threads, and the resume setting itself
MAY_CHANGE = ("resume", "max_steps", "run.name", "trainer.num_threads", "checkpoint.", "tracking.")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: value}


def differences(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for every key whose value differs, except :data:`MAY_CHANGE`."""
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in MAY_CHANGE or key.startswith(tuple(p for p in MAY_CHANGE if p.endswith("."))):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            shown = key if key.isprintable() else repr(key)  # one line, whatever the file holds
            out.append(f"{shown}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"[:200])
    return out


def config_yaml(cfg) -> str:
    """The run's ``config.yaml`` text: ``cfg`` (an OmegaConf config) with its secrets masked
    (``config.to_yaml``): the run folder and the MLflow artifact never hold a credential; a
    resume compares masked with masked, so a rotated credential is no difference."""
    from sat_cli.config import to_yaml

    return to_yaml(cfg)


def check_same_config(run_dir: Path, new: dict, resume: str | None) -> None:
    """Refuse (``UserError``) to resume ``run_dir`` with a config that differs from its
    ``config.yaml``, unless ``resume == "force"``; a run without ``config.yaml`` passes."""
    path = Path(run_dir) / "config.yaml"
    if resume == "force" or not os.path.lexists(path):  # a dangling link is read (refused)
        return
    from sat_cli.util.safe_yaml import read_yaml

    old = read_yaml(path, "the config.yaml sat wrote")  # bounded: size, depth, nodes
    if not isinstance(old, dict):
        raise UserError(f"{path} is not the config sat wrote (not a mapping)")
    from sat_cli.tracking.params import redact_config

    diff = differences(old, redact_config(new))  # config.yaml holds secrets masked
    if diff:
        shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise UserError(
            f"resume: the config differs from the run's {path} in {len(diff)} key(s): {shown}. "
            "Resuming would mix two experiments in one run: choose another run.name, or "
            "continue anyway with resume=force"
        )
