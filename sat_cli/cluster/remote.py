"""The orchestrator's side of a placed process: objects that look like the local ones.

- :class:`RemoteChannel` has the interface of
  :class:`~sat_cli.trainers.megatron.channel.LocalChannel` (``send``, ``recv``, ``exit_code``,
  ``pids_alive``, ``close``, ``launcher_pid``); ``MegatronTrainer`` drives trainer node 0
  through it exactly as through a local torchrun.
- :class:`RemoteServer` has the interface of
  :class:`~sat_cli.engines.managed_server.ManagedServer` that the engine's ``Supervisor`` uses
  (``start``, ``wait_ready``, ``stop``, ``alive``, ``returncode``, ``failure_message``, ``url``,
  ``pid``); the supervisor and the engine work unchanged. Its ``returncode`` is what the health
  monitor last heard (no Ray call per check); a lost node reads as a dead server whose message
  names the node.

Every call goes through ``RayLauncher.call`` (a deadline on each one); a lost actor turns into
the launcher's failure, which ``MegatronTrainer`` and the engine check while they wait.
"""

from __future__ import annotations

from sat_cli.cluster.ray_env import ClusterError
from sat_cli.errors import EngineError
from sat_cli.util.procs import LOG_TAIL_LINES, tail_lines

LOST_EXIT = -9  # the returncode a RemoteServer reports once its node is lost


class RemoteChannel:
    """torchrun on a cluster node behind a ``NodeHost`` actor (see the module docstring)."""

    def __init__(self, launcher, placed, command, env, **channel_args) -> None:
        self._launcher = launcher
        self._placed = placed
        self.launcher_pid = launcher.call(
            placed, placed.actor.open_channel.remote(command, env, **channel_args), "start torchrun"
        )

    def _quiet(self, ref, what: str, timeout: float | None = None):
        """The call's result, or None when the actor is lost (the launcher records why)."""
        try:
            return self._launcher.call(self._placed, ref, what, timeout)
        except ClusterError:
            return None

    def send(self, data: bytes) -> bool:
        return bool(self._quiet(self._placed.actor.send.remote(data), "a command"))

    def recv(self, timeout: float) -> bytes:
        out = self._quiet(
            self._placed.actor.recv.remote(timeout),
            "a reply",
            timeout + self._launcher.settings.call_timeout_s,
        )
        return out or b""

    def exit_code(self) -> int | None:
        return self._quiet(self._placed.actor.exit_code.remote(), "torchrun's exit code")

    def pids_alive(self, pids) -> bool:
        alive = self._quiet(self._placed.actor.pids_alive.remote(list(pids)), "the worker pids")
        return alive is not False

    def close(self, worker_pids=()) -> int | None:
        return self._quiet(
            self._placed.actor.close_channel.remote(list(worker_pids)),
            "stop torchrun",
            60.0 + self._launcher.settings.call_timeout_s,
        )


class RemoteServer:
    """An SGLang server run by a ``NodeHost`` actor on its node (see the module docstring)."""

    def __init__(self, launcher, placed, server) -> None:
        self._launcher = launcher
        self._placed = placed
        self.name = server.name
        self.log_path = server.log_path
        self.startup_timeout_s = server.startup_timeout_s
        self.host, self.port = launcher.call(
            placed, placed.actor.place_server.remote(server), "place the server"
        )
        self._pid: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def returncode(self) -> int | None:
        if self._launcher.lost(self._placed) is not None:
            return LOST_EXIT
        return self._placed.exit_code if self._pid is not None else None

    def alive(self) -> bool:
        return self._pid is not None and self.returncode is None

    def start(self) -> RemoteServer:
        self._placed.exit_code = None
        self._pid = self._launcher.call(
            self._placed, self._placed.actor.start_server.remote(), "start the server"
        )
        return self

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.5) -> None:
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        self._launcher.call(
            self._placed,
            self._placed.actor.wait_ready.remote(timeout_s),
            "the server's start-up",
            timeout_s + self._launcher.settings.call_timeout_s,
            error=EngineError,
        )

    def stop(self, grace_s: float = 10.0) -> None:
        if self._launcher.lost(self._placed) is not None:
            return  # its node is gone, and its processes with it (the guard ends them)
        try:
            self._launcher.call(
                self._placed,
                self._placed.actor.stop_server.remote(grace_s),
                "stop the server",
                2 * grace_s + 10 + self._launcher.settings.call_timeout_s,
            )
        except ClusterError:
            pass

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        from sat_cli.tracking.remote_text import escape_controls

        # the log is on the shared filesystem; the remote server's text, escaped
        return escape_controls(tail_lines(self.log_path, n), keep="\n")

    def failure_message(self, what: str) -> str:
        lost = self._launcher.lost(self._placed)
        if lost is not None:
            what = lost
        return (
            f"{self.name} at {self.url} {what}; log: {self.log_path}\n"
            f"--- last {LOG_TAIL_LINES} lines of the log ---\n{self.log_tail()}"
        )
