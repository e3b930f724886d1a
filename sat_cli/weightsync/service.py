"""A :class:`WeightSender` in another process, behind a socket: the Megatron trainer's sender.

The Megatron worker's rank 0 holds the gathered full tensors of each captured version (the
``capture`` command of the worker protocol: every rank gathers its shards, experts and stages,
``convert.megatron_to_hf`` names them as the disk export does, rank 0 keeps them in the engine's
dtype) and is rank 0 of the weight-update group. The driver's rollout thread drives it through
:class:`RemoteSender`, which has the sender's methods, over a TCP connection to
:class:`SenderService` (a thread of rank 0, bound to the trainer's rendezvous host): JSON lines
``{"id", "op", "args"}`` → ``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error",
"kind"}``. Training commands go on meanwhile over the worker's own channel: a broadcast from a
held version does not wait for a step.

Every call has a deadline (``op_timeout_s``, longer for ``write_hf``); a sender error comes back
as ``WeightSyncError``, a dead or silent service as ``WeightSyncError`` too (the loop then sends
the version from disk, written by the same service, or the run fails naming it).
"""

from __future__ import annotations

import json
import socket
import threading

from sat_cli.errors import WeightSyncError
from sat_cli.weightsync import buckets as B

OPS = (
    "listen",
    "connect",
    "connected",
    "send",
    "abort",
    "plan",
    "checksums",
    "write_hf",
    "has",
    "keep",
    "nbytes",
    "versions",
)


class SenderService:
    """Serve ``sender``'s methods on ``host:port`` (port 0: a free one; ``self.port``)."""

    def __init__(self, sender, host: str = "127.0.0.1", port: int = 0):
        self.sender = sender
        self._sock = socket.create_server((host, int(port)))
        self.port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True, name="sat-sender")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn, conn.makefile("rwb") as f:
                for line in f:
                    f.write((json.dumps(self._answer(line)) + "\n").encode())
                    f.flush()

    def _answer(self, line: bytes) -> dict:
        msg_id = None
        try:
            msg = json.loads(line)
            msg_id, op, args = msg.get("id"), msg["op"], msg.get("args", {})
            if op not in OPS:
                raise ValueError(f"unknown sender op {op!r}")
            if op == "connected":
                return {"id": msg_id, "ok": True, "result": self.sender.connected}
            result = getattr(self.sender, op)(**args)
            if op == "plan":
                result = [[m.as_json() for m in b.metas] for b in result]
            elif op == "send":
                s = self.sender
                result = {"bytes": result, "send_s": s.last_send_s, "flatten_s": s.last_flatten_s}
            elif op == "write_hf":
                result = str(result)
            return {"id": msg_id, "ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
            kind = "sync" if isinstance(exc, WeightSyncError) else type(exc).__name__
            return {"id": msg_id, "ok": False, "kind": kind, "error": f"{exc}"}

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class RemoteSender:
    """The driver's proxy of a :class:`SenderService` (the sender's methods, module doc)."""

    def __init__(
        self, host: str, port: int, *, op_timeout_s: float = 600.0, write_timeout_s: float = 3600.0
    ):
        self.address = (host, int(port))
        self.op_timeout_s, self.write_timeout_s = op_timeout_s, write_timeout_s
        self._lock = threading.Lock()
        self._sock = None
        self._file = None
        self._id = 0
        self.last_send_s = self.last_flatten_s = 0.0

    def _call(self, op: str, _wait: float | None = None, **args):
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.create_connection(self.address, timeout=30.0)
                    self._file = self._sock.makefile("rwb")
                self._sock.settimeout(_wait or self.op_timeout_s)
                self._id += 1
                self._file.write(
                    (json.dumps({"id": self._id, "op": op, "args": args}) + "\n").encode()
                )
                self._file.flush()
                line = self._file.readline()
            except OSError as exc:
                self._drop()
                raise WeightSyncError(
                    f"the trainer's weight sender at {self.address[0]}:{self.address[1]} did "
                    f"not answer {op} ({type(exc).__name__}: {exc})"
                ) from None
            if not line:
                self._drop()
                raise WeightSyncError(f"the trainer's weight sender closed during {op}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WeightSyncError(f"trainer's weight sender, {op}: {reply.get('error')}")
        return reply["result"]

    def _drop(self) -> None:
        for c in (self._file, self._sock):
            try:
                if c is not None:
                    c.close()
            except OSError:
                pass
        self._sock = self._file = None

    # --- the sender's methods ------------------------------------------------------------------
    def listen(self, master_addr: str, port: int, world_size: int, timeout_s: float) -> int:
        self._group_timeout_s = float(timeout_s)  # a send ends within it (the group's timeout)
        return int(
            self._call(
                "listen",
                master_addr=master_addr,
                port=port,
                world_size=world_size,
                timeout_s=timeout_s,
            )
        )

    def connect(self, group_name: str, backend: str) -> None:
        self._call("connect", group_name=group_name, backend=backend)

    @property
    def connected(self) -> bool:
        try:
            return bool(self._call("connected"))
        except WeightSyncError:
            return False

    def send(self, version: int, index: int) -> int:
        wait = max(self.op_timeout_s, getattr(self, "_group_timeout_s", 0.0) + 60.0)
        r = self._call("send", wait, version=int(version), index=int(index))
        self.last_send_s, self.last_flatten_s = float(r["send_s"]), float(r["flatten_s"])
        return int(r["bytes"])

    def abort(self) -> None:
        self._call("abort")

    def plan(self, version: int) -> list[B.Bucket]:
        rows = self._call("plan", version=int(version))
        return [B.Bucket(tuple(B.TensorMeta.from_json(r) for r in b)) for b in rows]

    def checksums(self, version: int, layout: str) -> dict[str, str]:
        return dict(self._call("checksums", version=int(version), layout=layout))

    def write_hf(self, version: int, folder) -> str:
        from pathlib import Path

        return self._call(
            "write_hf",
            self.write_timeout_s,
            version=int(version),
            folder=str(Path(folder).resolve()),
        )

    def has(self, version: int) -> bool:
        return bool(self._call("has", version=int(version)))

    def keep(self, versions) -> None:
        self._call("keep", versions=sorted(int(v) for v in versions))

    def nbytes(self, version: int) -> int:
        return int(self._call("nbytes", version=int(version)))

    def versions(self) -> list[int]:
        return [int(v) for v in self._call("versions")]

    def close(self) -> None:
        with self._lock:
            self._drop()
