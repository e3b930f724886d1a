"""Validation of an expanded sweep (every run composed with ``sat_cli.config.load``) into a
:class:`Plan`, and the plan table that ``--dry-run`` and each start print.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError
from sat_cli.sweep.spec import Sweep, SweepRun
from sat_cli.sweep.state import RUN_RECORD

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
    # per run, from its device plan (sat_cli.devices): GPUs on its node, whether it needs CUDA
    # (a local engine/trainer or SGLang on cuda; Megatron alone also runs on the CPU), nodes
    gpus: dict[str, int] = field(default_factory=dict)
    cuda: dict[str, bool] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    # per run: the CPUs and host memory its processes need on its node (sat_cli.config.needs)
    needs: dict[str, Any] = field(default_factory=dict)


def validate(sweep: Sweep, log=None) -> Plan:
    """Compose every run with :func:`sat_cli.config.load`; UserError names the first bad run."""
    from sat_cli.config import ConfigError, load

    run_dirs: dict[str, Path] = {}
    dirs: dict[str, str] = {}
    uris: dict[str | None, str] = {}
    warm: dict[str, SweepRun] = {}
    seen: dict[str, SweepRun] = {}  # composed config -> the first run with it
    gpus: dict[str, int] = {}
    cuda: dict[str, bool] = {}
    nodes: dict[str, int] = {}
    needs: dict[str, Any] = {}
    for i, run in enumerate(sweep.runs):
        if log and len(sweep.runs) > 20 and i and i % 20 == 0:
            log(f"  composed {i}/{len(sweep.runs)} runs")
        try:
            if sweep.replay:  # `sat replay`'s own composition and checks (docs/replay.md)
                from sat_cli.commands.replay import prepare

                cfg, obj, _ = prepare(sweep.replay, run.overrides)
            else:
                cfg, obj = load(run.overrides, "train")
        except ConfigError as exc:
            raise UserError(
                f"{sweep.file}: run {run.name!r} (method {run.method!r}) does not compose: {exc}"
            ) from None
        twin = seen.setdefault(_config_key(cfg), run)
        if twin is not run:
            raise UserError(_collision_message(sweep, twin, run))
        dirs.setdefault(obj.run.dir, run.name)
        uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
        if uri is not None and uri.strip().lower() in ("", "none", "off", "disabled"):
            uri = None
        uris.setdefault(uri, run.name)
        run_dirs[run.name] = Path(obj.run.dir) / obj.run.experiment / obj.run.name
        _check_model_path(sweep, run, obj)
        gpus[run.name], cuda[run.name], nodes[run.name], needs[run.name] = _devices(obj)
        if obj.model.kind == "tiny" and not obj.model.path and not sweep.replay:
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
        gpus=gpus,
        cuda=cuda,
        nodes=nodes,
        needs=needs,
    )


def _devices(obj) -> tuple[int, bool, int, Any]:
    """(GPUs on node 0, needs CUDA, nodes, CPUs and host memory) of a run's device plan."""
    from sat_cli.config.devices import device_plan
    from sat_cli.config.needs import job_needs

    plan = device_plan(obj)
    ranks = obj.trainer.gpu_layout().get("torchrun", False)  # its torchrun ranks do not count
    cuda = any(p.gpus for p in plan.procs if not (ranks and p.role == "trainer"))
    placed = type(obj.launcher).places  # launcher=ray: the run places its own nodes
    nodes = 1 if placed else obj.trainer.gpu_layout()["nnodes"]
    return plan.needed().get(0, 0), cuda, nodes, job_needs(obj, plan)


def _config_key(cfg) -> str:
    """What makes a run what it is: its composed config without its name and MLflow tags."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    c["run"].pop("name", None)
    c["tracking"].pop("tags", None)
    return json.dumps(c, sort_keys=True, default=str)


def _sources(sweep: Sweep, run: SweepRun) -> list[tuple[str, str]]:
    """(where, override) for each override of a run, in the order they are applied."""
    layers = [("base", sweep.base), (f"methods.{run.method}", sweep.methods[run.method])]
    layers.append(("axes", [f"{k}={v}" for k, v in run.axes.items()]))
    layers.append(("command-line overrides", sweep.cli_overrides))
    return [(w, o) for w, ovs in layers for o in ovs] + [("seeds", f"seed={run.seed}")]


def _collision_message(sweep: Sweep, a: SweepRun, b: SweepRun) -> str:
    """Two runs of the grid compose to one config: name what differs between them and what
    makes the difference void (a later or more specific override of the same setting)."""
    from sat_cli.sweep.overrides import override_key, override_parser

    parser = override_parser()
    src_a, src_b = _sources(sweep, a), _sources(sweep, b)
    texts_a, texts_b = {o for _, o in src_a}, {o for _, o in src_b}
    differ = [(w, o) for w, o in src_a if o not in texts_b]
    differ += [(w, o) for w, o in src_b if o not in texts_a]
    keys = {override_key(parser, o, w).split("@")[0] for w, o in differ}
    void = [
        f"{w}: {o}"
        for w, o in src_a
        if (w, o) in src_b
        for k in [override_key(parser, o, w).split("@")[0]]
        if any(k == d or k.startswith(d + ".") or d.startswith(k + ".") for d in keys)
    ]
    what = ", ".join(f"{w}: {o}" for w, o in differ) or "nothing"
    why = (
        f"; {' and '.join(void)} sets the same setting in both, so the difference is void"
        if void
        else "; the difference changes nothing in the composed config"
    )
    return (
        f"{sweep.file}: runs {a.name!r} and {b.name!r} are the same config (they differ only in "
        f"{what}{why}). Remove the colliding override or the axis, so that every run of the grid "
        "is a different experiment"
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
    from sat_cli.tracking.params import redact_text

    return redact_text("\n".join(lines))  # the overrides: a URL's password, a secret key's value


def conflict_message(plan: Plan, run: SweepRun) -> str:
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
