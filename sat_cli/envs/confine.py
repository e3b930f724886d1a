"""How the tool sandbox confines a child, probed once per process (Linux; ``sandbox.py`` uses it).

The ``strict`` sandbox (``env.sandbox=strict``, the default; ``isolate.py``) needs every layer:
``strict_refusal()`` probes it once and says which step the kernel refused; then a strict call
does not run (and an environment that runs tools refuses to start). What follows is the
``unsafe_local`` sandbox, which takes what the machine permits:

Two mechanisms depend on what the machine permits, so each is probed and the chosen mode is
reported (``isolation()``):

* **No network.** ``netns``: the launcher (``launch.py``) calls ``unshare(CLONE_NEWNET)`` before it
  execs the tool, which gets
  a network namespace with only a downed loopback, so every connect fails, also to 127.0.0.1
  (works as root, or where the kernel lets unprivileged users unshare). ``userns``: the same
  through a new user namespace first (``CLONE_NEWUSER | CLONE_NEWNET``, unprivileged). ``python``:
  neither is permitted; a ``sitecustomize.py`` on the tool's ``PYTHONPATH`` replaces
  ``socket.socket`` with a class that refuses to be created. That blocks only Python tools that do
  not undo it; it is a seat belt, not a boundary.
* **Process count.** ``cgroup``: a fresh pids cgroup per call (v1 ``pids`` hierarchy, or v2 where
  the own cgroup delegates ``pids``) with ``pids.max``; it also lists every process the tool made,
  including ones that left its process group (``setsid``), so cleanup kills them all. ``rlimit``:
  ``RLIMIT_NPROC`` set to the user's current process count plus the allowance. The kernel ignores
  ``RLIMIT_NPROC`` for root, so as root without a writable pids cgroup a fork bomb is stopped only
  by the wall-clock deadline and the group kill (mode ``none``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

from sat_cli.envs import launch

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NET_FLAGS = {"netns": CLONE_NEWNET, "userns": CLONE_NEWUSER | CLONE_NEWNET}
CGROUP_ROOT = Path("/sys/fs/cgroup")

SITECUSTOMIZE = '''"""Written by sat's tool sandbox: this Python tool may not open sockets."""
import socket as _s


