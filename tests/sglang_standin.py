"""A loopback STAND-IN for an SGLang server, for CPU tests only (no GPU, no SGLang installed).

It is not SGLang and generates nothing meaningful: it speaks SGLang's native HTTP wire format
(as read from sglang/srt/entrypoints/http_server.py and managers/io_struct.py) with
deterministic fake tokens, log-probs and routed experts, so the client, the engine and the
process supervision in ``sat_cli/engines/sglang*.py`` can be tested end to end on a CPU. The real
server is exercised only by ``scripts/gpu_check_sglang.sh`` on a GPU machine.

Endpoints: ``POST /generate`` (batched ``input_ids``, per-entry ``sampling_params``,
``return_logprob``, ``return_routed_experts``), ``POST /update_weights_from_disk``,
``GET /health_generate`` and ``/health``, ``POST /pause_generation``, ``/continue_generation``,
``/flush_cache``, ``GET /get_weight_version``; plus two test hooks, ``POST /standin/configure``
(switches: HTTP error status, delay, malformed payloads, unhealthy) and ``GET /standin/calls``
(the requests received).

Two ways to run it:
- in a thread of the test process: ``Standin(...).start()`` (fast; used by the client tests);
- as a subprocess in place of ``python -m sglang.launch_server``: ``python
  tests/sglang_standin.py -m sglang.launch_server --model-path M --host 127.0.0.1 --port P
  [--enable-return-routed-experts] [--weight-version V]`` — it accepts SGLang's flags and ignores
  the ones it does not know, plus ``--standin-*`` flags to misbehave at startup (used by the
  supervision tests).
"""

from __future__ import annotations

import argparse
import array
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DEFAULT_DIMS = {
    "num_hidden_layers": 4,
    "num_experts_per_tok": 2,
    "num_experts": 8,
    "vocab_size": 128,
}

# Switches settable through Standin.configure() or POST /standin/configure.
DEFAULT_SWITCHES = {
    "status_code": None,  # answer /generate with this HTTP error status (e.g. 500)
    "delay_s": 0.0,  # sleep before answering /generate
    "malformed": None,  # not_json | wrong_count | bad_routed_size | bad_routed_rows |
    #                     no_logprobs | version_text | logprob_ids
    "abort_entries": [],  # batch positions answered with finish_reason abort
    "healthy": True,  # /health_generate answers 200 (else 503)
    "update_delay_s": 0.0,
    "report_version": None,  # report this weight_version instead of the real one
    "mixed_versions_at": None,  # k: report weight_versions spans, first k tokens at version-1
}


def encode_int32(values: list[int]) -> str:
    """base64 of little-endian int32, as SGLang encodes meta_info["routed_experts"]."""
    arr = array.array("i", values)
    if sys.byteorder == "big":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


class StandinState:
    def __init__(self, dims: dict, *, routed_experts_enabled: bool, weight_version: str) -> None:
        self.dims = dims
        self.routed_experts_enabled = routed_experts_enabled
        self.version = weight_version
        self.switches = dict(DEFAULT_SWITCHES)
        self.calls: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.resumed = threading.Event()
        self.resumed.set()
        self.generated: list[dict] = []  # every /generate item sent, in order
        self.routed_by_id: dict[str, list[int]] = {}  # meta_info id -> routed experts encoded

    def record(self, path: str, payload: object) -> None:
        with self.lock:
            self.calls.append((path, payload))

    def fake_item(self, prompt: list[int], params: dict, position: int, want_routed: bool) -> dict:
        """Deterministic fake output for one entry: tokens and log-probs from a seeded RNG."""
        seed = params.get("sampling_seed", position)
        rng = random.Random(f"{prompt}|{seed}|{self.version}")
        vocab = int(self.dims["vocab_size"])
        stop_ids = set(params.get("stop_token_ids") or [])
        max_new = int(params.get("max_new_tokens", 128))
        tokens: list[int] = []
        finish: dict = {"type": "length", "length": max_new}
        for _ in range(max_new):
            tok = rng.randrange(vocab)
            tokens.append(tok)
            if tok in stop_ids:
                finish = {"type": "stop", "matched": tok}
                break
        logprobs = [[-round(rng.uniform(0.01, 6.0), 6), tok, None] for tok in tokens]
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": self.version,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "e2e_latency": 0.001,
            "output_token_logprobs": logprobs,
        }
        k = self.switches["mixed_versions_at"]
        if k is not None and len(tokens) > k:
            # As newer SGLang reports an update during the request (utils/weight_versions.py).
            meta["weight_versions"] = [
                {"version": str(int(self.version) - 1), "start": 0, "end": k},
                {"version": self.version, "start": k, "end": len(tokens)},
            ]
        if want_routed and self.routed_experts_enabled:
            layers, k = int(self.dims["num_hidden_layers"]), int(self.dims["num_experts_per_tok"])
            experts = int(self.dims["num_experts"])
            flat: list[int] = []
            for _ in range(len(prompt) + len(tokens) - 1):
                for _ in range(layers):
                    flat.extend(rng.sample(range(experts), k))
            meta["routed_experts"] = encode_int32(flat)
            with self.lock:
                self.routed_by_id[meta["id"]] = flat
        return {
            "text": "".join(chr(33 + t % 90) for t in tokens),
            "output_ids": tokens,
            "meta_info": meta,
        }


