"""examples/sum_digits, the copyable custom task: its reward on hand cases, its data generator,
and a short version of its experiment through the real `sat train` (2 steps)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_sat

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sum_digits"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("response", "gold", "want"),
    [
        ("\\boxed{579}", "579", {"exact": 1.0, "digits": 1.0}),
        ("\\boxed{578}", "579", {"exact": 0.0, "digits": 2 / 3}),
        ("\\boxed{79}", "579", {"exact": 0.0, "digits": 2 / 3}),  # read as 079
        ("\\boxed{1}\\boxed{1088}", "1088", {"exact": 1.0, "digits": 1.0}),  # the last box
        ("579", "579", {"exact": 0.0, "digits": 0.0}),  # no box
        ("\\boxed{5x9}", "579", {"exact": 0.0, "digits": 0.0}),
    ],
)
def test_example_reward_hand_cases(response, gold, want):
    got = _module("reward").score("123+456=", response, {"answer": gold})
    assert got == pytest.approx(want)


def test_example_data_is_deterministic_and_disjoint(tmp_path):
    for out in ("a", "b"):
        subprocess.run(
            [sys.executable, str(EXAMPLE / "make_data.py"), str(tmp_path / out)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    rows = {
        n: [json.loads(x) for x in (tmp_path / "a" / n).read_text().splitlines()]
        for n in ("train.jsonl", "heldout.jsonl")
    }
    assert (len(rows["train.jsonl"]), len(rows["heldout.jsonl"])) == (2000, 200)
    train_q = {r["question"] for r in rows["train.jsonl"]}
    assert not train_q & {r["question"] for r in rows["heldout.jsonl"]}
    for r in rows["train.jsonl"][:50]:
        a, b = r["question"].rstrip("=").split("+")
        assert r["sum"] == str(int(a) + int(b)) and len(a) == len(b) == 3


@pytest.mark.slow  # ~70 s on the shared 2-core machine; the reward and data tests stay
def test_example_experiment_runs_a_short_version(tmp_path):
    """The experiment config as a user runs it, cut to 2 steps and 8 held-out problems."""
    from mlflow import MlflowClient

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), str(data)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    repo = EXAMPLE.parents[1]
    out = run_sat(
        "train",
        "experiment=sum_digits_example",
        f"task.path={data / 'train.jsonl'}",
        f"task.heldout_path={data / 'heldout.jsonl'}",
        f"reward.fn={EXAMPLE / 'reward.py'}:score",
        f"model.path={repo / 'sat_cli/assets/tiny_moe_warm'}",
        "max_steps=2",
        "eval.every=2",
        "eval.limit=8",
        "eval.n=2",
        "task.prompts_per_step=4",
        "task.samples_per_prompt=4",
        "run.dir=runs",
        "run.name=ex",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    rid = run.info.run_id
    assert sorted(m.step for m in client.get_metric_history(rid, "eval/heldout/avg_at_2")) == [0, 2]
    for key in ("reward/exact", "reward/digits", "reward/error_frac"):
        assert sorted(m.step for m in client.get_metric_history(rid, key)) == [1, 2], key
    # rollout/reward_mean is the weighted sum of the components' means (exact 1.0, digits 0.5)
    for step in (1, 2):
        get = {
            k: next(m.value for m in client.get_metric_history(rid, k) if m.step == step)
            for k in ("reward/exact", "reward/digits", "rollout/reward_mean")
        }
        assert get["rollout/reward_mean"] == pytest.approx(
            get["reward/exact"] + 0.5 * get["reward/digits"]
        )
