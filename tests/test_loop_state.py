"""The loop's typed state (``sat_cli.checkpoints.loop_state``) and its checkpoint JSON: a checkpoint
written by the loop before ``TrainLoop`` existed (``tests/data/loop_v4_checkpoint``) reads back
to the same JSON, key for key and type for type, and resumes to the metrics and final state the
uninterrupted run of that loop recorded.

The fixture: the v4 loop (commit 9d6538e, ``train_loop``) on a micro Qwen3-MoE (seed 3, hidden
8, one layer, two experts; ``model/``), ``SevensTask`` of ``tests/test_loop.py``, 4 prompts x 4
samples, fixed lag 2, seed 5, evaluation every 2 steps (an evaluator returning ``10 x`` the
engine's weight version as ``eval/x/avg@2``), checkpoints every 2 steps; cut after step 3 and the
step-3 checkpoint removed: ``run/`` holds ``checkpoints/step_2`` (one batch pending, requested
from version 0) and the published weights ``v0``..``v2``. ``reference.json``: the uninterrupted
5-step run's metrics at steps 3..5 and its final loop state.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from test_loop import SAMPLING, Recorder, SevensTask

from sat_cli.checkpoints.loop_state import Counters, EvalRecord, LoopState
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.loop.train import EvalScores, Evaluators, LoopSettings, RunParts, TrainLoop

FIXTURE = Path(__file__).parent / "data" / "loop_v4_checkpoint"


def _json(path: Path) -> str:
    return json.dumps(json.loads(path.read_text()), indent=1, sort_keys=True)


def test_a_v4_checkpoint_state_reads_back_to_the_same_json():
    """Every field, and the int/float type of each counter (``sat_steps`` 2, ``sat_active_steps``
    2.0), survives ``from_json`` → ``to_json``."""
    path = FIXTURE / "run" / "checkpoints" / "step_2" / "loop_state.json"
    raw = json.loads(path.read_text())
    st = LoopState.from_json(raw)
    assert st.step == 2 and st.pending == [[2, 0]] and st.published == [0, 1, 2]
    assert st.eval == EvalRecord(20.0, 2, 20.0, 2, "eval/x/avg@2")
    assert json.dumps(st.to_json(), sort_keys=True) == json.dumps(raw, sort_keys=True)
    counters = st.to_json()["counters"]
    assert type(counters["sat_steps"]) is int and type(counters["sat_active_steps"]) is float


def test_the_state_json_keeps_the_v4_layout():
    """A fresh state: the keys the v4 loop wrote (``min_needed`` and ``lag_profile_counts``
    only once set), the per-side SAT counters only once a trainer reported them."""
    st = LoopState()
    assert st.to_json() == {
        "step": 0,
        "pending": [],
        "published": [0],
        "engine_version": 0,
        "eval": {"best": None, "best_step": None, "last": None, "last_step": None, "key": None},
        "counters": {
            "skipped_steps": 0,
            "dropped_groups": 0,
            "sat_active_steps": 0,
            "sat_steps": 0,
            "nonfinite_steps": 0,
            "stale_dropped": 0,
        },
        "finished": False,
        "mlflow_run_id": None,
    }
    # fractions: (1 + 0.5) / 2 either side; the low side from its first report on
    c = Counters()
    assert c.add_sat({"sat/active": 1.0}) == {"sat/active_frac": 1.0}
    got = c.add_sat({"sat/active": 0.5, "sat/active_low": 1.0})
    assert got == {"sat/active_frac": 0.75, "sat/active_low_frac": 0.5}
    assert c.to_json()["sat_active_low_steps"] == 1.0 and "sat_active_high_steps" not in c.to_json()
    st.count_lags([2, 0, 2])
    assert st.to_json()["lag_profile_counts"] == [1, 0, 2]
    rec = EvalRecord()
    for step, v in ((2, 5.0), (4, 7.0), (6, 6.0)):
        rec.record("eval/x/avg@2", v, step)
    assert (rec.best, rec.best_step, rec.last, rec.last_step) == (7.0, 4, 6.0, 6)


@pytest.mark.slow  # ~10 s: two engines on the micro model
def test_a_checkpoint_written_before_the_train_loop_resumes_identically(tmp_path):
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    ref = json.loads((FIXTURE / "reference.json").read_text())
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run_dir)
    model = str(FIXTURE / "model")
    trainer = LocalTrainer(model, lr=1e-2, seed=0, loss=LossConfig(algo="grpo", adaptive=True))
    rec = Recorder()
    rec.run_id = "fixture"
    s = LoopSettings(
        max_steps=5,
        prompts_per_step=4,
        group_size=4,
        sampling=replace(SAMPLING, stop_token_ids=(trainer.tokenizer.eos_token_id,)),
        lag=LagPolicy(2, "fixed"),
        run_dir=run_dir,
        seed=5,
        histograms=Every(0),
        checkpoints=Every(2),
        checkpoint_keep=5,
        eval=Every(2),
    )
    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(model, seed=0)) as engine:

        def evaluator():
            m = {"eval/x/avg@2": float(engine.weight_version) * 10.0, "eval/x/pass@1": 1.0}
            return EvalScores(m, headline="eval/x/avg@2")

        parts = RunParts(
            engine, trainer, rec, SevensTask(), trainer.tokenizer, Evaluators(evaluator)
        )
        st = TrainLoop(s, parts).run(run_dir / "checkpoints" / "step_2")
    assert sorted(rec.metrics) == [3, 4, 5]
    for t, want in ref["metrics"].items():
        got = {k: rec.metrics[int(t)][k] for k in want}
        # a loss that cancels to rounding noise (step 3's GRPO mean, ~1e-9) is compared as zero:
        # the order of that sum follows the CPU kind and the thread count, so its last bits do
        # too (run alone on an AMD Zen 4: -3.7e-09, the recording -6.2e-09); every other value,
        # and the steps after, stay bit-identical
        noise = {k for k, v in want.items() if k.startswith("loss/") and abs(v) < 1e-7}
        assert all(abs(got[k]) < 1e-7 for k in noise), (t, got)
        assert {k: v for k, v in got.items() if k not in noise} == {
            k: v for k, v in want.items() if k not in noise
        }, t
    assert json.dumps(st.to_json(), sort_keys=True) == json.dumps(ref["state"], sort_keys=True)
    final = run_dir / "checkpoints" / "step_5" / "loop_state.json"
    assert _json(final) == json.dumps(ref["state"], indent=1, sort_keys=True)
