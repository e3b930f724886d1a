"""Lag profiles (issue 33): parsing with hand-computed distributions, deterministic draws, the
loop's realised histogram against its target, ``empirical:`` from a table `sat` wrote, bad specs
(exit 2, one line, nothing written), and ``fixed:0`` / ``lag=0`` bit-identical to synchronous."""

from __future__ import annotations

import json

import pytest
import torch

from sat_cli.engines.base import SamplingParams
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.lag_profile import (
    PROFILE_TARGET_FILE,
    ProfileError,
    parse_profile,
    read_histogram,
    tv_distance,
)
from sat_cli.loop.publisher import future_versions
from sat_cli.loop.schedule import Every
from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
from tests.cli_helpers import run_sat
from tests.test_loop import Recorder, SevensTask, _trainer


def test_specs_give_hand_computed_distributions():
    assert parse_profile("fixed:2").pmf == (0.0, 0.0, 1.0)
    assert parse_profile("fixed:0").pmf == (1.0,)
    assert parse_profile("uniform:1-3").pmf == (0.0, 1 / 3, 1 / 3, 1 / 3)
    # 0.5, 0.25, 0.125 renormalised by 0.875
    assert parse_profile("geometric:0.5,max=2").pmf == pytest.approx((4 / 7, 2 / 7, 1 / 7))
    assert parse_profile("geometric:1,max=5").pmf == (1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert tv_distance((0.5, 0.5), [1, 3]) == pytest.approx(0.25)
    assert tv_distance((1.0,), [0, 2]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("geometric:1.5,max=3", "P must lie in (0, 1]"),
        ("geometric:0,max=3", "P must lie in (0, 1]"),
        ("geometric:0.5,max=-1", "max must be >= 0"),
        ("geometric:0.5", "geometric takes P,max=M"),
        ("geometric:x,max=2", "is not a number"),
        ("uniform:3-1", "needs A <= B"),
        ("fixd:1", "unknown profile 'fixd'"),
        ("fixed:", "expected fixed:K"),
        ("fixed:-2", "K must be >= 0"),
        ("empirical:/nonexistent/h.json", "does not exist"),
    ],
)
def test_bad_specs_are_named(spec, says):
    with pytest.raises(ProfileError) as err:
        parse_profile(spec)
    assert says in str(err.value) and spec in str(err.value)


def test_draws_are_deterministic_and_versions_exist_when_requested():
    prof = parse_profile("geometric:0.5,max=3")
    pol = LagPolicy(3, "fixed", profile=prof, seed=7, cells=8)
    assert pol.sample_versions(10) == pol.sample_versions(10)  # a function of (seed, k) only
    other = LagPolicy(3, "fixed", profile=prof, seed=8, cells=8)
    assert any(pol.sample_versions(k) != other.sample_versions(k) for k in range(5))
    for k in range(40):
        vs = pol.sample_versions(k)
        assert all(max(0, k - 3) <= v <= k for v in vs)
        # batch k is requested only once its newest version exists
        assert pol.can_submit(k, max(vs)) and (max(vs) == 0 or not pol.can_submit(k, max(vs) - 1))
        assert pol.batch_versions(k, k) <= future_versions(pol, k) | future_versions(pol, k - 1)
    # the window of versions kept on disk: the last max_lag + 1
    assert future_versions(pol, 10) == {7, 8, 9, 10}


def test_draws_follow_the_target():
    prof = parse_profile("geometric:0.5,max=3")
    counts = [0] * 4
    for k in range(500):
        for lag in prof.draws(0, k, 16):
            counts[lag] += 1
    assert tv_distance(prof.pmf, counts) < 0.02  # 8000 draws


def test_empirical_reads_numpy_edges_and_refuses_malformed(tmp_path):
    # numpy.histogram of lags {1, 2, 2} with bins = max + 1 (what log_histograms writes)
    good = tmp_path / "h.json"
    good.write_text(json.dumps({"edges": [1.0, 4 / 3, 5 / 3, 2.0], "counts": [1, 0, 2]}))
    assert read_histogram(good) == pytest.approx((0.0, 1 / 3, 2 / 3))
    # one value: numpy widens the range to [v - 0.5, v + 0.5]
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"edges": [0.5, 1.0, 1.5], "counts": [0, 5]}))
    assert read_histogram(one) == (0.0, 1.0)
    for name, body, says in [
        ("a", "[1, 2]", "'edges' and 'counts'"),
        ("b", '{"edges": [0, 1], "counts": [1, 2]}', "one longer"),
        ("c", '{"edges": [0.2, 0.8], "counts": [3]}', "exactly one lag"),
        ("d", '{"edges": [0, 1, 1], "counts": [1, 1]}', "increasing"),
        ("e", "{not json", "is not valid JSON"),
        ("f", '{"edges": [0, 1], "counts": [0]}', "every count is 0"),
    ]:
        p = tmp_path / f"{name}.json"
        p.write_text(body)
        with pytest.raises(ProfileError, match=says.replace("(", r"\(")):
            read_histogram(p)


