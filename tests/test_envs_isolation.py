"""The strict tool sandbox against tools that try to break each of its guarantees (real
processes, real namespaces), called by this process (root in CI) and by an ordinary user.

Each guarantee's test also runs the same hostile tool with ``env.sandbox=unsafe_local`` (the
old, best-effort sandbox) where that lets the tool through, so the test is seen to fail
without the strict sandbox's mechanism."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sandbox_tools import REPO, RUNNERS, run_as, sandbox_python

from sat_cli.envs import confine, isolate, registry
from sat_cli.envs.base import EnvSettings

pytestmark = pytest.mark.skipif(
    confine.strict_refusal() is not None, reason=f"no strict sandbox: {confine.strict_refusal()}"
)


@pytest.fixture
def shared_dir():
    """A world-writable folder (not under the /tmp the sandbox covers), removed after; a test
    that wants the tool to see it names it visible."""
    base = REPO if not str(REPO).startswith("/tmp/") else Path("/var/tmp")  # a clone in /tmp
    if not base.is_dir():
        pytest.skip("no folder outside /tmp to share with the tool (/var/tmp is absent)")
    path = Path(tempfile.mkdtemp(prefix=".sat-sandbox-test-", dir=base))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


ENVIRON_PROBE = """
import os
seen = [repr(dict(os.environ))]
pids = [p for p in os.listdir('/proc') if p.isdigit()]
for p in pids + [str(os.getppid())]:  # the parent: the caller, unless in a PID namespace
    try:
        env = open(f'/proc/{p}/environ', 'rb').read().decode(errors='replace').split('\\0')
        seen += [v for v in env if 'SAT_PLANTED' in v]
    except OSError as e:
        seen.append(f'{p}: {type(e).__name__}')
print('pids', len(pids))
print('\\n'.join(seen))
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_cannot_read_its_callers_environment(runner):
    secret = f"planted-{secrets.token_hex(8)}"
    args = [sandbox_python(), "-S", "-c", ENVIRON_PROBE]
    env = {"SAT_PLANTED_SECRET": secret}
    kind, text = run_as(runner, args, env=env)
    assert kind == "ok", text
    assert secret not in text
    assert int(text.split()[1]) <= 3  # its own /proc: init, the tool, nothing of the caller's
    if runner == "caller" and os.geteuid() == 0:  # the unsafe sandbox keeps a root tool root
        kind, text = run_as(runner, args, "unsafe_local", env=env)
        assert kind == "ok" and secret in text  # the host's /proc shows the caller's environment


WRITE_PROBE = """
import ctypes, os, sys
target = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    try:
        fn()
        print(name, 'WROTE')
    except OSError as e:
        print(name, type(e).__name__)
def nested_remount():  # its own user and mount namespace, then / read-write again
    if libc.unshare(0x10000000 | 0x00020000) != 0:
        raise OSError(ctypes.get_errno(), 'unshare')
    uid = os.getuid()
    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')
    if libc.mount(None, b'/', None, 32 | 4096, None) != 0:  # MS_REMOUNT | MS_BIND
        raise OSError(ctypes.get_errno(), 'remount')
    open(target + '/nested', 'w').write('x')
attempt('shared', lambda: open(target + '/escaped', 'w').write('x'))
attempt('root', lambda: open(sys.argv[2], 'w').write('x'))
attempt('remount', lambda: libc.mount(None, b'/', None, 32, None) == 0 or os.mkdir(target + '/m'))
attempt('chmod', lambda: os.chmod(target, 0o700))
attempt('nested', nested_remount)
attempt('work', lambda: open('/tmp/mine', 'w').write('x'))
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_cannot_write_outside_its_work_folder(runner, shared_dir):
    top = f"/sat-escaped-{secrets.token_hex(4)}"  # a new file in the root folder
    args = [sandbox_python(), "-S", "-c", WRITE_PROBE, str(shared_dir), top]
    try:
        kind, text = run_as(runner, args, visible=(str(shared_dir),))  # seen, read-only
        assert kind == "ok", text
        got = dict(line.split() for line in text.splitlines())
        assert got.pop("work") == "WROTE" and "WROTE" not in got.values(), got
        assert list(shared_dir.iterdir()) == [] and not os.path.exists(top)
        assert shared_dir.stat().st_mode & 0o777 == 0o777
        kind, text = run_as(runner, args, "unsafe_local")
        assert "shared WROTE" in text and (shared_dir / "escaped").exists()
    finally:
        if os.path.exists(top):
            os.unlink(top)


NESTED_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (('user', 0x10000000), ('uts', 0x04000000)):
    ret = libc.unshare(flag)
    print(name, 'MADE' if ret == 0 else os.strerror(ctypes.get_errno()))
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_makes_no_namespace_of_its_own(runner):
    """A nested user namespace gave a tool capabilities there, and with them namespaces without
    end, counted against the one host uid of every strict call (the sixth probe: the calls
    beside it could not start). The tool's namespace allows no user namespace below it."""
    kind, text = run_as(runner, [sandbox_python(), "-S", "-c", NESTED_PROBE])
    assert kind == "ok", text
    got = dict(line.split(" ", 1) for line in text.splitlines())
    assert got["user"] == "No space left on device" and got["uts"] == "Operation not permitted"


