"""The calls of a ``MegatronTrainer`` to its worker (``WorkerCalls``): one JSON command on the
channel (``protocol.py``), its reply matched by id, and, while waiting, the watch that turns a
dead torchrun, a dead worker rank or a lost node (``launcher=ray``) into
``MegatronWorkerError`` (with the tail of the worker's log) within about a second; an error
inside a command comes back as ``ok: false`` and is raised here (``R3Error`` for routing
errors)."""

from __future__ import annotations

import time
from pathlib import Path

from sat_cli.errors import TrainerError

from . import protocol


class MegatronWorkerError(TrainerError):
    """The megatron worker died, failed to start, or failed a command (exit 1 in the CLI)."""


class WorkerCalls:
    """Requests and replies on ``self._chan`` (a ``LocalChannel`` or a ``RemoteChannel``), for
    ``MegatronTrainer``, which holds the channel, the reply buffer, the worker pids, the placer
    and ``_teardown``."""

    def _log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _died(self, what: str) -> MegatronWorkerError:
        code = self._chan.exit_code() if self._chan else None
        reason = self._placer.failure(self._placer.settle_s) if self._placer else None
        if reason is not None:  # torchrun ended because a node of the job was lost
            return self._lost(reason)
        self._teardown()
        return MegatronWorkerError(
            f"megatron worker died during {what} (torchrun exit code {code}); "
            f"last lines of {self.log_path}:\n{self._log_tail()}"
        )

    def _lost(self, reason: str) -> MegatronWorkerError:
        self._teardown()
        return MegatronWorkerError(f"megatron trainer lost during its work: {reason}")

    def _read_reply(self, match, what: str, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        worker_gone_at = None
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.strip():
                    msg = protocol.decode(line)
                    if match(msg):
                        return msg
            if self._chan is None:
                raise MegatronWorkerError("megatron trainer is closed")
            chunk = self._chan.recv(0.2)
            if chunk:
                self._buf += chunk
                continue
            if self._placer is not None:  # a lost node or a dead process of another node
                reason = self._placer.failure()
                if reason is not None:
                    raise self._lost(reason)
            if self._chan.exit_code() is not None:
                raise self._died(what)
            if self._worker_pids and not self._chan.pids_alive(self._worker_pids):
                # torchrun notices within its monitor interval and exits; do not wait long
                worker_gone_at = worker_gone_at or time.monotonic()
                if time.monotonic() - worker_gone_at > 3.0:
                    raise self._died(what)
            if deadline is not None and time.monotonic() > deadline:
                self._teardown()
                raise MegatronWorkerError(
                    f"megatron worker did not answer {what} within {timeout:.0f} s; "
                    f"last lines of {self.log_path}:\n{self._log_tail()}"
                )

    def _request(self, cmd: str, timeout: float | None = None, **fields) -> dict:
        if self._chan is None:
            raise MegatronWorkerError("megatron trainer is closed")
        self._msg_id += 1
        msg_id = self._msg_id
        if not self._chan.send(protocol.encode({"id": msg_id, "cmd": cmd, **fields})):
            raise self._died(cmd)
        reply = self._read_reply(lambda m: m.get("id") == msg_id, cmd, timeout)
        if not reply.get("ok"):
            error = reply.get("error", "unknown error")
            reason = self._placer.failure(self._placer.settle_s) if self._placer else None
            if reason is not None:  # e.g. gloo's "connection closed by peer": a node was lost
                first = error.strip().splitlines()[0] if error.strip() else error
                raise self._lost(f"{reason} (then '{cmd}' failed: {first})")
            if error.startswith("R3Error"):
                from sat_cli.models.r3 import R3Error

                raise R3Error(error.split(": ", 1)[-1])
            raise MegatronWorkerError(
                f"megatron worker failed '{cmd}': {error}\n{reply.get('traceback', '')}"
            )
        return reply

    def _io_path(self, kind: str) -> Path:
        return self.work_dir / "io" / f"{kind}_{self._msg_id + 1}.safetensors"