def _profile_loop(
    tiny_dir, run_dir, lag: LagPolicy, steps: int, tracker, hist_every=0, engine=None
):
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    trainer = _trainer(tiny_dir)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=2, stop_token_ids=(trainer.tokenizer.eos_token_id,)
    )
    s = LoopSettings(
        max_steps=steps,
        prompts_per_step=2,
        group_size=4,
        sampling=sampling,
        lag=lag,
        run_dir=run_dir,
        seed=3,
        histograms=Every(hist_every),
    )
    own = engine is None
    engine = (
        LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0))
        if own
        else engine
    )
    try:
        parts = RunParts(engine, trainer, tracker, SevensTask(), trainer.tokenizer)
        st = TrainLoop(s, parts).run()
    finally:
        if own:
            engine.close()
    return st, trainer


def _expected_counts(lag: LagPolicy, steps: int) -> list[int]:
    """The realised lags the draws imply (clipped at version 0 in the first steps)."""
    want = [0] * (lag.profile.max_lag + 1)
    for k in range(steps):
        for v in lag.sample_versions(k):
            want[k - v] += 1
    return want


@pytest.mark.xdist_group("tiny_engine")
def test_geometric_profile_short_run(tiny_dir, tmp_path, tiny_engine):
    """12 steps x 8 samples of geometric:0.5,max=3: every sample's realised lag is its draw
    (the loop's own bookkeeping), staleness/lag_profile_tv is their TV distance to the target,
    the histogram holds one bin per lag, the target table is logged once and only the profile's
    version window stays on disk."""
    prof = parse_profile("geometric:0.5,max=3")
    lag = LagPolicy(3, "fixed", profile=prof, seed=3, cells=8)
    rec = Recorder()
    st, _ = _profile_loop(
        tiny_dir, tmp_path / "run", lag, 12, rec, hist_every=6, engine=tiny_engine
    )
    counts = st.lag_profile_counts
    assert counts == _expected_counts(lag, 12) and sum(counts) == 96
    assert rec.metrics[12]["staleness/lag_profile_tv"] == tv_distance(prof.pmf, counts)
    assert rec.metrics[12]["staleness/version_lag_max"] <= 3
    hist = rec.values[("staleness/lag_profile", 7)]  # the lags of steps 0..6
    assert len(hist) == 7 * 8 and sorted(set(hist)) <= [0.0, 1.0, 2.0, 3.0]
    kept = sorted(int(p.name[1:]) for p in (tmp_path / "run" / "weights").iterdir())
    assert kept == [0, 9, 10, 11]  # v12 is never needed (no batch 12): not published
    # the target is logged once, at step 0, as the table empirical: reads back
    assert list(rec.dicts) == [PROFILE_TARGET_FILE]
    assert rec.dicts[PROFILE_TARGET_FILE] == prof.target_table()


@pytest.mark.slow
def test_geometric_profile_100_steps_matches_target_and_empirical_reads_its_tables(
    tiny_dir, tmp_path, monkeypatch
):
    """100 steps x 8 samples of geometric:0.5,max=3 with a real MLflow store: the realised
    histogram is within TV 0.06 of the target; empirical: reads back the tables the run wrote
    (staleness/version_lag of one step, the cumulative staleness/lag_profile, the target)."""
    from sat_cli.tracking import Tracker, TrackerSettings

    monkeypatch.chdir(tmp_path)
    prof = parse_profile("geometric:0.5,max=3")
    lag = LagPolicy(3, "fixed", profile=prof, seed=3, cells=8)
    with Tracker(TrackerSettings(f"sqlite:///{tmp_path / 'mlflow.db'}", "profiles"), "r") as tr:
        st, _ = _profile_loop(tiny_dir, tmp_path / "run", lag, 100, tr, hist_every=50)
    counts = st.lag_profile_counts
    assert counts == _expected_counts(lag, 100) and sum(counts) == 800
    assert tv_distance(prof.pmf, counts) < 0.06, counts
    (step51,) = tmp_path.rglob("tables/staleness/version_lag/step_51.json")
    draws = [50 - v for v in lag.sample_versions(50)]  # batch 50, consumed at step 50
    assert parse_profile(f"empirical:{step51}").pmf == pytest.approx(
        tuple(draws.count(j) / 8 for j in range(max(draws) + 1))
    )
    (cumul,) = tmp_path.rglob("tables/staleness/lag_profile/step_51.json")
    c51 = _expected_counts(lag, 51)
    assert parse_profile(f"empirical:{cumul}").pmf == pytest.approx(
        tuple(c / sum(c51) for c in c51)
    )
    (target,) = tmp_path.rglob("tables/staleness/lag_profile_target.json")
    assert parse_profile(f"empirical:{target}").pmf == pytest.approx(prof.pmf)


