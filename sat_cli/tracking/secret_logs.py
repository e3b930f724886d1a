"""The one secret policy (``tracking.params``) applied to the logs of a run's child processes.

The engine's worker, the SGLang servers and router, the Megatron trainer and nodes and Ray write
``<run>/logs/*.log`` themselves (their own standard output and error), so what they print cannot
go through ``redact_text`` on its way: an SGLang server prints its arguments, ``--api-key`` and
its value included. :func:`scrub_logs` rewrites each such file with every line through
``redact_text`` (the name rules and every value known to be secret), atomically and only when a
line changes. `sat train` and `sat eval` call it when the run ends (every exit path, after the
engine and the trainer are closed) and, under the run's lock, before a run starts in a folder,
so a log a killed run left is masked by the next run there.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

LOG_SUFFIXES = (".log",)


def scrub_file(path: Path) -> bool:
    """Rewrite ``path`` (a regular file; links and anything else are left alone) with
    ``redact_text`` applied to each line; True if it changed. Never raises ``OSError``."""
    from sat_cli.tracking.params import redact_text

    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    tmp = None
    try:
        with os.fdopen(fd, "rb") as src:
            changed = False
            out = tempfile.NamedTemporaryFile(  # noqa: SIM115  closed below, renamed or removed
                "wb", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
            )
            tmp = Path(out.name)
            with out:
                for raw in src:
                    line = raw.decode("utf-8", "surrogateescape")
                    masked = redact_text(line)
                    changed |= masked != line
                    out.write(masked.encode("utf-8", "surrogateescape"))
        if not changed:
            tmp.unlink()
            return False
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        return False


def scrub_logs(folder: Path) -> list[Path]:
    """:func:`scrub_file` on every ``*.log`` under ``folder`` (recursively); the files changed."""
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in LOG_SUFFIXES and not p.is_symlink() and scrub_file(p)
    )