READ_PROBE = """
import os, sys
for path in sys.argv[1:]:
    try:
        print(path, open(path).read().strip())
    except OSError as e:
        print(path, type(e).__name__)
print('root', ' '.join(sorted(os.listdir('/'))))
print('dev', ' '.join(sorted(os.listdir('/dev'))))
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_sees_only_the_system_its_python_and_what_it_is_shown(runner, shared_dir):
    """Another run's store, world-readable in a world-readable folder of the host, is not in
    the tool's root at all; a folder the caller names is, read-only."""
    store, shown = shared_dir / "mlruns", shared_dir / "shown"
    secret = f"planted-{secrets.token_hex(8)}"
    for folder, name, text in ((store, "meta.yaml", secret), (shown, "data.txt", "shown-data")):
        folder.mkdir(mode=0o755)
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    args = [sandbox_python(), "-S", "-c", READ_PROBE, str(store / "meta.yaml")]
    args.append(str(shown / "data.txt"))
    kind, text = run_as(runner, args, visible=(str(shown),))
    assert kind == "ok", text
    got = dict(line.split(" ", 1) for line in text.splitlines())
    assert got[str(store / "meta.yaml")] == "FileNotFoundError" and secret not in text
    assert got[str(shown / "data.txt")] == "shown-data"
    binds, links = isolate.root_plan(isolate.default_visible() + [sandbox_python(), str(shown)])
    tops = {p.split("/")[1] for p in [*binds, *links]} | {"dev", "proc", "tmp"}
    root = set(got["root"].split())
    assert {"dev", "proc", "tmp", "usr", "etc"} <= root <= tops, (root, tops)
    assert not root & {"home", "var", "run", "srv", "mnt", "opt", "sys"} - tops
    assert got["dev"].split() == sorted([*isolate.DEVICES, "fd", "stdin", "stdout", "stderr"])
    kind, text = run_as(runner, args, "unsafe_local")  # without the new root: read
    assert kind == "ok" and f"meta.yaml {secret}" in text, text


def test_the_root_plan_follows_symlinks_and_binds_no_path_twice(shared_dir):
    """A hand case: a chain of links to a folder, a file inside it, a missing path, a path in a
    folder the sandbox makes itself."""
    top = shared_dir
    (top / "a" / "sub").mkdir(parents=True)
    (top / "a" / "sub" / "f").write_text("x")
    (top / "link").symlink_to("a")
    (top / "chain").symlink_to(top / "link")
    (top / "loop").symlink_to("loop")
    paths = [f"{top}/chain/sub/f", f"{top}/a", f"{top}/missing", "/proc/self", f"{top}/loop"]
    binds, links = isolate.root_plan(paths)
    assert binds == [f"{top}/a"]
    assert links == {f"{top}/chain": f"{top}/link", f"{top}/link": "a", f"{top}/loop": "loop"}
    binds, links = isolate.root_plan([f"{top}/chain/sub/f"])
    assert binds == [f"{top}/a/sub/f"] and set(links) == {f"{top}/chain", f"{top}/link"}


