"""Typed checks of the JSON records `sat` writes and reads back (its state files).

A state file that parses as JSON can still be of the wrong shape: a list instead of an object,
``"step": null``, a negative version, ``NaN`` in a counter. Every state file is checked against
its schema here when it is read, so a damaged one is named (file, field, what was expected, what
was found) before anything uses a value of it:

* :data:`LOOP_STATE` — ``checkpoints/step_N/loop_state.json`` (``sat_cli.checkpoints.state``);
* :data:`TRAINER_STATE` — ``checkpoints/step_N/trainer/trainer_state.json`` (both trainers);
* :data:`MANIFEST` — ``checkpoints/step_N/manifest.json`` (``sat_cli.checkpoints.manifest``);
* :data:`SWEEP_STATE` and :data:`SWEEP_RUN` — ``<sweep>/sweep_state.json`` and
  ``<run>/sweep_run.json`` (``sat_cli.sweep.state``).

A schema is built from :class:`Int`, :class:`Num` (finite), :class:`Bool`, :class:`Str`,
:class:`ListOf`, :class:`MapOf` and :class:`Obj` (named fields; unknown fields are allowed, so an
older `sat` reads a newer file). ``check(schema, value)`` returns None or a one-line reason;
``read_json(path, schema)`` reads a regular file (never a FIFO) and raises :class:`RecordError`
(a ``ValueError``) with that reason.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


class RecordError(ValueError):
    """A state file that cannot be read or does not have the shape of its schema."""


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = (
        json.dumps(value) if isinstance(value, str | int | float | bool) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


class _Spec:
    null = False
    what = "a value"

    def check(self, value: Any, where: str) -> str | None:
        if value is None:
            return None if self.null else f"{where}: expected {self.what}, got null"
        return self._check(value, where)

    def _check(self, value: Any, where: str) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError


class Int(_Spec):
    def __init__(self, lo: int | None = 0, hi: int | None = None, *, null: bool = False):
        self.lo, self.hi, self.null = lo, hi, null
        self.what = "an integer" + (f" >= {lo}" if lo is not None else "")

    def _check(self, value, where):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{where}: expected {self.what}, got {_show(value)}"
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            return f"{where}: {value} is out of range (expected {self.what})"
        return None


class Num(_Spec):
    """A finite number (an int or a float; NaN and infinity are refused)."""

    def __init__(self, lo: float | None = None, *, null: bool = False):
        self.lo, self.null = lo, null
        self.what = "a finite number" + (f" >= {lo}" if lo is not None else "")

    def _check(self, value, where):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{where}: expected {self.what}, got {_show(value)}"
        if not math.isfinite(value) or (self.lo is not None and value < self.lo):
            return f"{where}: {value} is out of range (expected {self.what})"
        return None


class Bool(_Spec):
    what = "true or false"

    def __init__(self, *, null: bool = False):
        self.null = null

    def _check(self, value, where):
        return (
            None
            if isinstance(value, bool)
            else f"{where}: expected {self.what}, got {_show(value)}"
        )


class Str(_Spec):
    what = "a string"

    def __init__(self, *, null: bool = False, choices: tuple[str, ...] | None = None):
        self.null, self.choices = null, choices

    def _check(self, value, where):
        if not isinstance(value, str):
            return f"{where}: expected {self.what}, got {_show(value)}"
        if self.choices is not None and value not in self.choices:
            return f"{where}: {_show(value)} is not one of {', '.join(self.choices)}"
        return None


class ListOf(_Spec):
    def __init__(self, item: _Spec, *, length: int | None = None, null: bool = False):
        self.item, self.length, self.null = item, length, null
        self.what = "a list" + (f" of {length}" if length is not None else "")

    def _check(self, value, where):
        if not isinstance(value, list):
            return f"{where}: expected {self.what}, got {_show(value)}"
        if self.length is not None and len(value) != self.length:
            return f"{where}: expected {self.what}, got {len(value)} items"
        for i, v in enumerate(value):
            err = self.item.check(v, f"{where}[{i}]")
            if err:
                return err
        return None


class MapOf(_Spec):
    """An object with any keys, each value of one kind."""

    what = "an object"

    def __init__(self, item: _Spec, *, null: bool = False):
        self.item, self.null = item, null

    def _check(self, value, where):
        if not isinstance(value, dict):
            return f"{where}: expected {self.what}, got {_show(value)}"
        for k, v in value.items():
            err = self.item.check(v, f"{where}.{k}")
            if err:
                return err
        return None


class Obj(_Spec):
    """An object with named fields (``required`` must be present; unknown fields are allowed)."""

    what = "an object"

    def __init__(self, fields: dict[str, _Spec], required: tuple[str, ...] = (), *, null=False):
        self.fields, self.required, self.null = fields, required, null

    def _check(self, value, where):
        if not isinstance(value, dict):
            return f"{where}: expected {self.what}, got {_show(value)}"
        for k in self.required:
            if k not in value:
                return f"{where}: the field {k!r} is missing"
        for k, spec in self.fields.items():
            if k in value:
                err = spec.check(value[k], f"{where}.{k}" if where else k)
                if err:
                    return err
        return None


def check(schema: _Spec, value: Any, name: str = "") -> str | None:
    """None if ``value`` has the shape of ``schema``, else a one-line reason."""
    err = schema.check(value, name)
    return err.lstrip(".: ") if err else None


def read_json(path: str | os.PathLike, schema: _Spec) -> Any:
    """The JSON value of ``path`` checked against ``schema``; :class:`RecordError` otherwise
    (also for a file that is not a regular file: a FIFO is never opened for reading)."""
    from sat_cli.util.fsio import read_regular_bytes

    name = os.path.basename(os.fspath(path))
    try:
        value = json.loads(read_regular_bytes(path))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RecordError(
            f"{name} is unreadable ({type(exc).__name__}: {str(detail)[:120]})"
        ) from None
    err = check(schema, value)
    if err:
        raise RecordError(f"{name}: {err}")
    return value


def read_checked(path: str | os.PathLike, schema: _Spec, *, what: str, error) -> Any:
    """The JSON value of a user's file through the bounded reader
    (:func:`sat_cli.util.readers.read_json`: regular file, size, depth, finite numbers), of the
    shape of ``schema``; ``error(message)`` otherwise (the caller's user error)."""
    from sat_cli.util.readers import read_json as read_bounded

    value = read_bounded(path, what=what, error=error)
    err = check(schema, value)
    if err:
        raise error(f"{what}: {err}")
    return value


# ----------------------------------------------------------------------------- the schemas

_COUNT = Num(0)
LOOP_STATE = Obj(
    {
        "step": Int(0),
        "pending": ListOf(ListOf(Int(0), length=2)),  # [[batch, version], ...]
        "published": ListOf(Int(0)),
        "engine_version": Int(0),
        "min_needed": Int(0),
        "finished": Bool(),
        "mlflow_run_id": Str(null=True),
        "counters": MapOf(_COUNT),
        "eval": Obj(
            {
                "best": Num(null=True),
                "best_step": Int(0, null=True),
                "last": Num(null=True),
                "last_step": Int(0, null=True),
                "key": Str(null=True),
            }
        ),
    },
    required=("step",),
)

_PARAM_GROUP = Obj(
    {"params": ListOf(Int(0)), "lr": Num(0), "betas": ListOf(Num(), length=2), "eps": Num(0)},
    required=("params",),
)
TRAINER_STATE = Obj(
    {
        "step_count": Int(0),
        "param_groups": ListOf(_PARAM_GROUP),  # megatron with its own optimizer: []
        "backend": Str(choices=("megatron",)),
        "world_size": Int(1),
        "ep": Int(1),
        "tp": Int(1),
        "pp": Int(1),
        "dtype": Str(),
    },
    required=("step_count", "param_groups"),
)

MANIFEST = Obj(
    {
        "format": Int(1),
        "files": MapOf(Obj({"size": Int(0), "sha256": Str()}, required=("size", "sha256"))),
    },
    required=("files",),
)

_RUN_RECORD = {
    "name": Str(),
    "method": Str(),
    "axes": MapOf(Str()),
    "seed": Int(0),
    "overrides": ListOf(Str()),
    "override_hash": Str(),
}
SWEEP_RUN = Obj(_RUN_RECORD)
SWEEP_STATE = Obj(
    {
        "runs": MapOf(
            Obj(
                {
                    **_RUN_RECORD,
                    "status": Str(choices=("running", "finished", "failed", "killed")),
                    "attempts": Int(0),
                    "pid": Int(1, null=True),
                    "returncode": Int(None, null=True),
                    "checkpoint_step": Int(0, null=True),
                    "wall_s": Num(null=True),
                    "executor": Str(),
                    "job_id": Str(null=True),
                }
            )
        ),
        "parents": MapOf(Str(null=True)),
        "invocations": Int(0),
    }
)
