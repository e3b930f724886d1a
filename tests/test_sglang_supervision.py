"""Process supervision with real subprocesses: startup, crash detection, clean shutdown, restart.

The "server command" is the loopback stand-in (tests/sglang_standin.py) run by this venv's
Python in place of ``python -m sglang.launch_server``: it takes the same flags, ignores the ones
it does not know, and has ``--standin-*`` flags to misbehave (never healthy, exit at startup,
spawn a child like SGLang's scheduler, ignore SIGTERM).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from sat_cli.engines.base import EngineError, SamplingParams
from sat_cli.engines.managed_server import ManagedServer
from sat_cli.engines.sglang import SGLangEngine
from sat_cli.engines.sglang.runtime import ProcessLaunch, ServerRuntime, SGLangRuntime
from sat_cli.engines.sglang.server import SGLangRouter, SGLangServer
from sat_cli.engines.sglang.settings import SGLangEngineSettings
from sat_cli.util.procs import http_get_status, live_group_members

STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
PREFIX = [sys.executable, str(STANDIN)]
DIMS = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_experts": 4, "vocab_size": 50}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DIMS))
    return d


# the engine settings of these tests: SGLang's defaults but not deterministic (the stand-in
# servers are launched without --enable-deterministic-inference)
PLAIN = SGLangEngineSettings(deterministic=False)


def make_server(model_dir, tmp_path, *extra, name="s0", timeout=30.0):
    s = SGLangEngineSettings(
        launch_prefix=PREFIX, extra_args=list(extra), startup_timeout_s=timeout, deterministic=False
    )
    return SGLangServer(s, ServerRuntime(str(model_dir), tmp_path / "logs" / f"{name}.log"))


def post(url: str, path: str, payload) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(
        "POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"}
    )
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer


def get(url: str, path: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer


def test_start_ready_and_clean_shutdown_leaves_no_process(model_dir, tmp_path):
    server = make_server(model_dir, tmp_path, "--standin-spawn-child")  # at version 0
    server.start()
    try:
        server.wait_ready()
        assert server.alive()
        pgid = server.pgid
        assert len(live_group_members(pgid)) == 2  # the server and its child
        assert get(server.url, "/model_info")["weight_version"] == "0"
    finally:
        server.stop()
    assert live_group_members(pgid) == []
    assert not server.alive()
    assert "standin: starting as sglang.launch_server" in server.log_tail()


def test_startup_timeout_quotes_the_log_and_stops_the_group(model_dir, tmp_path):
    server = make_server(model_dir, tmp_path, "--standin-never-healthy", timeout=5.0)
    server.start()
    pgid = server.pgid
    with pytest.raises(EngineError) as err:
        server.wait_ready()
    message = str(err.value)
    assert "was not healthy after 5 s" in message
    assert str(server.log_path) in message
    assert "standin: starting as sglang.launch_server" in message  # quoted from the log
    assert live_group_members(pgid) == []


def test_exit_before_ready_reports_code_and_log(model_dir, tmp_path):
    server = make_server(model_dir, tmp_path, "--standin-exit-code", "3")
    server.start()
    with pytest.raises(
        EngineError, match=r"exited with code 3 before ready(.|\n)*simulated startup"
    ):
        server.wait_ready()
    server.stop()


def test_sigterm_ignored_escalates_to_sigkill(model_dir, tmp_path):
    server = make_server(model_dir, tmp_path, "--standin-spawn-child", "--standin-ignore-sigterm")
    server.start()
    server.wait_ready()
    pgid = server.pgid
    t0 = time.monotonic()
    server.stop(grace_s=0.5)
    assert live_group_members(pgid) == []
    assert server.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5.0


def test_crash_is_detected_and_in_flight_requests_fail_naming_the_log(model_dir, tmp_path):
    server = make_server(model_dir, tmp_path, "--standin-spawn-child")
    runtime = SGLangRuntime(
        str(model_dir), servers=(server,), watchdog_s=0.2, retries=1, backoff_s=0.05
    )
    engine = SGLangEngine(PLAIN, runtime)
    try:
        pgid = server.pgid
        post(server.url, "/standin/configure", {"delay_s": 30.0})
        future = engine.generate_async([[1, 2]], 2, SamplingParams(max_new_tokens=4))
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as err:
            future.result(timeout=10)
        assert time.monotonic() - t0 < 6.0  # the request itself would take 30 s
        assert "died (exit code -9)" in str(err.value)
        assert str(server.log_path) in str(err.value)
        assert not engine.health()
        with pytest.raises(EngineError, match="died"):
            engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
        assert live_group_members(pgid)  # the orphaned child is still around ...
    finally:
        engine.close()
    assert live_group_members(pgid) == []  # ... until close() stops the whole group


def test_restart_on_failure_reloads_the_last_weights(model_dir, tmp_path):
    weights = tmp_path / "weights" / "v2"
    weights.mkdir(parents=True)
    server = make_server(model_dir, tmp_path)
    restart = SGLangEngineSettings(deterministic=False, restart_on_failure=True)
    runtime = SGLangRuntime(str(model_dir), servers=(server,), watchdog_s=0.2, retries=0)
    engine = SGLangEngine(restart, runtime)
    try:
        engine.update_weights(str(weights), 2)
        first_pid = server.pid
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not (server.pid != first_pid and engine.health()):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        (group,) = engine.generate([[1, 2]], 2, SamplingParams(max_new_tokens=3))
        # The new process started at --weight-version 0; the engine pushed v2 again.
        assert [s.weight_version for s in group] == [2, 2]
        assert get(server.url, "/model_info")["weight_version"] == "2"
    finally:
        engine.close()


def test_router_gets_generate_and_workers_get_weight_updates(model_dir, tmp_path):
    # The stand-in also plays sglang_router.launch_router (it answers /generate itself).
    weights = tmp_path / "v1"
    weights.mkdir()
    workers = [make_server(model_dir, tmp_path, name=f"w{i}") for i in range(2)]
    launch = ProcessLaunch(
        tmp_path / "logs" / "router.log",
        launch_prefix=PREFIX,
        extra_args=["--weight-version", "0"],  # for the stand-in; the real router has none
    )
    router = SGLangRouter([w.url for w in workers], launch)
    runtime = SGLangRuntime(str(model_dir), servers=tuple(workers), router=router, retries=0)
    engine = SGLangEngine(PLAIN, runtime)
    try:
        engine.generate([[1], [2]], 1, SamplingParams(max_new_tokens=2))
        engine.update_weights(str(weights), 1)
        calls = {p.url: get(p.url, "/standin/calls") for p in (router, *workers)}
    finally:
        engine.close()
    assert [path for path, _ in calls[router.url]] == ["/generate"]
    for w in workers:
        assert [path for path, _ in calls[w.url]] == ["/update_weights_from_disk"]
    assert "sglang_router.launch_router" in router.log_tail()


def test_launch_one_server_per_gpu_group_with_r3(model_dir, tmp_path):
    settings = SGLangEngineSettings(
        launch_prefix=PREFIX,
        gpu_groups=["0", "1"],
        use_router=False,
        startup_timeout_s=30,
        deterministic=False,
    )
    runtime = SGLangRuntime(
        str(model_dir), r3=True, log_dir=tmp_path / "logs", gpu_groups=("0", "1"), retries=0
    )
    engine = SGLangEngine.launch(settings, runtime)
    try:
        groups = engine.generate([[1, 2, 3]], 2, SamplingParams(max_new_tokens=4, seed=3))
        logs = [(tmp_path / "logs" / f"sglang_{i}.log").read_text() for i in range(2)]
    finally:
        engine.close()
    for i, text in enumerate(logs):
        assert f"standin: CUDA_VISIBLE_DEVICES={i}" in text
        assert "--enable-return-routed-experts" in text
    # R3 dims come from config.json (2 layers, top-2): [3 + 4 - 1, 2, 2].
    assert [s.routed_experts.shape for s in groups[0]] == [(6, 2, 2), (6, 2, 2)]


# a server that answers GET /health with 200 on the port given as argv[1] (until killed)
HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Script(ManagedServer):
    name = "script server"

    def __init__(self, code: str, port: int, log_path: Path):
        super().__init__(
            host="127.0.0.1",
            port=port,
            log_path=log_path,
            health_path="/health",
            startup_timeout_s=30.0,
            env=None,
        )
        self.code = code

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", self.code, str(self.port)]


def test_a_port_taken_by_another_process_is_not_taken_for_the_server(tmp_path):
    """The port is picked free and bound only when the server is up (SGLang: 20-40 s later). If
    another process (a second run's server) took it meanwhile, its health answer must not pass
    for this server's: EngineError naming the port, and this server is stopped. The same server
    that binds the port itself is ready."""
    import subprocess

    from sat_cli.util.procs import free_port

    port = free_port()
    stranger = subprocess.Popen([sys.executable, "-c", HEALTHY, str(port)])
    try:
        deadline = time.monotonic() + 30
        while http_get_status("127.0.0.1", port, "/health", 1.0) != 200:
            assert time.monotonic() < deadline and stranger.poll() is None
            time.sleep(0.1)
        late = _Script("import time; time.sleep(60)", port, tmp_path / "late.log")  # never binds
        late.start()
        pgid = late.pgid
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"is not what answers on port {port}: another"):
            late.wait_ready()
        assert time.monotonic() - t0 < 10 and live_group_members(pgid) == []
        assert stranger.poll() is None  # the other process is left alone
    finally:
        stranger.kill()
        stranger.wait()
    own = _Script(HEALTHY, free_port(), tmp_path / "own.log")
    with own:
        own.start()
        own.wait_ready()  # the answer comes from its own socket
        assert own.alive()
