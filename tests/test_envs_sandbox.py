"""The tool sandbox with real hostile tools (real subprocesses): each is contained, reported with
its kind within its deadline, and leaves no process, cgroup or scratch folder behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sandbox_tools import sandbox_python

from sat_cli.envs import confine, isolate, sandbox, seccomp, tool_io
from sat_cli.envs.sandbox import ToolLimits, ToolStats, call_tool, run_tool
from sat_cli.util.procs import live_group_members, pid_alive

PY = sys.executable  # replaced by the fixture below: a Python the sandbox's uid can run
PGID = "import os,sys; print('pgid', os.getpgid(0), os.readlink('/proc/self/ns/pid'), flush=True)\n"


@pytest.fixture(autouse=True)
def tool_python(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "PY", sandbox_python())


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """Scratch folders (of the ``unsafe_local`` sandbox; the strict one makes none on the host)
    go under tmp_path, so that the test sees whether they were removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sat-tool-")] == []


def in_pid_namespace(ns: str) -> list[int]:
    """The live processes (not zombies) whose PID namespace is ``ns`` (``pid:[inode]``)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/ns/pid") == ns and pid_alive(int(pid)):
                found.append(int(pid))
        except OSError:
            continue
    return found


def run_clean(
    code: str, limits: ToolLimits, budget_s: float, mode: str = "strict", stdin: bytes = b""
):
    """Run a Python tool that first prints its process group and PID namespace; check the
    deadline and that no process of it is left: none in its PID namespace (strict), none in its
    process group (``unsafe_local``, where the tool shares this process's namespace)."""
    t0 = time.monotonic()
    r = run_tool([PY, "-c", PGID + code], limits, stdin=stdin, mode=mode)
    assert time.monotonic() - t0 < budget_s, r
    first = r.text.split("\n", 1)[0]
    assert first.startswith("pgid "), r.text[:200]
    _, pgid, ns = first.split()
    if ns != os.readlink("/proc/self/ns/pid"):
        assert mode == "strict" and in_pid_namespace(ns) == []
    else:
        assert mode == "unsafe_local" and live_group_members(int(pgid)) == []
    if confine.proc_mode() == "cgroup":
        parent = confine.new_pids_cgroup(1)
        assert parent is not None
        parent.rmdir()
        assert not [p for p in parent.parent.glob(f"sat-tool-{os.getpid()}-*")]
    return r


def test_ok_tool_gets_its_input_and_a_scratch_folder(scratch_root):
    code = "import os,sys; print(sys.stdin.read()[::-1], os.getcwd() == os.environ['HOME'])"
    r = run_tool([PY, "-c", code], ToolLimits(), stdin=b"abc")
    assert (r.kind, r.text, r.returncode) == ("ok", "cba True\n", 0)
    # strict: the work folder is its own tmpfs on /tmp, empty at each call
    code = "import os; print(os.getcwd(), os.listdir('.')); open('f', 'w').write('x')"
    assert [run_tool([PY, "-c", code]).text for _ in range(2)] == ["/tmp []\n"] * 2
    cwd = run_tool([PY, "-c", "import os; print(os.getcwd())"], mode="unsafe_local").text.strip()
    assert os.path.dirname(cwd) == str(scratch_root) and not os.path.exists(cwd)


def test_infinite_loop_hits_the_cpu_limit(scratch_root):
    r = run_clean("while True: pass", ToolLimits(wall_s=20, cpu_s=1), budget_s=15)
    assert r.kind == "cpu_limit" and r.returncode < 0


def test_sleeping_tool_is_stopped_at_the_wall_clock_deadline(scratch_root):
    # its child leaves the group's foreground but not the group: killed with it
    code = "import subprocess,time; subprocess.Popen(['sleep','100']); time.sleep(100)"
    r = run_clean(code, ToolLimits(wall_s=1.0), budget_s=8)
    assert r.kind == "timeout" and 1.0 <= r.elapsed_s < 8


@pytest.mark.parametrize("mode", ["strict", "unsafe_local"])
def test_a_tool_that_closes_its_output_and_sleeps_is_a_timeout(scratch_root, mode):
    """Its output's end of file comes before its exit (``unsafe_local``: the tool holds the
    pipe's only write end): the deadline holds and ``run_tool`` returns, never raises (it
    raised ``TimeoutExpired``: a hostile tool of the fourth probe)."""
    code = "import os,time; os.close(1); os.close(2); time.sleep(100)"
    r = run_clean(code, ToolLimits(wall_s=1.0), budget_s=8, mode=mode)
    assert r.kind == "timeout" and 1.0 <= r.elapsed_s < 8


def test_a_gigabyte_of_output_is_cut_at_the_cap(scratch_root):
    code = "b = b'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.buffer.write(b)"
    r = run_clean(code, ToolLimits(wall_s=20, max_output_bytes=4096), budget_s=10)
    assert r.kind == "output_limit" and r.truncated
    assert r.text.startswith("pgid ") and r.text.count("x") == 4096 - len(r.text.split("\n")[0]) - 1


@pytest.mark.parametrize("mode", ["strict", "unsafe_local"])
def test_a_tool_that_shrinks_its_input_pipe_and_sleeps_is_a_timeout(
    scratch_root, monkeypatch, mode
):
    """A tool that shrinks its input pipe to one page (``F_SETPIPE_SZ``) before the caller
    writes 32 KiB, then never reads: the write gives up at the deadline (a blocking write waited
    until the tool ended, past the deadline). The caller is slowed here so that the tool wins
    the race it won under load (the fourth probe)."""
    started = tool_io.start_status

    def slow(fd, deadline):
        got = started(fd, deadline)
        time.sleep(1.0)  # the tool runs first: a loaded machine
        return got

    monkeypatch.setattr(tool_io, "start_status", slow)
    code = (
        "import fcntl,time; fcntl.fcntl(0, 1031, 4096); print('shrunk', flush=True); time.sleep(20)"
    )
    r = run_clean(code, ToolLimits(wall_s=2.0), budget_s=8, mode=mode, stdin=b"y" * 32768)
    assert r.kind == "timeout" and "shrunk" in r.text, r


def test_network_is_unreachable_even_on_loopback(scratch_root):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        r = run_clean(code, ToolLimits(wall_s=10), budget_s=8)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    assert r.kind == "crash"
    assert "Network is unreachable" in r.text or "network access is disabled" in r.text


def test_python_fallback_blocks_sockets(scratch_root, monkeypatch):
    """Where no namespace may be made, Python tools still cannot create a socket."""
    monkeypatch.setattr(confine, "net_mode", lambda: "python")
    r = run_tool([PY, "-c", "import socket; socket.socket()"], mode="unsafe_local")
    assert r.kind == "crash" and "network access is disabled in the tool sandbox" in r.text


def test_fork_bomb_is_contained(scratch_root):
    code = "import time\nfor _ in range(10000):\n    if os.fork() == 0: time.sleep(60)"
    r = run_clean(code, ToolLimits(wall_s=3, max_procs=16), budget_s=12)
    # strict: never root, so RLIMIT_NPROC holds even without a pids cgroup
    assert r.kind == "crash" and "Resource temporarily unavailable" in r.text
    r = run_clean(code, ToolLimits(wall_s=3, max_procs=16), budget_s=12, mode="unsafe_local")
    if confine.proc_mode() in ("cgroup", "rlimit"):
        assert r.kind == "crash" and "Resource temporarily unavailable" in r.text
    else:  # root without a pids cgroup: only the deadline and the group kill stop it
        assert r.kind == "timeout"


def test_crash_memory_and_file_limits(scratch_root):
    stats = ToolStats()
    for code, kind, needle in [
        ("raise SystemExit(3)", "crash", "exit status 3"),
        ("import os; os.abort()", "crash", "exit status -6"),
        ("x = bytearray(2 << 30)", "crash", "MemoryError"),
        ("open('f','wb').write(b'x' * (2 << 20))", "crash", "File too large"),
    ]:
        r = run_clean(code, ToolLimits(memory_mb=256, max_file_mb=1), budget_s=8)
        stats.add(r)
        assert r.kind == kind and needle in r.text, (code, r)
    stats.add(run_tool([PY, "-c", "print(1)"]))
    assert stats.calls == 5 and stats.errors == {"crash": 4} and stats.error_frac == 0.8


def test_bad_calls_are_results_not_exceptions(scratch_root):
    assert run_tool("python -c 1").kind == "start"
    missing = run_tool(["/nonexistent/tool"])
    assert missing.kind == "start" and missing.returncode == 127
    assert missing.text.startswith("tool could not start: exec: FileNotFoundError")
    assert run_tool([PY], stdin=b"x" * 40000).kind == "start"


@pytest.mark.parametrize("field,value", [("wall_s", 0), ("cpu_s", 10**6), ("memory_mb", "1")])
def test_limits_are_bounded(field, value):
    with pytest.raises(ValueError, match=field):
        ToolLimits(**{field: value})


@pytest.mark.slow
def test_a_tool_that_leaves_its_session_is_killed_through_its_cgroup(scratch_root):
    if confine.proc_mode() != "cgroup":
        pytest.skip("needs a pids cgroup")
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "print('child', p.pid, flush=True)"
    )
    r = run_clean(code, ToolLimits(wall_s=5), budget_s=10, mode="unsafe_local")
    child = int(r.text.split("child ")[1].split()[0])
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read()


@pytest.mark.slow
def test_shell_fork_bomb_is_contained(scratch_root):
    t0 = time.monotonic()
    run_tool(["sh", "-c", "b() { b | b & }; b"], ToolLimits(wall_s=3, max_procs=16))
    assert time.monotonic() - t0 < 10
    if confine.proc_mode() == "cgroup":
        parent = confine.new_pids_cgroup(1)
        parent.rmdir()
        assert not [p for p in parent.parent.glob(f"sat-tool-{os.getpid()}-*")]


LIMITS_PROBE = """
import os
lim = {l[:26].strip(): l[26:].split()[:2] for l in open('/proc/self/limits').read().splitlines()[1:]}
print(lim['Max cpu time'], lim['Max address space'], lim['Max file size'], lim['Max core file size'])
print(os.readlink('/proc/self/ns/net'))
print(sorted({l.split(':', 2)[2] for l in open('/proc/self/cgroup').read().split()}))
print(os.getpid(), sorted(os.listdir('/proc/self/fd')))
"""


def test_the_tool_runs_with_the_limits_namespace_and_cgroup_it_was_given(scratch_root):
    """The launcher applies every limit before it execs the tool; read back from /proc."""
    r = run_tool([PY, "-c", LIMITS_PROBE], ToolLimits(cpu_s=3, memory_mb=300, max_file_mb=2))
    lines = r.text.splitlines()
    mb = 1 << 20
    assert (
        lines[0] == f"['3', '4'] ['{300 * mb}', '{300 * mb}'] ['{2 * mb}', '{2 * mb}'] ['0', '0']"
    )
    if confine.net_mode() in confine.NET_FLAGS:
        assert lines[1] != os.readlink("/proc/self/ns/net")
    # its own cgroup namespace, rooted at the call's cgroups: no host cgroup path is named
    # (that the call's cgroups hold it: test_fork_bomb_is_contained, the memory_limit test)
    assert lines[2] == "['/']"
    # pid 2 of its own PID namespace (1: its init), and no descriptor beyond stdio: the status
    # and report pipes closed
    assert lines[3] == "2 ['0', '1', '2', '3']"  # 3: the listing's own descriptor


def test_no_python_runs_between_fork_and_exec(scratch_root, monkeypatch):
    """``preexec_fn`` is unsafe in a threaded process: the sandbox must never pass one."""
    seen = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        seen.append(kwargs.get("preexec_fn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert run_tool([PY, "-c", "print(1)"]).text == "1\n"
    assert seen == [None]


def test_a_failing_launcher_step_is_a_start_error(scratch_root, monkeypatch, tmp_path):
    if confine.proc_mode() != "cgroup":
        pytest.skip("needs a pids cgroup")
    monkeypatch.setattr(confine, "new_pids_cgroup", lambda n: tmp_path / "no-such-cgroup")
    r = run_tool([PY, "-c", "print('ran')"])
    assert r.kind == "start" and r.returncode == 127 and "ran" not in r.text
    assert r.text.startswith("tool could not start: confine: FileNotFoundError")


def test_tools_from_many_threads_at_once(scratch_root):
    """The rollout thread's case: concurrent calls, each with its own result."""
    results = {}

    def one(i):
        results[i] = run_tool([PY, "-c", f"print({i} * {i})"], ToolLimits(wall_s=30))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: (r.kind, r.text) for i, r in results.items()} == {
        i: ("ok", f"{i * i}\n") for i in range(6)
    }


def test_hostile_tools_become_error_observations_and_the_caller_goes_on(scratch_root):
    """Each hostile tool of the issue through an environment's path (``call_tool``): an error
    message to the model within its deadline, counted in the ``ToolStats`` that feeds
    ``env/tool_error_frac``; the next call works."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    hostile = {
        "loop": ("while True: pass", "cpu_limit"),
        "fork": (
            "import os, time\nfor _ in range(10000):\n    if os.fork() == 0: time.sleep(60)",
            None,
        ),
        "flood": (
            "import sys\nwhile True: sys.stdout.buffer.write(b'x' * (1 << 20))",
            "output_limit",
        ),
        "local": (f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)", "crash"),
        "remote": ("import socket; socket.create_connection(('1.1.1.1', 53), 2)", "crash"),
    }
    stats = ToolStats()
    limits = ToolLimits(wall_s=4, cpu_s=1, max_procs=16, max_output_bytes=1 << 16)
    try:
        for name, (code, kind) in hostile.items():
            t0 = time.monotonic()
            msg = call_tool([PY, "-c", code], stats, limits)
            assert time.monotonic() - t0 < limits.wall_s + sandbox.KILL_WAIT_S, name
            assert msg["role"] == "tool" and msg["content"].startswith("error ("), (name, msg)
            if kind is not None:
                assert msg["content"].startswith(f"error ({kind}): "), (name, msg["content"][-300:])
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert stats.calls == 5 and stats.error_frac == 1.0
    assert call_tool([PY, "-c", "print(6 * 7)"], stats) == {"role": "tool", "content": "42\n"}
    assert stats.calls == 6 and stats.error_frac == 5 / 6


def _seccomp_verdict(prog, arch: int, nr: int, family: int, kind: int = 0) -> str:
    """Run the classic BPF program ``prog`` (only the instructions ``seccomp_program`` uses) on
    a ``seccomp_data`` of (nr, arch, args[0] = family, args[1] = kind)."""
    data = {0: nr, 4: arch, 16: family, 24: kind}
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            acc = data[k]
        elif code == 0x54:
            acc &= k
        elif code in (0x15, 0x35):
            hit = acc == k if code == 0x15 else acc >= k
            pc += jt if hit else jf
        elif code == 0x06:
            return {seccomp.SECCOMP_ALLOW: "allow", seccomp.SECCOMP_DENY: "deny"}[k]
        pc += 1


@pytest.mark.parametrize("machine", sorted(seccomp.SECCOMP_ARCHES))
def test_the_seccomp_filter_refuses_unix_sockets_on_every_abi(machine):
    """Probe (issue 53 v5): on x86_64 an x32 ``socket(AF_UNIX)`` (nr | 0x40000000, the same
    audit arch) jumped to the allow, not the deny (the kernel here has no x32: ENOSYS)."""
    arch, sys_socket, sys_uring, x32 = seccomp.SECCOMP_ARCHES[machine]
    prog = seccomp.seccomp_program(machine)
    verdict = lambda nr, family=0, a=arch: _seccomp_verdict(prog, a, nr, family)  # noqa: E731
    assert verdict(sys_socket, seccomp.AF_UNIX) == "deny"
    assert verdict(sys_socket, socket.AF_INET) == "allow"
    assert verdict(sys_uring) == "deny"
    assert verdict(0) == "allow"
    assert verdict(sys_socket, seccomp.AF_UNIX, arch ^ 1) == "deny"  # another ABI
    if x32:
        assert verdict(x32 | sys_socket, seccomp.AF_UNIX) == "deny"
        assert verdict(x32 | 0) == "deny"
    else:
        assert verdict(0xFFFFFFFF) == "deny"


@pytest.mark.parametrize("machine", sorted(seccomp.SECCOMP_ARCHES))
def test_the_seccomp_filter_allows_only_the_socket_families_a_network_namespace_confines(machine):
    """Probe (issue 53 v6): ``AF_VSOCK`` sockets were allowed (their ports are shared by every
    network namespace; on a VM they reach the hypervisor), and so were the keyring calls (a
    tool read a key of the caller's session keyring, which it inherits)."""
    arch, sys_socket, _, _ = seccomp.SECCOMP_ARCHES[machine]
    prog = seccomp.seccomp_program(machine)
    verdict = lambda nr, family=0: _seccomp_verdict(prog, arch, nr, family)  # noqa: E731
    for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK):
        assert verdict(sys_socket, family) == "allow", family
    for family in (seccomp.AF_UNIX, 40, 17, 38, 0, 3, 45, 0xFFFF):  # VSOCK, PACKET, ALG, …
        assert verdict(sys_socket, family) == "deny", family
    for nr in seccomp.SECCOMP_KEYRING_CALLS[machine]:
        assert verdict(nr) == "deny", nr
    connect = {"x86_64": 42, "aarch64": 203}[machine]  # (sys_socket + 1 is socketpair on arm64)
    assert verdict(connect, 40) == "allow"  # connect(2) etc.: another call, any fd


@pytest.mark.parametrize("machine", sorted(seccomp.SECCOMP_ARCHES))
def test_the_seccomp_filter_allows_only_connected_unix_socketpairs(machine):
    """Probe (issue 53 v7): ``socketpair(AF_UNIX, SOCK_DGRAM)`` was allowed, and ``sendto(2)``
    on one end delivered a datagram to a host socket file on a visible path: ``AF_UNIX``
    refused by ``socket(2)`` only. ``SOCK_RAW`` makes the same datagram pair."""
    arch, _, _, _ = seccomp.SECCOMP_ARCHES[machine]
    pair = seccomp.SECCOMP_SOCKETPAIR[machine]
    prog = seccomp.seccomp_program(machine)
    verdict = lambda family, kind: _seccomp_verdict(prog, arch, pair, family, kind)  # noqa: E731
    cloexec, nonblock = 0o2000000, 0o4000
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        for flags in (0, cloexec, nonblock, cloexec | nonblock):
            assert verdict(seccomp.AF_UNIX, kind | flags) == "allow", (kind, flags)
    for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW, 0, 4, 6, 10, 0xF):
        for flags in (0, cloexec, nonblock):
            assert verdict(seccomp.AF_UNIX, kind | flags) == "deny", (kind, flags)
    for family in (socket.AF_INET, socket.AF_INET6, 30, 40):  # TIPC, VSOCK: not AF_UNIX
        assert verdict(family, socket.SOCK_STREAM) == "deny", family


@pytest.mark.parametrize("mode", sandbox.MODES)
@pytest.mark.parametrize(
    "args, stdin, why",
    [
        ([PY, "-c", "print(1)\0"], b"", "tool argument 2 holds a NUL character"),
        (["py\0thon3"], b"", "tool argument 0 holds a NUL character"),
        ([PY, "-c", "print('\ud800')"], b"", "tool argument 2 cannot be encoded"),
        ([PY, "-c", "print(1)"], "text", "tool input must be bytes, not str"),
        ([PY, "-c", "print(1)"], None, "tool input must be bytes, not NoneType"),
    ],
)
def test_arguments_exec_cannot_take_are_a_start_result_not_an_exception(mode, args, stdin, why):
    """Probe (issue 53 v6): a NUL or a lone surrogate in an argument (model text can hold
    both) raised ValueError / UnicodeEncodeError out of ``run_tool`` (documented never to
    raise), leaving its status pipe open and its pids cgroup behind; a ``str`` input raised
    TypeError."""
    fds = len(os.listdir("/proc/self/fd"))
    r = run_tool(args, stdin=stdin, mode=mode)
    assert (r.kind, r.returncode) == ("start", None) and why in r.text, r.text
    assert len(os.listdir("/proc/self/fd")) == fds
    stats = ToolStats()
    msg = call_tool(args, stats, stdin=stdin, mode=mode)
    assert msg["content"].startswith("error (start): ") and stats.errors == {"start": 1}


@pytest.mark.parametrize(
    "visible, why",
    [
        (("relative/dir",), "absolute and normalised"),
        (("/a/../etc",), "absolute and normalised"),
        (("//etc",), "absolute and normalised"),
        (("/",), "the whole host"),
        (("/proc/1",), "lies in /proc"),
        (("/tmp",), "lies in /tmp"),
        (("/dev/shm/x",), "lies in /dev"),
        (("/etc\0/x",), "non-empty string"),
        (("",), "non-empty string"),
        ((3,), "non-empty string"),
        (("/" + "a" * 5000,), "at most 4096 bytes"),
        ("/etc", "a list of paths"),
        (tuple(f"/p{i}" for i in range(isolate.MAX_VISIBLE + 1)), "at most 64 visible paths"),
    ],
)
def test_a_bad_visible_path_is_refused_before_anything_starts(visible, why):
    r = run_tool([PY, "-c", "print(1)"], visible=visible)
    assert r.kind == "start" and why in r.text, r.text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_check_visible_accepts_only_absolute_normalised_paths_outside_the_sandboxs_own(path):
    """Fuzz: any string is either refused with ValueError or one the new root can bind."""
    try:
        got = isolate.check_visible(path)
    except ValueError:
        return
    assert got == path and path.startswith("/") and os.path.normpath(path) == path != "/"
    assert "\0" not in path and not any(
        path == top or path.startswith(top + "/") for top in isolate.RESERVED
    )


MEMORY_PROBE = r"""
import os, select
r, w = os.pipe()
hold_r, hold_w = os.pipe()  # children hold their memory until this closes
kids = {}
for i in range(6):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(hold_w)
        b = bytearray(300 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        os.write(w, bytes([i]))
        os.read(hold_r, 1)
        os._exit(0)
    kids[pid] = i
os.close(w)
wrote, dead = set(), set()
while wrote | dead != set(range(6)):  # each child holds its 300 MiB, or is gone
    if select.select([r], [], [], 0.1)[0]:
        wrote |= set(os.read(r, 100))
    for pid, i in list(kids.items()):
        if os.waitpid(pid, os.WNOHANG)[0]:
            dead.add(kids.pop(pid))
print("held", len(wrote - dead))  # alive together, each with its 300 MiB
os.close(hold_w)
for pid in kids:
    os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("mode", sandbox.MODES)
def test_a_calls_processes_share_one_memory_budget(mode, monkeypatch):
    """Six children of 300 MiB each under memory_mb=512: RLIMIT_AS is per process, so each is
    allowed alone; the call's memory cgroup holds them to 512 + work_mb MiB together."""
    if confine.memory_mode() != "cgroup":
        pytest.skip("no memory cgroup can be made here (the per-process RLIMIT_AS is the bound)")
    limits = ToolLimits(memory_mb=512, wall_s=60, max_procs=16)
    r = run_tool([PY, "-S", "-c", MEMORY_PROBE], limits, mode=mode)
    assert r.kind == "ok" and r.text.split() == ["held", "1"], r.text
    monkeypatch.setattr(confine, "memory_mode", lambda: "rlimit")  # without the cgroup
    r = run_tool([PY, "-S", "-c", MEMORY_PROBE], limits, mode=mode)
    assert r.kind == "ok" and r.text.split() == ["held", "6"], r.text


def test_a_memory_cgroup_is_made_with_its_limit_and_removable():
    if confine.memory_mode() != "cgroup":
        pytest.skip("no memory cgroup can be made here")
    path = confine.new_memory_cgroup(96)
    try:
        name = (
            "memory.limit_in_bytes" if (path / "memory.limit_in_bytes").exists() else "memory.max"
        )
        assert int((path / name).read_text()) == 96 << 20
    finally:
        path.rmdir()
    assert not path.exists()


@pytest.mark.parametrize("mode", sandbox.MODES)
def test_a_tool_killed_by_its_memory_budget_is_a_memory_limit(mode):
    """A memfd's pages are not in RLIMIT_AS (nothing maps them) but are charged to the call's
    memory cgroup: 700 MiB under memory_mb=512 ends the tool with SIGKILL from the cgroup,
    reported as memory_limit (not cpu_limit, the other SIGKILL)."""
    if confine.memory_mode() != "cgroup":
        pytest.skip("no memory cgroup can be made here")
    code = (
        "import os\nfd = os.memfd_create('x')\nblock = b'x' * (1 << 20)\n"
        "for _ in range(700):\n    os.write(fd, block)\nprint('wrote 700 MiB')"
    )
    r = run_tool([PY, "-S", "-c", code], ToolLimits(memory_mb=512, max_file_mb=1024), mode=mode)
    assert r.kind == "memory_limit" and "wrote" not in r.text, (r.kind, r.text)
    assert sandbox._classify("exit", -9, 0) == "cpu_limit"  # no OOM kill counted: the CPU limit


def test_on_cgroup_v2_one_cgroup_holds_both_limits(tmp_path, monkeypatch):
    """A process is in one v2 cgroup only: a memory cgroup beside the pids cgroup would take
    the tool out of the pids limit when it joins the second (the fourth probe, by reading).
    Where both controllers have one folder (v2), the memory limits go into the pids cgroup;
    where they differ (v1), each controller gets its own."""
    monkeypatch.setattr(confine, "_own_cgroup", lambda controller: tmp_path)  # v2: one folder
    pids = confine.new_pids_cgroup(8)
    assert confine.new_memory_cgroup(100, pids) == pids
    assert (pids / "pids.max").read_text() == "8"
    assert (pids / "memory.max").read_text() == str(100 << 20)
    assert [p.name for p in tmp_path.iterdir()] == [pids.name]
    v1 = {"pids": tmp_path / "pids", "memory": tmp_path / "memory"}
    for folder in v1.values():
        folder.mkdir()
    monkeypatch.setattr(confine, "_own_cgroup", v1.get)
    pids = confine.new_pids_cgroup(8)
    memory = confine.new_memory_cgroup(100, pids)
    assert memory is not None and memory.parent == v1["memory"] and pids.parent == v1["pids"]


@pytest.mark.parametrize("mode", sandbox.MODES)
def test_a_caller_with_more_than_1024_open_files_still_gets_a_result(mode):
    """select() refuses a descriptor above 1023 (the fifth probe: run_tool raised ValueError
    in such a caller); the pipes are waited on with poll()."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        r = run_tool([PY, "-S", "-c", "print(input())"], ToolLimits(wall_s=10), b"42\n", mode)
        assert (r.kind, r.text) == ("ok", "42\n"), r.text
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_one_calls_fork_bomb_does_not_fail_a_call_beside_it():
    """Strict tools share one uid, and RLIMIT_NPROC counts per uid: a bomb holding its
    processes used up the allowance of a call started beside it (the fifth probe: the benign
    call crashed with 'Cannot fork'). With a pids cgroup the call's own limit is the bound."""
    if confine.proc_mode() != "cgroup" or confine.strict_refusal() is not None:
        pytest.skip("needs the strict sandbox and a pids cgroup")
    bomb = "import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n"
    bomb += "            time.sleep(30)\n    except OSError:\n        break\ntime.sleep(30)"
    benign = ["sh", "-c", "sleep 0.6; echo a | cat; echo benign"]
    limits = ToolLimits(wall_s=4, max_procs=16)
    out: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: out.update(bomb=run_tool([PY, "-S", "-c", bomb], limits))),
        threading.Thread(target=lambda: out.update(benign=run_tool(benign, limits))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (out["benign"].kind, out["benign"].text) == ("ok", "a\nbenign\n"), out["benign"]
    assert out["bomb"].kind == "timeout"


def test_a_refused_strict_sandbox_is_probed_again_an_available_one_is_kept(monkeypatch):
    """A refusal can pass (another uid-65534 process held every namespace its uid may make:
    the sixth probe); kept for good, it left the process without strict tools."""
    answers = iter(["isolate: unshare: No space left on device", None])
    probes = []
    monkeypatch.setattr(confine, "_strict_probe", lambda: probes.append(1) or next(answers))
    monkeypatch.setattr(confine, "_strict_state", {})
    clock = [100.0]
    monkeypatch.setattr(confine.time, "monotonic", lambda: clock[0])
    assert confine.strict_refusal() == "isolate: unshare: No space left on device"
    clock[0] += confine.REFUSAL_RECHECK_S - 1
    assert confine.strict_refusal() == "isolate: unshare: No space left on device"
    assert len(probes) == 1  # within the recheck interval: not probed again
    clock[0] += 2
    assert confine.strict_refusal() is None and len(probes) == 2
    clock[0] += 1000
    assert confine.strict_refusal() is None and len(probes) == 2  # available: kept


@pytest.mark.parametrize("name", ["cpu_s", "memory_mb", "max_procs", "max_file_mb", "work_mb"])
def test_a_fractional_integer_limit_is_refused_when_made(name):
    """cpu_s=1.5 passed the bounds and every call then failed to start ('float' object cannot
    be interpreted as an integer, in setrlimit): the sixth probe. Refused where it is made."""
    value = 64.5 if name in ("memory_mb",) else 1.5  # inside the bounds: only the type is wrong
    with pytest.raises(ValueError, match=f"tool limit {name}={value} must be an integer"):
        ToolLimits(**{name: value})
    assert ToolLimits(wall_s=1.5).wall_s == 1.5
