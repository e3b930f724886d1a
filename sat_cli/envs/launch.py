"""The tool sandbox's launcher: a fresh Python process that confines itself, then execs the tool.

``sandbox.run_tool`` starts ``python -S -m sat_cli.envs.launch SPEC -- TOOL ARGS…`` instead of
setting limits in ``preexec_fn``: code between ``fork`` and ``exec`` of a process that has
threads (the loop's rollout thread calls tools) may deadlock on a lock another thread held at
fork time, so Python documents ``preexec_fn`` as unsafe there. ``subprocess`` starts this
launcher without running any Python in the child (``start_new_session`` is done in C); the
launcher is single-threaded, so everything below is ordinary code. It also makes
``unshare(CLONE_NEWUSER)`` possible, which the kernel refuses to a multi-threaded caller.

``SPEC`` is a JSON object, every key optional::

    {"cgroup": "/sys/fs/cgroup/…/sat-tool-…",   # join this pids cgroup (write own pid)
     "memory_cgroup": "/sys/fs/cgroup/…",         # and this memory cgroup (the call's budget)
     "cpu_s": 5, "memory_mb": 512, "max_file_mb": 16, "nproc": 140,   # rlimits
     "net_flags": 1073741824,                    # unshare(2) flags (confine.NET_FLAGS)
     "env": {"PATH": …, "HOME": …},              # the tool's whole environment
     "isolate": true, "work_mb": 64,             # the strict sandbox (isolate.py)
     "status_fd": 5}                             # where a failure is reported

In that order: join the cgroups, set ``RLIMIT_CPU`` (hard = soft + 1 s), ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_CORE`` 0 and ``RLIMIT_NPROC``, unshare the network, then ``execvpe``
the tool (a ``PATH`` search in the tool's environment). With ``isolate`` (the strict sandbox,
``env.sandbox=strict``) the last two steps are ``isolate.run_isolated`` instead: another uid,
all namespaces, a private ``/proc``, a read-only root of its own showing only the visible
paths, a ``tmpfs`` work folder, no capabilities. The status descriptor is close-on-exec: the
parent reads it to end of file; nothing there means the tool is running, a line means a step
failed (``"<step>: <error>"``) and the launcher exited with status 127 without starting the tool.
The launcher's own start-up (~30 ms of CPU) counts against the tool's CPU limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import sys

MB = 1 << 20
FAILED = 127


def unshare(flags: int) -> None:
    """``unshare(2)`` of the calling process; OSError when refused."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def confine_self(spec: dict) -> None:
    """Apply ``spec``'s cgroup, limits and network namespace to this process (module docstring)."""
    for key in ("cgroup", "memory_cgroup"):
        if spec.get(key):
            with open(os.path.join(spec[key], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    if "cpu_s" in spec:
        resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    if "memory_mb" in spec:
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_mb"] * MB,) * 2)
    if "max_file_mb" in spec:
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["max_file_mb"] * MB,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec.get("nproc") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    if spec.get("net_flags"):
        unshare(spec["net_flags"])


def command(spec: dict, args: list[str]) -> list[str]:
    """The argument list that runs ``args`` under this launcher with ``spec``."""
    return [sys.executable, "-S", "-P", "-m", "sat_cli.envs.launch", json.dumps(spec), "--", *args]


def launcher_environment() -> dict[str, str]:
    """The launcher's own environment: only what finds this package (the tool gets spec["env"])."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}


def main(argv: list[str]) -> None:
    status = None
    step = "arguments"
    try:
        if len(argv) < 3 or argv[1] != "--":
            raise ValueError("usage: python -m sat_cli.envs.launch SPEC -- TOOL [ARGS…]")
        spec, args = json.loads(argv[0]), argv[2:]
        status = spec.get("status_fd")
        if status is not None:
            os.set_inheritable(status, False)  # closed by a successful exec
        step = "confine"
        confine_self(spec)
        env = spec.get("env", {})
        if spec.get("isolate"):
            from sat_cli.envs import isolate

            step = "isolate"
            isolate.run_isolated(spec, args, env, status)
        step = "exec"
        os.execvpe(args[0], args, env)
    except Exception as e:  # noqa: BLE001 — every failure is reported, none raised past here
        msg = f"{step}: {type(e).__name__}: {e}"[:1000]
        if status is not None:
            try:
                os.write(status, msg.encode())
            except OSError:
                pass
        else:
            print(msg, file=sys.stderr)
        os._exit(FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
