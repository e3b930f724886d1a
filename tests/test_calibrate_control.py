"""`sat calibrate-control RUN` (sat_cli/commands/calibrate.py): the dose-matched control, by
replaying a recorded stream with SAT and with PPO at scaled radii."""

import json
import math
import os

import pytest

from sat_cli.commands.calibrate import S_MIN, mean_dose, search_scale
from sat_cli.errors import UserError
from tests.cli_helpers import run_sat


def test_mean_dose_adds_sats_band_step_by_step():
    assert mean_dose([0.1, 0.3]) == pytest.approx(0.2, abs=1e-15)
    assert mean_dose([0.1, 0.3], [0.05, 0.15]) == pytest.approx(0.3, abs=1e-15)
    for bad in (([], None), ([0.1], [0.1, 0.2])):
        with pytest.raises(UserError, match="no clip fractions"):
            mean_dose(*bad)


def test_search_scale_bisects_log_scale_and_keeps_the_nearest():
    calls = []

    def measure(s):  # a decreasing dose: 0.02 / s, capped at 1
        calls.append(s)
        return min(1.0, 0.02 / s)

    scale, tried = search_scale(measure, target=0.08, iters=8)  # exact answer s = 0.25
    assert [s for s, _ in tried] == calls and len(calls) == 8
    assert calls[0] == float(f"{math.sqrt(S_MIN):.4g}")  # the geometric middle of [S_MIN, 1]
    assert scale == pytest.approx(0.25, rel=0.02)
    assert all(S_MIN <= s <= 1 for s in calls)
    # every dose ties (a target no scale reaches): the mildest, largest scale tried
    scale, tried = search_scale(lambda s: 0.01, target=0.5, iters=3)
    assert scale == max(s for s, _ in tried)  # all doses tie: the largest scale (the mildest)


