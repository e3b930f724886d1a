"""Sweep files: reading, checking and expanding them into runs (``load_sweep``; the overrides
and axes are parsed in :mod:`sat_cli.sweep.overrides`), and the run record (``SweepRun``) with
its override hash and name slug.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError
from sat_cli.sweep.overrides import (
    axis_size,
    expand_axis,
    merge_overrides,
    override_key,
    override_list,
    override_parser,
)

# a sweep file's keys; each registered executor with settings has a section too (slurm, ray),
# after max_runs
OPTIONAL_KEYS = ("max_runs", "replay", "clean_tree")
SWEEP_KEYS = ("name", "base", "axes", "methods", "seeds", *OPTIONAL_KEYS)
REQUIRED_KEYS = ("name", "axes", "methods", "seeds")
RESERVED = ("seed", "run.name", "run.experiment", "resume")  # set by the sweep for each run
# runs a grid may have unless its file says more (`max_runs:`): each is composed before the
# sweep starts (about 0.1-0.3 s a run), and a typo such as range(0,10**9) must not hang it
DEFAULT_MAX_RUNS = 2000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class SweepRun:
    """One `sat train` run of the grid."""

    name: str
    method: str
    axes: dict[str, str]  # axis key -> value (as Hydra's sweep iterator writes it)
    seed: int
    overrides: list[str]  # the full argument list after `sat train`
    hash: str  # sha256 of the sorted override list

    def record(self) -> dict[str, Any]:
        """What the sweep's state, each run's ``sweep_run.json`` and the parent run's artifact
        hold: the overrides masked (``redact_text``; collisions compare ``override_hash``)."""
        from sat_cli.tracking.params import redact_text

        return {
            "name": self.name,
            "method": self.method,
            "axes": dict(self.axes),
            "seed": self.seed,
            "overrides": [redact_text(o) for o in self.overrides],
            "override_hash": self.hash,
        }


@dataclass
class Sweep:
    """A parsed, expanded sweep file (not yet validated against the config schema)."""

    name: str
    file: str
    base: list[str]
    axes: dict[str, list[str]]
    methods: dict[str, list[str]]
    seeds: list[int]
    cli_overrides: list[str]
    runs: list[SweepRun] = field(default_factory=list)
    # executor settings of `--executor slurm|ray` (sat_cli/sweep/executor.py); not in the id
    executors: dict[str, dict] = field(default_factory=dict)
    replay: str | None = None  # a recorded run: every run is `sat replay <it> …` (docs/replay.md)
    # a pre-registered study: refuse to run from a git tree with changes (sat_cli/sweep/clean_tree.py)
    clean_tree: bool = False

    @property
    def id(self) -> str:
        runs = [r.overrides for r in self.runs] + ([self.replay] if self.replay else [])
        blob = json.dumps(runs, separators=(",", ":"))
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


SANE_MAX_RUNS = 10**6  # above it a grid's size is a typo (range(0,10**9)), not a plan


def _count(n: int) -> str:
    """A grid's or an axis's size for a message: exact up to 10^15, then ``1.23e+130``."""
    return str(n) if n < 10**15 else f"{float(n):.3g}" if n < 10**308 else "more than 1e308"


def override_hash(overrides: list[str]) -> str:
    """SHA-256 (hex) of the sorted override list, JSON-encoded."""
    blob = json.dumps(sorted(overrides), separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def slug(text: str) -> str:
    """Lower-case file-name form: runs of other characters than ``a-z0-9.+`` become ``-``."""
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")


# ----------------------------------------------------------------------------- load


def sweeps_dir() -> Path:
    """The project's sweep files: ``sat_cli/sweeps/``, package data (a wheel carries them; in a
    checkout it is a link to the top-level ``sweeps/``, as ``sat_cli/conf`` is to ``conf/``)."""
    return (Path(__file__).resolve().parents[1] / "sweeps").resolve()


def named_sweeps() -> dict[str, Path]:
    d = sweeps_dir()
    return {f.stem: f for f in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


def sweep_listing() -> str:
    """``name  first line of its description`` for every sweep file of :func:`sweeps_dir`."""
    rows = []
    for name, f in named_sweeps().items():
        comments = [ln[1:].strip() for ln in f.read_text().splitlines() if ln.startswith("#")]
        about = next((c for c in comments if c and not c.startswith("sat ")), "")
        rows.append(f"{name:<28} {about[:90]}")
    return "\n".join(rows) + "\n" if rows else f"no sweep files in {sweeps_dir()}\n"


def resolve_sweep(path: str | os.PathLike) -> Path:
    """``path``, or the project's sweep file it names: ``paper_table1`` (``sat sweep --list``), or
    ``sweeps/paper_table1.yaml`` as the docs write it, from a folder that has no such file (an
    installed ``sat`` outside the checkout)."""
    p = Path(path)
    if p.exists():
        return p
    shipped = named_sweeps()
    if p.suffix == "" and len(p.parts) == 1 and str(p) in shipped:
        return shipped[str(p)]
    if p.parts[:1] == ("sweeps",) and len(p.parts) == 2 and p.suffix == ".yaml":
        return shipped.get(p.stem, p)
    return p


def load_sweep(path: str | os.PathLike, cli_overrides: list[str] | None = None) -> Sweep:
    """Read and expand a sweep file (a path, or a name of ``sat sweep --list``). UserError names
    the problem (and the key or run)."""

    p = resolve_sweep(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        hint = "" if p.exists() else " (the project's sweep files by name: sat sweep --list)"
        raise UserError(f"sweep file {str(p)!r} {what}{hint}")
    from sat_cli.util.safe_yaml import read_yaml

    doc = read_yaml(p, "a sweep file is a short list of overrides")
    from sat_cli.sweep.registry import EXECUTORS

    sections = [k for k in EXECUTORS.names() if EXECUTORS.get(k).keys]
    at = SWEEP_KEYS.index("max_runs") + 1
    keys = ", ".join((*SWEEP_KEYS[:at], *sections, *SWEEP_KEYS[at:]))
    if not isinstance(doc, dict):
        raise UserError(f"{p}: a sweep file is a mapping with keys {keys}")
    unknown = sorted(set(doc) - {*SWEEP_KEYS, *sections})
    if unknown:
        raise UserError(
            f"{p}: unknown key(s) {', '.join(map(repr, unknown))}; a sweep file has {keys} "
            f"(base, {' and '.join(sections)} are optional)"
        )
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise UserError(
            f"{p}: missing key(s) {', '.join(missing)}; a sweep file has {keys} "
            "(axes may be {} for no grid)"
        )
    name = doc["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{p}: name must be a folder-safe word ([A-Za-z0-9_.-]), got {name!r}")
    parser = override_parser()
    base = override_list(doc.get("base"), f"{p}: base")
    cli = override_list(list(cli_overrides or []), "command-line overrides")

    axes_doc = doc["axes"]
    if axes_doc is None:
        axes_doc = {}
    if not isinstance(axes_doc, dict):
        raise UserError(f'{p}: axes must be a mapping key -> sweep string, e.g. {{lag: "1,8"}}')
    for k in axes_doc:
        try:  # the key an axis sets (`+seed`, `++seed` and `seed@pkg` set seed too)
            key = override_key(parser, f"{k}=0", f"{p}: axes.{k}")
        except UserError:
            continue  # _expand_axis names the parse error
        if key.split("@")[0] in RESERVED:
            raise UserError(
                f"{p}: axes.{k} sets {key!r}, which the sweep sets for each run "
                "(use seeds: [..] for seeds)"
            )
    sizes = {str(k): axis_size(parser, str(k), v, f"{p}: axes.{k}") for k, v in axes_doc.items()}

    methods_doc = doc["methods"]
    if not isinstance(methods_doc, dict) or not methods_doc:
        raise UserError(
            f"{p}: methods must be a non-empty mapping name -> overrides, "
            "e.g. {GRPO: [algo=grpo, clip=ppo]}"
        )
    methods = {str(m): override_list(v, f"{p}: methods.{m}") for m, v in methods_doc.items()}
    for m in methods:
        if not m.strip() or "${" in m or any(ord(c) < 32 or ord(c) == 127 for c in m):
            raise UserError(
                f"{p}: method name {m!r}: a name must be non-empty and free of '${{' and control "
                "characters (it becomes an MLflow tag and a report row)"
            )

    seeds = doc["seeds"]
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise UserError(f"{p}: seeds must be a non-empty list of distinct integers >= 0")
    max_runs = doc.get("max_runs", DEFAULT_MAX_RUNS)
    if (
        isinstance(max_runs, bool)
        or not isinstance(max_runs, int)
        or not 1 <= max_runs <= SANE_MAX_RUNS
    ):
        raise UserError(
            f"{p}: max_runs must be an integer in [1, {SANE_MAX_RUNS}], got {str(max_runs)[:40]}"
        )
    total = len(methods) * len(seeds)
    for n in sizes.values():
        total *= n
    if total > max_runs:
        grid = " × ".join(
            [
                f"{len(methods)} methods",
                *(f"{k}({_count(n)})" for k, n in sizes.items()),
                f"{len(seeds)} seeds",
            ]
        )
        advice = (  # a size no machine composes is not worth a max_runs: it gets no advice to
            f", or set max_runs: {total} in the sweep file if you mean it"  # set it
            if total <= SANE_MAX_RUNS
            else f"; no sweep runs more than {SANE_MAX_RUNS} runs"
        )
        raise UserError(
            f"{p}: the grid has {_count(total)} runs ({grid}), more than max_runs={max_runs}; "
            f"every run is composed and checked before the sweep starts. Narrow an axis{advice}"
        )
    axes = {str(k): expand_axis(parser, str(k), v, f"{p}: axes.{k}") for k, v in axes_doc.items()}

    # keys the sweep owns, and axis keys that would be silently overridden
    axis_keys: dict[str, str] = {}
    for k, v in axes.items():
        key = override_key(parser, f"{k}={v[0]}", f"{p}: axes.{k}")
        if key in axis_keys:
            raise UserError(
                f"{p}: axes.{axis_keys[key]} and axes.{k} both set {key!r}; the later one would "
                "override the earlier in every run (the grid would repeat the same runs)"
            )
        axis_keys[key] = k
    layers = [("base", base), *((f"methods.{m}", o) for m, o in methods.items()), ("cli", cli)]
    for where, overrides in layers:
        label = "command-line overrides" if where == "cli" else f"{p}: {where}"
        for ov in overrides:
            key = override_key(parser, ov, label)
            if key in RESERVED:
                raise UserError(
                    f"{label}: {ov!r} sets {key!r}, which the sweep sets for each run "
                    "(seeds: for seed, name: for run.experiment; run.name and resume are fixed)"
                )
            if key in axis_keys:
                raise UserError(
                    f"{label}: {ov!r} sets {key!r}, which is an axis of the sweep; "
                    "change the axis values instead"
                )

    from sat_cli.sweep.executor import check_section

    sweep = Sweep(
        name=name,
        file=str(p),
        base=base,
        axes=axes,
        methods=methods,
        seeds=list(seeds),
        cli_overrides=cli,
        executors={
            k: check_section(str(p), k, doc.get(k), EXECUTORS.get(k).keys)
            for k in EXECUTORS.names()
            if EXECUTORS.get(k).keys
        },
    )
    replay = doc.get("replay")
    if replay is not None and (not isinstance(replay, str) or not replay.strip()):
        raise UserError(f"{p}: replay must be the folder of a recorded run, got {replay!r}")
    sweep.replay = replay
    clean = doc.get("clean_tree", False)
    if not isinstance(clean, bool):
        raise UserError(f"{p}: clean_tree must be true or false, got {clean!r}")
    sweep.clean_tree = clean
    sweep.runs = _expand(parser, sweep)
    return sweep


def _axis_labels(keys: list[str]) -> dict[str, str]:
    """Short labels for axis keys in run names: the last dotted part unless it is ambiguous."""
    short = {k: slug(k.split("@")[0].rsplit(".", 1)[-1]) for k in keys}
    counts: dict[str, int] = {}
    for s in short.values():
        counts[s] = counts.get(s, 0) + 1
    return {k: (s if counts[s] == 1 else slug(k).replace(".", "_")) for k, s in short.items()}


def _expand(parser, sweep: Sweep) -> list[SweepRun]:
    keys = list(sweep.axes)
    labels = _axis_labels(keys)
    points = [
        dict(zip(keys, vals, strict=True)) for vals in itertools.product(*sweep.axes.values())
    ]
    runs: list[SweepRun] = []
    names: dict[str, str] = {}
    for seed in sweep.seeds:
        for method, m_ovs in sweep.methods.items():
            for point in points:
                parts = [slug(method) or "run"]
                parts += [f"{labels[k]}{slug(v) or 'x'}" for k, v in point.items()]
                parts.append(f"s{seed}")
                name = "-".join(parts)
                desc = f"method {method!r}, axes {point}, seed {seed}"
                if name in names:
                    raise UserError(
                        f"{sweep.file}: two runs get the same name {name!r} ({names[name]} and "
                        f"{desc}); rename a method"
                    )
                names[name] = desc
                overrides, _ = merge_overrides(
                    parser,
                    [
                        ("base", sweep.base),
                        (f"methods.{method}", m_ovs),
                        ("axes", [f"{k}={v}" for k, v in point.items()]),
                        ("command-line overrides", sweep.cli_overrides),
                    ],
                )
                overrides += [
                    f"seed={seed}",
                    f"run.name={name}",
                    f"run.experiment={sweep.name}",
                    "resume=auto",
                ]
                runs.append(
                    SweepRun(name, method, point, seed, overrides, override_hash(overrides))
                )
    return runs
