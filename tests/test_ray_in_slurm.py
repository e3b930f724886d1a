"""scripts/ray_in_slurm.sh: Ray started inside a SLURM allocation, then `sat train launcher=ray`.

Run against stand-ins of ``scontrol`` (the allocation's host names), ``srun`` (runs its command
here, recording the node it was aimed at), ``ray`` (records ``start``/``stop``; ``status`` prints
one ``node_…`` line per started node, as Ray's autoscaler summary does: ``test_ray_status_format``)
and ``sat`` (records its arguments). The order and arguments of every call are checked.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from ray_cluster import pids_carrying

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ray_in_slurm.sh"

STANDINS = {
    "scontrol": 'printf "gpu-a\\ngpu-b\\n"\n',
    "srun": (
        'while [ "$#" -gt 0 ]; do case "$1" in -w) echo "srun $2" >> "$CALLS"; shift 2;; '
        "--*) shift;; *) break;; esac; done\n"
        'exec "$@"\n'
    ),
    "ray": (
        'echo "ray $*" >> "$CALLS"\n'
        'case "$1" in\n'
        # a daemon of the node (Ray's raylet, GCS) outlives `ray start --block`'s own process
        '  start) echo x >> "$CALLS.nodes"; sleep 60 & exec sleep 60;;\n'
        '  status) while read -r _; do echo " 1 node_0123abcd"; done < "$CALLS.nodes";;\n'
        "esac\n"
    ),
    "sat": 'echo "sat $*" >> "$CALLS"\n',
}


def _standins(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in STANDINS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    (tmp_path / "calls.nodes").write_text("")
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_GPUS_ON_NODE": "8",
        "RAY_START_TIMEOUT_S": "20",
    }


def test_ray_in_slurm_starts_the_cluster_runs_sat_and_stops(tmp_path):
    job = f"{os.getpid()}{time.monotonic_ns() % 10**6}"
    env = {**_standins(tmp_path), "SLURM_JOB_ID": job}
    ours, other = f"RAY_TMPDIR=/tmp/sat-ray-{job}", f"/tmp/sat-ray-{job}-another-job"
    # another job's Ray on the same node: `ray stop` would stop it too, the script must not
    bystander = subprocess.Popen(["sleep", "60"], env={**os.environ, "RAY_TMPDIR": other})
    try:
        args = ["bash", str(SCRIPT), "experiment=paper_qwen3_30b_a3b", "trainer.nnodes=2"]
        out = subprocess.run(
            args, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
        )
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 node(s) gpu-a gpu-b; head gpu-a" in out.stdout and "8 GPU(s) per node" in out.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    ip = next(c for c in calls if c.startswith("sat ")).split("launcher.address=")[1].split()[0]
    head = [c for c in calls if c.startswith("ray start --head")]
    assert head == [
        f"ray start --head --node-ip-address={ip.split(':')[0]} --port=6379 --num-gpus=8 --block"
    ]
    assert f"ray start --address={ip} --num-gpus=8 --block" in calls
    sat = [c for c in calls if c.startswith("sat ")]
    assert sat == [
        f"sat train launcher=ray launcher.address={ip} experiment=paper_qwen3_30b_a3b trainer.nnodes=2"
    ]
    # sat ran after both nodes had started; every node stopped this job's Ray afterwards: no
    # process with its RAY_TMPDIR is left (the daemons included), and no `ray stop` ran
    assert calls.index(sat[0]) > max(i for i, c in enumerate(calls) if c.startswith("ray start"))
    after = calls[calls.index(sat[0]) :]
    assert "srun gpu-a" in after and "srun gpu-b" in after and "ray stop" not in calls
    assert pids_carrying(ours) == []


def test_ray_in_slurm_bad_input_exits_2(tmp_path):
    env = {k: v for k, v in _standins(tmp_path).items() if k != "SLURM_JOB_NODELIST"}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 2 and "not inside a SLURM allocation" in out.stderr
    port = "must be a port (1-65535)"
    tmp = "must be an absolute path of at most 64 characters"
    for bad, message in (
        ({"RAY_PORT": "70000"}, port),
        ({"RAY_START_TIMEOUT_S": "soon"}, port),
        ({"SAT_RAY_TMPDIR": "relative/ray"}, tmp),
        ({"SAT_RAY_TMPDIR": "/tmp/" + "r" * 60}, tmp),  # Ray's socket paths: < 107 bytes
        ({"SAT_RAY_TMPDIR": "/tmp/a b"}, tmp),
        ({"SAT_RAY_TMPDIR": "/tmp/$(id)"}, tmp),
    ):
        env = {**_standins(tmp_path / next(iter(bad)) / str(len(bad[next(iter(bad))]))), **bad}
        out = subprocess.run(
            ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env
        )
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)
    assert (tmp_path / "calls").read_text() == ""  # nothing was started


def test_ray_status_format():
    """The stand-in's `ray status` lines are those of Ray's autoscaler summary: one
    `` {count} {node_type}`` line per node type, and a node started by hand (no cluster config)
    is its own type ``node_<id>``."""
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    root = Path(ray.__file__).parent / "autoscaler"
    assert 'line = f" {count} {node_type}"' in (root / "_private" / "util.py").read_text()
    assert 'ray_node_type_name = f"node_{node_id}"' in (root / "v2" / "utils.py").read_text()
