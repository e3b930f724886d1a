"""The strict tool sandbox's layers, applied by the launcher (``launch.py``) before the tool runs.

``run_isolated(spec, args, env, status)`` is called in the single-threaded launcher ``L``
(already in the tool's pids cgroup and with its rlimits) and never returns. In this order:

1. **Another uid.** As root, ``L`` drops to ``SANDBOX_UID``/``SANDBOX_GID`` (65534, ``nobody``)
   with no supplementary groups; an ordinary user stays themself. From here on nothing in the
   tree runs as root, so the kernel's ``RLIMIT_NPROC`` applies and the caller's files and
   ``/proc`` entries are another user's.
2. **New namespaces**: ``unshare(CLONE_NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS |
   NEWCGROUP)``,
   as that unprivileged uid (so it needs unprivileged user namespaces); the uid and gid map
   only themselves (``setgroups`` denied). The network namespace has only a downed loopback.
3. ``L`` forks ``C``, the new PID namespace's init. ``C`` dies with ``L`` (``PR_SET_PDEATHSIG``),
   and when ``C`` exits the kernel kills every process left in the namespace: no process of the
   tool outlives its call, also one that left the session with ``setsid``.
4. ``C`` makes the mounts private and builds a **new root** (``build_root``): an empty
   ``tmpfs`` that shows only the host paths of ``spec["visible"]`` (``root_plan``: the system
   folders, the Python that runs ``sat``, the tool's program and what the caller names; each
   bind-mounted, symlinks on the way re-created), five device nodes (``/dev/null``, ``zero``,
   ``full``, ``random``, ``urandom``) and a fresh ``/proc`` (only the namespace's processes),
   then ``pivot_root``s into it and detaches the old root: the rest of the host (home folders,
   ``/work``-style checkouts, other runs' stores, ``/var``, ``/run``, ``/dev/shm``, ``/sys``) is
   not there at all. It makes every mount read-only and ``nosuid``
   (``mount_setattr(AT_RECURSIVE)``), mounts an empty ``tmpfs`` of ``work_mb`` MiB on ``/tmp``
   (the tool's only writable folder: working directory, ``HOME``, ``TMPDIR``) and sets the
   hostname ``sandbox``.
5. ``C`` forks the tool ``T``: ``PR_SET_NO_NEW_PRIVS``, the capability bounding set and the
   ambient set emptied, the seccomp filter of ``seccomp.py`` installed, then ``execvpe``.
   ``T``'s uid is not 0 in its namespace, so ``exec`` leaves it no capabilities; set-uid programs cannot raise them (``no_new_privs``, ``nosuid``).
6. ``C`` reaps orphans until ``T`` exits and reports ``T``'s wait status to ``L``, which ends
   the same way (the same exit status, or killed by the same signal).

Every step that fails raises: the launcher reports ``<step>: <error>`` on the status pipe and
exits 127 without running the tool, so a layer the kernel refuses is never silently dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import sys

from sat_cli.envs import seccomp

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000  # the tool's cgroup paths start at its own cgroup: no host names
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
NAMESPACES |= CLONE_NEWCGROUP
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64 (the unified syscall table)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
MS_BIND, MNT_DETACH, O_PATH = 0x1000, 2, 0o10000000
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
WORK = "/tmp"
# what the new root shows of the host, besides the Python that runs sat (``default_visible``)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
# made by the sandbox itself: a visible path may not be (or lie under) one of these
RESERVED = ("/proc", "/dev", "/sys", WORK)
MAX_VISIBLE = 64  # paths a caller may add
MAX_LINKS = 16  # symlinks followed while resolving one visible path


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns")]


def _load_libc() -> ctypes.CDLL:
    """glibc by its soname; ``find_library`` (which runs ``ldconfig -p``, a subprocess at
    import time) only where that name is absent."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_libc = _load_libc()
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]
_libc.mount.argtypes += [ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0, arg3: int = 0) -> None:
    _check(_libc.prctl(option, arg, arg3, 0, 0), f"prctl({option})")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    src, dst = source.encode(), target.encode()
    kind = fstype.encode() if fstype else None
    _check(_libc.mount(src, dst, kind, flags, data.encode() or None), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def drop_user() -> tuple[int, int]:
    """As root: become ``SANDBOX_UID``; anyone else keeps their uid. Returns (uid, gid)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        _prctl(PR_SET_DUMPABLE, 1)  # a uid change clears it; /proc/self/uid_map needs it
    return os.geteuid(), os.getegid()


def enter_namespaces(uid: int, gid: int) -> None:
    """New user, mount, PID, network, IPC and UTS namespaces; ``uid``/``gid`` map to themselves
    (a non-zero uid inside: ``exec`` leaves the tool no capabilities)."""
    _check(_libc.unshare(NAMESPACES), "unshare(user, mount, pid, net, ipc, uts, cgroup)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # no user namespace below this one: a nested one would give the tool capabilities there,
    # with which it could make other namespaces without end, and those count against its
    # host uid's limits, shared by every strict call (the sixth probe: 96,555 UTS namespaces in
    # 0.2 s, and every call beside it failed to start); the limit is this namespace's own
    _write("/proc/sys/user/max_user_namespaces", "0")


def _read_only_root() -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(
        SYS_MOUNT_SETATTR,
        ctypes.c_int(AT_FDCWD),
        b"/",
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, "mount_setattr / read-only")


def check_visible(path: object) -> str:
    """``path`` as a visible path of the new root, or ValueError saying why it cannot be one:
    an absolute, normalised path of at most 4096 bytes, not ``/`` and not under ``RESERVED``."""
    if not isinstance(path, str) or not path or "\0" in path or len(path.encode()) > 4096:
        raise ValueError(
            f"a visible path must be a non-empty string of at most 4096 bytes: {path!r}"
        )
    if not path.startswith("/") or os.path.normpath(path) != path or path.startswith("//"):
        raise ValueError(f"a visible path must be absolute and normalised: {path!r}")
    if path == "/":
        raise ValueError("the whole host ('/') cannot be a visible path")
    for top in RESERVED:
        if path == top or path.startswith(top + "/"):
            raise ValueError(f"{path!r} lies in {top}, which the sandbox makes itself")
    return path


def default_visible() -> list[str]:
    """The system folders and the prefixes of the Python running this (a tool may be ``python``)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return list(SYSTEM_PATHS) + sorted(p for p in prefixes if p and p != "/")


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def root_plan(paths: list[str]) -> tuple[list[str], dict[str, str]]:
    """What the new root holds for host ``paths``: the real paths to bind (none inside another)
    and the symlinks met on the way (path -> its link text), so that a path that goes through a
    symlink (``/lib64`` -> ``usr/lib64``, a venv's ``bin/python``) resolves inside as outside.
    A path that does not exist is left out; one that leaves ``RESERVED`` or ``/`` is too."""
    binds: set[str] = set()
    links: dict[str, str] = {}
    for path in paths:
        todo, hops = path, 0
        while todo is not None and hops <= MAX_LINKS:
            parts, cur, nxt = todo.strip("/").split("/"), "", None
            for i, part in enumerate(parts):
                cur += "/" + part
                if os.path.islink(cur):
                    links[cur] = os.readlink(cur)
                    rest = "/".join(parts[i + 1 :])
                    target = os.path.join(os.path.dirname(cur), links[cur], rest)
                    nxt = os.path.normpath(target).replace("//", "/", 1)
                    break
            else:
                if os.path.exists(cur) and cur != "/":
                    binds.add(cur)
            todo, hops = nxt, hops + 1
    binds = {b for b in binds if not any(_under(b, top) for top in RESERVED)}
    kept = sorted(b for b in binds if not any(o != b and _under(b, o) for o in binds))
    links = {
        k: v
        for k, v in links.items()
        if not any(_under(k, b) for b in kept) and not any(_under(k, top) for top in RESERVED)
    }
    return kept, dict(sorted(links.items()))


def _mount_point(path: str, is_dir: bool) -> None:
    os.makedirs(path if is_dir else os.path.dirname(path), mode=0o755, exist_ok=True)
    if not is_dir and not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def _bind(fd: int, target: str) -> None:
    """Bind the host path open as ``fd`` (``O_PATH``, opened before ``/tmp`` was covered)."""
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def open_planned(path: str) -> int | None:
    """``path`` of ``root_plan``'s binds open as ``O_PATH`` (None if it is gone), or OSError
    when it is no longer what the plan saw: a folder on the way swapped for a symlink between
    the plan and the open (the open follows it: a tool was shown the host's ``/`` where a
    visible folder was planned) ends somewhere else, which the descriptor's path shows."""
    try:
        fd = os.open(path, O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    if (now := os.readlink(f"/proc/self/fd/{fd}")) != path:
        os.close(fd)
        raise OSError(errno.ESTALE, f"{path} changed while the root was built (now {now})")
    return fd


def build_root(binds: list[str], links: dict[str, str]) -> None:
    """Step 4's new root: a tmpfs staged on ``/tmp`` (the host's ``/tmp`` is then covered:
    what is bound from it was opened first), the binds, links, devices and ``/proc``; then
    ``pivot_root`` into it and the old root detached."""
    opened = []
    for path in binds:
        fd = open_planned(path)
        if fd is not None:
            opened.append((path, fd, os.path.isdir(f"/proc/self/fd/{fd}")))
    devices = [(f"/dev/{d}", os.open(f"/dev/{d}", O_PATH | os.O_CLOEXEC), False) for d in DEVICES]
    new = WORK
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd, is_dir in opened + devices:
        _mount_point(new + path, is_dir)
        _bind(fd, new + path)
        os.close(fd)
    for path, text in links.items():
        os.makedirs(os.path.dirname(new + path), mode=0o755, exist_ok=True)
        os.symlink(text, new + path)
    for name, text in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(text, f"{new}/dev/{name}")
    for n, name in ((1, "stdout"), (2, "stderr")):
        os.symlink(f"/proc/self/fd/{n}", f"{new}/dev/{name}")
    os.mkdir(new + "/proc", 0o555)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + WORK, 0o755)
    os.mkdir(new + "/.old", 0o700)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"no pivot_root syscall number for machine {machine!r}")
    ret = _libc.syscall(SYS_PIVOT_ROOT[machine], new.encode(), (new + "/.old").encode())
    _check(ret, "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.rmdir("/.old")


def make_mounts(work_mb: int, binds: list[str], links: dict[str, str]) -> None:
    """Step 4 of the module docstring (in ``C``, the PID namespace's init)."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    build_root(binds, links)
    _read_only_root()
    _mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_mb}m,mode=0700")
    _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    os.chdir(WORK)


def drop_capabilities() -> None:
    """``no_new_privs``, and the bounding and ambient capability sets emptied (in ``T``)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def _end_like(status: int) -> None:
    """End this process as a child with wait status ``status`` ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _fail(status: int | None, msg: str) -> None:
    """Report a failed step on the status pipe and exit 127 (``launch.FAILED``)."""
    if status is not None:
        try:
            os.write(status, msg[:1000].encode())
        except OSError:
            pass
    os._exit(127)


def _init(spec: dict, args: list[str], env: dict, status: int | None, report: int) -> None:
    """``C``: the PID namespace's init (steps 3–6); never returns."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # L is waiting for C: it cannot have gone yet
    binds, links = root_plan(spec["visible"] if "visible" in spec else default_visible())
    make_mounts(spec.get("work_mb", 64), binds, links)
    tool = os.fork()
    if tool == 0:
        os.close(report)
        drop_capabilities()
        seccomp.deny_sockets_and_keyrings()
        try:
            os.execvpe(args[0], args, env)
        except OSError as e:
            _fail(status, f"exec: {type(e).__name__}: {e}")
    if status is not None:
        os.close(status)  # the parent's read ends once the tool has exec'd (close-on-exec)
    while True:
        pid, wstatus = os.wait()
        if pid == tool:
            os.write(report, wstatus.to_bytes(4, "little"))
            os._exit(0)


def run_isolated(spec: dict, args: list[str], env: dict, status: int | None) -> None:
    """Steps 1–2 in ``L``, then ``C`` (steps 3–6); ``L`` ends as the tool ended."""
    try:
        uid, gid = drop_user()
    except OSError as e:
        raise OSError(e.errno, f"dropping to uid {SANDBOX_UID}: {e.strerror}") from None
    enter_namespaces(uid, gid)
    report_r, report_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(report_r)
        try:
            _init(spec, args, env, status, report_w)
        except Exception as e:  # noqa: BLE001 — every failure is reported, as in launch.main
            _fail(status, f"isolate: {type(e).__name__}: {e}")
    os.close(report_w)
    if status is not None:
        os.close(status)
    _, wstatus = os.waitpid(init, 0)
    got = os.read(report_r, 4)
    if len(got) == 4:
        _end_like(int.from_bytes(got, "little"))
    _end_like(wstatus)
