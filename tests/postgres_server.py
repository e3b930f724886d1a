"""A real PostgreSQL server for tests: the distribution's ``initdb`` / ``postgres`` binaries.

Why these and not an embedded one: the distribution's PostgreSQL is what a cluster's MLflow
store runs on, it is on this machine kind (and ``.ci/run`` installs it where it can), and it
needs nothing from PyPI. ``start()`` makes a fresh cluster in a temporary folder (``initdb``,
trust authentication for user ``sat`` on 127.0.0.1 only), starts ``postgres`` bound to
127.0.0.1 on a free port with its socket in that folder, waits until it accepts connections
and creates database ``mlflow``. PostgreSQL refuses to run as root, so as root the folder
belongs to the ``postgres`` system user and the server runs as that user. ``stop()`` ends it
and removes the folder. The binaries: ``$SAT_PG_BIN``, else PATH, else Debian's
``/usr/lib/postgresql/<version>/bin``; without them the tests skip naming what is missing.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path


def pg_bin() -> Path | None:
    if os.environ.get("SAT_PG_BIN"):
        return Path(os.environ["SAT_PG_BIN"])
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


class PostgresServer:
    def __init__(self) -> None:
        from sat_cli.util.procs import free_port

        self.bin = pg_bin()
        if self.bin is None:
            raise FileNotFoundError(
                "no PostgreSQL binaries (initdb, postgres): install the distribution's "
                "postgresql package or set SAT_PG_BIN"
            )
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sat-pg-"))
        self.data = self.dir / "data"
        self.as_user = "postgres" if os.geteuid() == 0 else None
        self.proc: subprocess.Popen | None = None
        self.uri = f"postgresql://sat@127.0.0.1:{self.port}/mlflow"

    def _run(self, *args: str, timeout: float = 120) -> None:
        res = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            user=self.as_user,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.dir,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({res.returncode}): {res.stderr[-2000:]}")

    def start(self, timeout_s: float = 120) -> PostgresServer:
        if self.as_user:
            shutil.chown(self.dir, self.as_user, self.as_user)
        self._run("initdb", "-D", str(self.data), "-U", "sat", "-A", "trust", "--no-sync")
        log = open(self.dir / "postgres.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.data), "-h", "127.0.0.1"]
            + ["-p", str(self.port), "-k", str(self.data), "-c", "fsync=off"],
            user=self.as_user,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._run(
                    "createdb",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-U",
                    "sat",
                    "mlflow",
                    timeout=30,
                )
                return self
            except RuntimeError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PostgreSQL did not start: {exc}") from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)  # fast shutdown
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
