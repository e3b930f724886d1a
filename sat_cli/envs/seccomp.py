"""The strict tool sandbox's seccomp filter (step 5 of ``isolate.py``): what a network
namespace does not confine is refused by system call.

A Unix socket's path on the read-only root stays connectable by whoever may write it, and
``AF_VSOCK`` reaches a VM's host (its ports are shared by every network namespace); the kernel's
keyrings are not namespaced, and the caller's session keyring is inherited; ``io_uring`` makes
sockets without ``socket(2)``, and a datagram ``socketpair(2)`` is a Unix socket too; another
ABI (i386 on x86_64, x32 numbers) would pass a filter written for the native numbers. ``seccomp_program`` is the filter as data (tested instruction by
instruction in ``tests/test_envs_sandbox.py``), ``deny_sockets_and_keyrings`` installs it.
"""

from __future__ import annotations

import ctypes
import os

# seccomp: (audit arch, socket(2)'s number, io_uring_setup(2)'s number, x32 bit to refuse)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 425, 0)}
SECCOMP_SOCKETPAIR = {"x86_64": 53, "aarch64": 199}  # socketpair(2)'s number
# add_key, request_key, keyctl: the kernel's keyrings are not namespaced, and the caller's
# session keyring is inherited (a tool read a key the caller had added to it)
SECCOMP_KEYRING_CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
SECCOMP_ALLOW, SECCOMP_DENY = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
# the only socket families a tool may make: those its network namespace confines (AF_UNIX
# reaches a socket file on the read-only root; AF_VSOCK reaches the hypervisor of a VM, and its
# ports are shared by every network namespace)
SOCKET_FAMILIES = (AF_INET, AF_INET6, AF_NETLINK)
SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 5, 0xF
# the only socketpair(2) types a tool may make (of AF_UNIX): connected for good. A datagram
# pair (SOCK_DGRAM, or SOCK_RAW, which AF_UNIX makes a datagram socket) is a Unix socket that
# sendto(2) or connect(2) points at any socket file on the root: AF_UNIX refused by another way
SOCKETPAIR_TYPES = (SOCK_STREAM, SOCK_SEQPACKET)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8)]
    _fields_ += [("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter of ``deny_sockets_and_keyrings`` as (code, jt, jf, k) BPF instructions (a jump's
    target is the next instruction's index plus its offset). Refused: another ABI, x32 numbers,
    ``io_uring_setup``, the keyring calls, ``socket(2)`` of a family not in
    ``SOCKET_FAMILIES`` and ``socketpair(2)`` but of ``AF_UNIX`` with a type in
    ``SOCKETPAIR_TYPES``; everything else is allowed."""
    arch, sys_socket, sys_uring, x32 = SECCOMP_ARCHES[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, …|JGE|K, BPF_RET|K
    and_ = 0x54  # BPF_ALU|BPF_AND|BPF_K
    refused = (sys_uring, *SECCOMP_KEYRING_CALLS[machine])
    # jumps name their targets ("allow", "deny", "pair" or 0: the next instruction)
    sym: list[tuple[int, object, object, int]] = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 0, "deny", arch),  # another ABI (i386 on x86_64): refused
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, "deny", 0, x32) if x32 else (jeq, "deny", 0, 0xFFFFFFFF),  # x32 numbers
        *[(jeq, "deny", 0, nr) for nr in refused],  # io_uring makes sockets without socket(2)
        (jeq, "pair", 0, SECCOMP_SOCKETPAIR[machine]),
        (jeq, 0, "allow", sys_socket),
        (ld, 0, 0, 16),  # the low half of socket(2)'s first argument: its family
        *[(jeq, "allow", 0, family) for family in SOCKET_FAMILIES[:-1]],
        (jeq, "allow", "deny", SOCKET_FAMILIES[-1]),  # any other family: refused
    ]
    pair = len(sym)
    sym += [
        (ld, 0, 0, 16),  # "pair": socketpair(2)'s family
        (jeq, 0, "deny", AF_UNIX),
        (ld, 0, 0, 24),  # the low half of its second argument: the type and its flags
        (and_, 0, 0, SOCK_TYPE_MASK),
        *[(jeq, "allow", 0, kind) for kind in SOCKETPAIR_TYPES[:-1]],
        (jeq, "allow", "deny", SOCKETPAIR_TYPES[-1]),  # a datagram pair: refused
        (ret, 0, 0, SECCOMP_ALLOW),
        (ret, 0, 0, SECCOMP_DENY),
    ]
    where = {"allow": len(sym) - 2, "deny": len(sym) - 1, "pair": pair}

    def offset(i: int, target: object) -> int:
        return 0 if target == 0 else where[target] - i - 1

    return [(c, offset(i, jt), offset(i, jf), k) for i, (c, jt, jf, k) in enumerate(sym)]


def deny_sockets_and_keyrings() -> None:
    """A seccomp filter (``seccomp_program``): ``socket(2)`` of any family but ``AF_INET``,
    ``AF_INET6`` and ``AF_NETLINK``, ``io_uring_setup`` and the keyring calls fail with
    ``EACCES``. A Unix socket's path on the read-only root stays connectable by whoever may
    write it (a world-writable one: by anyone), and ``AF_VSOCK`` reaches a VM's host, which a
    network namespace does not stop; ``socketpair`` of connected ``AF_UNIX`` sockets (pipes
    between the tool's own processes) still works, a datagram pair (which ``sendto(2)`` points
    at a socket file) does not. Needs ``no_new_privs``."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise OSError(f"no seccomp filter for machine {machine!r}")
    prog = seccomp_program(machine)
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
