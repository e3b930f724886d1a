"""A real two-node Ray cluster on the loopback interface, for the ``ray`` test tier.

Run as a script (``python tests/ray_cluster.py``), in its own process, by the fixture
:func:`ray_cluster` below: ``ray.cluster_utils.Cluster`` with a head node and one added node,
one CPU each and a custom resource per node (``node0``, ``node1``), every address 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in its environment before Python starts: otherwise Ray
moves the cluster to the machine's own IP), no dashboard, usage statistics off, a ``RAY_TMPDIR``
of its own, and fast node-death detection (a missed heartbeat counts after 0.5 s, a node is dead
after 3: a test-cluster setting, not sat's). It prints one JSON line (the address) and then
obeys lines on its stdin:

- ``kill-raylet`` — SIGKILL the raylet of the newest worker node (what a lost machine looks
  like to Ray), then the rest of that node's Ray processes;
- ``add-node`` — start another node (``node<k>`` resource), to heal the cluster after a kill;
- ``quit`` (or EOF: the test process is gone) — shut the cluster down and exit.

A hard timeout (``--timeout``, default 1800 s) ends it whatever happens. The fixture checks
afterwards that no process that carries the cluster's ``RAY_TMPDIR`` is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


def serve(timeout_s: float) -> None:
    from ray.cluster_utils import Cluster

    timer = threading.Timer(timeout_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.daemon = True  # not a reason to stay up after `quit`
    timer.start()
    head = dict(
        num_cpus=1,
        resources={"node0": 1},
        node_ip_address="127.0.0.1",
        include_dashboard=False,
        _system_config=FAST_HEALTH,
    )
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    nodes = [cluster.head_node]
    added = 1
    try:
        nodes.append(
            cluster.add_node(num_cpus=1, resources={"node1": 1}, node_ip_address="127.0.0.1")
        )
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "kill-raylet":  # the newest live worker node (never the head)
                node = nodes.pop()
                os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
                # what is left of that node (its object store, log monitor) goes too, and the
                # Cluster object stops counting it
                cluster.remove_node(node, allow_graceful=False)
                cluster.wait_for_nodes(timeout=60)  # until the GCS counts the node dead
                print(json.dumps({"killed": len(nodes)}), flush=True)
            elif cmd[0] == "add-node":
                added += 1
                k = added  # a fresh resource name
                nodes.append(
                    cluster.add_node(
                        num_cpus=1, resources={f"node{k}": 1}, node_ip_address="127.0.0.1"
                    )
                )
                cluster.wait_for_nodes()
                print(json.dumps({"added": k}), flush=True)
            elif cmd[0] == "quit":
                break
    finally:
        cluster.shutdown()


# ----------------------------------------------------------------------------- the fixture side


class RayTestCluster:
    """The cluster process seen from a test: its address and the commands above."""

    def __init__(self, tmp: Path, timeout_s: float = 1800.0) -> None:
        self.tmp = tmp
        self.env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_TMPDIR": str(tmp),
            "PYTHONUNBUFFERED": "1",
        }
        self.log = open(tmp / "cluster.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--timeout", str(timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=self.env,
            text=True,
            start_new_session=True,
        )
        self.address = self._answer("address", 120)

    def _answer(self, key: str, timeout_s: float):
        out: dict = {}

        def read() -> None:
            for line in self.proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if key in msg:
                    out["v"] = msg[key]
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout_s)
        if "v" not in out:
            self.stop()
            raise RuntimeError(
                f"the test Ray cluster did not answer {key!r} within {timeout_s:.0f} s; log:\n"
                + (self.tmp / "cluster.log").read_text(errors="replace")[-3000:]
            )
        return out["v"]

    def command(self, line: str, key: str, timeout_s: float = 120):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer(key, timeout_s)

    def kill_raylet(self) -> None:
        """Kill the newest worker node; returns once Ray counts it dead."""
        self.command("kill-raylet", "killed")

    def add_node(self) -> int:
        return self.command("add-node", "added")

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def leftover_pids(self) -> list[int]:
        """Processes that carry this cluster's RAY_TMPDIR (Ray's, and what its actors started)."""
        return pids_carrying(f"RAY_TMPDIR={self.tmp}")


def pids_carrying(mark: str) -> list[int]:
    """Live processes (not this one) whose environment holds ``mark`` (``NAME=value``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if mark.encode() in env.split(b"\0") and stat.rsplit(")", 1)[1].split()[0] not in "ZX":
            found.append(int(entry))
    return found


def stop_processes_of(tmp: Path, timeout_s: float = 20) -> list[int]:
    """SIGTERM, then SIGKILL after ``timeout_s``, every process that carries ``RAY_TMPDIR=tmp``;
    returns those still there. Not ``ray stop``: that stops every Ray process of the machine's
    user, whatever its RAY_TMPDIR (``ray.scripts.scripts.stop`` matches process names), so it
    would take down the shared test cluster of another test running beside it."""
    import time

    mark = f"RAY_TMPDIR={tmp}"
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        for pid in pids_carrying(mark):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids_carrying(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
    return pids_carrying(mark)


def new_tmp() -> Path:
    # Ray's socket paths must stay under 107 bytes: a short folder of its own
    return Path(tempfile.mkdtemp(prefix="sat-ray-"))


if __name__ == "__main__":
    timeout = float(sys.argv[sys.argv.index("--timeout") + 1]) if "--timeout" in sys.argv else 1800
    serve(timeout)
