"""`sat train` with engine.weight_sync=distributed (issue 28), as a user runs it.

Each run is a real `sat` subprocess on the embedded CPU default, made small. Reference: the same
command with the disk path (engine.weight_sync=disk, the default): every evaluation and reward
must be bit-identical. Faults are real behaviours of a faulty sender (its bytes damaged on the
wire, or on the wire and on disk; or no broadcast at all), put into the run's process by a
``sitecustomize`` module on ``PYTHONPATH`` — nothing in sat has a switch for them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_sat

SMALL = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.every=2",
    "eval.n=1",
    "max_steps=3",
    "run.dir=runs",
]
# what a faulty sender does, selected by SAT_TEST_SENDER_FAULT (this file's runs only)
SITECUSTOMIZE = """
import os
fault = os.environ.get("SAT_TEST_SENDER_FAULT")
if fault:
    from sat_cli.weightsync import sender as S
    if fault in ("wire", "wire+disk"):
        S.WeightSender._on_wire = lambda self, flat: flat + 1
    if fault == "silent":  # never broadcasts
        def send(self, version, index):
            self.last_send_s = self.last_flatten_s = 0.0
            return 0
        S.WeightSender.send = send
    if fault == "wire+disk":
        def write_hf(self, version, folder):
            from sat_cli.models.hf_checkpoint import save_hf_checkpoint
            damaged = {k: v + 1 for k, v in self._get(version)}
            return save_hf_checkpoint(damaged, folder, self.source_dir)
        S.WeightSender.write_hf = write_hf
