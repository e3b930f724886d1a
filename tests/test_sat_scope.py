"""SAT on a sequence-level ratio (GSPO, GSPO-token) with ``q`` taken over one response is a
no-op by construction (the response's tokens all share one ``|d| = q`` and the gate needs
``|d| > q``): every command that composes a config refuses it, naming the fix
(sat_cli/config/sat_scope.py, ``check_sat_scope``). The paper preset composes for every row of the
paper's grid and trains and evaluates with one prompt template (issue 30, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import run_sat

from sat_cli.config import ConfigError, load
from sat_cli.config.sat_scope import SEQUENCE_ALGOS
from sat_cli.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parent.parent
PAPER = "experiment=paper_qwen3_30b_a3b"
ONE_ROW = ["clip.q_scope=micro_batch", "clip.micro_batch_size=1"]


def test_sequence_algos_are_the_registrys_sequence_levels():
    from sat_cli.rl.registry import ALGORITHMS

    assert set(SEQUENCE_ALGOS) == {n for n, a in ALGORITHMS.items() if a.level != "token"}


@pytest.mark.parametrize("algo", SEQUENCE_ALGOS)
@pytest.mark.parametrize("clip", ["sat", "sat_anchored"])
def test_sat_on_a_sequence_ratio_over_one_response_is_refused(algo, clip):
    with pytest.raises(ConfigError) as exc:
        load([f"algo={algo}", f"clip={clip}", *ONE_ROW])
    msg = str(exc.value)
    assert f"algo={algo}" in msg and "clip.micro_batch_size=1 is a no-op" in msg
    assert "clip.q_scope=batch" in msg and "clip=ppo" in msg  # the fixes, named
    assert "10 responses per micro-batch at clip.quantile=0.9" in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=gspo", "clip=sat"],  # q over the whole batch (the default scope)
        ["algo=gspo", "clip=sat", "clip.q_scope=micro_batch", "clip.micro_batch_size=10"],
        ["algo=grpo", "clip=sat", *ONE_ROW],  # token level: q over the response's tokens
        ["algo=gspo", "clip=ppo", *ONE_ROW],  # no SAT, nothing to be inert
    ],
    ids=["gspo-batch", "gspo-10-rows", "grpo-one-row", "gspo-ppo-one-row"],
)
def test_what_stays_allowed(overrides):
    load(overrides)


def test_the_quantile_sets_the_rows_named():
    with pytest.raises(ConfigError, match="5 responses per micro-batch at clip.quantile=0.8"):
        load(["algo=gspo", "clip.quantile=0.8", *ONE_ROW])


@pytest.mark.parametrize("command", [["plan"], ["train", "--dry-run"]])
def test_sat_plan_and_sat_train_refuse_it_with_exit_2(command, tmp_path):
    out = run_sat(*command, PAPER, "algo=gspo", *ONE_ROW, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "clip.micro_batch_size=1 is a no-op" in out.stderr
    assert "clip.q_scope=batch" in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_the_paper_preset_composes_sat_gspo_and_agrees_on_its_prompt_template():
    _, obj = load([PAPER, "algo=gspo", "clip=sat"])
    assert obj.clip.adaptive and obj.clip.q_scope == "batch"
    assert obj.task.template == obj.eval.template == "dapo"


def test_every_sat_row_of_the_paper_grid_composes():
    sw = load_sweep(ROOT / "sweeps" / "paper_table1.yaml")
    rows = [r for r in sw.runs if r.method.startswith("SAT-") and r.axes["lag"] == "8"]
    assert {r.method for r in rows} == {"SAT-GRPO", "SAT-GSPO", "SAT-GRPO w/ R3", "SAT-GSPO w/ R3"}
    for r in rows:
        _, obj = load(r.overrides, "train")
        assert obj.clip.adaptive, r.method