def test_bad_input_exits_2_before_any_replay(tmp_path):
    for args in (
        ["calibrate-control", str(tmp_path / "absent")],
        ["calibrate-control", str(tmp_path), "--iters", "0"],
    ):
        r = run_sat(*args, cwd=tmp_path, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "sat: error:" in r.stderr


@pytest.mark.slow
def test_calibration_on_a_recorded_run(tmp_path):
    """A recorded 3-step run (lag 2, a bf16 engine: small ratios spread around 1); 1 + 2
    replays: the JSON's doses are the replays' own logged clip fractions, the smaller scale
    clips more, and the control arm composes."""
    from mlflow import MlflowClient

    from sat_cli.config import load

    rec = ["experiment=cpu_smoke", "run.dir=runs", "lag=2", "engine.dtype=bfloat16", "clip=sat"]
    r = run_sat("train", *rec, "run.name=rec", "replay.record=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_sat("calibrate-control", "runs/sat/rec", "--iters", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "runs/sat/rec/control_calibration.json").read_text())
    c = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("sat").experiment_id
    runs = {x.info.run_name: x.info.run_id for x in c.search_runs([exp])}

    def values(name, key):
        pts = sorted(c.get_metric_history(runs[name], key), key=lambda m: m.step)
        return [m.value for m in pts]

    sat = mean_dose(
        values("rec-calib-sat", "loss/clipfrac"), values("rec-calib-sat", "sat/clipfrac_sat_band")
    )
    assert out["sat_dose"] == pytest.approx(sat, rel=1e-12) and sat > 0
    assert len(out["tried"]) == 2
    (s1, d1), (s2, d2) = [(t["radius_scale"], t["dose"]) for t in out["tried"]]
    assert s1 != s2 and (d1 - d2) * (s2 - s1) > 0, out  # the smaller scale clipped more
    for t in out["tried"]:
        got = mean_dose(values(f"rec-calib-s{t['radius_scale']}", "loss/clipfrac"))
        assert t["dose"] == pytest.approx(got, rel=1e-12)
    assert out["radius_scale"] in [t["radius_scale"] for t in out["tried"]]
    _, obj = load(out["control_overrides"])
    assert obj.algo.eps_low == pytest.approx(0.2 * out["radius_scale"], rel=1e-9)


def test_replay_names_are_derived_safely_from_the_argument(tmp_path):
    from sat_cli.commands.calibrate import MAX_STEM, safe_name

    (tmp_path / "rec").mkdir()
    assert safe_name(str(tmp_path / "rec")) == "rec"
    assert safe_name(str(tmp_path / "rec") + "/.") == "rec"  # the folder, not the text
    assert safe_name(str(tmp_path / "rec") + "/") == "rec"
    assert safe_name(str(tmp_path / "a b$(x);é")) == "a_b__x___"
    assert safe_name(str(tmp_path / "..hidden")) == "hidden"
    assert len(safe_name(str(tmp_path / ("x" * 255)))) == MAX_STEM


@pytest.mark.parametrize("how", ["folder", "fifo", "dangling-link"])
def test_the_destination_is_checked_before_anything_else(tmp_path, how):
    """A result path that cannot be replaced by a file is named first, before the recording is
    read and any replay runs (the command used to replay for minutes, then fail to write)."""
    run = tmp_path / "runs/sat/rec"
    run.mkdir(parents=True)
    dest = run / "control_calibration.json"
    if how == "folder":
        dest.mkdir()
    elif how == "fifo":
        os.mkfifo(dest)
    else:
        dest.symlink_to(tmp_path / "nowhere")
    r = run_sat("calibrate-control", "runs/sat/rec", "--iters", "1", cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("sat: error:") == 1 and "Traceback" not in r.stderr
    assert "control_calibration.json exists and is not a regular file" in r.stderr, r.stderr
    assert sorted(p.name for p in run.parent.iterdir()) == ["rec"]


@pytest.mark.slow
def test_a_run_recorded_without_tracking_is_calibrated_and_re_calibrated(tmp_path):
    """tracking.uri=none: the doses come from a private store in the run's folder; a second
    calibration runs (replays named calib2) and replaces the result; a result folder in the way
    is refused before any replay (nothing written)."""
    from mlflow import MlflowClient

    rec = ["experiment=cpu_smoke", "run.dir=runs", "lag=2", "engine.dtype=bfloat16", "clip=sat"]
    r = run_sat(
        "train", *rec, "run.name=rec", "replay.record=true", "tracking.uri=none", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    result = tmp_path / "runs/sat/rec/control_calibration.json"
    outs = []
    for _ in range(2):
        r = run_sat("calibrate-control", "runs/sat/rec/.", "--iters", "1", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(result.read_text()))
    names = sorted(p.name for p in (tmp_path / "runs/sat").iterdir())
    s = outs[0]["radius_scale"]
    assert names == [
        "rec",
        f"rec-calib-s{s}",
        "rec-calib-sat",
        f"rec-calib2-s{s}",
        "rec-calib2-sat",
    ]
    c = MlflowClient(f"sqlite:///{tmp_path / 'runs/sat/rec/calibration/mlflow.db'}")
    runs = {
        x.info.run_name: x.info.run_id
        for x in c.search_runs([c.get_experiment_by_name("sat").experiment_id])
    }
    for out, tag in zip(outs, ("calib", "calib2"), strict=True):
        pts = sorted(
            c.get_metric_history(runs[f"rec-{tag}-s{s}"], "loss/clipfrac"), key=lambda m: m.step
        )
        assert out["tried"][0]["dose"] == pytest.approx(
            mean_dose([m.value for m in pts]), rel=1e-12
        )
    assert outs[0] == outs[1]  # the same replays of the same recording
    result.unlink()
    result.mkdir()
    r = run_sat("calibrate-control", "runs/sat/rec", "--iters", "1", cwd=tmp_path)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "runs/sat").iterdir()) == names
