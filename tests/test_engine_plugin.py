"""An engine added from outside the package goes through the same seam as the shipped ones
(issue 52 item 3): ``tests/engine_plugin.py`` (``engine=tiny``, one file: settings, build,
engine, server) is built, served by a ``ManagedServer``, synced through the loop's disk transport
and verified through its declared ``Checksums`` — 2 files with this test, nothing edited in
``sat_cli/``.

Reference: the same command with ``engine=local``. The plug-in serves the local engine's model
with the same settings and seed, so every evaluation and reward must be bit-identical; each load
is verified (``engine.verify_weights=every``); a server that loads other weights than it was sent
fails the run (exit 1) naming the tensor; an engine that declares itself unverified is refused
(exit 2) unless ``engine.verify_weights=off``, and then the run says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import seeded_store
from test_weight_sync_cli import outcome, run_metrics

from sat_cli.errors import UserError

TESTS = Path(__file__).resolve().parent
SMALL = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.every=2",
    "eval.n=1",
    "max_steps=3",
    "run.dir=runs",
    "checkpoint.every=0",
]


def sat_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`sat train <args>` in a subprocess that imports the plug-in first (as a user's would)."""
    if not (cwd / "runs" / "mlflow.db").exists():  # a second run there keeps the first's
        seeded_store(cwd / "runs" / "mlflow.db")
    code = "import engine_plugin, sys; from sat_cli.cli import app; app(sys.argv[1:])"
    path = os.pathsep.join([str(TESTS), str(TESTS.parent)])
    return subprocess.run(
        [sys.executable, "-c", code, "train", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
    )


@pytest.mark.slow  # two short runs, ~40 s each
def test_a_plugin_engine_is_served_synced_and_verified_like_the_local_one(tmp_path):
    local = sat_train(*SMALL, "run.name=local", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    args = ["engine=tiny", "engine.verify_weights=every"]
    tiny = sat_train(*SMALL, *args, "run.name=tiny", cwd=tmp_path)
    assert tiny.returncode == 0, tiny.stderr[-3000:]
    (status, reference), (status_tiny, hist) = (
        run_metrics(tmp_path, "local"),
        run_metrics(tmp_path, "tiny"),
    )
    assert status == status_tiny == "FINISHED"
    assert outcome(hist) == outcome(reference) and outcome(hist)["eval/toy/avg_at_1"]
    # every step loaded one version from disk, and every load was verified
    assert [s for s, _ in hist["weights/verify_s"]] == [s for s, _ in hist["weights/sync_s"]]
    assert all(v > 0 for _, v in hist["weights/verify_s"])
    assert {v for _, v in hist["weights/sync_fallback"]} == {0.0}
    server_log = (tmp_path / "runs/sat/tiny/logs/tiny_server.log").read_text()
    assert "=== sat: starting tiny engine server: " in server_log  # the ManagedServer's line


@pytest.mark.slow
def test_a_plugin_server_serving_other_weights_fails_the_run(tmp_path):
    """``engine.corrupt=true``: the server loads each version with one tensor changed; the
    checksums catch it, the second load from disk too, and the run ends FAILED (exit 1)."""
    out = sat_train(*SMALL, "engine=tiny", "engine.corrupt=true", "run.name=bad", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    # the first tensor by name (the one the server changed), once per load, in both loads
    mismatch = (
        r"http://127\.0\.0\.1:\d+ does not serve the weights v(\d) it was sent \(disk\): 1 of "
        r"135 tensors differ: lm_head\.weight: served [0-9a-f]{16}, sent [0-9a-f]{16}"
    )
    found = re.fullmatch(
        rf"sat: error: weights v(\d) did not reach the engine: {mismatch}; then from disk: "
        rf"{mismatch}\. The checkpoints written so far are complete: continue with resume=auto "
        r"once the cause is fixed\.",
        last,
    )
    assert found and found[1] == found[2] == found[3], last
    assert "Traceback" not in out.stderr
    assert run_metrics(tmp_path, "bad")[0] == "FAILED"


@pytest.mark.slow
def test_an_unverified_plugin_is_refused_unless_verification_is_off(tmp_path):
    out = sat_train(*SMALL, "engine=tiny", "engine.verified=false", "run.name=u", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "sat: error: engine=tiny cannot verify the weights it serves (its server keeps no "
        "checksums (engine.verified=false)); engine.verify_weights=first asks for it: set "
        "engine.verify_weights=off to run with unverified weights"
    )
    off = ["engine=tiny", "engine.verified=false", "engine.verify_weights=off", "max_steps=1"]
    ran = sat_train(*SMALL, *off, "eval.every=0", "run.name=off", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = "engine=tiny: its weights are not verified (its server keeps no checksums"
    assert said in ran.stdout + ran.stderr


@pytest.fixture
def plugin_imported():
    """Import the plug-in in this process and take it out again afterwards: its ``ENGINES.add``
    must not leak into tests that read the registry (they run in the same worker)."""
    import engine_plugin

    from sat_cli.engines.registry import ENGINES

    yield engine_plugin
    ENGINES.remove("tiny")
    sys.modules.pop("engine_plugin", None)


def test_an_engine_that_declares_no_verification_is_refused(plugin_imported):
    """The check a run makes once its engine is built (``engines/verification.py``)."""
    UNVERIFIED = plugin_imported.UNVERIFIED

    from sat_cli.engines.verification import Checksums, OnArrival, Unverified, require_verification

    class Undeclared:
        weight_verification = None

    with pytest.raises(UserError) as info:
        require_verification(Undeclared(), "tiny", "first")
    assert str(info.value) == (
        "engine=tiny does not declare how its weights are verified (weight_verification: "
        "Checksums, OnArrival or Unverified with its reason; sat_cli/engines/verification.py): "
        "its weights would never be checked"
    )
    assert info.value.code == 2
    with pytest.raises(UserError, match="does not declare"):
        require_verification(object(), "tiny", "off")  # off does not excuse an undeclared one
    said = []
    for declared in (Checksums("hf"), OnArrival("a probe"), Unverified(UNVERIFIED)):

        class Engine:
            weight_verification = declared

        assert require_verification(Engine(), "tiny", "off", said.append) is declared
    assert said == [f"engine=tiny: its weights are not verified ({UNVERIFIED})"]
    with pytest.raises(ValueError, match="needs its reason"):
        Unverified(" ")
