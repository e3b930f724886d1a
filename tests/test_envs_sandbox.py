"""The tool sandbox with real hostile tools (real subprocesses): each is contained, reported with
its kind within its deadline, and leaves no process, cgroup or scratch folder behind."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import pytest

from sat_cli.envs import confine
from sat_cli.envs.sandbox import ToolLimits, ToolStats, run_tool
from sat_cli.util.procs import live_group_members

PY = sys.executable
PGID = "import os,sys; print('pgid', os.getpgid(0), flush=True)\n"


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """Scratch folders go under tmp_path, so that the test sees whether they were removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sat-tool-")] == []


def run_clean(code: str, limits: ToolLimits, budget_s: float):
    """Run a Python tool that first prints its process group; check the deadline and that the
    group is gone afterwards."""
    t0 = time.monotonic()
    r = run_tool([PY, "-c", PGID + code], limits)
    assert time.monotonic() - t0 < budget_s, r
    first = r.text.split("\n", 1)[0]
    assert first.startswith("pgid "), r.text[:200]
    assert live_group_members(int(first.split()[1])) == []
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
    cwd = run_tool([PY, "-c", "import os; print(os.getcwd())"]).text.strip()
    assert os.path.dirname(cwd) == str(scratch_root) and not os.path.exists(cwd)


def test_infinite_loop_hits_the_cpu_limit(scratch_root):
    r = run_clean("while True: pass", ToolLimits(wall_s=20, cpu_s=1), budget_s=15)
    assert r.kind == "cpu_limit" and r.returncode < 0


def test_sleeping_tool_is_stopped_at_the_wall_clock_deadline(scratch_root):
    # its child leaves the group's foreground but not the group: killed with it
    code = "import subprocess,time; subprocess.Popen(['sleep','100']); time.sleep(100)"
    r = run_clean(code, ToolLimits(wall_s=1.0), budget_s=8)
    assert r.kind == "timeout" and 1.0 <= r.elapsed_s < 8


def test_a_gigabyte_of_output_is_cut_at_the_cap(scratch_root):
    code = "b = b'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.buffer.write(b)"
    r = run_clean(code, ToolLimits(wall_s=20, max_output_bytes=4096), budget_s=10)
    assert r.kind == "output_limit" and r.truncated
    assert r.text.startswith("pgid ") and r.text.count("x") == 4096 - len(r.text.split("\n")[0]) - 1


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
    r = run_tool([PY, "-c", "import socket; socket.socket()"])
    assert r.kind == "crash" and "network access is disabled in the tool sandbox" in r.text


def test_fork_bomb_is_contained(scratch_root):
    code = "import time\nfor _ in range(10000):\n    if os.fork() == 0: time.sleep(60)"
    r = run_clean(code, ToolLimits(wall_s=3, max_procs=16), budget_s=12)
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
    assert run_tool(["/nonexistent/tool"]).kind == "start"
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
    r = run_clean(code, ToolLimits(wall_s=5), budget_s=10)
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
