"""``python -m sat_cli.cluster.guard OWNERS ROOT_PID``: end a process tree when an owner dies.

A Ray actor that starts a process (torchrun, ``sat worker --join``, an SGLang server) starts one
guard beside it, with ``OWNERS`` = the actor's pid and its parent's (the raylet), comma
separated. When a node loses its raylet, the actor's worker process may die or linger (seen:
reparented to init, still running), and the processes it started live on in their own sessions,
torchrun's worker ranks in sessions of their own. The guard polls every 0.5 s: it remembers
every descendant of ``ROOT_PID`` (``/proc``'s parent links) and the members of its process
group; once any owner is gone it sends SIGTERM to all of them, SIGKILL after 5 s, and exits.
It also exits, doing nothing, once the tree is gone by itself (a normal stop). Standard library
only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
GRACE_S = 5.0


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[2]), fields[0]


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] not in ("Z", "X")


def tree(root: int) -> set[int]:
    """``root``, its live descendants and the live members of its process group."""
    children: dict[int, list[int]] = {}
    group: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is None or st[2] in ("Z", "X"):
            continue
        children.setdefault(st[0], []).append(int(entry))
        if st[1] == root:
            group.add(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return {p for p in found | group if _alive(p)}


def kill_all(pids: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every pid, SIGKILL to those left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            if not any(_alive(p) for p in pids):
                return
            time.sleep(0.1)


def watch(owners: list[int], root: int) -> None:
    seen: set[int] = set()
    while True:
        now = tree(root) if _alive(root) or seen else set()
        seen = {p for p in seen | now if _alive(p)}
        if not all(_alive(o) for o in owners):
            kill_all(seen | tree(root))
            return
        if not seen:
            return  # the processes ended by themselves
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    owners = argv[0].split(",") if len(argv) == 2 else []
    if not owners or not all(a.isdigit() for a in [*owners, argv[1]]):
        print("usage: python -m sat_cli.cluster.guard OWNER[,OWNER...] ROOT_PID", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only an owner's death or the tree's end
    watch([int(o) for o in owners], int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
