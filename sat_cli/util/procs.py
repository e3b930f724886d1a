"""Small process and port helpers shared by the code that starts servers (SGLang, MLflow, ...).

Linux only where it reads ``/proc`` (the platform this project runs its servers on).
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import NoReturn

LOG_TAIL_LINES = 40


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def abort_connection(conn) -> None:
    """Shut an ``http.client`` connection's socket down, so that a read or write blocked on it
    in another thread fails now (a deadline passed, or the client is closing)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def tail_lines(path: str | os.PathLike, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            lines = deque(f, maxlen=n)
    except FileNotFoundError:
        return ""
    return b"".join(lines).decode("utf-8", errors="replace")


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a killed child stays a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def live_group_members(pgid: int) -> list[int]:
    """PIDs of the processes in process group ``pgid`` that are not zombies (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # the process went away while we looked
            continue
        # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may contain spaces/parens.
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(entry))
    return members


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` in seconds (Linux /proc; OSError when it is
    gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # comm may contain spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def http_get_status(host: str, port: int, path: str, timeout_s: float) -> int | None:
    """Status code of ``GET path``, or None when the server cannot be reached."""
    import http.client  # here: `sat --help` imports this module (exit_process)

    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def listening_inodes(port: int) -> set[int] | None:
    """Inodes of the TCP sockets in LISTEN state on ``port`` (any address; Linux
    ``/proc/net/tcp`` and ``tcp6``), or None where neither can be read."""
    found: set[int] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:  # "sl local_address rem_address st ... uid timeout inode"
            fields = row.split()
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                found.add(int(fields[9]))
    return found if readable else None


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` has open (empty where its fds cannot be read)."""
    found: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def group_holds_socket(pgid: int, inodes: set[int]) -> bool:
    """Whether a live process of group ``pgid`` has one of the sockets ``inodes`` open."""
    return any(socket_inodes(pid) & inodes for pid in live_group_members(pgid))


def exit_process(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` does, without the interpreter's teardown when torch
    is loaded (1.1-1.5 s of CPU with torch, transformers and mlflow: module dictionaries and
    every object freed one by one, at the end of every `sat train` or `sat eval`).

    What an exit guarantees still happens, in the interpreter's order: non-daemon threads are
    joined (``threading._shutdown``, which also stops idle thread pools), the ``atexit``
    handlers run (logging flushes its files, Ray and MLflow close), standard output and error
    are flushed. What is skipped is what Python does not promise at exit anyway: ``__del__`` of
    objects still alive. A light process (no torch) exits the usual way."""
    import atexit
    import sys
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if "torch" not in sys.modules or shutdown is None or run_exitfuncs is None:
        sys.exit(code)
    status = code if isinstance(code, int) else 0 if code is None else 1
    if not isinstance(code, int | None):
        print(code, file=sys.stderr)  # sys.exit("message") prints it, exit 1
    shutdown()
    run_exitfuncs()
    flush_std_streams()
    os._exit(status)


def flush_std_streams() -> None:
    """Flush standard output and error before an ``os._exit``; a closed pipe or terminal has
    nothing to flush into."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
