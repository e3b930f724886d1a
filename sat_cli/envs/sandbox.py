"""Run one tool call in a confined subprocess and return a typed result; never raise.

``run_tool(args, limits)`` starts ``args`` (a list, no shell) in a fresh scratch folder (its
working directory, ``HOME`` and ``TMPDIR``; removed afterwards) in a new session, with
``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file it
may write), ``RLIMIT_CORE`` 0, no network and a process-count limit (``confine.py``: the modes
and what each guarantees). Its stdout and stderr share one pipe, read incrementally: at most
``max_output_bytes`` are kept and more ends the call (``output_limit``). The call ends when its
first process exits, at the wall-clock deadline (``timeout``), or at the output cap; then every
process it made is killed (its process group, and its pids cgroup where there is one) and waited
for, and the scratch folder removed.

``ToolResult.kind`` is ``ok`` (exit status 0) or an error kind: ``timeout``, ``cpu_limit``
(killed by ``SIGXCPU``/the hard CPU limit), ``memory_limit`` (killed by the call's memory
cgroup), ``output_limit``, ``file_limit`` (``SIGXFSZ``),
``crash`` (any other non-zero exit or signal; a refused connection, a ``MemoryError`` or a
refused fork show here with the tool's own message), ``start`` (it could not be started);
``bad_call`` is for environments: a call of an unknown tool or with bad arguments.
``ToolStats`` counts calls and errors per kind (``env/tool_error_frac``).

The limits are set by an exec'd launcher (``launch.py``: ``python -m sat_cli.envs.launch``),
not by ``preexec_fn``, so this is safe to call from any thread of a threaded process; a step of
the launcher that fails (joining the cgroup, a limit, the namespace, the ``exec`` itself) comes
back on a close-on-exec status pipe as a ``start`` result.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli.envs import confine, isolate, launch, tool_inputs, tool_io

MODES = ("strict", "unsafe_local")  # env.sandbox (config/env.py)
UNSAFE_HINT = "env.sandbox=unsafe_local runs tools without it, on a machine you trust"
ERROR_KINDS = (
    "timeout",
    "cpu_limit",
    "memory_limit",
    "output_limit",
    "file_limit",
    "crash",
    "start",
    "bad_call",
)
KILL_WAIT_S = 5.0  # how long cleanup waits for killed processes to go
MAX_STDIN_BYTES = 32768  # below a pipe's buffer: writing it never waits on the tool


@dataclass(frozen=True)
class ToolLimits:
    """Limits of one tool call (bounds checked here)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_procs: int = 32
    max_file_mb: int = 16
    max_output_bytes: int = 16384
    work_mb: int = 64  # the strict sandbox's tmpfs work folder

    def __post_init__(self):
        bounds = {
            "work_mb": (1, 65536),
            "wall_s": (0.1, 600.0),
            "cpu_s": (1, 600),
            "memory_mb": (32, 65536),
            "max_procs": (1, 4096),
            "max_file_mb": (0, 65536),
            "max_output_bytes": (1, 1 << 26),
        }
        for name, (lo, hi) in bounds.items():
            v = getattr(self, name)
            kind = int | float if name == "wall_s" else int  # the rest are rlimits and sizes
            if isinstance(v, bool) or not isinstance(v, kind) or not lo <= v <= hi:
                what = "a number" if name == "wall_s" else "an integer"
                raise ValueError(f"tool limit {name}={v!r} must be {what} in [{lo}, {hi}]")


@dataclass(frozen=True)
class ToolResult:
    kind: str  # "ok" or one of ERROR_KINDS
    text: str  # the tool's output (at most max_output_bytes, decoded), or what went wrong
    returncode: int | None = None
    elapsed_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass
class ToolStats:
    calls: int = 0
    errors: Counter = field(default_factory=Counter)

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        if not result.ok:
            self.errors[result.kind] += 1

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def error_frac(self) -> float:
        return self.failed / self.calls if self.calls else 0.0


def _launch_spec(
    limits: ToolLimits, cgroup: Path | None, nproc: int | None, net: str, shown: list[str]
) -> dict:
    """What the launcher applies before it execs the tool (``launch.py``); ``net`` is
    ``strict`` for the strict sandbox (``isolate.py``: all namespaces, a root showing only
    ``shown``) or a network mode."""
    spec = {
        "cgroup": str(cgroup) if cgroup is not None else None,
        "cpu_s": limits.cpu_s,
        "memory_mb": limits.memory_mb,
        "max_file_mb": limits.max_file_mb,
        "nproc": nproc,
        "net_flags": confine.NET_FLAGS.get(net, 0),
    }
    if net == "strict":
        spec.update(isolate=True, work_mb=limits.work_mb, visible=shown)
    return spec


def _environment(scratch: Path, net: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if net == "python":
        site = scratch / ".sat-site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(confine.SITECUSTOMIZE)
        env["PYTHONPATH"] = str(site)
    return env


def _kill_all(proc: subprocess.Popen, cgroups: list[Path]) -> int:
    """Kill the tool's process group and its cgroups' processes; wait until they are gone.
    Returns how many of them the memory cgroup's limit had killed (``confine.oom_kills``)."""
    from sat_cli.util.procs import live_group_members

    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        left = [pid for cgroup in cgroups for pid in confine.cgroup_pids(cgroup)]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
        group = live_group_members(proc.pid)
        if (proc.returncode is not None and not group and not left) or time.monotonic() > deadline:
            break
    ooms = sum(confine.oom_kills(cgroup) for cgroup in cgroups)
    for cgroup in cgroups:
        try:
            cgroup.rmdir()
        except OSError:
            pass  # a process that would not die keeps it; the next run's cleanup may remove it
    return ooms


def _classify(reason: str, returncode: int | None, ooms: int = 0) -> str:
    if reason != "exit":
        return reason
    if returncode == 0:
        return "ok"
    if ooms and returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "memory_limit"  # the call's memory cgroup killed a process of it
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"  # we kill only after timeout/output_limit, so SIGKILL is the hard limit
    if returncode == -signal.SIGXFSZ:
        return "file_limit"
    return "crash"


def refusal(mode: str) -> str | None:
    """Why ``mode`` cannot run here, or None."""
    if mode not in MODES:
        return f"env.sandbox={mode!r} must be one of {', '.join(MODES)}"
    if mode == "strict" and (why := confine.strict_refusal()) is not None:
        return f"the strict tool sandbox is not available here ({why}); {UNSAFE_HINT}"
    return None


def run_tool(
    args: list[str],
    limits: ToolLimits | None = None,
    stdin: bytes = b"",
    mode: str = "strict",
    visible: tuple[str, ...] = (),
) -> ToolResult:
    """Run ``args`` confined (module docstring) in sandbox ``mode`` (``MODES``); any failure is
    a ``ToolResult``, never raised. A ``strict`` sandbox the machine cannot make is a ``start``
    result: the call never runs less confined than asked. ``visible``: host paths (absolute)
    the strict sandbox shows the tool read-only besides the system folders, the Python that
    runs ``sat`` and the program itself (``tool_inputs.visible_paths``); the rest of the host
    is absent."""
    limits = limits or ToolLimits()
    start = time.monotonic()
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        return ToolResult("start", f"tool arguments must be a non-empty list of strings: {args!r}")
    if (why := tool_inputs.unpassable(args)) is not None:
        return ToolResult("start", f"tool could not start: {why}")
    if not isinstance(stdin, bytes | bytearray):
        return ToolResult("start", f"tool input must be bytes, not {type(stdin).__name__}")
    if len(stdin) > MAX_STDIN_BYTES:
        return ToolResult("start", f"tool input over {MAX_STDIN_BYTES} bytes: {len(stdin)}")
    try:
        shown = tool_inputs.visible_paths(args, _environment(Path(isolate.WORK), "strict"), visible)
    except ValueError as e:
        return ToolResult("start", f"tool could not start: {e}")
    if (why := refusal(mode)) is not None:
        return ToolResult("start", f"tool could not start: {why}")
    strict = mode == "strict"
    net = "strict" if strict else confine.net_mode()
    cgroup = confine.new_pids_cgroup(limits.max_procs) if confine.proc_mode() == "cgroup" else None
    memcg = None  # one budget for all the call's processes and its work folder, where permitted
    if confine.memory_mode() == "cgroup":
        memcg = confine.new_memory_cgroup(limits.memory_mb + limits.work_mb, cgroup)
    cgroups = [c for c in (cgroup, memcg) if c is not None]
    if memcg is not None and memcg == cgroup:  # cgroup v2: one cgroup holds both limits
        cgroups, memcg = [cgroup], None
    nproc = None
    if strict and cgroup is None:  # the tool never runs as root here: RLIMIT_NPROC holds
        # (per uid, so calls at the same time share it; a pids cgroup, where there is one, is
        # the call's own, and one call's fork bomb does not fail the calls beside it)
        uid = isolate.SANDBOX_UID if os.geteuid() == 0 else os.getuid()
        nproc = confine.user_process_count(uid) + limits.max_procs
    elif cgroup is None and os.geteuid() != 0:
        nproc = confine.user_process_count(os.getuid()) + limits.max_procs
    scratch = Path(tempfile.mkdtemp(prefix="sat-tool-")) if not strict else None
    status_r, status_w = os.pipe()
    env = _environment(Path(isolate.WORK) if strict else scratch, net)
    spec = {**_launch_spec(limits, cgroup, nproc, net, shown), "env": env, "status_fd": status_w}
    spec["memory_cgroup"] = str(memcg) if memcg is not None else None
    try:
        try:
            proc = subprocess.Popen(
                launch.command(spec, args),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=scratch or "/",
                env=launch.launcher_environment(),
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except (OSError, subprocess.SubprocessError) as e:
            os.close(status_r)
            for c in cgroups:
                c.rmdir()
            return ToolResult("start", f"tool could not start: {e}", None, time.monotonic() - start)
        finally:
            os.close(status_w)
        try:
            failed = tool_io.start_status(status_r, start + limits.wall_s)
            if failed is None:
                out, reason = b"", "timeout"
            elif failed:
                out, reason = failed.encode(), "start"
                try:  # the launcher exits 127 right after saying why
                    proc.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
            else:
                tool_io.feed(proc, stdin, start + limits.wall_s)
                out, reason = tool_io.read_output(
                    proc, limits.max_output_bytes, start + limits.wall_s
                )
        finally:
            os.close(status_r)
            ooms = _kill_all(proc, cgroups)
            proc.stdin.close()
            proc.stdout.close()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    kind = _classify(reason, proc.returncode, ooms)
    text = out.decode("utf-8", errors="replace")
    if kind == "timeout":
        text += f"\n[tool stopped: wall-clock limit {limits.wall_s} s]"
    elif kind == "output_limit":
        text += f"\n[tool stopped: output over {limits.max_output_bytes} bytes]"
    elif kind == "start":
        text = f"tool could not start: {text}"
    elif kind != "ok":
        text += f"\n[tool failed: {kind}, exit status {proc.returncode}]"
    elapsed = time.monotonic() - start
    return ToolResult(kind, text, proc.returncode, elapsed, kind == "output_limit")


def call_tool(
    args: list[str],
    stats: ToolStats,
    limits: ToolLimits | None = None,
    stdin: bytes = b"",
    mode: str = "strict",
    visible: tuple[str, ...] = (),
) -> dict[str, str]:
    """Run one tool call for an environment: counted in ``stats`` and returned as the ``tool``
    message to append: the output when it succeeded, else ``error (<kind>): <what happened>``.
    ``mode``: the environment's ``settings.sandbox``; ``visible``: host paths the tool reads
    (its scripts, data), as in ``run_tool``."""
    r = run_tool(args, limits, stdin, mode, visible)
    stats.add(r)
    return {"role": "tool", "content": r.text if r.ok else f"error ({r.kind}): {r.text}"}
