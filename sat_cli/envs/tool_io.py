"""The pipes between ``sandbox.run_tool`` and its tool: the launcher's start status, the
tool's input (written without blocking, up to the deadline) and its output (read in chunks, at
most the cap, up to the deadline). Each ends by the call's deadline whatever the tool does."""

from __future__ import annotations

import os
import select
import subprocess
import time

READ_CHUNK = 65536


def _ready(fd: int, event: int, timeout: float) -> bool:
    """Whether ``fd`` is ready for ``event`` (``select.POLLIN`` / ``POLLOUT``; an error or hang-up
    counts as ready: the next read or write says which) within ``timeout`` seconds. ``poll``,
    not ``select``: ``select`` refuses a descriptor above 1023, which a caller with many open
    files hands out (the fifth probe: run_tool raised ValueError there)."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(timeout, 0.0) * 1000))


def start_status(fd: int, deadline: float) -> str | None:
    """The launcher's failure message, '' once it has exec'd the tool (the pipe's end of file),
    or None when the deadline came first."""
    got = b""
    while (left := deadline - time.monotonic()) > 0:
        if not _ready(fd, select.POLLIN, left):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            return got.decode("utf-8", errors="replace")
        got += chunk
    return None


def read_output(proc: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, str]:
    """The tool's output (at most the cap) and why reading stopped: ``exit``, ``timeout`` or
    ``output_limit``. After its first process exits, only what is already written is read."""
    fd = proc.stdout.fileno()
    out = bytearray()
    exited_at = None
    while True:
        now = time.monotonic()
        if now >= deadline:  # what the tool wrote by then is kept (its input may have taken it all)
            while len(out) <= cap and _ready(fd, select.POLLIN, 0):
                if not (chunk := os.read(fd, min(READ_CHUNK, cap + 1 - len(out)))):
                    break
                out += chunk
            if len(out) > cap:
                return bytes(out[:cap]), "output_limit"
            return bytes(out), "timeout"
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        wait = min(deadline - now, 0.05 if exited_at is not None else 0.5)
        ready = _ready(fd, select.POLLIN, wait)
        if not ready or (exited_at is not None and now - exited_at > 0.2):
            if exited_at is not None:
                return bytes(out), "exit"  # children may hold the pipe open: stop here
            continue
        chunk = os.read(fd, min(READ_CHUNK, cap + 1 - len(out)))
        if not chunk:  # a tool may close its output and go on running: the deadline holds
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                return bytes(out), "timeout"
            return bytes(out), "exit"
        out += chunk
        if len(out) > cap:
            return bytes(out[:cap]), "output_limit"


def feed(proc: subprocess.Popen, stdin: bytes, deadline: float) -> None:
    """Write ``stdin`` (small: tool arguments) and close it, giving up at ``deadline``; a tool
    that does not read it may close its end first. The write does not block: a tool can shrink
    its input pipe (``F_SETPIPE_SZ``, before the write) and never read it, and a blocking write
    waited past the deadline for as long as the tool slept (the fourth probe)."""
    fd = proc.stdin.fileno()
    view = memoryview(bytes(stdin))
    try:
        os.set_blocking(fd, False)
        while view and (left := deadline - time.monotonic()) > 0:
            if not _ready(fd, select.POLLOUT, left):
                break
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
    except OSError:  # BrokenPipeError: the tool closed its end
        pass
    try:
        proc.stdin.close()
    except OSError:
        pass
