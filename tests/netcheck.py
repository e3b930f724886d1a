"""Which addresses a set of processes listens on and talks to, read from ``/proc`` (Linux).

``sockets(pids)`` maps each process's open socket inodes (``/proc/<pid>/fd``) to the rows of
``/proc/net/{tcp,tcp6,udp,udp6}`` and returns ``(pid, proto, local_ip, local_port, remote_ip,
state)``. ``off_loopback(rows)`` keeps the rows that are not loopback-only: a listener on
0.0.0.0 or :: counts, since it also answers on the machine's other addresses.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

from sat_cli.util.procs import socket_inodes

TCP_LISTEN = "0A"


def _addr(hexaddr: str) -> tuple[str, int]:
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    else:  # four little-endian 32-bit words
        words = struct.unpack("<4I", raw)
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
    return ip, int(port_hex, 16)


def _table(proto: str) -> dict[str, tuple]:
    rows = {}
    try:
        with open(f"/proc/net/{proto}") as f:
            next(f)
            for line in f:
                parts = line.split()
                local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
                rows[inode] = (proto, *_addr(local), _addr(remote)[0], state)
    except OSError:
        pass
    return rows


def sockets(pids) -> list[tuple]:
    tables: dict[str, tuple] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        tables.update(_table(proto))
    out = []
    for pid in pids:
        for inode in sorted(socket_inodes(pid)):
            row = tables.get(str(inode))
            if row is not None:
                out.append((pid, *row))
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def off_loopback(rows) -> list[tuple]:
    """Rows bound to, or connected to, anything but loopback (a wildcard listener included)."""
    bad = []
    for pid, proto, local_ip, port, remote_ip, state in rows:
        unconnected = remote_ip in ("0.0.0.0", "::")
        if not _loopback(local_ip) or (not unconnected and not _loopback(remote_ip)):
            bad.append((pid, proto, local_ip, port, remote_ip, state))
    return bad


def descendants(root: int) -> set[int]:
    """``root``, its live descendants and its process group (the guard's own walk)."""
    from sat_cli.cluster.guard import tree

    return tree(root)
