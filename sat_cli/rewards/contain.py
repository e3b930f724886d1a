"""A reward worker (``pool.py``) as a contained process tree: what it starts dies with it.

In the worker, first thing (``contain_self``): its own session and process group
(``setsid``: a Ctrl-C at the terminal reaches ``sat`` only, which then stops the workers), a
child subreaper (``PR_SET_CHILD_SUBREAPER``: a process its code starts and orphans, e.g. a
double-forked daemon, is re-parented to the worker, not to init, so it stays in the worker's
tree), ``RLIMIT_AS`` of ``memory_mb`` MiB (a reward that allocates more gets a
``MemoryError``, counted as that sample's error), and a watchdog thread that kills the tree and
exits when ``sat`` is gone (killed with ``SIGKILL``: no ``finally`` of ``sat``'s ran).

From ``sat`` (``kill_tree``): the worker's process group and the worker are stopped
(``SIGSTOP``: a fork loop cannot outrun the kill), then every descendant of the worker, found
through ``/proc`` while the worker (their subreaper) still exists, and its process group get
``SIGKILL`` until none is left (bounded by ``KILL_WAIT_S``), then the worker. ``pool.py`` calls it on every
exit path: a timed-out or dead call, ``close()`` (the run's ``finally``: normal end, an error,
Ctrl-C, SIGTERM) and ``atexit``. A process that calls ``setsid`` and is orphaned *after* its
worker died is out of reach (no cgroup is used: the pids hierarchy is not writable for
ordinary users).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
KILL_WAIT_S = 5.0
WATCH_S = 0.2
MB = 1 << 20


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``/proc/<pid>/task/*/children``)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL ``pid``'s descendants, its process group and (``include_self``) ``pid`` itself,
    again until none is left or ``KILL_WAIT_S`` has passed."""
    from sat_cli.util.procs import live_group_members, pid_alive

    if include_self:  # frozen first: a worker that keeps forking cannot outrun the loop
        for stop in (lambda: os.killpg(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGSTOP)):
            try:
                stop()
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        below = [p for p in descendants(pid) if pid_alive(p)]
        group = [p for p in live_group_members(pid) if p != os.getpid() and p != pid]
        for p in below + group:
            _kill(p)
        if not below and not group:
            break
        time.sleep(0.01)  # the killed ones' orphans reach the subreaper
    if include_self:
        _kill(pid)


def is_child(pid: int) -> bool:
    """Whether ``pid`` is this process's child not yet reaped (so the number is still its)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def stop_worker_tree(pid: int) -> None:
    """``kill_tree`` while ``pid`` is still this process's child; after it was reaped, only
    what is left in its process group: a member holds the group's number, so it cannot have
    been given to another process (no signal can reach a stranger)."""
    from sat_cli.util.procs import live_group_members

    if is_child(pid):
        kill_tree(pid)
    elif live_group_members(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    kill_tree(os.getpid(), include_self=False)
    os._exit(1)


def contain_self(memory_mb: int | None) -> None:
    """In a new worker (module docstring); ``memory_mb`` None: no address-space limit."""
    os.setsid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    if memory_mb is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * MB, memory_mb * MB))
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True).start()
