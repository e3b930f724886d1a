"""Typed inputs outside the Hydra config: every command-line option and argument of `sat` and
every environment variable it reads is parsed by one of the specs here.

``Num`` (an integer or a number: finite, within bounds, with units where natural: ``90s``,
``2m``, ``1.5h`` for seconds; ``512MB``, ``16GB`` for gigabytes) and ``Text`` (a path, a host,
``HOST:PORT``, a URI, ``KEY=VALUE``, one of some choices, a name: never a control character, a
NUL byte, undecodable bytes or more than ``max_len`` characters). A spec is the ``parser`` of a
typer option (``sat_cli.cli.guard.opt`` / ``arg``), so a bad value is refused before the
command runs, as one ``sat: error:`` line with exit code 2 (``cli.guard.SatGroup``), and
:func:`env` reads an environment variable with the same rules (:class:`OptionError`, a
``UserError``).

Declaring an input here is what covers it: ``tests/test_input_surfaces.py`` lists every option
of every command (from typer) and every environment variable read in ``sat_cli`` (from the
source) and fails for one without a spec; the fuzz harness draws hostile values for each spec.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from sat_cli.errors import UserError


class OptionError(UserError):
    """A command-line option or environment variable with a bad value (exit 2)."""


_UNITS = {
    "s": {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0},
    "min": {"": 1.0, "m": 1.0, "min": 1.0, "h": 60.0},
    "GB": {"": 1.0, "gb": 1.0, "g": 1.0, "mb": 1e-3, "m": 1e-3, "tb": 1e3, "t": 1e3},
}
_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class _Parser:
    """A typer ``parser``: the value, or ``BadParameter`` with the one-line reason."""

    def parse(self, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.parse(value)
        except ValueError as exc:
            import typer  # the command line's error type (this module imports no CLI)

            raise typer.BadParameter(str(exc)) from None


@dataclass(frozen=True)
class Num(_Parser):
    """An integer (``kind=int``) or a finite number in ``[lo, hi]`` (``lo_open``: ``> lo``);
    ``unit`` ``s``, ``min`` or ``GB`` also takes the suffixes of ``_UNITS``."""

    kind: type = float
    lo: float | None = None
    hi: float | None = None
    unit: str | None = None
    lo_open: bool = False

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        unit = f" ({self.unit})" if self.unit else ""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            if self.kind is int:
                return f"{what} in {_fmt(lo)}-{_fmt(hi)}{unit}"
            return f"{what} in {'(' if self.lo_open else '['}{_fmt(lo)}, {_fmt(hi)}]{unit}"
        if lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {_fmt(lo)}{unit}"
        return f"{what} <= {_fmt(hi)}{unit}" if hi is not None else what + unit

    def parse(self, value: Any) -> int | float:
        """The value, or ``ValueError`` with a one-line reason."""
        if isinstance(value, bool):
            raise ValueError(f"expected {self.describe()}, got {value!r}")
        if isinstance(value, int | float):
            x, scale = value, 1.0
        else:
            text = _text(value)
            m = _NUMBER.fullmatch(text)
            scales = {k.lower(): v for k, v in _UNITS.get(self.unit or "", {"": 1.0}).items()}
            if not m or m.group(2).lower() not in scales:
                raise ValueError(f"expected {self.describe()}, got {text[:80]!r}")
            num, scale = m.group(1), scales[m.group(2).lower()]
            if len(num) > 400:
                raise ValueError(f"expected {self.describe()}, got a {len(num)}-digit number")
            integral = self.kind is int and scale == 1.0 and re.fullmatch(r"[-+]?\d+", num)
            x = int(num) if integral else float(num)
        x = x * scale if scale != 1.0 else x
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"expected {self.describe()}, got {value!r} (not finite)")
        if self.kind is int:
            if isinstance(x, float):
                if not x.is_integer():
                    raise ValueError(f"expected {self.describe()}, got {value!r}")
                x = int(x)
        else:
            x = float(x)
        if self.lo is not None and (x < self.lo or (self.lo_open and x == self.lo)):
            raise ValueError(f"expected {self.describe()}, got {value!r}")
        if self.hi is not None and x > self.hi:
            raise ValueError(f"expected {self.describe()}, got {value!r}")
        return x


def _text(value: Any) -> str:
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes of argv the locale could not decode: lone surrogates
        try:  # under an ASCII (C/POSIX) locale UTF-8 bytes arrive so too: they are fine
            return os.fsencode(text).decode("utf-8")
        except (UnicodeError, ValueError):
            raise ValueError(f"{text[:80]!r} is not valid UTF-8") from None
    return text


@dataclass(frozen=True)
class Text(_Parser):
    """A string of kind ``path``, ``host``, ``endpoint`` (HOST:PORT), ``uri``, ``keyvalue``
    (KEY=VALUE), ``choice`` (one of ``choices``), ``line`` (any printable line) or ``name``
    (letters, digits and ``._-@/:``)."""

    kind: str = "line"
    choices: tuple[str, ...] = ()
    max_len: int = 4096

    def describe(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return {"endpoint": "HOST:PORT", "keyvalue": "KEY=VALUE"}.get(self.kind, f"a {self.kind}")

    def parse(self, value: Any) -> str:
        text = _text(value)
        if len(text) > self.max_len:
            raise ValueError(
                f"{text[:40]!r}… is {len(text)} characters long, at most {self.max_len}"
            )
        if _CONTROL.search(text):
            raise ValueError(f"{text[:80]!r} has a control character")
        if self.kind == "choice" and text not in self.choices:
            raise ValueError(f"{text[:80]!r}: choose {self.describe()}")
        if self.kind in ("path", "host", "endpoint", "uri") and not text.strip():
            raise ValueError(f"expected {self.describe()}, got an empty string")
        if self.kind == "host" and not re.fullmatch(r"[A-Za-z0-9.:\-\[\]%_]+", text):
            raise ValueError(f"{text[:80]!r} is not a host name or address")
        if self.kind == "endpoint":
            host, sep, port = text.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"expected HOST:PORT (port 1-65535), got {text[:80]!r}")
        if self.kind == "keyvalue" and not re.fullmatch(r"[A-Za-z_][\w.\-]*=.*", text, re.S):
            raise ValueError(f"expected KEY=VALUE, got {text[:80]!r}")
        if self.kind == "name" and not re.fullmatch(r"[\w.@/:+\-]+", text):
            raise ValueError(f"{text[:80]!r} is not a name (letters, digits, ._-@/:+)")
        return text


Spec = Num | Text
PORT = Num(int, 1, 65535)
SECONDS = Num(float, 0, 7 * 86400, unit="s", lo_open=True)
COUNT = Num(int, 1, 1_000_000)
PATH, HOST, URI, LINE = Text("path"), Text("host"), Text("uri"), Text("line")
OVERRIDE = Text("line", max_len=100_000)


# Every environment variable `sat` reads, with its spec; variables a launcher sets for the
# processes it starts (torchrun) are listed apart: a user does not type them.
ENV: dict[str, Spec] = {
    "SAT_SWEEP_GRACE_S": Num(float, 0, 3600, unit="s"),
    "SAT_CONF_DIR": PATH,
    "SAT_DATA_DIR": Text("line"),
    "SAT_SGLANG_PYTHON": PATH,
    "SAT_SGLANG_CPU_SKIP": Text("line"),
    # a file in /proc/cpuinfo's format read instead of /proc/cpuinfo (CPU model, vendor and ISA
    # flags: sat_cli.numerics.cpu_info); tests fake a CPU kind with it
    "SAT_CPUINFO": PATH,
    "SAT_MEGATRON_CORE_OPTIMIZER": Text("choice", ("0", "1")),
    "TMPDIR": PATH,
    "CUDA_VISIBLE_DEVICES": Text("line"),
    # extra variables Ray actors get beside the allow-list, comma-separated (cluster/ray_env.py)
    "SAT_RAY_ENV": Text("line"),
    "HF_HUB_OFFLINE": Text("line"),  # a true value: hub ids resolve from the cache only
    "PATH": Text("line", max_len=1 << 16),  # passed on to a tool sandbox (envs/sandbox.py)
}
ENV_FROM_LAUNCHERS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def env(name: str, default: Any = None) -> Any:
    """``$name`` parsed by its spec in :data:`ENV` (``default`` when unset or empty);
    :class:`OptionError` naming the variable for a bad value."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return ENV[name].parse(raw)
    except ValueError as exc:
        raise OptionError(f"${name}: {exc}") from None