"""


def train(*args: str, cwd: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """`sat train <args>`; ``fault``: the faulty sender (SITECUSTOMIZE) this run gets."""
    if fault is None:
        return run_sat("train", *args, cwd=cwd)
    (cwd / "inject").mkdir(exist_ok=True)
    (cwd / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "SAT_TEST_SENDER_FAULT": fault,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(cwd / "inject"), os.environ.get("PYTHONPATH")])
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def run_metrics(root: Path, name: str) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("sat")
    (run,) = [r for r in c.search_runs([exp.experiment_id]) if r.info.run_name == name]
    keys = [k for k in run.data.metrics]
    hist = {
        k: sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, k)) for k in keys
    }
    return run.info.status, hist


def outcome(hist: dict) -> dict:
    """What must not depend on the weight path: evaluations and rewards, step by step."""
    return {k: v for k, v in hist.items() if k.startswith("eval/") or k == "rollout/reward_mean"}


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    out = train(*SMALL, "run.name=disk", cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    status, hist = run_metrics(root, "disk")
    assert status == "FINISHED"
    return hist


@pytest.mark.slow  # ~40 s; in process: test_weight_sync.py and test_weight_sync_views.py, to the bit
def test_distributed_gives_the_disk_paths_numbers_bit_for_bit(disk_run, tmp_path):
    out = train(*SMALL, "run.name=dist", "engine.weight_sync=distributed", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    status, hist = run_metrics(tmp_path, "dist")
    assert status == "FINISHED"
    assert outcome(hist) == outcome(disk_run) and outcome(hist)["eval/toy/avg_at_1"]
    assert {v for _, v in hist["weights/sync_fallback"]} == {0.0}
    assert max(v for _, v in hist["weights/verify_s"]) > 0  # the first sync was verified
    sent = [v for _, v in hist["weights/sync_bytes"]]  # versions loaded since the last step
    assert sent and all(v > 0 and v % 4085248 == 0 for v in sent)  # the tiny model in fp32
    # the disk path verified its first load too (the default, engine.verify_weights=first)
    assert max(v for _, v in disk_run["weights/verify_s"]) > 0


@pytest.mark.slow  # ~40 s; in process: test_weight_sync.py::test_wrong_bytes_on_both_paths_fail_the_run
def test_a_sender_whose_bytes_are_wrong_everywhere_fails_the_run(tmp_path):
    """Damaged on the wire and in what it writes to disk: the broadcast's checksums differ, the
    disk fallback's too, the run ends FAILED (exit 1) after its last checkpoint, which a
    resume=auto without the fault continues to the end."""
    args = [
        *SMALL,
        "max_steps=4",
        "checkpoint.every=1",
        "run.name=bad",
        "engine.weight_sync=distributed",
    ]
    out = train(*args, cwd=tmp_path, fault="wire+disk")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert re.search(r"sat: error: weights v\d did not reach the engine: ", out.stderr)
    assert "then from disk: " in out.stderr and "tensors differ" in out.stderr
    assert "continue with resume=auto" in out.stderr
    status, hist = run_metrics(tmp_path, "bad")
    assert status == "FAILED"
    ckpts = sorted(p.name for p in (tmp_path / "runs/sat/bad/checkpoints").iterdir())
    assert ckpts and all(c.startswith("step_") for c in ckpts)
    again = train(*args, "resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    status, hist = run_metrics(tmp_path, "bad")
    assert status == "FINISHED" and hist["eval/toy/avg_at_1"][-1][0] == 4


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["wire", "silent"])
def test_a_faulty_broadcast_falls_back_to_the_disk_and_the_numbers_stay(disk_run, tmp_path, fault):
    """Damaged bytes (checksum mismatch) or no broadcast at all (the engine's receive times out
    after engine.weight_sync_timeout_s): each version goes through the disk once, counted in
    weights/sync_fallback; the run ends with the disk path's numbers."""
    out = train(
        *SMALL,
        "run.name=fb",
        "engine.weight_sync=distributed",
        "engine.weight_sync_timeout_s=3",
        cwd=tmp_path,
        fault=fault,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sending them from disk instead" in out.stdout + out.stderr
    status, hist = run_metrics(tmp_path, "fb")
    assert status == "FINISHED" and outcome(hist) == outcome(disk_run)
    assert hist["weights/sync_fallback"][-1][1] >= 2  # v1, v2 (and the final v3)


def test_bad_input_exits_2_naming_why_and_writes_nothing(tmp_path):
    cases = [
        (
            ["lag=2", "lag.mode=bounded", "lag.inflight_updates=true"],
            "takes in-flight updates (mid-generation) from disk only",
        ),
        (["engine=sglang", "engine.device=cuda", "engine.dp=2"], "data-parallel replicas"),
        (
            ["engine=sglang", "engine.tp=2", "engine.verify_weights=first"],
            "SGLang reports a checksum per rank shard",
        ),
    ]
    for extra, why in cases:
        out = train(*SMALL, "engine.weight_sync=distributed", *extra, cwd=tmp_path)
        assert out.returncode == 2, (extra, out.stderr[-2000:])
        assert why in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = train(
            *SMALL,
            "engine.weight_sync=distributed",
            f"engine.weight_sync_port={port}",
            cwd=tmp_path,
        )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"engine.weight_sync_port={port}: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert not (tmp_path / "runs").exists()


STANDIN = Path(__file__).with_name("sglang_standin.py")
SGLANG = [
    "engine=sglang",
    "engine.device=cpu",
    f"engine.launch_prefix=[{sys.executable},{STANDIN}]",
]


@pytest.mark.slow  # ~15 s; the stand-in protocol: tests/test_sglang_weight_sync.py
def test_sglang_servers_take_the_broadcast_and_are_verified(tmp_path):
    """engine=sglang (the stand-in process, in a real gloo group with the trainer): every
    version by broadcast, the first one verified against /weights_checker, no fallback."""
    out = train(*SMALL, "run.name=sg", *SGLANG, "engine.weight_sync=distributed", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    status, hist = run_metrics(tmp_path, "sg")
    assert status == "FINISHED" and {v for _, v in hist["weights/sync_fallback"]} == {0.0}
    assert max(v for _, v in hist["weights/verify_s"]) > 0
    sent = [v for _, v in hist["weights/sync_bytes"]]
    assert sent and all(v > 0 and v % 2042624 == 0 for v in sent)  # the tiny model in bf16


@pytest.mark.slow  # ~11 s; test_bad_input_exits_2_naming_why_and_writes_nothing stays
def test_a_server_that_cannot_take_a_broadcast_exits_2_naming_it(tmp_path):
    out = train(
        *SMALL,
        "run.name=no",
        *SGLANG,
        "engine.weight_sync=distributed",
        "engine.extra_args=[--standin-no-sync-routes]",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert re.search(
        r"sat: error: engine.weight_sync=distributed cannot be used: the server at "
        r"http://127.0.0.1:\d+ has no /destroy_weights_update_group \(HTTP 404",
        out.stderr,
    )


@pytest.mark.slow  # two Megatron runs (torchrun), about a minute each
def test_megatron_trainer_broadcasts_from_its_rank_0_with_the_disk_paths_numbers(tmp_path):
    from cli_helpers import MEGATRON_SMOKE

    args = [*MEGATRON_SMOKE, "eval.every=2", "eval.n=1", "max_steps=3"]
    for name, sync in (("mdisk", "disk"), ("mdist", "distributed")):
        out = train(*args, f"run.name={name}", f"engine.weight_sync={sync}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    (s1, disk), (s2, dist) = run_metrics(tmp_path, "mdisk"), run_metrics(tmp_path, "mdist")
    assert s1 == s2 == "FINISHED" and outcome(dist) == outcome(disk)
    assert {v for _, v in dist["weights/sync_fallback"]} == {0.0}
    assert max(v for _, v in dist["weights/verify_s"]) > 0