class _NoNetwork(_s.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("network access is disabled in the tool sandbox")


_s.socket = _NoNetwork
'''


def _probe_net(flags: int) -> bool:
    """Whether a child that unshares ``flags`` starts and sees no network."""
    code = "import socket,sys;sys.exit([n for _, n in socket.if_nameindex()] != ['lo'])"
    spec = {"net_flags": flags, "env": {"LANG": "C.UTF-8"}}
    try:
        done = subprocess.run(
            launch.command(spec, [sys.executable, "-S", "-c", code]),
            env=launch.launcher_environment(),
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.cache
def net_mode() -> str:
    """``netns``, ``userns`` or ``python`` (module docstring)."""
    for mode, flags in NET_FLAGS.items():
        if _probe_net(flags):
            return mode
    return "python"


def _own_cgroup(controller: str) -> Path | None:
    """This process's cgroup folder for ``controller`` (v1), or its v2 folder when it delegates
    ``controller`` to children; None when neither exists."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
    for line in lines:
        if line.startswith("0::"):
            own = CGROUP_ROOT / line[3:].lstrip("/")
            try:
                if controller in (own / "cgroup.subtree_control").read_text().split():
                    return own
            except OSError:
                return None
    return None


def _new_cgroup(controller: str, limits) -> Path | None:
    """A fresh child cgroup of this process's ``controller`` cgroup, with ``limits(path)``
    (which writes its limit files) applied; None where either is not permitted."""
    parent = _own_cgroup(controller)
    if parent is None:
        return None
    path = parent / f"sat-tool-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
    except OSError:
        return None
    try:
        limits(path)
    except OSError:
        path.rmdir()
        return None
    return path


def new_pids_cgroup(max_procs: int) -> Path | None:
    """A fresh pids cgroup limited to ``max_procs`` processes, or None where not permitted."""
    return _new_cgroup("pids", lambda path: (path / "pids.max").write_text(str(max_procs)))


def _memory_limits(path: Path, limit_mb: int) -> None:
    if (path / "memory.limit_in_bytes").exists():  # v1
        (path / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
        return
    (path / "memory.max").write_text(str(limit_mb << 20))
    if (path / "memory.swap.max").exists():
        (path / "memory.swap.max").write_text("0")


def new_memory_cgroup(limit_mb: int, pids: Path | None = None) -> Path | None:
    """A fresh memory cgroup capped at ``limit_mb`` MiB for all of one call's processes and
    the pages they own (``tmpfs`` and ``memfd`` pages too): v1 ``memory.limit_in_bytes``, v2
    ``memory.max`` with ``memory.swap.max`` 0; None where not permitted. On cgroup v2, where
    the call's pids cgroup ``pids`` lies in the same hierarchy, the limits go into it: a process
    is in one v2 cgroup only, so joining a second, sibling one would take it out of ``pids``."""
    if pids is not None and _own_cgroup("memory") == pids.parent:
        try:
            _memory_limits(pids, limit_mb)
        except OSError:
            return None
        return pids
    return _new_cgroup("memory", lambda path: _memory_limits(path, limit_mb))


def oom_kills(path: Path) -> int:
    """How many processes the kernel killed for the memory cgroup ``path``'s limit (v1
    ``memory.oom_control``, v2 ``memory.events``: their ``oom_kill`` line); 0 for another
    controller's cgroup or where unreadable."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            lines = (path / name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


@functools.cache
def memory_mode() -> str:
    """``cgroup`` where a memory cgroup per call can be made (the call's processes share one
    ``memory_mb + work_mb`` budget), else ``rlimit`` (``RLIMIT_AS`` per process only: a call
    of ``n`` processes can hold ``n * memory_mb``)."""
    probe = new_memory_cgroup(64)
    if probe is not None:
        probe.rmdir()
        return "cgroup"
    return "rlimit"


@functools.cache
def proc_mode() -> str:
    """``cgroup``, ``rlimit`` or ``none`` (module docstring)."""
    probe = new_pids_cgroup(1)
    if probe is not None:
        probe.rmdir()
        return "cgroup"
    return "none" if os.geteuid() == 0 else "rlimit"


def isolation() -> dict[str, str]:
    """The modes this machine gives the sandbox: ``{"network": …, "processes": …}`` (the
    ``unsafe_local`` sandbox) and ``"strict"``: ``available`` or why the kernel refuses it."""
    strict = strict_refusal()
    modes = {"network": net_mode(), "processes": proc_mode(), "memory": memory_mode()}
    return modes | {"strict": strict or "available"}


def _strict_probe() -> str | None:
    """One probe: None when the strict sandbox starts a shell here, else why not."""
    spec = {"isolate": True, "work_mb": 1, "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}}
    try:
        done = subprocess.run(
            launch.command(spec, ["sh", "-c", "exit 0"]),
            env=launch.launcher_environment(),
            capture_output=True,
            timeout=10,
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the probe did not run: {e}"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else f"the probe exited with status {done.returncode}"


REFUSAL_RECHECK_S = 10.0  # a refusal is probed again after this long; an available sandbox is kept
_strict_state: dict[str, object] = {}


def strict_refusal() -> str | None:
    """None when the strict sandbox (``isolate.py``: every layer) starts a shell here; else the
    step the kernel refused, one line (e.g. ``isolate: OSError: [Errno 1] unshare: …``).
    "Available" is kept for the process; a refusal only for ``REFUSAL_RECHECK_S``: it may be
    passing (another uid-65534 process that held every namespace its uid may have, the sixth
    probe), and kept for good it left the whole process without strict tools."""
    now = time.monotonic()
    if "ok" in _strict_state or now < float(_strict_state.get("until", 0.0)):
        return _strict_state.get("why")  # type: ignore[return-value]
    why = _strict_probe()
    _strict_state.clear()
    _strict_state.update({"ok": True} if why is None else {"why": why})
    _strict_state["until"] = now + REFUSAL_RECHECK_S
    return why


def user_process_count(uid: int) -> int:
    """How many processes ``uid`` runs now (``RLIMIT_NPROC`` counts them all)."""
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                n += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                continue
    return n


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []
