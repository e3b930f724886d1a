"""A server subprocess managed by sat: its own process group, a log file, a health URL. Any
engine's (the neutral part of an engine served by another process; torch-free).

:class:`ManagedServer` is what :class:`sat_cli.engines.sglang.server.SGLangServer` and
``SGLangRouter`` build on, and an engine plug-in's server too (``tests/engine_plugin.py``):
``start()`` (``start_new_session=True``, output appended
to the log), ``wait_ready()`` (poll the health path until 200; EngineError quoting the log tail on
exit, on timeout, or when what answers is another process on the port), ``stop()`` (SIGTERM to
the group, SIGKILL after a grace period, return when no live process of the group is left).
Subclasses give ``command``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from sat_cli.errors import EngineError
from sat_cli.util.procs import (
    LOG_TAIL_LINES,
    free_port,
    group_holds_socket,
    http_get_status,
    listening_inodes,
    live_group_members,
    tail_lines,
)


class ManagedServer:
    """A server subprocess in its own process group, logging to a file, with a health URL."""

    name = "process"
    # whether the process itself binds the port (no launch prefix: a container or job launcher in
    # front of it may run the server outside this process group), so that wait_ready can check
    # that the answer came from it
    binds_itself = True

    def __init__(
        self,
        *,
        host: str,
        port: int | None,
        log_path: str | os.PathLike,
        health_path: str,
        startup_timeout_s: float,
        env: Mapping[str, str] | None,
    ) -> None:
        if host != "127.0.0.1":
            # Servers are loopback-only in this project; several nodes go through the router.
            raise ValueError(f"{self.name} must bind 127.0.0.1, got host={host!r}")
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.log_path = Path(log_path)
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env) if env is not None else None
        self._proc: subprocess.Popen | None = None

    def rebind(self, host: str, port: int) -> None:
        """Listen on ``host:port`` instead, before ``start()``: a server that ``launcher=ray``
        places on a cluster node binds the address Ray knows that node by (127.0.0.1 on a
        loopback cluster) so that the orchestrator on another node can reach it."""
        if self._proc is not None:
            raise EngineError(f"{self.name} at {self.url} is already started; cannot rebind")
        self.host, self.port = host, int(port)

    # -- to be provided by subclasses -------------------------------------------------------
    @property
    def command(self) -> list[str]:
        raise NotImplementedError

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def pgid(self) -> int | None:
        # start_new_session=True makes the child a session and group leader: pgid == pid.
        return self.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> ManagedServer:
        if self.alive():
            raise EngineError(f"{self.name} at {self.url} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = None
        if self.env is not None:
            env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== sat: starting {self.name}: {self.command}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        from sat_cli.tracking.remote_text import escape_controls

        return escape_controls(tail_lines(self.log_path, n), keep="\n")  # the server's text

    def failure_message(self, what: str) -> str:
        tail = self.log_tail()
        return (
            f"{self.name} at {self.url} {what}; log: {self.log_path}\n"
            f"--- last {LOG_TAIL_LINES} lines of the log ---\n{tail}"
        )

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.5) -> None:
        """Block until ``GET health_path`` answers 200; raise EngineError on exit or timeout."""
        if self._proc is None:
            raise EngineError(f"{self.name} was never started")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.returncode
            if code is not None:
                raise EngineError(self.failure_message(f"exited with code {code} before ready"))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                message = self.failure_message(f"was not healthy after {timeout_s:.0f} s")
                self.stop()
                raise EngineError(message)
            if self.ready(timeout_s=min(max(remaining, 0.1), 30.0)):
                self._check_listener()
                return
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))

    def _check_listener(self) -> None:
        """The port was picked free, then released until the server binds it (SGLang: 20-40 s
        of imports): another process can take it meanwhile, e.g. a second run's server. Its
        health answer must not pass for this server's, or this run would generate with, and
        load its weights into, the other one: EngineError unless a process of this group holds
        a listening socket on the port."""
        if not self.binds_itself or self.pgid is None:
            return
        inodes = listening_inodes(self.port)
        if not inodes or group_holds_socket(self.pgid, inodes):
            return  # cannot tell (no /proc), or ours
        message = self.failure_message(
            f"is not what answers on port {self.port}: another process took the port between "
            "its pick and this server's bind (a second run on this machine?)"
        )
        self.stop()
        raise EngineError(message)

    def ready(self, timeout_s: float) -> bool:
        """One readiness probe: ``GET health_path`` answers 200."""
        return http_get_status(self.host, self.port, self.health_path, timeout_s) == 200

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; return when none is left."""
        if self._proc is None:
            return
        pgid = self.pgid
        if self._proc.poll() is not None and not live_group_members(pgid):
            return  # already stopped (or died with its whole group)
        self._signal_group(pgid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Children of the leader may outlive it (or ignore SIGTERM): wait for the group too.
        deadline = time.monotonic() + grace_s
        while live_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if live_group_members(pgid):
            self._signal_group(pgid, signal.SIGKILL)
        self._proc.wait()
        deadline = time.monotonic() + 5.0
        while live_group_members(pgid):
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.name}: processes {live_group_members(pgid)} of group {pgid} "
                    "survived SIGKILL"
                )
            time.sleep(0.05)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
