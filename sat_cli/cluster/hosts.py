"""What a Ray actor of ``launcher=ray`` does on its node: run one of today's processes there.

:class:`NodeHost` is a plain class; ``sat_cli.cluster.launcher`` turns it into a Ray actor
(``max_restarts=0``, threaded so that a health ping never waits behind a long call) placed in
one bundle of the run's placement group. It holds exactly one of:

- an SGLang server (``place_server`` / ``start_server`` / ``wait_ready`` / ``stop_server``): the
  :class:`~sat_cli.engines.sglang.server.SGLangServer` object built by ``build_servers``, so the
  argument list, process group and log file are those of a local launch; the server binds the
  address Ray knows this node by (127.0.0.1 on a loopback cluster) on a port free here;
- trainer node 0 (``open_channel`` and the channel calls): a
  :class:`~sat_cli.trainers.megatron.channel.LocalChannel`, torchrun started on this node and
  driven over its stdin and reply FIFO, relayed call by call;
- trainer node k > 0 (``start_join``): ``sat worker --join HOST:PORT --config ... --node-rank k``,
  the documented command of a joining node, in its own session with its own log.

Every process it starts gets a guard (``sat_cli.cluster.guard``) that ends the whole process
tree if this actor or its raylet dies, e.g. when the node's raylet is killed; and the actor
exits by itself when its raylet is gone. ``ping`` answers the health
monitor with the exit code of the process (None while it runs).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


class NodeHost:
    """One placed process (see the module docstring); a Ray actor at run time."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._server = None  # an SGLangServer
        self._chan = None  # a LocalChannel (trainer node 0)
        self._join: subprocess.Popen | None = None  # `sat worker --join` (trainer node k)
        self._guard: subprocess.Popen | None = None
        # A worker whose raylet died can linger, reparented (seen with Ray 2.60): leave then.
        self._raylet = os.getppid()
        threading.Thread(target=self._exit_with_raylet, name="raylet-watch", daemon=True).start()

    def _exit_with_raylet(self) -> None:
        while os.getppid() == self._raylet:
            time.sleep(0.5)
        os._exit(1)  # the guards end what this actor started

    # -- this node ------------------------------------------------------------------------------
    def node(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "hostname": socket.gethostname(),
            "python": sys.executable,
            "pid": os.getpid(),
        }

    def free_port(self, host: str) -> int:
        from sat_cli.util.procs import free_port

        return free_port(host)

    def ping(self) -> dict:
        """{"exit": the process's exit code or None while it runs (or before it starts)}."""
        if self._server is not None:
            return {"exit": self._server.returncode}
        if self._chan is not None:
            return {"exit": self._chan.exit_code()}
        if self._join is not None:
            return {"exit": self._join.poll()}
        return {"exit": None}

    def _start_guard(self, root_pid: int) -> None:
        self._guard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sat_cli.cluster.guard",
                f"{os.getpid()},{os.getppid()}",  # this actor and its raylet
                str(root_pid),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _stop_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None and guard.poll() is None:
            guard.terminate()
            guard.wait(timeout=10)

    # -- an SGLang server -----------------------------------------------------------------------
    def place_server(self, server) -> tuple[str, int]:
        """Keep ``server`` here, bound to this node's address on a port free here."""
        from sat_cli.util.procs import free_port

        host = self.node()["ip"]
        server.rebind(host, free_port(host))
        self._server = server
        return server.host, server.port

    def start_server(self) -> int:
        self._server.start()
        self._start_guard(self._server.pid)
        return self._server.pid

    def wait_ready(self, timeout_s: float | None = None) -> None:
        self._server.wait_ready(timeout_s)

    def stop_server(self, grace_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s)
        self._stop_guard()

    def server_alive(self) -> bool:
        return self._server is not None and self._server.alive()

    # -- trainer node 0: torchrun driven over stdin / the reply FIFO ----------------------------
    def open_channel(self, command: list[str], env: dict[str, str], **channel_args) -> int:
        from sat_cli.trainers.megatron.channel import LocalChannel
        from sat_cli.trainers.megatron.launch import launch_env

        self._chan = LocalChannel(command, env=launch_env(env), **channel_args)
        self._start_guard(self._chan.launcher_pid)
        return self._chan.launcher_pid

    def send(self, data: bytes) -> bool:
        return self._chan is not None and self._chan.send(data)

    def recv(self, timeout: float) -> bytes:
        return self._chan.recv(timeout) if self._chan is not None else b""

    def exit_code(self) -> int | None:
        return self._chan.exit_code() if self._chan is not None else None

    def pids_alive(self, pids: list[int]) -> bool:
        return self._chan is not None and self._chan.pids_alive(pids)

    def close_channel(self, worker_pids: list[int]) -> int | None:
        chan, self._chan = self._chan, None
        code = chan.close(worker_pids) if chan is not None else None
        self._stop_guard()
        return code

    # -- trainer node k > 0: `sat worker --join` ------------------------------------------------
    def start_join(self, command: list[str], log_path: str) -> int:
        from sat_cli.trainers.megatron.launch import launch_env

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== sat: {' '.join(command)}\n".encode())
            log.flush()
            self._join = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=launch_env(),
                start_new_session=True,
            )
        self._start_guard(self._join.pid)
        return self._join.pid

    def stop_join(self, grace_s: float = 30.0) -> int | None:
        """Wait up to ``grace_s`` for the node's ranks to end with node 0, then end the tree."""
        from sat_cli.cluster.guard import kill_all, tree

        proc, self._join = self._join, None
        if proc is None:
            return None
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tree(proc.pid)
        if left:
            kill_all(left)
        proc.wait()
        self._stop_guard()
        return proc.returncode
