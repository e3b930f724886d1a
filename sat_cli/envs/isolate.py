"""The strict tool sandbox's layers, applied by the launcher (``launch.py``) before the tool runs.

``run_isolated(spec, args, env, status)`` is called in the single-threaded launcher ``L``
(already in the tool's pids cgroup and with its rlimits) and never returns. In this order:

1. **Another uid.** As root, ``L`` drops to ``SANDBOX_UID``/``SANDBOX_GID`` (65534, ``nobody``)
   with no supplementary groups; an ordinary user stays themself. From here on nothing in the
   tree runs as root, so the kernel's ``RLIMIT_NPROC`` applies and the caller's files and
   ``/proc`` entries are another user's.
2. **New namespaces**: ``unshare(CLONE_NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS)``,
   as that unprivileged uid (so it needs unprivileged user namespaces); the uid and gid map
   only themselves (``setgroups`` denied). The network namespace has only a downed loopback.
3. ``L`` forks ``C``, the new PID namespace's init. ``C`` dies with ``L`` (``PR_SET_PDEATHSIG``),
   and when ``C`` exits the kernel kills every process left in the namespace: no process of the
   tool outlives its call, also one that left the session with ``setsid``.
4. ``C`` makes the mounts private, mounts a fresh ``/proc`` (only the namespace's processes),
   makes every mount read-only and ``nosuid`` (``mount_setattr(AT_RECURSIVE)``), mounts an empty
   ``tmpfs`` of ``work_mb`` MiB on ``/tmp`` (the tool's only writable folder: working directory,
   ``HOME``, ``TMPDIR``) and empty read-only ``tmpfs`` over ``/dev/shm``, ``/run`` and ``/var/tmp``
   (their sockets are out of reach), and sets the hostname ``sandbox``.
5. ``C`` forks the tool ``T``: ``PR_SET_NO_NEW_PRIVS``, the capability bounding set and the
   ambient set emptied, then ``execvpe``. ``T``'s uid is not 0 in its namespace, so ``exec``
   leaves it no capabilities; set-uid programs cannot raise them (``no_new_privs``, ``nosuid``).
6. ``C`` reaps orphans until ``T`` exits and reports ``T``'s wait status to ``L``, which ends
   the same way (the same exit status, or killed by the same signal).

Every step that fails raises: the launcher reports ``<step>: <error>`` on the status pipe and
exits 127 without running the tool, so a layer the kernel refuses is never silently dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64 (the unified syscall table)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
WORK = "/tmp"
HIDDEN = ("/dev/shm", "/run", "/var/tmp")  # empty read-only tmpfs over these, where present


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
    _check(_libc.unshare(NAMESPACES), "unshare(user, mount, pid, net, ipc, uts)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


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


def make_mounts(work_mb: int) -> None:
    """Step 4 of the module docstring (in ``C``, the PID namespace's init)."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _read_only_root()
    _mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_mb}m,mode=0700")
    for path in HIDDEN:
        if os.path.isdir(path) and not os.path.islink(path):
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            _mount("tmpfs", path, "tmpfs", flags, "size=4k,mode=0755")
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


# seccomp: (audit arch, socket(2)'s number, io_uring_setup(2)'s number, x32 bit to refuse)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 425, 0)}
SECCOMP_ALLOW, SECCOMP_DENY = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AF_UNIX = 1


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8)]
    _fields_ += [("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter of ``deny_unix_sockets`` as (code, jt, jf, k) BPF instructions (a jump's
    target is the next instruction's index plus its offset: from index 4, 5 reaches the last)."""
    arch, sys_socket, sys_uring, x32 = SECCOMP_ARCHES[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, …|JGE|K, BPF_RET|K
    return [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, arch),
        (ret, 0, 0, SECCOMP_DENY),  # another ABI (i386 on x86_64): refused
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, 5, 0, x32) if x32 else (jeq, 5, 0, 0xFFFFFFFF),  # x32 numbers: refused
        (jeq, 4, 0, sys_uring),  # io_uring makes sockets without socket(2): refused
        (jeq, 0, 2, sys_socket),
        (ld, 0, 0, 16),  # the low half of socket(2)'s first argument: its family
        (jeq, 1, 0, AF_UNIX),
        (ret, 0, 0, SECCOMP_ALLOW),
        (ret, 0, 0, SECCOMP_DENY),
    ]


def deny_unix_sockets() -> None:
    """A seccomp filter: ``socket(AF_UNIX, …)`` and ``io_uring_setup`` fail with ``EACCES``.
    A Unix socket's path on the read-only root stays connectable by whoever may write it (a
    world-writable one: by anyone), which a network namespace does not stop; ``socketpair``
    (pipes between the tool's own processes) still works. Needs ``no_new_privs``."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise OSError(f"no seccomp filter for machine {machine!r}")
    prog = seccomp_program(machine)
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


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
    make_mounts(spec.get("work_mb", 64))
    tool = os.fork()
    if tool == 0:
        os.close(report)
        drop_capabilities()
        deny_unix_sockets()
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
