"""Launch and supervise SGLang server processes (and `sglang-router`) without importing SGLang.

SGLang pins its own CUDA torch and transformers, so it lives in a separate environment and is
driven as a subprocess (see docs/sglang.md). This module only builds argument lists and manages
processes:

- :class:`SGLangServer` runs ``[*launch_prefix, "-m", "sglang.launch_server", "--model-path",
  ..., "--host", "127.0.0.1", "--port", ..., "--dtype", ...]`` in its own session
  (``start_new_session=True``, so the server and every process it forks share one process
  group), with stdout and stderr appended to a log file. With ``device="cpu"`` the module is run
  through ``cpu_launch.py`` (three SGLang CPU workarounds) with SGLang's CPU flags (below).
- :class:`SGLangRouter` runs ``python -m sglang_router.launch_router --worker-urls ...`` in
  front of several servers.
- ``wait_ready()`` polls ``GET /health_generate`` (the router: ``GET /health``) until it answers
  200, and raises :class:`EngineError` quoting the last 40 lines of the log when the process
  exits first or the startup timeout passes (the process group is stopped before raising).
- ``stop()`` sends SIGTERM to the whole process group, then SIGKILL after a grace period, and
  returns only when no live process of the group is left.

The launch prefix is anything that ends in a Python interpreter: ``["/opt/sglang-env/bin/python"]``
or a container command such as ``["docker", "run", "--gpus", "all", ..., "python"]``. Tests use a
loopback stand-in speaking SGLang's wire format (``tests/sglang_standin.py``) as the prefix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sat_cli.engines.managed_server import ManagedServer
from sat_cli.engines.sglang.runtime import ProcessLaunch, ServerRuntime
from sat_cli.util.procs import free_port

CPU_LAUNCHER = Path(__file__).with_name("cpu_launch.py")
# SGLang 0.5.23 on an AMX CPU (../shared/sglang-cpu/README.md): the AMX attention kernel of the
# only CPU kernel build at hand is older than 0.5.23 and dies in warm-up, so attention runs in
# torch; matmuls, MoE, norms and rope still use the AMX kernels. The KV pool is sized explicitly
# (there is no device memory to take a fraction of).
# --sleep-on-idle: an idle scheduler otherwise polls without pause and keeps a whole core busy
# (measured: 10 CPU-seconds in 10 idle seconds) that the trainer on the same CPU needs; it waits
# on its zmq sockets instead and wakes when a request or a weight update arrives.
CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-overlap-schedule",
    "--sleep-on-idle",
)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# SGLang's CPU all-reduce (sgl_kernel shm.cpp) keeps 259 MB segments in /dev/shm named
# deepspeed_allreduce_buffer_<i>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and nothing removes them when
# the server stops (they filled /dev/shm, i.e. RAM, here: 17 GB after a day of tests). SGLang
# only sets MASTER_ADDR/MASTER_PORT if unset (distributed/bootstrap.py), so each CPU process gets
# a tag of ours (a free port number: only a name, nothing binds it) and `stop` unlinks its
# segments.
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"
DEVICES = ("cuda", "cpu")
SGLANG_VENV = ".venv-sglang"  # what `make sglang-cpu` builds
CPU_KV_TOKENS = 4096  # the KV pool of a CPU server when engine.max_total_tokens is null


def resolve_python(spec: str) -> str:
    """The SGLang interpreter for ``engine.python``.

    ``auto``: ``$SAT_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` in the current folder,
    else in the sat checkout this package runs from. A bare name is looked up on PATH; a path
    must be an executable file. Raises ``FileNotFoundError`` naming what was tried.
    """
    import shutil

    if spec == "auto":
        env = os.environ.get("SAT_SGLANG_PYTHON")
        if env:
            return resolve_python(env)
        tried = [
            Path.cwd() / SGLANG_VENV / "bin" / "python",
            Path(__file__).resolve().parents[3] / SGLANG_VENV / "bin" / "python",
        ]
        for cand in tried:
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
        raise FileNotFoundError(
            "engine.python=auto found no SGLang interpreter (looked at $SAT_SGLANG_PYTHON, "
            + ", ".join(str(c) for c in dict.fromkeys(tried))
            + "): run `make sglang-cpu` or set engine.python=<SGLang env>/bin/python"
        )
    if os.sep not in spec:
        found = shutil.which(spec)
        if found is None:
            raise FileNotFoundError(f"engine.python={spec!r} is not on PATH")
        return found
    path = Path(spec).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"engine.python={spec!r} is not an executable file")
    return str(path)


class SGLangProcess(ManagedServer):
    """An SGLang module run by SGLang's interpreter (or a launch prefix ending in one); on the
    CPU through ``cpu_launch.py`` (its patches also cover the router, whose Python launcher
    imports sglang and so torchvision)."""

    module = ""

    health_path = "/health"

    def __init__(self, launch: ProcessLaunch) -> None:
        """``launch``: the interpreter or launch prefix, device, arguments, log, environment,
        port and start-up timeout of this process."""
        if launch.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {launch.device!r}")
        self.shm_tag: tuple[str, str] | None = None
        env = launch.env
        if launch.device == "cpu":
            env = {**CPU_ENV, **(env or {})}
            if "MASTER_PORT" not in env and "MASTER_PORT" not in os.environ:
                env.setdefault("MASTER_ADDR", "127.0.0.1")
                env["MASTER_PORT"] = str(free_port())
                self.shm_tag = (env["MASTER_ADDR"], env["MASTER_PORT"])
        super().__init__(
            host="127.0.0.1",
            port=launch.port,
            log_path=launch.log_path,
            health_path=self.health_path,
            startup_timeout_s=launch.startup_timeout_s,
            env=env,
        )
        self.launch_prefix = list(launch.launch_prefix) or [launch.python]
        self.binds_itself = not launch.launch_prefix
        self.device = launch.device
        self.extra_args = list(launch.extra_args)

    def shm_segments(self) -> list[Path]:
        """This process's SGLang CPU all-reduce segments in /dev/shm (see ``SHM_PREFIX``)."""
        if self.shm_tag is None or not SHM_DIR.is_dir():
            return []
        addr, port = self.shm_tag
        return sorted(SHM_DIR.glob(f"{SHM_PREFIX}_*_{addr}_{port}_*"))

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            super().stop(grace_s)
        finally:
            if self._proc is not None and self._proc.poll() is not None:
                for seg in self.shm_segments():
                    seg.unlink(missing_ok=True)

    @property
    def launch_head(self) -> list[str]:
        launcher = [str(CPU_LAUNCHER)] if self.device == "cpu" else []
        return [*self.launch_prefix, *launcher, "-m", self.module]


class SGLangServer(SGLangProcess):
    """One ``sglang.launch_server`` process (one GPU group: set CUDA_VISIBLE_DEVICES via env)."""

    name = "SGLang server"
    module = "sglang.launch_server"

    health_path = "/health_generate"

    def __init__(self, settings, runtime: ServerRuntime) -> None:
        """``settings``: ``engine.*`` of ``engine=sglang`` (``settings.SGLangEngineSettings``:
        launch prefix, device, dtype,
        parallel sizes, KV pool, determinism, extra arguments, start-up timeout); ``runtime``:
        the model, this server's log, interpreter, environment and port, the version it starts
        at, R3 and the planned memory fraction."""
        s, rt = settings, runtime
        super().__init__(ProcessLaunch.of(s, rt.log_path, rt.python, rt.env, rt.port))
        for key in ("tp", "dp", "ep"):
            if getattr(s, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(s, key)}")
        mem = s.mem_fraction_static if rt.mem_fraction_static is None else rt.mem_fraction_static
        if mem is not None and not 0.0 < mem < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem}")
        self.model_path = str(rt.model_path)
        self.dtype = s.dtype
        self.tp, self.dp, self.ep = s.tp, s.dp, s.ep
        self.mem_fraction_static = mem
        # SGLang on the CPU: the KV pool is sized explicitly (no device memory to take from)
        self.max_total_tokens = s.max_total_tokens or (CPU_KV_TOKENS if s.device == "cpu" else None)
        self.deterministic = s.seeded
        self.enable_return_routed_experts = rt.r3
        self.weight_version = rt.weight_version
        self.lora_args = list(rt.lora_args)

    def absolute_paths(self) -> None:
        """Make the log and model paths absolute (a process started on another node, from
        another working folder, must find them on the shared filesystem); a hub id stays."""
        self.log_path = Path(self.log_path).resolve()
        if Path(self.model_path).exists():
            self.model_path = str(Path(self.model_path).resolve())

    @property
    def command(self) -> list[str]:
        # Flag names as declared in sglang/srt/server_args.py (ServerArgs.add_cli_args; its own
        # parser accepts this command: tests/test_sglang_cpu_launch.py). --enable-deterministic-
        # inference: sampling seeds are honoured only with it; --weight-version: the string
        # reported back until /update_weights_from_disk sets another.
        cmd = [
            *self.launch_head,
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--tp-size",
            str(self.tp),
            "--dp-size",
            str(self.dp),
            "--ep-size",
            str(self.ep),
        ]
        if self.device == "cpu":
            cmd += CPU_ARGS
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.deterministic:
            cmd.append("--enable-deterministic-inference")
        if self.enable_return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if self.weight_version is not None:
            cmd += ["--weight-version", str(self.weight_version)]
        return cmd + self.lora_args + self.extra_args


class SGLangRouter(SGLangProcess):
    """``sglang_router.launch_router`` in front of several SGLang servers (generation only).

    Weight updates and pause/continue must reach every worker, so the engine sends those to the
    worker URLs directly, and only ``/generate`` goes through the router.

    The router answers ``/health`` before it has registered its workers (in the background),
    and a ``/generate`` then gets 503 "no available workers"; it is ready once ``GET
    /readiness`` counts every worker healthy. Its own health checks probe ``/health`` of each
    worker, which blocks while a worker loads weights or is paused: a longer probe timeout and
    failure threshold than the defaults keep it from opening the circuit of a busy worker (sat
    watches the worker processes itself).
    """

    name = "sglang-router"
    module = "sglang_router.launch_router"
    ROUTER_ARGS = ("--health-check-timeout-secs", "60", "--health-failure-threshold", "10")

    def __init__(
        self, worker_urls: Sequence[str], launch: ProcessLaunch, policy: str = "round_robin"
    ):
        super().__init__(launch)
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        self.worker_urls = list(worker_urls)
        self.policy = policy

    @property
    def command(self) -> list[str]:
        return [
            *self.launch_head,
            "--worker-urls",
            *self.worker_urls,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--policy",
            self.policy,
            *self.ROUTER_ARGS,
            *self.extra_args,
        ]

    def ready(self, timeout_s: float) -> bool:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=timeout_s) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError):
            return False
        return int(body.get("healthy_workers", 0)) >= len(self.worker_urls)
