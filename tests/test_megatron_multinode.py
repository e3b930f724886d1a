"""Multi-node megatron trainer on one machine: two "nodes" on the loopback interface.

Node 0 is ``MegatronTrainer(nnodes=2, nproc_per_node=1)`` (what ``sat train`` builds with
``trainer.nnodes=2``); node 1 is joined by the documented command, ``sat worker --join
127.0.0.1:PORT --config WORK/worker_config.json``, in a subprocess. Reference: the same two
ranks on one node (``nproc_per_node=2``), which tests/test_megatron_trainer.py checks against
the local trainer. The fast tests check the join command's input handling (exit 2, one
``sat: error:`` line, no traceback).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from cli_helpers import MEGATRON_SMOKE, run_sat

from sat_cli.util.procs import free_port


def _config(tmp_path, nnodes=2):
    path = tmp_path / "worker_config.json"
    path.write_text(
        json.dumps({"protocol": 1, "model_path": "m", "nnodes": nnodes, "nproc_per_node": 1})
    )
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--join", "localhost"], "expected HOST:PORT"),
        (["--join", "127.0.0.1:99999"], "expected HOST:PORT"),
        (["--join", "127.0.0.1:1", "--config", "/no/such/worker_config.json"], "no such file"),
        (["--join", "127.0.0.1:1", "--node-rank", "2"], "--node-rank 2: must be 1 .. 1"),
        (["--join", "127.0.0.1:1", "--nproc-per-node", "3"], "runs 1 processes per node"),
        # nothing listens there: a clear message after --wait seconds
        (["--join", "127.0.0.1:PORT", "--wait", "1"], "cannot reach the job's rendezvous"),
    ],
)
def test_join_refuses_bad_input(tmp_path, args, message):
    args = [a.replace("PORT", str(free_port())) for a in args]
    if "--config" not in args:
        args += ["--config", str(_config(tmp_path))]
    t0 = time.monotonic()
    res = run_sat("worker", *args, cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("sat: error:") and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert time.monotonic() - t0 < 30


def test_join_refuses_a_single_node_job(tmp_path):
    res = run_sat(
        "worker", "--join", "127.0.0.1:1", "--config", str(_config(tmp_path, 1)), cwd=tmp_path
    )
    assert res.returncode == 2 and "nothing to join" in res.stderr


def _join_when_config_appears(config, endpoint, out: dict):
    deadline = time.monotonic() + 120
    while not config.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    cmd = [sys.executable, "-m", "sat_cli.cli", "worker", "--join", endpoint]
    cmd += ["--config", str(config)]
    out["proc"] = subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_loopback_nodes_match_one_node(tiny_dir, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from test_megatron_trainer import make_samples
    from trainer_checks import megatron_trainer

    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.batch import collate
    from sat_cli.trainers.megatron import convert

    loss = LossConfig(algo="grpo", adaptive=True)
    kw = dict(lr=1e-4, loss=loss, num_minibatches=2, r3=True, ep=2)
    kw["max_shard_size"] = 1_000_000
    batches = [collate(*make_samples(n=7, seed=s), 0, need_routes=True) for s in (2, 3)]

    def run(work, **launch):
        metrics = []
        with megatron_trainer(tiny_dir, work, **launch, **kw) as tr:
            for b in batches:
                metrics.append(tr.step(b))
            published = tr.publish_weights(work / "weights", 2)
            weights = convert.load_hf_state(published)
        # trainer.max_shard_size reaches the export: the 4.1 MB tiny model in five shards
        assert len(json.loads((published / "model.safetensors.index.json").read_text())) == 2
        assert len(list(published.glob("model-0000?-of-00005.safetensors"))) == 5
        return metrics, weights

    t0 = time.monotonic()
    one_m, one_w = run(tmp_path / "one", nproc_per_node=2)
    t1 = time.monotonic()
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    work = tmp_path / "two"
    joined: dict = {}
    joiner = threading.Thread(
        target=_join_when_config_appears, args=(work / "worker_config.json", endpoint, joined)
    )
    joiner.start()
    two_m, two_w = run(work, nproc_per_node=1, nnodes=2, master_port=port)
    joiner.join(timeout=60)
    t2 = time.monotonic()
    print(f"one node {t1 - t0:.1f} s, two nodes {t2 - t1:.1f} s")
    proc = joined["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "node 1 of 2 joining" in proc.stderr
    log = (work / "logs" / "megatron_trainer.log").read_text()
    assert f"sat worker --join {endpoint} --config" in log
    for a, b in zip(one_m, two_m, strict=True):
        # the same ranks and collectives: bit-identical metrics (all but wall-clock times)
        assert {k: v for k, v in a.items() if not k.endswith("_s")} == {
            k: v for k, v in b.items() if not k.endswith("_s")
        }
        assert len(a) == len(b) > 20
    assert set(one_w) == set(two_w)
    assert all(torch.equal(one_w[k], two_w[k]) for k in one_w)  # bit-exact weights
    moved = convert.load_hf_state(tiny_dir)
    assert max((one_w[k] - moved[k]).abs().max().item() for k in one_w) > 1e-4


@pytest.mark.slow
def test_sat_train_on_two_loopback_nodes_matches_one_node(tmp_path):
    """`sat train trainer=megatron trainer.nnodes=2 trainer.nproc_per_node=1 max_steps=3` with
    node 1 joined by `sat worker --join`, against `trainer.nproc_per_node=2` on one node (both
    ep = 2): the same losses and gradient norms and the same final weights. Three steps: on
    this smoke task the first two have no gradient (zero-advantage groups), the third has."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from test_megatron_tp import _run_history

    from sat_cli.trainers.megatron import convert

    common = [
        "train",
        *MEGATRON_SMOKE,
        "trainer.ep=2",
        "max_steps=3",
    ]
    out = run_sat(*common, "run.name=one", "trainer.nproc_per_node=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    port = free_port()
    config = tmp_path / "runs/sat/two/megatron/worker_config.json"
    joined: dict = {}
    joiner = threading.Thread(
        target=_join_when_config_appears, args=(config, f"127.0.0.1:{port}", joined)
    )
    joiner.start()
    two = ["run.name=two", "trainer.nnodes=2", f"trainer.master_port={port}"]
    out = run_sat(*common, *two, cwd=tmp_path)
    joiner.join(timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"sat worker --join 127.0.0.1:{port} --config {config}" in out.stderr
    assert joined["proc"].returncode == 0, joined["proc"].stderr[-3000:]
    for key in ("loss/policy", "loss/grad_norm", "loss/entropy"):
        ref, got = _run_history(tmp_path, "one", key), _run_history(tmp_path, "two", key)
        assert [s for s, _ in got] == [s for s, _ in ref] == [1, 2, 3], key
        assert got == ref, key
        if key == "loss/grad_norm":
            assert max(v for _, v in ref) > 0  # a step with a gradient
    ckpt = "checkpoints/step_{}/trainer/model"
    one = convert.load_hf_state(tmp_path / "runs/sat/one" / ckpt.format(3))
    two_w = convert.load_hf_state(tmp_path / "runs/sat/two" / ckpt.format(3))
    before = convert.load_hf_state(tmp_path / "runs/sat/one" / ckpt.format(2))
    assert max((one[k] - before[k]).abs().max().item() for k in one) > 1e-4
    worst = max((one[k] - two_w[k]).abs().max().item() for k in one)
    print(f"two loopback nodes vs one node: weights max |diff| {worst:.1e}")
    assert worst <= 1e-6
