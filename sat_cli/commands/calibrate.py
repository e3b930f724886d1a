"""`sat calibrate-control RUN`: the dose-matched "smaller step" control of the collapse study.

A uniformly tighter clip controls for "any smaller step" only if it takes as much as SAT does.
This command measures both on the same data, with `sat replay` (docs/replay.md):

1. **SAT's dose**: RUN's recorded stream replayed with ``clip=sat``; per step, the fraction of
   active tokens the PPO interval clips (``loss/clipfrac``) plus the fraction only SAT's
   contracted interval clips (``sat/clipfrac_sat_band``); the dose is the mean over the steps.
2. **The control's dose at a radius scale ``s``**: the stream replayed with ``clip=ppo_tight
   clip.radius_scale=s`` (PPO at ``s`` x the algorithm's own radii); the mean ``loss/clipfrac``.
3. **The match**: the scale is searched by bisection on ``log s`` in ``[S_MIN, 1]`` (the clipped
   fraction grows as ``s`` shrinks), ``iters`` replays; the scale whose dose is nearest SAT's is
   chosen. Every replay measured is listed, so the choice can be checked.

Written atomically to ``RUN/control_calibration.json``: SAT's dose, each scale tried with its
dose, the chosen scale and the control arm's overrides. The replays are ordinary runs of the
recorded run's experiment (``<RUN>-calib-sat``, ``<RUN>-calib-s<scale>``; a later calibration of
the same run ``<RUN>-calib2-…``, so the command can be re-run and the result is replaced).
Everything is checked before the first replay: the recording, the result's folder (writable,
``RUN/control_calibration.json`` a regular file if it exists), the replays' folder; a run
recorded with ``tracking=none`` is calibrated through a private store, ``RUN/calibration/mlflow.db``.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from sat_cli import metric_names as M
from sat_cli.errors import UserError

S_MIN = 0.05  # the smallest radius scale searched (0.2 -> 0.01)
RESULT = "control_calibration.json"
MAX_STEM = 200  # characters of the replays' name stem (a file name holds 255 bytes)


def mean_dose(clipfrac: list[float], band: list[float] | None = None) -> float:
    """Mean over steps of the clipped fraction (plus SAT's band, step by step, when given)."""
    if not clipfrac or (band is not None and len(band) != len(clipfrac)):
        raise UserError("calibrate-control: a replay logged no clip fractions to compare")
    vals = clipfrac if band is None else [a + b for a, b in zip(clipfrac, band, strict=True)]
    return sum(vals) / len(vals)


def search_scale(measure: Callable[[float], float], target: float, iters: int):
    """``(chosen scale, [(scale, dose), ...])``: bisection on ``log s`` in ``[S_MIN, 1]`` for
    ``measure(s) = target``, ``measure`` decreasing in ``s``; the nearest dose measured wins."""
    lo, hi = math.log(S_MIN), 0.0
    tried: list[tuple[float, float]] = []
    for _ in range(iters):
        s = float(f"{math.exp((lo + hi) / 2):.4g}")
        dose = measure(s)
        tried.append((s, dose))
        if dose < target:  # too little clipped: a smaller scale
            hi = math.log(s)
        else:
            lo = math.log(s)
    best = min(tried, key=lambda t: (abs(t[1] - target), -t[0]))
    return best[0], tried


def _history(uri: str, run_id: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    pts = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return [m.value for m in sorted(pts, key=lambda m: m.step)]


def _replay(run: str, given: list[str]) -> tuple[str, str]:
    """One `sat replay` in this process: ``(tracking uri, MLflow run id)``."""
    from sat_cli.commands.replay import prepare
    from sat_cli.commands.train import train

    cfg, obj, recording = prepare(run, given)
    st = train(cfg, obj, given, replay=recording)
    return obj.tracking.uri, st.mlflow_run_id


def safe_name(run: str) -> str:
    """The replays' name stem: the recorded run's folder name (resolved: ``runs/sat/rec/.``
    and ``./rec/`` are ``rec``), every character outside ``[A-Za-z0-9._-]`` as ``_``, at most
    :data:`MAX_STEM` characters (room for ``-calibN-s0.1234`` within a file name)."""
    name = Path(os.path.abspath(run)).name
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".-") or "run"
    return stem[:MAX_STEM]


def _free_tag(root: Path, stem: str) -> str:
    """``calib`` for the first calibration of a run, ``calib2``, ``calib3``… for the next ones:
    the replays of an earlier calibration are kept and never block a new one."""
    for k in range(1, 10_000):
        tag = "calib" if k == 1 else f"calib{k}"
        if not any(root.glob(f"{glob.escape(stem)}-{tag}-s*")):
            return tag
    raise UserError(f"calibrate-control: {root} holds 9999 calibrations of {stem}")


def _plan(run: str, steps: int | None) -> tuple[list[str], str]:
    """``(the overrides every replay takes, the replays' name prefix)``, checked before any
    replay: the argument is a recorded run, its result can be written, the replays' folder
    is usable; a run recorded without tracking gets a private store in its own folder
    (``RUN/calibration/mlflow.db``: the doses are read back from the replays' metrics)."""
    from sat_cli.commands.replay import prepare
    from sat_cli.tracking.store import is_disabled_uri
    from sat_cli.util.fsio import check_output_dir

    folder = Path(run)
    if not folder.is_dir():
        raise UserError(f"calibrate-control: {run} is not a run folder")
    dest = folder / RESULT
    if os.path.lexists(dest) and not (dest.is_file() and not dest.is_symlink()):
        raise UserError(
            f"calibrate-control: the result {dest} exists and is not a regular file; "
            "move it away first"
        )
    check_output_dir(folder, "calibrate-control: the result's folder")
    common = [f"max_steps={steps}"] if steps is not None else []
    _, obj, _ = prepare(run, [*common, "clip=sat"])  # the recording, checked (reads only)
    if obj.tracking.backend == "none" or is_disabled_uri(obj.tracking.uri):
        store = folder.resolve() / "calibration" / "mlflow.db"
        check_output_dir(store.parent, "calibrate-control: the private store's folder")
        common += ["tracking.backend=mlflow", f"tracking.uri=sqlite:///{store}"]
    root = Path(obj.run.dir) / obj.run.experiment
    check_output_dir(root, "calibrate-control: the replays' folder")
    stem = safe_name(run)
    return common, f"{stem}-{_free_tag(root, stem)}"


def calibrate_control(run: str, iters: int = 6, steps: int | None = None, log=print) -> dict:
    """The calibration of the module docstring; returns what it writes to ``RUN/RESULT``."""
    if iters < 1:
        raise UserError(f"calibrate-control: --iters must be >= 1, got {iters}")
    if steps is not None and steps < 1:
        raise UserError(f"calibrate-control: --steps must be >= 1, got {steps}")
    common, name = _plan(run, steps)
    uri, rid = _replay(run, [*common, "clip=sat", f"run.name={name}-sat"])
    target = mean_dose(_history(uri, rid, M.CLIPFRAC), _history(uri, rid, M.SAT_BAND))
    log(f"calibrate-control: SAT's dose (PPO-clipped + SAT band) {target:.6g}")

    def measure(s: float) -> float:
        over = [*common, "clip=ppo_tight", f"clip.radius_scale={s}", f"run.name={name}-s{s}"]
        u, r = _replay(run, over)
        dose = mean_dose(_history(u, r, M.CLIPFRAC))
        log(f"calibrate-control: radius scale {s}: clipped {dose:.6g} (target {target:.6g})")
        return dose

    scale, tried = search_scale(measure, target, iters)
    result = {
        "run": str(run),
        "sat_dose": target,
        "tried": [{"radius_scale": s, "dose": d} for s, d in tried],
        "radius_scale": scale,
        "control_overrides": ["clip=ppo_tight", f"clip.radius_scale={scale}"],
    }
    from sat_cli.util.fsio import atomic_write_json

    atomic_write_json(Path(run) / RESULT, result)
    arm = " ".join(result["control_overrides"])
    log(f"calibrate-control: the control is {arm} ({Path(run) / RESULT})")
    return result
