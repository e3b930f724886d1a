"""A real one-node SLURM on 127.0.0.1 for the ``slow`` tier: munged, slurmctld and slurmd of the
distribution (Debian's ``slurmctld slurmd munge slurm-client``; ``.ci/run`` does not install
them, the test skips without them, saying so).

Everything lives in a temporary folder: a fresh munge key and socket, ``slurm.conf`` (cluster
``sat``, one node ``localhost`` at 127.0.0.1 with this machine's CPUs, partition ``debug``,
free ports, no accounting database, ``proctrack/linuxproc``), the state and spool folders and
the logs. The daemons run in the foreground of their own process groups (as root, which a
one-machine test cluster allows: ``SlurmUser=root``); the commands (``sbatch``, ``squeue``,
``sacct``, ``scancel``) find the cluster through ``SLURM_CONF``. ``stop()`` ends the daemons and
removes the folder. Without accounting ``sacct`` answers nothing useful; ``sat``'s SLURM job
falls back on ``squeue`` (``sat_cli/cluster/slurm.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> list[str]:
    need = [*DAEMONS, "mungekey", "sbatch", "squeue", "scancel", "sinfo"]
    return [b for b in need if shutil.which(b) is None]


class SlurmCluster:
    def __init__(self) -> None:
        from sat_cli.util.procs import free_port

        self.dir = Path(tempfile.mkdtemp(prefix="sat-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.ports = [free_port(), free_port()]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        d = self.dir
        cpus = os.cpu_count() or 1
        for sub in ("state", "spool", "log", "munge"):
            (d / sub).mkdir(exist_ok=True)
        self.conf.write_text(
            f"""ClusterName=sat
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / "munge" / "munge.socket"}
SlurmctldPort={self.ports[0]}
SlurmdPort={self.ports[1]}
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        self._write_conf()
        m = self.dir / "munge"
        key = m / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, timeout=30)
        os.chmod(key, 0o400)
        munged = [
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={m / 'munge.socket'}",
            f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}",
        ]
        self._spawn(munged, "munged")
        deadline = time.monotonic() + timeout_s
        while not (m / "munge.socket").exists():
            self._alive_or_raise(deadline)
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], "slurmd")
        while True:
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True
            )
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            self._alive_or_raise(deadline)

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()

    def _alive_or_raise(self, deadline: float) -> None:
        dead = [p.args[0] for p in self.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}"
                for f in sorted((self.dir / "log").glob("*"))
            )
            self.stop()
            raise RuntimeError(f"the test SLURM did not come up ({dead or 'timeout'}):\n{logs}")
        time.sleep(0.3)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
