"""The overrides of a sweep file, read with Hydra's own override parser: the key an override
sets (``override_key``), a list of overrides checked (``override_list``), an axis counted
without enumerating it (``axis_size``) and expanded into its values (``expand_axis``), and
layers of overrides merged, a later one of the same key replacing the earlier
(``merge_overrides``). Every problem is a one-line ``UserError`` naming where it is."""

from __future__ import annotations

from typing import Any

from sat_cli.errors import UserError


def override_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def override_key(parser, text: str, where: str) -> str:
    """The key an override sets (``algo``, ``trainer.lr``, ``algo@pkg``); UserError if unparsable."""
    from hydra.errors import HydraException

    try:
        ov = parser.parse_override(text)
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{where}: cannot parse override {text!r}: {first}") from None
    if ov.is_sweep_override():
        raise UserError(
            f"{where}: {text!r} is a sweep (several values); put it under `axes:` instead"
        )
    return ov.key_or_group + (f"@{ov.package}" if ov.package else "")


def override_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, list):
        raise UserError(
            f"{where}: expected a list of overrides (e.g. [algo=grpo, clip=ppo]), got {value!r}"
        )
    out = []
    for item in value:
        if not isinstance(item, str) or "=" not in item and not item.startswith("~"):
            raise UserError(f"{where}: {item!r} is not an override of the form key=value")
        out.append(item.strip())
    return out


def axis_size(parser, key: str, value: Any, where: str) -> int:
    """How many values an axis has, from Hydra's parsed sweep object (a range is never
    enumerated); UserError for an axis that is not a finite, reproducible list."""
    import math

    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from hydra.errors import HydraException

    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return 1  # refused with its own message by expand_axis
    try:
        ov = parser.parse_override(f"{key}={value}")
        sweep = ov.value() if ov.is_sweep_override() else None
    except HydraException:
        return 1  # _expand_axis names the parse error
    if sweep is None:
        return 1
    if getattr(sweep, "shuffle", False):
        raise UserError(
            f"{where}: shuffle() gives another order each time; a sweep's runs must "
            "be the same at every invocation (resume, the sweep id)"
        )
    if isinstance(sweep, IntervalSweep):
        raise UserError(f"{where}: interval() is a continuous range, not a list of values")
    if isinstance(sweep, ChoiceSweep):
        return len(sweep.list)
    if isinstance(sweep, RangeSweep):
        start, stop, step = sweep.start, sweep.stop, sweep.step
        nums = (start, stop, step)
        if step == 0 or not all(math.isfinite(x) for x in nums):
            raise UserError(f"{where}: range({start}, {stop}, {step}) has no finite list of values")
        if all(isinstance(x, int) for x in nums):  # exact for any size (len(range) is not)
            q, r = divmod(stop - start, step)
            return max(0, q + (r != 0))
        ratio = (stop - start) / step
        if not math.isfinite(ratio):  # e.g. range(0, 1e308, 1e-308)
            raise UserError(
                f"{where}: range({start}, {stop}, {step}) has more values than any sweep can hold"
            )
        return max(0, math.ceil(ratio))
    return 1  # glob(): bounded by the option files; expanded (or refused) by expand_axis


def expand_axis(parser, key: str, value: Any, where: str) -> list[str]:
    from hydra.errors import HydraException

    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(
            f'{where}: give a Hydra sweep string such as "1,8" or "range(0,3)", got {value!r}'
        )
    text = f"{key}={value}"
    try:
        ov = parser.parse_override(text)
        if ov.is_sweep_override():
            values = list(ov.sweep_string_iterator())
        else:
            values = [str(value)]
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{where}: cannot expand {text!r}: {first}") from None
    if not values:
        raise UserError(f"{where}: {text!r} expands to no values")
    if len(set(values)) != len(values):
        raise UserError(f"{where}: {text!r} repeats a value")
    return values


def merge_overrides(
    parser, layers: list[tuple[str, list[str]]]
) -> tuple[list[str], dict[str, str]]:
    """Concatenate override layers; a later override of the same key replaces the earlier one."""
    merged: dict[str, str] = {}
    source: dict[str, str] = {}
    for where, overrides in layers:
        for ov in overrides:
            key = override_key(parser, ov, where)
            merged.pop(key, None)  # keep the order in which the final values were given
            merged[key] = ov
            source[key] = where
    return list(merged.values()), source
