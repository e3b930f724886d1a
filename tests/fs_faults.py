"""Real file-system faults for the tests: a full disk and a read-only folder.

* ``small_disk(path, size)`` makes ``path`` a file system that really runs out of space: a
  ``tmpfs`` of ``size`` bytes mounted there, so writes fail with ``ENOSPC`` ("No space left on
  device") at the ``write`` call. Mounting needs root with ``CAP_SYS_ADMIN`` (the reference
  machine's tests run as root); elsewhere the returned ``preexec`` limits the child process's
  file size instead (``RLIMIT_FSIZE``: a write past ``size`` bytes fails with ``EFBIG``, "File too
  large"). Either way the error comes from the kernel at the write, not from a mock.
* ``read_only_dir(path)`` makes ``path`` a folder nobody can write into: a read-only ``tmpfs``
  (``EROFS``, which stops root too) when mounting works, else mode 0555 (``EACCES``) for a
  non-root user; ``None`` when neither applies (root without mount rights).

``unmount_all()`` undoes the mounts (lazily, so a leftover process cannot keep them busy).
"""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

DISK_FULL = r"(No space left on device|File too large)"
_MOUNTED: list[Path] = []


def _mount(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        _MOUNTED.append(path)
        return True
    return False


def small_disk(path: Path, size: int, rlimit: int | None = None):
    """(kind, preexec_fn for the child): ``"tmpfs"`` (None) or ``"rlimit"`` (sets RLIMIT_FSIZE
    to ``rlimit`` or ``size``)."""
    path.mkdir(parents=True, exist_ok=True)
    if _mount(path, f"size={size},mode=0755"):
        return "tmpfs", None
    limit = rlimit or size

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return "rlimit", preexec


def read_only_dir(path: Path) -> str | None:
    path.mkdir(parents=True, exist_ok=True)
    if _mount(path, "ro,size=1m,mode=0755"):
        return "tmpfs-ro"
    if os.geteuid() != 0:
        path.chmod(0o555)
        return "mode-0555"
    return None


def unmount_all() -> None:
    while _MOUNTED:
        p = _MOUNTED.pop()
        subprocess.run(["umount", "-l", str(p)], capture_output=True)
