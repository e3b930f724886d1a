"""Cluster engines on one machine: the smoke sweep through each executor, and Ray's start-up cost.

    .venv/bin/python bench/cluster.py [--jobs 2] [--repeat 1]

In one run, on the same machine and the same tracking server (``sat mlflow-server`` on a fresh
PostgreSQL, tests/postgres_server.py):

1. the two-node loopback Ray cluster of the tests (tests/ray_cluster.py): start-up and
   shut-down time;
2. ``sat sweep sweeps/smoke.yaml --jobs J`` (4 runs) with ``--executor local``, ``ray`` (on that
   cluster) and ``slurm --slurm-cluster local`` (submitit's local executor), each into its own
   run.dir: wall time and the ratio to local;
3. ``launcher=ray``'s own start-up: connect, place a placement group of two trainer-node
   bundles, start one actor per bundle, and close it all again (``RayLauncher.start`` +
   ``close``), in a fresh process each time.

Prints a table; the figures go into bench/README.md ("Cluster engines").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

LAUNCHER_START = """
import sys, time
t0 = time.perf_counter()
from sat_cli.cluster.launcher import RayLauncher, RaySettings
la = RayLauncher(RaySettings(address=sys.argv[1]), trainer_nodes=2, servers=0, log=lambda m: None)
la.start()
t1 = time.perf_counter()
la.close()
print(f"START {t1 - t0:.3f} CLOSE {time.perf_counter() - t1:.3f}")
"""


def timed(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}); see {log}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    from postgres_server import PostgresServer
    from ray_cluster import RayTestCluster, new_tmp

    from sat_cli.util.procs import free_port

    work = Path(tempfile.mkdtemp(prefix="sat-bench-cluster-"))
    t0 = time.perf_counter()
    cluster = RayTestCluster(new_tmp())
    ray_up = time.perf_counter() - t0
    pg = PostgresServer().start()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "mlflow-server", "--backend-store-uri", pg.uri]
        + ["--artifacts-destination", str(work / "mlartifacts"), "--port", str(port)],
        stdout=open(work / "server.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rows: dict[str, list[float]] = {"local": [], "ray": [], "slurm (submitit local)": []}
    launcher: list[tuple[float, float]] = []
    try:
        while "Ctrl-C to stop" not in (work / "server.log").read_text():
            assert server.poll() is None, (work / "server.log").read_text()
            time.sleep(0.5)
        uri = f"http://127.0.0.1:{port}"
        common = [sys.executable, "-m", "sat_cli.cli", "sweep", str(REPO / "sweeps/smoke.yaml")]
        common += ["--jobs", str(args.jobs), "tracking=mlflow_server", f"tracking.uri={uri}"]
        executors = {
            "local": [],
            "ray": ["--executor", "ray", "--ray-address", cluster.address],
            "slurm (submitit local)": ["--executor", "slurm", "--slurm-cluster", "local"],
        }
        names = list(executors)
        for r in range(args.repeat):
            order = names[r % len(names) :] + names[: r % len(names)]  # no order advantage
            for name in order:
                extra = executors[name]
                folder = work / f"{name.split()[0]}-{r}"
                folder.mkdir()
                wall = timed([*common, *extra, f"run.dir={folder}"], folder, folder / "out.log")
                rows[name].append(wall)
                print(f"  {name:<24} {wall:7.1f} s", flush=True)
            out = subprocess.run(
                [sys.executable, "-c", LAUNCHER_START, cluster.address],
                capture_output=True,
                text=True,
                timeout=600,
            )
            parts = out.stdout.split()
            launcher.append((float(parts[1]), float(parts[3])))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        pg.stop()
        t1 = time.perf_counter()
        cluster.stop()
        ray_down = time.perf_counter() - t1
    base = min(rows["local"])
    print(f"\nsmoke sweep (4 runs, --jobs {args.jobs}), best of {args.repeat}:")
    print(f"{'executor':<24} {'wall s':>8} {'vs local':>9}")
    for name, walls in rows.items():
        print(f"{name:<24} {min(walls):8.1f} {min(walls) / base:9.2f}")
    start = min(a for a, _ in launcher)
    close = min(b for _, b in launcher)
    print(f"\ntwo-node loopback Ray cluster: up {ray_up:.1f} s, down {ray_down:.1f} s")
    print(
        f"launcher=ray start-up (connect + placement group of 2 bundles + 2 actors): {start:.2f} s;"
        f" close {close:.2f} s"
    )


if __name__ == "__main__":
    main()