@pytest.mark.xdist_group("tiny_engine")
def test_fixed0_profile_and_lag0_are_bit_identical(tiny_dir, tmp_path, tiny_engine):
    """lag=0 and lag.profile=fixed:0 give the same losses, rewards, prompts and weights (the
    profile's single-version batches take the plain path; lag=0 equals a hand-written
    synchronous loop in tests/test_loop.py)."""
    ref_rec, prof_rec = Recorder(), Recorder()
    engine = tiny_engine
    _, ref = _profile_loop(tiny_dir, tmp_path / "lag0", LagPolicy(0), 3, ref_rec, engine=engine)
    engine.update_weights(str(tmp_path / "lag0" / "weights" / "v0"), 0)
    pol = LagPolicy(0, "fixed", profile=parse_profile("fixed:0"), seed=3, cells=8)
    _, prof = _profile_loop(tiny_dir, tmp_path / "fixed0", pol, 3, prof_rec, engine=engine)
    for t in (1, 2, 3):
        for key in ("loss/policy", "rollout/reward_mean", "rollout/prompt_digest"):
            assert prof_rec.metrics[t][key] == ref_rec.metrics[t][key], (t, key)
        assert prof_rec.metrics[t]["staleness/lag_profile_tv"] == 0.0
    assert any(ref_rec.metrics[t]["loss/policy"] != 0 for t in (1, 2, 3))
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, prof.model.state_dict()[k]), k


def test_cli_refuses_bad_profiles_before_writing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"edges": [0.2, 0.8], "counts": [3]}')
    for spec, says in [
        ("geometric:1.5,max=3", "P must lie in (0, 1]"),
        (f"empirical:{bad}", "does not hold exactly one lag"),
        (f"empirical:{tmp_path / 'missing.json'}", "does not exist"),
    ]:
        r = run_sat("train", f"lag.profile={spec}", "run.dir=runs", cwd=tmp_path, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sat: error: ") and says in lines[0]
        assert "Traceback" not in r.stderr
    r = run_sat("config", "lag.profile=geometric:0.5,max=2", cwd=tmp_path)  # unquoted: one string
    assert r.returncode == 0 and "profile: geometric:0.5,max=2" in r.stdout
    r = run_sat(
        "train",
        "lag.profile=fixed:1",
        "lag.mode=bounded",
        "run.dir=runs",
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2 and "per-token profiles are not implemented" in r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_profile_run_resumes_from_a_checkpoint_exactly(tiny_dir, tmp_path):
    """uniform:1-3 over 5 steps, checkpoints every 2: a run cut after step 3 and resumed from
    its step-2 checkpoint finds every version its batches draw (the window kept with the
    checkpoint) and ends with the uninterrupted run's losses, realised lags and weights."""
    import shutil

    from sat_cli.checkpoints.state import latest_checkpoint
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    lag = LagPolicy(3, "fixed", profile=parse_profile("uniform:1-3"), seed=3, cells=8)

    def run(run_dir, steps, resume=None):
        trainer, rec = _trainer(tiny_dir), Recorder()
        sampling = SamplingParams(
            temperature=1.0, max_new_tokens=2, stop_token_ids=(trainer.tokenizer.eos_token_id,)
        )
        s = LoopSettings(
            max_steps=steps,
            prompts_per_step=2,
            group_size=4,
            sampling=sampling,
            lag=lag,
            run_dir=run_dir,
            seed=3,
            histograms=Every(0),
            checkpoints=Every(2),
            checkpoint_keep=5,
        )
        with LocalEngine(
            LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0)
        ) as engine:
            parts = RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer)
            st = TrainLoop(s, parts).run(resume)
        return rec, st, trainer.model.state_dict()

    full, st_full, w_full = run(tmp_path / "full", 5)
    run(tmp_path / "cut", 3)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_3")
    ck = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ck.name == "step_2"
    resumed, st_res, w_res = run(tmp_path / "cut", 5, resume=ck)
    assert sorted(resumed.metrics) == [3, 4, 5]
    for t in (3, 4, 5):
        for key in ("loss/policy", "staleness/version_lag_mean", "staleness/lag_profile_tv"):
            assert resumed.metrics[t][key] == full.metrics[t][key], (t, key)
    assert st_res.lag_profile_counts == st_full.lag_profile_counts
    assert st_full.lag_profile_counts == _expected_counts(lag, 5)
    for k, v in w_full.items():
        assert torch.equal(v, w_res[k]), k