def test_a_bind_swapped_after_the_plan_is_refused_not_followed(shared_dir):
    """Probe (issue 53 v6): a visible folder swapped for a symlink to ``/`` between the root's
    plan and its ``O_PATH`` open was followed: the tool was shown the host's whole root (4 of
    40 calls against a renaming loop). The open now finds where the descriptor ended."""
    folder = shared_dir / "data"
    folder.mkdir()
    binds, _ = isolate.root_plan([str(folder)])
    assert binds == [str(folder)]
    fd = isolate.open_planned(str(folder))
    assert os.readlink(f"/proc/self/fd/{fd}") == str(folder)
    os.close(fd)
    folder.rmdir()
    folder.symlink_to("/")  # what the plan saw as a folder now leads to the host's root
    with pytest.raises(OSError, match="changed while the root was built"):
        isolate.open_planned(str(folder))
    assert isolate.open_planned(str(shared_dir / "missing")) is None


KEYRING_AND_VSOCK_PROBE = """
import ctypes, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {'x86_64': 250, 'aarch64': 219}[__import__('os').uname().machine]
key = libc.syscall(nr, 10, -3, b'user', sys.argv[1].encode(), 0)  # KEYCTL_SEARCH, session
buf = ctypes.create_string_buffer(256)
got = libc.syscall(nr, 11, key, buf, 256) if key > 0 else -1  # KEYCTL_READ
print('key', buf.raw[:got].decode() if got > 0 else ctypes.get_errno())
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
    print('vsock MADE')
except OSError as e:
    print('vsock', e.errno)
"""


def test_a_tool_reads_no_key_of_its_callers_keyring_and_makes_no_vsock():
    """Probe (issue 53 v6): keyrings are not namespaced: the tool inherited this process's
    session keyring and read a key added to it (``add_key``); ``AF_VSOCK``, whose ports
    every network namespace shares (a VM's way to its host), was allowed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # add_key, request_key, keyctl
    calls = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}.get(os.uname().machine)
    if calls is None:
        pytest.skip("no keyring call numbers for this machine")
    name, secret = f"sat-test-{secrets.token_hex(4)}", f"planted-{secrets.token_hex(8)}"
    key = libc.syscall(calls[0], b"user", name.encode(), secret.encode(), len(secret), -3)
    if key < 0:
        pytest.skip(f"no keyring here: errno {ctypes.get_errno()}")
    try:
        args = [sandbox_python(), "-S", "-c", KEYRING_AND_VSOCK_PROBE, name]
        kind, text = run_as("caller", args)
        assert kind == "ok", text
        assert text.split("\n")[:2] == ["key 13", "vsock 13"] and secret not in text  # EACCES
        if os.geteuid() == 0:  # the unsafe sandbox: the caller's uid and its keyring
            kind, text = run_as("caller", args, "unsafe_local")
            assert f"key {secret}" in text
    finally:
        libc.syscall(calls[2], 3, key)  # KEYCTL_REVOKE


NET_PROBE = """
import socket, sys
for name, family, addr in [('tcp', socket.AF_INET, ('127.0.0.1', int(sys.argv[1]))),
                           ('unix', socket.AF_UNIX, sys.argv[2])]:
    try:
        s = socket.socket(family)
        s.settimeout(2)
        s.connect(addr)
        print(name, 'CONNECTED')
    except OSError as e:
        print(name, type(e).__name__)
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_reaches_no_network_not_even_loopback_or_a_unix_socket(runner, shared_dir):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(shared_dir / "s"))
    (shared_dir / "s").chmod(0o777)  # anyone may connect: only the sandbox can stop the tool
    unix.listen(4)
    for s in (tcp, unix):
        s.setblocking(False)
    args = [sandbox_python(), "-S", "-c", NET_PROBE, str(tcp.getsockname()[1])]
    args.append(str(shared_dir / "s"))
    try:
        kind, text = run_as(runner, args, visible=(str(shared_dir),))  # the socket is there
        assert kind == "ok" and "CONNECTED" not in text, text
        for s in (tcp, unix):
            with pytest.raises(BlockingIOError):
                s.accept()
        kind, text = run_as(runner, args, "unsafe_local")
        assert "unix CONNECTED" in text  # a network namespace alone does not stop this one
    finally:
        tcp.close()
        unix.close()