class _Handler(BaseHTTPRequestHandler):
    state: StandinState  # set on the subclass made per server

    def log_message(self, fmt, *args):  # keep test output quiet; the subprocess logs to stdout
        if os.environ.get("SGLANG_STANDIN_VERBOSE"):
            sys.stdout.write("standin: " + fmt % args + "\n")

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else {}

    def _send(self, status: int, payload=None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        st = self.state
        if self.path in ("/health_generate", "/health"):
            self._send(200 if st.switches["healthy"] else 503, {})
        elif self.path == "/get_weight_version":
            self._send(200, {"weight_version": st.version})
        elif self.path == "/standin/calls":
            with st.lock:
                self._send(200, st.calls)
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        st = self.state
        try:
            body = self._body()
        except json.JSONDecodeError as e:
            self._send(400, {"object": "error", "message": f"bad JSON: {e}", "code": 400})
            return
        st.record(self.path, body)
        if self.path == "/generate":
            self._generate(body)
        elif self.path == "/update_weights_from_disk":
            time.sleep(st.switches["update_delay_s"])
            path = body.get("model_path", "")
            if not Path(path).is_dir():
                msg = f"Failed to get weights iterator: {path} not found"
                self._send(400, {"success": False, "message": msg, "num_paused_requests": 0})
                return
            if body.get("weight_version") is not None:
                st.version = str(body["weight_version"])
            msg = f"Succeeded to update model weights. Weight version updated to {st.version}."
            self._send(200, {"success": True, "message": msg, "num_paused_requests": 0})
        elif self.path == "/pause_generation":
            st.resumed.clear()
            self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        elif self.path == "/continue_generation":
            st.resumed.set()
            self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        elif self.path == "/flush_cache":
            self._send(200, raw=b"Cache flushed.\n")
        elif self.path == "/standin/configure":
            unknown = set(body) - set(DEFAULT_SWITCHES)
            if unknown:
                self._send(400, {"message": f"unknown switches {sorted(unknown)}"})
                return
            st.switches.update(body)
            self._send(200, st.switches)
        else:
            self._send(404, {"detail": "Not Found"})

    def _generate(self, body: dict) -> None:
        st, sw = self.state, self.state.switches
        if sw["delay_s"]:
            time.sleep(sw["delay_s"])
        st.resumed.wait()  # paused in place: hold the request until /continue_generation
        if sw["status_code"]:
            self._send(sw["status_code"], {"object": "error", "message": "stand-in failure"})
            return
        input_ids = body.get("input_ids")
        if not input_ids:
            self._send(400, {"object": "error", "message": "input_ids cannot be empty."})
            return
        if isinstance(input_ids[0], int):
            input_ids = [input_ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(input_ids)
        if len(params) != len(input_ids):
            msg = "The length of sampling_params should be equal to the batch size."
            self._send(400, {"object": "error", "message": msg})
            return
        want_routed = bool(body.get("return_routed_experts"))
        items = [
            st.fake_item(p, sp, i, want_routed)
            for i, (p, sp) in enumerate(zip(input_ids, params, strict=True))
        ]
        for i in sw["abort_entries"]:
            items[i]["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort by test"}
            items[i]["meta_info"].pop("routed_experts", None)
        if sw["report_version"] is not None:
            for item in items:
                item["meta_info"]["weight_version"] = sw["report_version"]
        bad = sw["malformed"]
        if bad == "not_json":
            self._send(200, raw=b"<html>502 Bad Gateway</html>")
            return
        if bad == "wrong_count":
            items = items[:-1]
        elif bad == "no_logprobs":
            del items[0]["meta_info"]["output_token_logprobs"]
        elif bad == "version_text":
            items[0]["meta_info"]["weight_version"] = "default"
        elif bad == "logprob_ids":
            items[0]["meta_info"]["output_token_logprobs"][0][1] += 1
        elif bad in ("bad_routed_size", "bad_routed_rows"):
            meta = items[0]["meta_info"]
            raw = base64.b64decode(meta["routed_experts"])
            per_row = 4 * int(st.dims["num_hidden_layers"]) * int(st.dims["num_experts_per_tok"])
            raw = raw + raw[:4] if bad == "bad_routed_size" else raw[:-per_row]
            meta["routed_experts"] = base64.b64encode(raw).decode("ascii")
        with st.lock:
            st.generated.extend(items)
        self._send(200, items)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that gave up (timeout, abort_inflight) is expected in these tests.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def make_server(state: StandinState, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"state": state})
    server = _Server((host, port), handler)
    server.daemon_threads = True
    return server


def read_dims(model_path: str | None) -> dict:
    dims = dict(DEFAULT_DIMS)
    if model_path and (Path(model_path) / "config.json").is_file():
        config = json.loads((Path(model_path) / "config.json").read_text())
        dims.update({k: config[k] for k in DEFAULT_DIMS if k in config})
        if "num_local_experts" in config:  # transformers 5 spelling
            dims["num_experts"] = config["num_local_experts"]
    return dims


class Standin:
    """The stand-in in a thread of the calling process (``url``, ``configure``, ``calls``)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        routed_experts_enabled: bool = True,
        weight_version: str = "0",
        port: int = 0,
    ) -> None:
        self.state = StandinState(
            read_dims(model_path),
            routed_experts_enabled=routed_experts_enabled,
            weight_version=weight_version,
        )
        self.server = make_server(self.state, "127.0.0.1", port)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Standin:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.state.resumed.set()
        self.server.shutdown()
        self.server.server_close()

    def configure(self, **switches) -> None:
        unknown = set(switches) - set(DEFAULT_SWITCHES)
        assert not unknown, f"unknown switches {unknown}"
        self.state.switches.update(switches)

    def calls(self, path: str) -> list:
        with self.state.lock:
            return [payload for p, payload in self.state.calls if p == path]

    def __enter__(self) -> Standin:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SGLang stand-in (tests only)")
    parser.add_argument("-m", dest="module")  # "sglang.launch_server" when used as its stand-in
    parser.add_argument("--model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-never-healthy", action="store_true")
    parser.add_argument("--standin-exit-code", type=int, default=None)
    parser.add_argument("--standin-spawn-child", action="store_true")
    parser.add_argument("--standin-ignore-sigterm", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    print(f"standin: starting as {args.module} with {vars(args)}; ignoring {unknown}", flush=True)
    print(f"standin: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    if args.standin_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.standin_spawn_child:
        # Like SGLang's scheduler/detokenizer processes: a child in the same process group.
        code = "import signal, time\n"
        if args.standin_ignore_sigterm:
            code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        code += "time.sleep(3600)\n"
        child = subprocess.Popen([sys.executable, "-c", code])
        print(f"standin: spawned child pid {child.pid}", flush=True)
    if args.standin_exit_code is not None:
        print(
            f"standin: RuntimeError: simulated startup failure, exit {args.standin_exit_code}",
            flush=True,
        )
        sys.exit(args.standin_exit_code)
    time.sleep(args.standin_startup_delay)
    state = StandinState(
        read_dims(args.model_path),
        routed_experts_enabled=args.enable_return_routed_experts,
        weight_version=args.weight_version,
    )
    state.switches["healthy"] = not args.standin_never_healthy
    server = make_server(state, args.host, args.port)
    print(f"standin: serving on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
