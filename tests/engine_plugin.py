"""A rollout-engine plug-in, ``engine=tiny``, registered from this file alone (the
``ENGINES.add`` line at its end; nothing in ``sat_cli/`` names it), built, served, synced and
verified through the engine seam (issue 52 item 3; ``tests/test_engine_plugin.py`` runs it):

- **served**: a small HTTP server — this file run as a script — in its own process group,
  started, health-checked against a deadline and stopped by the engine-neutral
  :class:`sat_cli.engines.managed_server.ManagedServer`; it serves the local engine's model (a
  ``LocalEngine`` inside it, built with the settings and seed ``engine=local`` gets);
- **synced**: the loop's disk transport (``update_weights`` → ``POST /update_weights``);
- **verified**: it declares ``Checksums("hf")`` and answers ``served_checksums()`` from the
  served model (``POST /checksums``), so ``engine.verify_weights`` holds it like any engine.

Two switches make it misbehave for real: ``engine.corrupt=true`` has the server load every
version with one tensor changed (what the verification must catch), ``engine.verified=false``
has the engine declare itself ``Unverified`` (a run refuses it unless
``engine.verify_weights=off``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sat_cli.engines.base import RolloutEngine
from sat_cli.engines.managed_server import ManagedServer
from sat_cli.engines.registry import ENGINES
from sat_cli.engines.settings import EngineSettings
from sat_cli.engines.verification import Checksums, Unverified
from sat_cli.errors import EngineError
from sat_cli.registry import Component

UNVERIFIED = "its server keeps no checksums (engine.verified=false)"


@dataclass
class TinyEngineSettings(EngineSettings):
    name: str = "tiny"
    num_threads: int = 1
    corrupt: bool = False  # the server loads every version with one tensor changed
    verified: bool = True  # False: the engine declares itself Unverified


class TinyServer(ManagedServer):
    name = "tiny engine server"

    def __init__(self, args: list[str], log_path: Path) -> None:
        super().__init__(
            host="127.0.0.1",
            port=None,
            log_path=log_path,
            health_path="/health",
            startup_timeout_s=300.0,
            env=None,
        )
        self.args = args

    @property
    def command(self) -> list[str]:
        return [sys.executable, __file__, "--port", str(self.port), *self.args]


class TinyEngine(RolloutEngine):
    """The client of one :class:`TinyServer` (JSON over HTTP)."""

    weight_verification = Checksums("hf")  # the local engine's names: served_checksums()

    def __init__(self, server: TinyServer, verified: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.server, self.pid = server, server.pid
        self.weight_version = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiny-engine")
        if not verified:
            self.weight_verification = Unverified(UNVERIFIED)

    def _post(self, route: str, body: dict, timeout_s: float = 600.0):
        import http.client

        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=timeout_s)
        try:
            conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
        except OSError as exc:
            raise EngineError(
                self.server.failure_message(f"did not answer {route}: {exc}")
            ) from None
        finally:
            conn.close()
        if reply.status != 200:
            raise EngineError(f"{self.server.url}{route}: HTTP {reply.status}: {data[:500]!r}")
        return json.loads(data)

    def generate(self, prompts, n, sampling):
        from sat_cli.samples import Sample

        body = {"prompts": prompts, "n": n, "sampling": asdict(sampling)}
        rows = self._post("/generate", body)
        return [[Sample(**r) for r in group] for group in rows]

    def generate_async(self, prompts, n, sampling):
        return self._pool.submit(self.generate, prompts, n, sampling)

    def update_weights(self, path: str, version: int) -> None:
        done = self._pool.submit(self._post, "/update_weights", {"path": path, "version": version})
        self.weight_version = done.result()["weight_version"]

    def served_checksums(self) -> dict[str, dict[str, str]]:
        return {self.server.url: self._pool.submit(self._post, "/checksums", {}).result()}

    def health(self) -> bool:
        return self.server.alive() and self.server.ready(timeout_s=10.0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.server.stop()


def build(s: TinyEngineSettings, rt):
    args = ["--model", str(rt.model_path), "--seed", str(rt.seed), "--dtype", s.dtype]
    args += ["--threads", str(s.num_threads), "--log", str(rt.logs / "engine.log")]
    server = TinyServer(args + (["--corrupt"] if s.corrupt else []), rt.logs / "tiny_server.log")
    server.start()
    try:
        server.wait_ready()
    except EngineError:
        server.stop()
        raise
    return TinyEngine(server, s.verified)


ENGINES.add("tiny", Component(TinyEngineSettings, build))


# --- the server (this file run as a script) -----------------------------------------------
def _corrupted(path: str, out: Path) -> str:
    """A copy of the HF folder ``path`` at ``out`` whose first tensor has 1 added."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(path, out)
    shard = sorted(out.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    return str(out)


def serve(argv: list[str]) -> None:
    import argparse
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from sat_cli.engines.local.engine import LocalEngine
    from sat_cli.engines.local.settings import LocalEngineRuntime, LocalEngineSettings
    from sat_cli.samples import SamplingParams

    p = argparse.ArgumentParser()
    for flag in ("--port", "--seed", "--threads"):
        p.add_argument(flag, type=int)
    for flag in ("--model", "--dtype", "--log"):
        p.add_argument(flag)
    p.add_argument("--corrupt", action="store_true")
    a = p.parse_args(argv)
    own = LocalEngineSettings(dtype=a.dtype, device="cpu", num_threads=a.threads)
    engine = LocalEngine(own, LocalEngineRuntime(a.model, seed=a.seed, log_file=a.log))

    def generate(body: dict):
        s = body["sampling"]
        sampling = SamplingParams(**{**s, "stop_token_ids": tuple(s["stop_token_ids"])})
        groups = engine.generate(body["prompts"], body["n"], sampling)
        return [[_plain(x) for x in group] for group in groups]

    def update(body: dict):
        path = body["path"]
        if a.corrupt:
            path = _corrupted(path, Path(a.log).parent / "tiny_corrupted")
        engine.update_weights(path, int(body["version"]))
        return {"weight_version": engine.weight_version}

    routes = {
        "/generate": generate,
        "/update_weights": update,
        "/checksums": lambda body: engine.served_checksums()["the local engine"],
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self._answer(200 if self.path == "/health" and engine.health() else 503, {})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                self._answer(200, routes[self.path](body))
            except Exception as exc:  # noqa: BLE001 - the client raises it as EngineError
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

        def _answer(self, status: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    HTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


def _plain(sample) -> dict:
    """A sample as JSON (this plug-in serves the plain path: no R3 routes, masks or top-k)."""
    if sample.routed_experts is not None or sample.sampling_mask or sample.topk_ids is not None:
        raise ValueError("engine=tiny serves samples without routes, masks or top-k")
    keep = ("prompt_ids", "response_ids", "rollout_logp", "finish_reason", "weight_version")
    return {**{k: getattr(sample, k) for k in keep}, "meta": sample.meta}


if __name__ == "__main__":
    serve(sys.argv[1:])