DATAGRAM_PROBE = """
import socket, sys
for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):  # SOCK_RAW: AF_UNIX makes it a datagram pair
    try:
        a, _ = socket.socketpair(socket.AF_UNIX, kind)
        a.sendto(b'SENT', sys.argv[1])
        print(kind, 'SENT')
    except OSError as e:
        print(kind, type(e).__name__)
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_sends_no_datagram_to_a_unix_socket(runner, shared_dir):
    """Probe (issue 53 v7): ``socket(AF_UNIX)`` was refused, but ``socketpair(AF_UNIX,
    SOCK_DGRAM)`` was not, and ``sendto(2)`` on one end delivered to a host datagram socket on
    a visible path (the kind ``/dev/log`` or journald listen on)."""
    path = str(shared_dir / "d")
    host = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    host.bind(path)
    os.chmod(path, 0o777)  # anyone may send: only the sandbox can stop the tool
    host.setblocking(False)
    args = [sandbox_python(), "-S", "-c", DATAGRAM_PROBE, path]
    try:
        kind, text = run_as(runner, args, visible=(str(shared_dir),))
        assert kind == "ok" and "SENT" not in text, text
        with pytest.raises(BlockingIOError):
            host.recv(16)
        kind, text = run_as(runner, args, "unsafe_local")
        assert "SENT" in text and host.recv(16) == b"SENT"  # no network namespace stops it
    finally:
        host.close()


def _marked(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and marker in open(f"/proc/{pid}/cmdline", "rb").read().decode():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("runner", RUNNERS)
def test_no_process_of_a_tool_outlives_its_call(runner, monkeypatch):
    """A child that leaves the session (``setsid``) and is orphaned escapes the process-group
    kill; without a pids or memory cgroup (both list it) only the PID namespace ends it."""
    monkeypatch.setattr(confine, "proc_mode", lambda: "none")
    monkeypatch.setattr(confine, "memory_mode", lambda: "rlimit")
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    code = (
        "import subprocess\n"
        f"subprocess.Popen(['sh', '-c', 'sleep {marker} & sleep {marker}'],"
        " start_new_session=True)\n"
        "print('started')"
    )
    args = [sandbox_python(), "-S", "-c", code]
    kind, text = run_as(runner, args, wall_s=10)
    assert (kind, text) == ("ok", "started\n")
    assert _marked(f"sleep {marker}") == []
    run_as(runner, args, "unsafe_local", wall_s=10)
    left = _marked(f"sleep {marker}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left  # the old sandbox's group kill misses them


PRIVILEGE_PROBE = """
import os, socket
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
print(*[status[k].split()[0] for k in ('Uid', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')])
print(status['NoNewPrivs'].strip(), status['Seccomp'].strip(), socket.gethostname())
try:
    os.setuid(0)
    print('setuid WORKED')
except OSError as e:
    print('setuid', type(e).__name__)
print(sorted({line.split(':', 2)[2] for line in open('/proc/self/cgroup').read().split()}))
"""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_tool_has_no_uid_0_no_capabilities_and_no_new_privileges(runner):
    kind, text = run_as(runner, [sandbox_python(), "-S", "-c", PRIVILEGE_PROBE])
    assert kind == "ok", text
    ids, flags, setuid, cgroups = text.splitlines()
    assert cgroups == "['/']"  # its own cgroup namespace: no host cgroup path is named
    uid, *caps = ids.split()
    assert int(uid) != 0 and caps == ["0000000000000000"] * 4
    assert flags == "1 2 sandbox" and setuid in ("setuid OSError", "setuid PermissionError")


REFUSED = """
import sys
from sat_cli.envs import confine, isolate, registry, sandbox
from sat_cli.envs.base import EnvSettings, TurnBasedEnv


@registry.register_env("needs-tools")
class NeedsTools(TurnBasedEnv):
    uses_sandbox = True


print(confine.strict_refusal())
print(sandbox.run_tool(['sh', '-c', 'echo ran']).text)
try:
    registry.make('needs-tools', EnvSettings())
except ValueError as e:
    print('refused:', e)
print(type(registry.make('needs-tools', EnvSettings(sandbox='unsafe_local'))).__name__)
print(sandbox.run_tool(['sh', '-c', 'echo ran'], mode='unsafe_local').text)
"""


def test_where_the_kernel_refuses_a_layer_the_environment_refuses_to_start():
    """A real refusal: in a user namespace that may not make more (``max_user_namespaces``
    0) and maps only uid 0, the drop to the sandbox's uid and the ``unshare`` are refused."""
    if not shutil.which("unshare"):
        pytest.skip("needs util-linux unshare")
    shell = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", shell, sys.executable, REFUSED],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
    )
    if done.returncode != 0 and b"unshare failed" in done.stderr:
        pytest.skip(f"cannot make a user namespace here: {done.stderr.decode().strip()}")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stdout.decode().splitlines()
    assert lines[0].startswith("isolate: ")
    assert lines[1].startswith("tool could not start: the strict tool sandbox is not available")
    assert "ran" not in lines[1]
    assert lines[2].startswith("refused: env=needs-tools runs tools and cannot start: ")
    assert "env.sandbox=unsafe_local" in lines[2]
    assert lines[3:5] == ["NeedsTools", "ran"]


def test_a_strict_call_is_refused_not_weakened(monkeypatch):
    """Where the probe failed, a strict call does not run at all."""
    monkeypatch.setattr(confine, "strict_refusal", lambda: "isolate: unshare: refused")
    t0 = time.monotonic()
    r = run_as("caller", ["sh", "-c", "echo ran"])
    assert r[0] == "start" and "ran" not in r[1] and "unshare: refused" in r[1]
    assert time.monotonic() - t0 < 1

    class NeedsTools:
        uses_sandbox = True

        def __init__(self, settings):
            self.settings = settings

    registry.ENVIRONMENTS.add("needs-tools-here", NeedsTools)
    try:
        with pytest.raises(ValueError, match="env.sandbox=unsafe_local") as e:
            registry.make("needs-tools-here", EnvSettings())
        assert "\n" not in str(e.value) and "isolate: unshare: refused" in str(e.value)
        made = registry.make("needs-tools-here", EnvSettings(sandbox="unsafe_local"))
        assert made.settings.sandbox == "unsafe_local"
    finally:
        registry.ENVIRONMENTS.remove("needs-tools-here")


@pytest.mark.parametrize("value", ["", "none", "STRICT", "unsafe-local", 1])
def test_env_sandbox_is_one_of_the_modes(value):
    from sat_cli.config.env import SANDBOX_MODES, EnvConfig
    from sat_cli.envs.sandbox import MODES
    from sat_cli.validate import ConfigError

    assert SANDBOX_MODES == MODES == ("strict", "unsafe_local")
    with pytest.raises(ConfigError, match="env.sandbox"):
        EnvConfig(sandbox=value)
    with pytest.raises(ValueError, match="env.sandbox"):
        EnvSettings(sandbox=value)
