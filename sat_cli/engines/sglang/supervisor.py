"""Start, watch and restart the SGLang processes behind one engine.

:func:`build_servers` turns the engine settings into :class:`SGLangServer` objects (one per GPU
group, or ``num_servers`` on one device) and an optional :class:`SGLangRouter`;
:class:`Supervisor` starts them, polls them from a watchdog thread every ``watchdog_s`` and
records why the engine cannot be used (a dead process, a failed restart). When a process dies,
``on_dead`` runs once (the engine aborts its calls in flight so they fail now, naming the log
file); with ``restart_on_failure`` every process is stopped and started again and ``on_restart``
runs (the engine loads its last weights again), one attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from sat_cli.engines.sglang.runtime import ProcessLaunch, ServerRuntime, SGLangRuntime
from sat_cli.engines.sglang.server import SGLangRouter, SGLangServer
from sat_cli.errors import EngineError
from sat_cli.util.procs import free_port

log = logging.getLogger(__name__)


def build_servers(s, rt: SGLangRuntime) -> tuple[list[SGLangServer], SGLangRouter | None]:
    """``s.servers`` servers (``s``: ``settings.SGLangEngineSettings``), one per GPU group of ``rt.gpu_groups`` (→ CUDA_VISIBLE_DEVICES)
    when given, each logging to ``rt.log_dir/sglang_<i>.log``; ``s.router`` puts
    ``sglang_router`` in front. Ports are distinct."""
    if rt.gpu_groups and s.servers not in (1, len(rt.gpu_groups)):
        raise ValueError(f"{s.servers} servers but {len(rt.gpu_groups)} gpu_groups")
    groups = list(rt.gpu_groups) if rt.gpu_groups else [None] * s.servers
    log_dir = Path(rt.log_dir)
    servers = []
    for i, group in enumerate(groups):
        env = None if group is None else {"CUDA_VISIBLE_DEVICES": group}
        log = log_dir / f"sglang_{i}.log"
        at = dict(
            weight_version=rt.initial_version,
            r3=rt.r3,
            mem_fraction_static=rt.mem_fraction_static,
            lora_args=tuple(rt.lora_args),
        )
        servers.append(SGLangServer(s, ServerRuntime(rt.model_path, log, rt.python, env, **at)))
    router = None
    if s.router:
        launch = ProcessLaunch(log_dir / "sglang_router.log", rt.python, s.launch_prefix, s.device)
        # worker URLs are set again below, after the ports are made distinct
        router = SGLangRouter([srv.url for srv in servers], launch)
    _distinct_ports([*servers, *([router] if router else [])])
    if router is not None:
        router.worker_urls = [srv.url for srv in servers]
    return servers, router


def _distinct_ports(procs: Sequence[SGLangServer | SGLangRouter]) -> None:
    """Free ports are picked one at a time and may repeat before any is bound: re-pick."""
    used: set[int] = set()
    for proc in procs:
        while proc.port in used:
            proc.port = free_port(proc.host)
        used.add(proc.port)


class Supervisor:
    """The processes of one engine: start, stop, watch, restart (see the module docstring)."""

    def __init__(
        self,
        servers: Sequence[SGLangServer],
        router: SGLangRouter | None = None,
        *,
        restart_on_failure: bool = False,
        watchdog_s: float = 0.5,
    ) -> None:
        self.servers = list(servers)
        self.router = router
        self.restart_on_failure = restart_on_failure
        self.watchdog_s = watchdog_s
        self.on_dead: Callable[[], None] = lambda: None
        self.on_restart: Callable[[], None] = lambda: None
        self._failure: str | None = None
        self._state_lock = threading.RLock()  # guards _failure
        self._process_lock = threading.Lock()  # restart vs stop
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def procs(self) -> list[SGLangServer | SGLangRouter]:
        return [*self.servers, *([self.router] if self.router else [])]

    def start(self) -> None:
        """Start every process and wait until each is healthy; on failure stop them all."""
        try:
            for server in self.servers:
                if not server.alive():
                    server.start()
            for server in self.servers:
                server.wait_ready()
            if self.router is not None:
                if not self.router.alive():
                    self.router.start()
                self.router.wait_ready()
        except BaseException:
            self._stop_all()
            raise

    def watch(self) -> None:
        if self.servers and self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="sglang-watchdog", daemon=True
            )
            self._watchdog.start()

    def _stop_all(self) -> None:
        if self.router is not None:
            self.router.stop()
        for server in self.servers:
            server.stop()

    def stop(self) -> None:
        self._stopped.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5 * self.watchdog_s + 1)
        with self._process_lock:  # waits for a restart in progress, then stops everything
            self._stop_all()

    def failure(self) -> str | None:
        """Why calls cannot succeed now (a dead process, a failed restart), or None. Checked
        without waiting for the watchdog, so a call that failed because its server died says so."""
        with self._state_lock:
            if self._failure is not None:
                return self._failure
        return self._dead_process_reason()

    def _dead_process_reason(self) -> str | None:
        for proc in self.procs:
            code = proc.returncode
            if code is not None:
                return proc.failure_message(f"died (exit code {code})")
        return None

    def _watch(self) -> None:
        restart_failed = False
        while not self._stopped.wait(self.watchdog_s):
            reason = self._dead_process_reason()
            if reason is None:
                continue
            with self._state_lock:
                newly_dead = self._failure is None
                if newly_dead:
                    self._failure = reason
            if newly_dead:
                log.error("%s", reason)
                self.on_dead()
            if self.restart_on_failure and not restart_failed:
                restart_failed = not self._restart()

    def _restart(self) -> bool:
        """Stop every process, start them again, then ``on_restart`` (one attempt)."""
        with self._process_lock:
            if self._stopped.is_set():
                return False
            log.warning("restarting SGLang servers after a failure")
            try:
                self._stop_all()
                self.start()
                self.on_restart()
            except EngineError as e:
                with self._state_lock:
                    self._failure = f"restart after a server failure failed: {e}"
                log.error("%s", self._failure)
                return False
            with self._state_lock:
                self._failure = None
            return True
