"""`sat sweep`: a grid of `sat train` runs, resumable, grouped under one MLflow parent run.

A sweep file (YAML; format in docs/sweeps.md) names a grid::

    name: smoke                          # MLflow experiment and folder <run.dir>/<name>/
    base: [experiment=cpu_smoke]         # overrides of every run
    axes: {lag: "1,8"}                   # Hydra sweep strings, expanded as a Cartesian product
    methods:                             # ordered named variants (the rows of `sat report`)
      GRPO: [algo=grpo, clip=ppo]
      SAT-GRPO: [algo=grpo, clip=sat]
    seeds: [0]

Each run is ``base + method + axis point + CLI overrides`` (a later override of the same key
replaces an earlier one) ``+ seed=S run.name=<method>-<axes>-s<S> run.experiment=<name>
resume=auto``. Its *override hash* is the SHA-256 of the sorted override list; the *sweep id*
is ``<name>-<10 hex of the SHA-256 of every run's override list>``. Axes are expanded with
Hydra's ``OverridesParser`` and ``sweep_string_iterator`` (``1,8``, ``choice(…)``,
``range(…)``), as Hydra's basic sweeper does, but no multirun launcher is involved: each run is
a ``sat train`` subprocess (``python -m sat_cli.cli train …``, an argument list), ``--jobs`` of
them at once, each in its own process group, its output in
``<run.dir>/<name>/<run>/logs/sweep_child.log``.

Every run is composed and validated with :func:`sat_cli.config.load` before anything starts; a
bad sweep file or a run that does not compose raises :class:`UserError` (exit 2) naming the
run and the problem.

State: ``<run.dir>/<name>/sweep_state.json`` (atomic writes) records each run's overrides,
hash, status, attempts and exit code, and the parent MLflow run of each sweep id. Re-running a
sweep skips finished runs (their latest checkpoint's ``loop_state.json`` says
``"finished": true``), resumes interrupted ones from their last checkpoint (``resume=auto``
with a fixed ``run.name`` continues the same MLflow run) and reruns failed ones. A run folder
started with other overrides is refused rather than resumed with a changed config
(``<run>/sweep_run.json`` holds the hash it was started with). A lock file keeps two sweeps of
one name from running in the same folder at once.

MLflow: a parent run ``sweep-<name>`` in experiment ``<name>`` with tags ``sat.sweep_id``,
``sat.sweep_role=parent``, the method order, axes and seeds, and artifacts ``sweep/runs.json``
(every run's name, method, axis point, seed, overrides, hash) and the sweep file. Children get
the overrides ``++tracking.tags.{sweep_id,override_hash,method,parent_run_id}=…``, which
``sat train`` logs as tags (``mlflow.parentRunId`` nests them); no environment variable carries
configuration.

Ctrl-C (or SIGTERM, or SIGHUP): SIGINT to each child's process group, a grace period
(``SAT_SWEEP_GRACE_S``, default 30 s; a second Ctrl-C cuts it short), then SIGKILL; the parent
run ends KILLED and the command exits 130. Runs that failed make the command exit 1 after the
others are done.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sat_cli.errors import RunFailed, UserError

SWEEP_KEYS = ("name", "base", "axes", "methods", "seeds")
REQUIRED_KEYS = ("name", "axes", "methods", "seeds")
RESERVED = ("seed", "run.name", "run.experiment", "resume")  # set by the sweep for each run
STATE_FILE = "sweep_state.json"
RUN_RECORD = "sweep_run.json"
CHILD_LOG = "sweep_child.log"
DEFAULT_GRACE_S = 30.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a sweep: children stopped, parent run KILLED, exit 130."""


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
        return {
            "name": self.name,
            "method": self.method,
            "axes": dict(self.axes),
            "seed": self.seed,
            "overrides": list(self.overrides),
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

    @property
    def id(self) -> str:
        blob = json.dumps([r.overrides for r in self.runs], separators=(",", ":"))
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def override_hash(overrides: list[str]) -> str:
    """SHA-256 (hex) of the sorted override list, JSON-encoded."""
    blob = json.dumps(sorted(overrides), separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def slug(text: str) -> str:
    """Lower-case file-name form: runs of other characters than ``a-z0-9.+`` become ``-``."""
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")


# ----------------------------------------------------------------------------- parse / expand


def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _override_key(parser, text: str, where: str) -> str:
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


def _override_list(value: Any, where: str) -> list[str]:
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


def _expand_axis(parser, key: str, value: Any, where: str) -> list[str]:
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


def _merge(parser, layers: list[tuple[str, list[str]]]) -> tuple[list[str], dict[str, str]]:
    """Concatenate override layers; a later override of the same key replaces the earlier one."""
    merged: dict[str, str] = {}
    source: dict[str, str] = {}
    for where, overrides in layers:
        for ov in overrides:
            key = _override_key(parser, ov, where)
            merged.pop(key, None)  # keep the order in which the final values were given
            merged[key] = ov
            source[key] = where
    return list(merged.values()), source


def load_sweep(path: str | os.PathLike, cli_overrides: list[str] | None = None) -> Sweep:
    """Read and expand a sweep file. UserError names the problem (and the key or run)."""

    p = Path(path)
    if not p.is_file():
        raise UserError(f"sweep file {str(p)!r} does not exist")
    from sat_cli.safe_yaml import read_yaml

    doc = read_yaml(p, "a sweep file is a short list of overrides")
    if not isinstance(doc, dict):
        raise UserError(f"{p}: a sweep file is a mapping with keys {', '.join(SWEEP_KEYS)}")
    unknown = sorted(set(doc) - set(SWEEP_KEYS))
    if unknown:
        raise UserError(
            f"{p}: unknown key(s) {', '.join(map(repr, unknown))}; a sweep file has "
            f"{', '.join(SWEEP_KEYS)} (base is optional)"
        )
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise UserError(
            f"{p}: missing key(s) {', '.join(missing)}; a sweep file has {', '.join(SWEEP_KEYS)} "
            "(axes may be {} for no grid)"
        )
    name = doc["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{p}: name must be a folder-safe word ([A-Za-z0-9_.-]), got {name!r}")
    parser = _parser()
    base = _override_list(doc.get("base"), f"{p}: base")
    cli = _override_list(list(cli_overrides or []), "command-line overrides")

    axes_doc = doc["axes"]
    if axes_doc is None:
        axes_doc = {}
    if not isinstance(axes_doc, dict):
        raise UserError(f'{p}: axes must be a mapping key -> sweep string, e.g. {{lag: "1,8"}}')
    for k in axes_doc:
        if str(k) in RESERVED:
            raise UserError(
                f"{p}: axes.{k} sets {str(k)!r}, which the sweep sets for each run "
                "(use seeds: [..] for seeds)"
            )
    axes = {str(k): _expand_axis(parser, str(k), v, f"{p}: axes.{k}") for k, v in axes_doc.items()}

    methods_doc = doc["methods"]
    if not isinstance(methods_doc, dict) or not methods_doc:
        raise UserError(
            f"{p}: methods must be a non-empty mapping name -> overrides, "
            "e.g. {GRPO: [algo=grpo, clip=ppo]}"
        )
    methods = {str(m): _override_list(v, f"{p}: methods.{m}") for m, v in methods_doc.items()}
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

    # keys the sweep owns, and axis keys that would be silently overridden
    axis_keys = {_override_key(parser, f"{k}={v[0]}", f"{p}: axes.{k}") for k, v in axes.items()}
    layers = [("base", base), *((f"methods.{m}", o) for m, o in methods.items()), ("cli", cli)]
    for where, overrides in layers:
        label = "command-line overrides" if where == "cli" else f"{p}: {where}"
        for ov in overrides:
            key = _override_key(parser, ov, label)
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

    sweep = Sweep(
        name=name,
        file=str(p),
        base=base,
        axes=axes,
        methods=methods,
        seeds=list(seeds),
        cli_overrides=cli,
    )
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
                overrides, _ = _merge(
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


# ----------------------------------------------------------------------------- validation


@dataclass
class Plan:
    """A validated sweep: the composed settings that the launcher needs."""

    sweep: Sweep
    root: Path  # <run.dir>/<name>
    run_dir: str  # run.dir shared by all runs
    tracking_uri: str | None  # None: tracking off
    run_dirs: dict[str, Path]
    needs_warm_start: list[SweepRun]  # one representative run per distinct warm-start config


def validate(sweep: Sweep, log=None) -> Plan:
    """Compose every run with :func:`sat_cli.config.load`; UserError names the first bad run."""
    from sat_cli.config import ConfigError, load

    run_dirs: dict[str, Path] = {}
    dirs: dict[str, str] = {}
    uris: dict[str | None, str] = {}
    warm: dict[str, SweepRun] = {}
    for i, run in enumerate(sweep.runs):
        if log and len(sweep.runs) > 20 and i and i % 20 == 0:
            log(f"  composed {i}/{len(sweep.runs)} runs")
        try:
            _, obj = load(run.overrides)
        except ConfigError as exc:
            raise UserError(
                f"{sweep.file}: run {run.name!r} (method {run.method!r}) does not compose: {exc}"
            ) from None
        dirs.setdefault(obj.run.dir, run.name)
        uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
        if uri is not None and uri.strip().lower() in ("", "none", "off", "disabled"):
            uri = None
        uris.setdefault(uri, run.name)
        run_dirs[run.name] = Path(obj.run.dir) / obj.run.experiment / obj.run.name
        _check_model_path(sweep, run, obj)
        if obj.model.kind == "tiny" and not obj.model.path:
            key = json.dumps([obj.run.dir, repr(obj.model), obj.task.digits])
            warm.setdefault(key, run)
    if len(dirs) > 1:
        raise UserError(
            f"{sweep.file}: all runs of a sweep share one run.dir; runs "
            f"{', '.join(repr(n) for n in dirs.values())} use {', '.join(map(repr, dirs))}"
        )
    if len(uris) > 1:
        raise UserError(
            f"{sweep.file}: all runs of a sweep log to one tracking store; runs "
            f"{', '.join(repr(n) for n in uris.values())} use different tracking settings"
        )
    run_dir = next(iter(dirs))
    return Plan(
        sweep=sweep,
        root=Path(run_dir) / sweep.name,
        run_dir=run_dir,
        tracking_uri=next(iter(uris)),
        run_dirs=run_dirs,
        needs_warm_start=list(warm.values()),
    )


def _check_model_path(sweep: Sweep, run: SweepRun, obj) -> None:
    """A local model.path must be an HF folder (hub ids of model=hf are left to the run)."""
    p = obj.model.path
    if not p:
        return
    # a hub id looks like "org/name"; absolute, ./relative or existing paths are local
    local = obj.model.kind != "hf" or p.startswith(("/", ".", "~")) or Path(p).exists()
    if local and not (Path(p) / "config.json").is_file():
        raise UserError(
            f"{sweep.file}: run {run.name!r}: model.path={p!r} is not an HF checkpoint folder "
            "(no config.json)"
        )


# ----------------------------------------------------------------------------- status


def checkpoint_status(run_dir: Path) -> tuple[bool, int | None]:
    """(finished, step of the latest complete checkpoint or None)."""
    from sat_cli.loop.state import CheckpointError, latest_checkpoint, read_loop_state

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return False, None
    try:
        st = read_loop_state(ckpt)
    except CheckpointError:
        return False, None
    return bool(st.get("finished")), int(st.get("step", 0))


def _recorded_hash(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_RECORD).read_text()).get("override_hash")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def run_status(run: SweepRun, run_dir: Path, state: dict) -> str:
    """``finished`` | ``resume (step N)`` | ``conflict`` | ``rerun (failed|killed)`` | ``pending``."""
    finished, step = checkpoint_status(run_dir)
    rec = _recorded_hash(run_dir)
    if step is not None and rec is not None and rec != run.hash:
        return "conflict"
    if finished:
        return "finished"
    if step is not None:
        return f"resume (step {step})"
    prev = state.get("runs", {}).get(run.name, {}).get("status")
    if prev in ("failed", "killed", "running"):
        return f"rerun ({'interrupted' if prev == 'running' else prev})"
    return "pending"


def _still_running(name: str, rec: dict) -> int | None:
    """The pid of a child left running by an earlier sweep that died (its command names the run)."""
    pid = rec.get("pid")
    if rec.get("status") != "running" or not isinstance(pid, int):
        return None
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if f"run.name={name}".encode() in cmd else None


def read_state(root: Path) -> dict:
    path = root / STATE_FILE
    if path.is_dir():
        raise UserError(f"sweep state {path} is a folder; remove it (or pick another run.dir)")
    if not path.is_file():
        return {"runs": {}, "parents": {}, "invocations": 0}
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read sweep state {path}: {exc}; delete it to start over") from None
    state.setdefault("runs", {})
    state.setdefault("parents", {})
    state.setdefault("invocations", 0)
    return state


def _write_state(root: Path, state: dict) -> None:
    from sat_cli.loop.state import atomic_write_json

    state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write_json(root / STATE_FILE, state)


@contextlib.contextmanager
def _lock(root: Path):
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".sweep.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"another `sat sweep` is running in {root} (lock {root / '.sweep.lock'})"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- printing


def format_plan(plan: Plan, statuses: dict[str, str]) -> str:
    s = plan.sweep
    grid = " × ".join([f"{len(s.methods)} methods"] + [f"{k}({len(v)})" for k, v in s.axes.items()])
    lines = [
        f"sweep {s.name}  id {s.id}  ({s.file})",
        f"{len(s.runs)} runs = {grid} × {len(s.seeds)} seeds; folder {plan.root}",
        f"base: {' '.join(s.base + s.cli_overrides) or '(none)'}",
    ]
    w_name = max(len(r.name) for r in s.runs)
    w_meth = max(len(r.method) for r in s.runs)
    w_stat = max(len(v) for v in statuses.values())
    lines.append(
        f"{'#':>3}  {'name':<{w_name}}  {'method':<{w_meth}}  {'status':<{w_stat}}  overrides"
    )
    base_set = set(s.base + s.cli_overrides)
    for i, r in enumerate(s.runs, 1):
        own = [
            o for o in r.overrides if o not in base_set and not o.startswith(("run.", "resume="))
        ]
        lines.append(
            f"{i:>3}  {r.name:<{w_name}}  {r.method:<{w_meth}}  {statuses[r.name]:<{w_stat}}  "
            + " ".join(own)
        )
    counts: dict[str, int] = {}
    for v in statuses.values():
        counts[v.split(" ")[0]] = counts.get(v.split(" ")[0], 0) + 1
    lines.append("status: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    return "\n".join(lines)


def _conflict_message(plan: Plan, run: SweepRun) -> str:
    d = plan.run_dirs[run.name]
    try:
        old = json.loads((d / RUN_RECORD).read_text()).get("overrides", [])
    except (OSError, json.JSONDecodeError):
        old = []
    gone = sorted(set(old) - set(run.overrides))
    new = sorted(set(run.overrides) - set(old))
    return (
        f"run {run.name!r} in {d} was started with other overrides (was: {' '.join(gone) or '-'}; "
        f"now: {' '.join(new) or '-'}); resuming it would mix two configs. Re-run the sweep with "
        "the original overrides, pick another run.dir=…, or delete that folder."
    )


# ----------------------------------------------------------------------------- children


@dataclass
class _Child:
    run: SweepRun
    proc: subprocess.Popen
    log: Any
    started: float


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def hydra_quote(text: str) -> str:
    """``text`` as a Hydra quoted value that composes back to exactly ``text`` (names with
    spaces, commas, quotes or backslashes; ``${`` is refused where the names are read)."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def tag_overrides(sweep_id: str, run: SweepRun, parent_run_id: str | None) -> list[str]:
    """The overrides that give a child its sweep tags (``tracking.tags``; see the schema)."""
    tags = {"sweep_id": sweep_id, "override_hash": run.hash, "method": run.method}
    if parent_run_id:
        tags["parent_run_id"] = parent_run_id
    return [f"++tracking.tags.{k}={hydra_quote(v)}" for k, v in tags.items()]


def _launch(cmd: list[str], log_path: Path, env: dict[str, str], header: str) -> tuple:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed when the child ends
    f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n$ {' '.join(cmd)}\n")
    f.flush()
    proc = subprocess.Popen(
        cmd,
        stdout=f,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # own process group: Ctrl-C reaches it only through us
    )
    return proc, f


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_children(children: list[_Child], grace_s: float, log) -> None:
    """SIGINT to each child's process group, wait up to ``grace_s``, then SIGKILL the rest."""
    alive = [c for c in children if c.proc.poll() is None]
    if not alive:
        return
    log(f"stopping {len(alive)} run(s): SIGINT, then SIGKILL after {grace_s:.0f} s")
    for c in alive:
        _signal_group(c.proc, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    try:
        while any(c.proc.poll() is None for c in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        log("second interrupt: killing now")
    for c in alive:
        if c.proc.poll() is None:
            _signal_group(c.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=10)
        # the group may hold grandchildren (engine process) that outlived the child
        _signal_group(c.proc, signal.SIGKILL)


def _tail(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    | " + line for line in lines[-n:])


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through a subprocess
    if signum == signal.SIGHUP:  # the terminal is gone: do not let a write to it fail the stop
        from sat_cli.signals import _detach_terminal

        _detach_terminal()
    raise SweepInterrupted()


# ----------------------------------------------------------------------------- parent run


def _open_parent(plan: Plan, state: dict, log):
    """The parent MLflow run of this sweep id (continued when the state names one)."""
    from sat_cli.tracking import Tracker, TrackingError

    s = plan.sweep
    if plan.tracking_uri is None:
        return None
    tags = {
        "sat.sweep_id": s.id,
        "sat.sweep_name": s.name,
        "sat.sweep_role": "parent",
        "sat.sweep_methods": json.dumps(list(s.methods)),
        "sat.sweep_axes": json.dumps(list(s.axes)),
        "sat.sweep_seeds": json.dumps(s.seeds),
        "sat.sweep_file": s.file,
    }
    params = {
        "sweep.file": s.file,
        "sweep.runs": str(len(s.runs)),
        "sweep.base": json.dumps(s.base),
        "sweep.cli_overrides": json.dumps(s.cli_overrides),
        "sweep.axes": json.dumps(s.axes),
        "sweep.seeds": json.dumps(s.seeds),
    }
    prev = state["parents"].get(s.id)
    try:
        tr = Tracker(
            plan.tracking_uri, s.name, f"sweep-{s.name}", run_id=prev, tags=tags, params=params
        )
    except TrackingError:
        if prev is None:
            raise
        log(f"parent run {prev} is gone from the store; starting a new one")
        tr = Tracker(plan.tracking_uri, s.name, f"sweep-{s.name}", tags=tags, params=params)
    from sat_cli.loop.final_status import apply_pending

    apply_pending(Path(plan.run_dir), tr, log)
    tr.log_dict([r.record() for r in s.runs], "sweep/runs.json")
    tr.log_artifact(s.file, "sweep")
    return tr


# ----------------------------------------------------------------------------- main


def run_sweep(sweep_file: str, overrides: list[str], *, jobs: int, dry_run: bool) -> None:
    """`sat sweep`: expand, validate, then run (or list with ``dry_run``) the grid."""
    log = _printer()
    sweep = load_sweep(sweep_file, overrides)
    plan = validate(sweep, log=log)
    state = read_state(plan.root)
    statuses = {r.name: run_status(r, plan.run_dirs[r.name], state) for r in sweep.runs}
    if dry_run:
        log(format_plan(plan, statuses))
        return
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    from sat_cli.loop.preflight import check_output_dir

    check_output_dir(plan.root, "sweep folder")
    conflicts = [r for r in sweep.runs if statuses[r.name] == "conflict"]
    if conflicts:
        raise UserError(_conflict_message(plan, conflicts[0]))
    with _lock(plan.root):
        _run_locked(plan, read_state(plan.root), jobs, log)


def _printer():
    def log(msg: str = "") -> None:
        print(msg, flush=True)

    return log


def _run_locked(plan: Plan, state: dict, jobs: int, log) -> None:
    sweep = plan.sweep
    orphans = {n: pid for n, rec in state["runs"].items() if (pid := _still_running(n, rec))}
    if orphans:
        raise UserError(
            "runs of an earlier `sat sweep` of this name are still running: "
            + ", ".join(f"{n} (pid {pid})" for n, pid in orphans.items())
            + "; wait for them or stop them (kill -INT -<pid> stops a run and its engine)"
        )
    state.update(sweep_id=sweep.id, name=sweep.name, file=sweep.file)
    state["invocations"] = int(state.get("invocations", 0)) + 1
    statuses = {r.name: run_status(r, plan.run_dirs[r.name], state) for r in sweep.runs}
    todo = [r for r in sweep.runs if statuses[r.name] != "finished"]
    log(format_plan(plan, statuses))
    grace = float(os.environ.get("SAT_SWEEP_GRACE_S", DEFAULT_GRACE_S))

    previous = {sig: signal.signal(sig, _on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
    parent = None
    children: dict[str, _Child] = {}
    outcome = "KILLED"
    t0 = time.perf_counter()
    results: dict[str, str] = {}
    try:
        parent = _open_parent(plan, state, log)
        parent_id = parent.run_id if parent is not None else None
        if parent_id:
            state["parents"][sweep.id] = parent_id
        _write_state(plan.root, state)
        if not todo:
            log(f"all {len(sweep.runs)} runs are finished; nothing to do")
        elif jobs > 1 and plan.needs_warm_start:
            _warm_start(plan, log)
        queue = deque(todo)
        done = 0
        while queue or children:
            while queue and len(children) < jobs:
                run = queue.popleft()
                children[run.name] = _start_child(plan, state, run, parent_id, log)
            time.sleep(0.2)
            for name, child in list(children.items()):
                rc = child.proc.poll()
                if rc is None:
                    continue
                del children[name]
                if rc != 0:  # a crashed child may leave its engine process behind in its group
                    _signal_group(child.proc, signal.SIGKILL)
                done += 1
                results[name] = _finish_child(plan, state, child, rc, done, len(todo), log)
        failed = [n for n, v in results.items() if v != "finished"]
        outcome = "FAILED" if failed else "FINISHED"
        if parent is not None:
            finished_all = sum(checkpoint_status(plan.run_dirs[r.name])[0] for r in sweep.runs)
            parent.log_metrics(
                {
                    "sweep/runs_finished": finished_all,
                    "sweep/runs_failed": len(failed),
                    "sweep/wall_s": time.perf_counter() - t0,
                },
                step=state["invocations"],
            )
        _summary(plan, results, time.perf_counter() - t0, log)
        if failed:
            raise RunFailed(
                f"{len(failed)} of {len(todo)} run(s) did not finish: "
                f"{', '.join(f'{n} ({results[n]})' for n in failed)}; logs: "
                f"<run>/logs/{CHILD_LOG} under {plan.root}. Re-run the same command to retry "
                "them (finished runs are skipped)."
            )
    except KeyboardInterrupt:
        outcome = "KILLED"
        stop_children(list(children.values()), grace, log)
        for child in children.values():
            _finish_child(plan, state, child, child.proc.returncode, 0, 0, log, interrupted=True)
        children.clear()
        raise SweepInterrupted() from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children.values():  # an unexpected error: do not leave orphans behind
            stop_children([child], 5.0, log)
        if parent is not None:
            from sat_cli.loop.final_status import end_run

            end_run(parent, outcome, Path(plan.run_dir), log)
        _write_state(plan.root, state)


def _warm_start(plan: Plan, log) -> None:
    """Build the warm-start cache once before parallel runs would race to build it."""
    for run in plan.needs_warm_start:
        train_only = [o for o in run.overrides if o != "resume=auto"]
        # --use-shipped: the same warm start `sat train` (and so --jobs 1) uses — the shipped
        # checkpoint when its key matches — not `sat pretrain`'s rebuild from scratch
        cmd = [sys.executable, "-m", "sat_cli.cli", "pretrain", "--use-shipped", *train_only]
        log_path = plan.root / "logs" / "pretrain.log"
        log(f"warm start (once, before parallel runs): log {log_path}")
        proc, f = _launch(cmd, log_path, dict(os.environ), "sat pretrain")
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            _signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            _signal_group(proc, signal.SIGKILL)
            raise
        finally:
            f.close()
        if rc != 0:
            raise RunFailed(f"warm start failed (exit {rc}); see {log_path}\n{_tail(log_path)}")


def _start_child(plan: Plan, state: dict, run: SweepRun, parent_id: str | None, log) -> _Child:
    from sat_cli.loop.state import atomic_write_json

    run_dir = plan.run_dirs[run.name]
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / RUN_RECORD, {**run.record(), "sweep_id": plan.sweep.id})
    tags = tag_overrides(plan.sweep.id, run, parent_id)
    cmd = [sys.executable, "-m", "sat_cli.cli", "train", *run.overrides, *tags]
    log_path = run_dir / "logs" / CHILD_LOG
    rec = state["runs"].setdefault(run.name, {})
    rec.update(
        run.record(),
        status="running",
        attempts=int(rec.get("attempts", 0)) + 1,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        log=str(log_path),
    )
    proc, f = _launch(cmd, log_path, _child_env(), f"sweep attempt {rec['attempts']}")
    rec["pid"] = proc.pid
    _write_state(plan.root, state)
    log(f"start  {run.name}  ({run.method}; pid {proc.pid}; log {log_path})")
    return _Child(run, proc, f, time.perf_counter())


def _finish_child(
    plan: Plan, state: dict, child: _Child, rc, done: int, total: int, log, *, interrupted=False
) -> str:
    child.log.close()
    finished, step = checkpoint_status(plan.run_dirs[child.run.name])
    wall = time.perf_counter() - child.started
    if finished and rc == 0:
        status = "finished"
    elif interrupted or rc in (130, 143, -signal.SIGINT, -signal.SIGKILL, -signal.SIGTERM):
        status = "killed"
    else:
        status = "failed"
    rec = state["runs"].setdefault(child.run.name, {})
    rec.update(
        status=status,
        returncode=rc,
        ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_s=round(wall, 1),
        checkpoint_step=step,
    )
    rec.pop("pid", None)
    _write_state(plan.root, state)
    where = f"[{done}/{total}] " if total else ""
    if status == "finished":
        log(f"{where}done   {child.run.name}  in {wall:.0f} s")
    else:
        log(
            f"{where}{status.upper()} {child.run.name}  (exit {rc}) after {wall:.0f} s; "
            f"last checkpoint: {step if step is not None else 'none'}; log "
            f"{plan.run_dirs[child.run.name] / 'logs' / CHILD_LOG}"
        )
        if status == "failed":
            log(_tail(plan.run_dirs[child.run.name] / "logs" / CHILD_LOG))
    return status


def _summary(plan: Plan, results: dict[str, str], wall: float, log) -> None:
    s = plan.sweep
    n_done = sum(checkpoint_status(plan.run_dirs[r.name])[0] for r in s.runs)
    log("")
    log(
        f"sweep {s.id}: {n_done}/{len(s.runs)} runs finished ({len(results)} ran now, {wall:.0f} s)"
    )
    uri = f" --tracking-uri {plan.tracking_uri}" if plan.tracking_uri else ""
    if plan.tracking_uri:
        log(f"table and plots: sat report {s.id}{uri}")
