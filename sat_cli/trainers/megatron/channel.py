"""The transport under ``MegatronTrainer``: torchrun as a child process, commands on its stdin,
replies on a FIFO (``protocol.py`` has the messages).

:class:`LocalChannel` is that transport on this machine: it makes the reply FIFO, starts the
torchrun argument list in its own session (stdout and stderr appended to the log file) and
offers ``send`` (a line on torchrun's stdin), ``recv`` (what rank 0 wrote on the FIFO within a
timeout), ``exit_code`` (torchrun's), ``pids_alive`` (the worker ranks) and ``close``. With
``launcher=ray`` the same object lives inside a Ray actor on trainer node 0
(``sat_cli.cluster.hosts``) and the client talks to it through ``sat_cli.cluster.remote``: the
FIFO and the processes are then local to that node, as here. Torch-free.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from sat_cli.util.procs import pid_alive


class LocalChannel:
    """torchrun started here, driven over stdin / a reply FIFO (see the module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: dict[str, str],
        log_path: str | os.PathLike,
        fifo: str | os.PathLike,
        cleanup: Sequence[str | os.PathLike] = (),
        note: str | None = None,
    ) -> None:
        self.fifo = Path(fifo)
        self._cleanup = [Path(p) for p in cleanup]
        if self.fifo.exists():
            self.fifo.unlink()
        os.mkfifo(self.fifo)
        self._rfd: int | None = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        # Our own idle writer keeps the FIFO from signalling EOF before the worker opens it;
        # worker death is detected from the processes instead.
        self._keep_fd: int | None = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        if note:
            self._log.write(note.encode())
            self._log.flush()
        self._proc: subprocess.Popen | None = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    @property
    def launcher_pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def send(self, data: bytes) -> bool:
        """Write ``data`` to torchrun's stdin; False when the pipe is gone (torchrun exited)."""
        if self._proc is None:
            return False
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def recv(self, timeout: float) -> bytes:
        """Bytes rank 0 wrote on the FIFO, waiting at most ``timeout`` s (b"" when none)."""
        if self._rfd is None:
            return b""
        ready, _, _ = select.select([self._rfd], [], [], timeout)
        return os.read(self._rfd, 1 << 16) if ready else b""

    def exit_code(self) -> int | None:
        """torchrun's exit code, None while it runs (or after close)."""
        return self._proc.poll() if self._proc is not None else None

    def pids_alive(self, pids: Sequence[int]) -> bool:
        return all(pid_alive(p) for p in pids)

    def close(self, worker_pids: Sequence[int] = ()) -> int | None:
        """EOF on stdin (the worker exits by itself), then SIGTERM and SIGKILL after 10 s each;
        the worker ranks are killed by pid if they outlive torchrun. Returns torchrun's code."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            try:
                proc.stdin.close()  # EOF: a worker still serving exits by itself
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        for pid in worker_pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for fd in (self._rfd, self._keep_fd):
            if fd is not None:
                os.close(fd)
        self._rfd = self._keep_fd = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self.fifo.unlink(missing_ok=True)
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)
        return code
