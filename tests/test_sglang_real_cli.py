"""`sat train` / `sat eval` with a REAL SGLang server on this CPU, end to end (tier ``sglang``).

Each test starts its own servers through the CLI (about 20-30 s each on an idle machine) and
reads what the run logged in its MLflow store. All are slow (`make test-full`): the default
suite's `sat train` on a real SGLang server with R3 runs on the server of
tests/test_sglang_real.py (one SGLang start fewer).
"""

from __future__ import annotations

import re

import pytest
from sglang_real import metrics, sat, sglang_python

# one xdist worker runs the real-server tier (its module-scoped servers are started once)
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang")]

SMALL = [
    "engine=sglang",
    "engine.device=cpu",
    "experiment=cpu_smoke",
    "task.prompts_per_step=8",
    "task.samples_per_prompt=4",
    "eval.every=3",
    "eval.limit=16",
    "eval.n=2",
    "run.dir=runs",
    "run.name=sg",
]


def ok(out) -> None:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


@pytest.mark.slow  # 40-70 s; `make test-full` (the default suite's run: tests/test_sglang_real.py)
def test_eval_toy_on_sglang(tmp_path):
    sglang_python()
    out = sat(
        "eval",
        "toy",
        "engine=sglang",
        "engine.device=cpu",
        "eval.limit=32",
        "eval.n=2",
        "run.dir=runs",
        cwd=tmp_path,
    )
    ok(out)
    assert "eval toy: complete" in out.stdout
    # the table row: problems, n, avg@2, pass@1, pass@2
    assert re.search(r"32/32\s*│\s*2\s*│\s*\d+\.\d+\s*│", out.stdout), out.stdout[-2000:]


@pytest.mark.slow  # 40-70 s; `make test-full` (the default suite's run: tests/test_sglang_real.py)
def test_two_servers_behind_the_router_serve_one_run(tmp_path):
    sglang_python()
    out = sat("train", *SMALL, "max_steps=3", "engine.num_servers=2", "eval.every=0", cwd=tmp_path)
    ok(out)
    logs = tmp_path / "runs" / "sat" / "sg" / "logs"
    assert "sglang_router.launch_router" in (logs / "sglang_router.log").read_text()
    for i in (0, 1):
        text = (logs / f"sglang_{i}.log").read_text()
        # generation went through the router to both workers; weight updates to each directly
        assert text.count('"POST /generate HTTP/1.1" 200') >= 1, f"server {i}"
        assert text.count('"POST /update_weights_from_disk HTTP/1.1" 200') >= 1, f"server {i}"
    assert sorted(metrics(tmp_path / "runs", "rollout/reward_mean")) == [1, 2, 3]


@pytest.mark.slow  # 40-70 s; `make test-full` (the default suite's run: tests/test_sglang_real.py)
def test_the_papers_stack_in_miniature(tmp_path):
    # SGLang rollouts, the megatron-core trainer, SGLang's routed experts replayed in
    # megatron's RouterReplay: every replayed (token, layer) row uses SGLang's experts.
    sglang_python()
    out = sat(
        "train",
        *SMALL,
        "max_steps=3",
        "trainer=megatron",
        "r3=true",
        "trainer.r3_audit=true",
        "eval.every=0",
        cwd=tmp_path,
    )
    ok(out)
    rows = metrics(tmp_path / "runs", "r3/audit_rows")
    bad = metrics(tmp_path / "runs", "r3/audit_mismatched_rows")
    assert sorted(rows) == [1, 2, 3] and min(rows.values()) > 0
    assert set(bad.values()) == {0.0}
