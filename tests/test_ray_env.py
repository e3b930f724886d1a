"""The environment and placement rules of sat's Ray actors (``sat_cli.cluster.ray_env``): the
allow-list of variables forwarded through ``runtime_env`` (hand cases, then an exported
``NCCL_DEBUG`` reaching an actor on the other node of the real two-node loopback cluster,
``tests/ray_cluster.py``), and placements no live node set can hold, refused before anything
starts (hand cases here; ``sat train launcher=ray`` on the real cluster:
``tests/test_ray_launcher.py::test_placement_the_cluster_cannot_give_exits_1``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sat_cli.cluster.ray_env import forwarded_env, unmet

GB = 1e9


def test_allow_list_forwards_run_settings_and_never_unnamed_secrets(monkeypatch):
    monkeypatch.delenv("SAT_RAY_ENV", raising=False)
    environ = {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "eth0",
        "HF_HOME": "/shared/hf",
        "HF_HUB_OFFLINE": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",  # Ray's, per bundle
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "4",
        "SAT_SWEEP_GRACE_S": "10",
        "HF_TOKEN": "hf_secret",  # a secret: never unless named
        "WANDB_API_KEY": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "HOME": "/root",  # not on the list
        "PATH": "/usr/bin",
        "LD_PRELOAD": "x.so",
    }
    assert forwarded_env(environ) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "HF_HOME": "/shared/hf",
        "HF_HUB_OFFLINE": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "SAT_SWEEP_GRACE_S": "10",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    monkeypatch.setenv("SAT_RAY_ENV", "HF_TOKEN, WANDB_API_KEY,NOT_SET")
    out = forwarded_env(environ)
    assert out["HF_TOKEN"] == "hf_secret" and out["WANDB_API_KEY"] == "k"
    assert "NOT_SET" not in out and "AWS_SECRET_ACCESS_KEY" not in out


def test_runtime_env_logs_names_not_values(monkeypatch):
    from sat_cli.cluster.ray_env import runtime_env

    for name in [n for n in os.environ if forwarded_env({n: "x"})]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("SAT_RAY_ENV", "MY_PASSWORD")
    monkeypatch.setenv("MY_PASSWORD", "hunter2")
    lines: list[str] = []
    env = runtime_env(lines.append)
    assert env == {
        "env_vars": {"MY_PASSWORD": "hunter2", "NCCL_DEBUG": "WARN", "SAT_RAY_ENV": "MY_PASSWORD"}
    }
    assert lines == [
        "ray: environment forwarded to the Ray actors: MY_PASSWORD, NCCL_DEBUG, SAT_RAY_ENV"
    ]


NODE = {"CPU": 16.0, "GPU": 8.0, "memory": 512 * GB, "node:1.2.3.4": 1.0}
SMALL = {"CPU": 4.0, "memory": 64 * GB}


@pytest.mark.parametrize(
    ("bundles", "strategy", "nodes", "why"),
    [
        ([{"CPU": 4, "GPU": 4}] * 2, "PACK", [NODE], None),
        ([{"CPU": 4, "GPU": 4}] * 2, "STRICT_PACK", [NODE], None),
        ([{"CPU": 4, "GPU": 4}] * 3, "STRICT_PACK", [NODE], "STRICT_PACK needs [CPU: 12, GPU: 12]"),
        ([{"GPU": 9}], "PACK", [NODE, NODE], "a bundle [GPU: 9] is larger than every live node"),
        ([{"memory": 600 * GB}], "PACK", [NODE], "[memory: 600.0 GB] is larger than every"),
        ([{"CPU": 1}, {"CPU": 1}], "STRICT_SPREAD", [NODE], "only 1 of the 1 live nodes"),
        ([{"CPU": 1, "GPU": 1}, {"CPU": 1}], "STRICT_SPREAD", [SMALL, NODE], None),
        ([{"CPU": 1, "GPU": 1}] * 2, "STRICT_SPREAD", [SMALL, NODE], "only 1 of the 2 live"),
        ([{"CPU": 1, "TPU": 1}], "SPREAD", [NODE], "a bundle [CPU: 1, TPU: 1] is larger"),
        ([{"CPU": 1}], "PACK", [], "the cluster has no live node"),
    ],
)
def test_unmet_placements_hand_cases(bundles, strategy, nodes, why):
    got = unmet(bundles, strategy, nodes)
    assert (got is None) if why is None else (why in (got or "")), got


PROBE = """
import sys, time
from pathlib import Path
from sat_cli.cluster.executors import RaySweepExecutor, RaySweepSettings
ex = RaySweepExecutor(RaySweepSettings(address=sys.argv[1], resources={"node1": 1.0}))
code = "import os; print('seen', *(f'{k}={os.environ.get(k)}' for k in sys.argv[1:]))"
names = ["NCCL_DEBUG", "HF_TOKEN", "WANDB_API_KEY"]
job = ex.submit("probe", [sys.executable, "-c", "import sys;" + code, *names],
                Path(sys.argv[2]), {}, "envprobe attempt 1")
deadline = time.monotonic() + 120
while job.poll() is None and time.monotonic() < deadline:
    time.sleep(0.5)
print("exit", job.poll(), flush=True)
ex.close()
"""


@pytest.mark.xdist_group("ray")
def test_exported_nccl_debug_reaches_an_actor_on_the_other_node(ray_cluster, tmp_path):
    """`NCCL_DEBUG` exported where the driver runs (not where the cluster was started) reaches
    a sweep actor pinned to the second node (its ``node1`` resource); an unnamed secret does
    not, a named one does."""
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_DEBUG", "HF_TOKEN")}
    assert "NCCL_DEBUG" not in ray_cluster.env  # the nodes do not have it themselves
    env.update(NCCL_DEBUG="INFO", HF_TOKEN="hf_x", WANDB_API_KEY="w", SAT_RAY_ENV="WANDB_API_KEY")
    log = tmp_path / "probe.log"
    res = subprocess.run(
        [sys.executable, "-c", PROBE, ray_cluster.address, str(log)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert res.returncode == 0 and "exit 0" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "seen NCCL_DEBUG=INFO HF_TOKEN=None WANDB_API_KEY=w" in log.read_text()
