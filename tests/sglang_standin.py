"""A loopback STAND-IN for an SGLang 0.5.23 server, for fast CPU tests of the client and engine.

It is not SGLang and generates nothing meaningful: fake tokens, log-probs and routed experts
from a seeded RNG. What it must get right is everything the client can observe, and that was
checked against a real SGLang 0.5.23 server on this machine's CPU: the answers it captured are
in ``tests/data/sglang_captured/`` (``scripts/sglang_capture.py``), and
``tests/test_sglang_standin_fidelity.py`` compares the stand-in with them key by key. The real
server itself is exercised by the ``sglang`` test tier (``tests/test_sglang_real.py``).

Routes, as the real server has them: ``POST /generate`` (batched ``input_ids``, per-entry
``sampling_params`` validated strictly: unknown keys and float-typed integers answer 400
``{"error": ...}``; ``return_logprob``, ``return_routed_experts``, ``return_sampling_mask``),
``POST /update_weights_from_disk``, ``GET /model_info`` (``weight_version``; there is no
``/get_weight_version``), ``GET /health_generate`` and ``/health``, ``POST /pause_generation``
(``abort`` / ``retract`` / ``in_place``), ``/continue_generation``, ``/flush_cache``.

Behaviours reproduced: every finished output carries ``weight_versions`` spans (the scheduler's
stamps) besides ``weight_version`` (the tokenizer manager's); ``output_ids`` end with the matched
stop token; the stop rule is the union of ``stop_token_ids``, the EOS ids of ``config.json`` and
``generation_config.json`` and the tokenizer's EOS; ``sampling_seed`` is honoured only with
``--enable-deterministic-inference``; a request running when an ``in_place`` pause arrives is held
after ``pause_at_token`` tokens and continues on resume under the scheduler's current version
(two spans); an update while paused in place with ``flush_cache=true`` and a request running
loads the weights (scheduler version moves) and then answers 400 "Weights were updated, but the
cache was not flushed ..." (the tokenizer's version stays); ``/flush_cache`` answers 400 "Flush
cache failed." while a request runs (not while paused ``retract``, which retracts running requests
to the waiting queue: from SGLang's source, not captured); while paused, ``/health_generate`` and ``/health`` answer 503
after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20 by default); an ``abort`` pause ends running
requests with ``{"type": "abort", "message": "Aborted", ...}``.

Weight sync (``/init_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``,
``/weights_checker``): ``tests/sglang_standin_sync.py``, with real tensors and a real gloo group.

Test hooks (not SGLang): ``POST /standin/configure`` (switches below), ``GET /standin/calls``.

Two ways to run it:
- in a thread of the test process: ``Standin(...).start()``;
- as a subprocess in place of ``python -m sglang.launch_server``: ``python
  tests/sglang_standin.py -m sglang.launch_server --model-path M --host 127.0.0.1 --port P ...``;
  it accepts SGLang's flags, ignores the ones it does not know, and has ``--standin-*`` flags to
  misbehave at start-up (supervision tests).
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

import sglang_standin_sync as sync_routes

DEFAULT_DIMS = {
    "num_hidden_layers": 4,
    "num_experts_per_tok": 2,
    "num_experts": 8,
    "vocab_size": 128,
}
# sampling_params keys SGLang 0.5.23 accepts (its 400 message lists them; captured).
SAMPLING_KEYS = (
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p "
    "frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema regex "
    "ebnf structural_tag ignore_eos skip_special_tokens spaces_between_special_tokens "
    "no_stop_trim stream_interval logit_bias sampling_seed custom_params beam_width watermark "
    "choice"
).split()
INT_KEYS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval")
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
UPDATE_NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)

# Switches settable through Standin.configure() or POST /standin/configure.
DEFAULT_SWITCHES = {
    "status_code": None,  # answer /generate with this HTTP error status (e.g. 500)
    "delay_s": 0.0,  # a /generate request "runs" this long (an in_place pause can catch it)
    "malformed": None,  # not_json | wrong_count | bad_routed_size | bad_routed_rows |
    #                     no_logprobs | version_text | logprob_ids
    "abort_entries": [],  # batch positions answered with finish_reason abort
    "healthy": True,  # /health_generate answers 200 (else 503)
    "update_delay_s": 0.0,
    "report_version": None,  # report this weight_version instead of the real one
    "pause_at_token": 1,  # tokens a request has made when an in_place pause holds it
    **sync_routes.SWITCHES,  # weight sync faults (tests/sglang_standin_sync.py)
}


def encode_int32(values: list[int]) -> str:
    """base64 of little-endian int32, as SGLang encodes meta_info["routed_experts"]."""
    arr = array.array("i", values)
    if sys.byteorder == "big":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def model_eos_ids(model_path: str | None) -> set[int]:
    """SGLang's stop ids besides the request's: config.json and generation_config.json EOS
    (model_config._get_hf_eos_token_id) and the tokenizer's EOS (schedule_batch)."""
    out: set[int] = set()
    if not model_path:
        return out
    root = Path(model_path)
    for name, key in (
        ("config.json", "eos_token_id"),
        ("generation_config.json", "eos_token_id"),
    ):
        f = root / name
        if f.is_file():
            value = json.loads(f.read_text()).get(key)
            out |= {value} if isinstance(value, int) else set(value or [])
    tok = root / "tokenizer.json"
    tok_cfg = root / "tokenizer_config.json"
    if tok.is_file() and tok_cfg.is_file():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        vocab = json.loads(tok.read_text()).get("model", {}).get("vocab", {})
        if isinstance(eos, str) and eos in vocab:
            out.add(int(vocab[eos]))
    return out


class _Request:
    """A /generate call in flight: pause handling and its spans."""

    def __init__(self, version: str) -> None:
        self.spans = [[version, 0]]  # [version, first token] per stretch
        self.aborted = False
        self.held = False  # caught by an in_place/retract pause


class StandinState:
    def __init__(
        self,
        dims: dict,
        *,
        routed_experts_enabled: bool,
        weight_version: str,
        deterministic: bool = False,
        eos_ids: set[int] = frozenset(),
        model_path: str = "",
        dtype: str = "bfloat16",
    ) -> None:
        self.dims = dims
        self.sync = sync_routes.SyncState(model_path, dtype)  # weight-sync routes' state
        self.routed_experts_enabled = routed_experts_enabled
        self.deterministic = deterministic
        self.eos_ids = set(eos_ids)
        self.model_path = model_path
        self.version = weight_version  # the tokenizer manager's (meta weight_version, model_info)
        self.sched_version = weight_version  # the scheduler's (weight_versions spans)
        self.switches = dict(DEFAULT_SWITCHES)
        self.calls: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.resumed = threading.Event()
        self.resumed.set()
        self.pause_mode: str | None = None
        self.running: set[_Request] = set()
        self.router_workers: list[str] | None = None  # set when it plays sglang_router
        self.generated: list[dict] = []  # every /generate item sent, in order
        self.routed_by_id: dict[str, list[int]] = {}  # meta_info id -> routed experts encoded

    def busy(self) -> bool:
        """Requests run in the scheduler (a flush is refused). Paused ``retract``, none does:
        they were retracted to the waiting queue, which SGLang 0.5.23's ``flush_cache`` ignores
        while paused (``is_fully_idle(ignore_waiting=self._engine_paused)``; from its source,
        not captured). Call with ``lock`` held."""
        return bool(self.running) and self.pause_mode != "retract"

    def record(self, path: str, payload: object) -> None:
        with self.lock:
            self.calls.append((path, payload))

    def fake_item(
        self,
        prompt: list[int],
        params: dict,
        position: int,
        *,
        want_routed: bool,
        want_mask: bool,
        req: _Request,
        support: bool = False,
        top_n: int = 0,
    ) -> dict:
        """Fake output for one entry: tokens and log-probs from an RNG seeded by the request's
        ``sampling_seed`` under deterministic inference, else by a fresh random value."""
        seed = params.get("sampling_seed", position) if self.deterministic else uuid.uuid4().hex
        rng = random.Random(f"{prompt}|{seed}|{req.spans[0][0]}")
        vocab = int(self.dims["vocab_size"])
        stop_ids = set(params.get("stop_token_ids") or []) | self.eos_ids
        if params.get("ignore_eos"):
            stop_ids = set()
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
        if req.aborted:
            k = min(int(self.switches["pause_at_token"]), len(tokens))
            tokens, logprobs = tokens[:k], logprobs[:k]
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        spans = []
        for i, (version, start) in enumerate(req.spans):
            end = req.spans[i + 1][1] if i + 1 < len(req.spans) else len(tokens)
            start, end = min(start, len(tokens)), min(end, len(tokens))
            if end > start or not spans:
                spans.append({"version": version, "start": start, "end": end})
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": self.version,
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": logprobs,
            "output_token_logprobs_length": len(logprobs),
            "reasoning_tokens": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "cached_tokens_details": None,
            "dp_rank": None,
            "e2e_latency": 0.001,
            "response_sent_to_client_ts": time.time(),
        }
        meta["weight_versions"] = spans  # also on aborted outputs (captured)
        if want_mask:
            # a fake support: the sampled token and two others; the behaviour log-prob is
            # higher than the unfiltered one (renormalised over a smaller support)
            meta["output_token_sampling_mask"] = [
                sorted({t, (t + 1) % vocab, (t + 2) % vocab}) for t in tokens
            ]
            meta["output_token_sampling_logprobs"] = [round(lp[0] / 2, 6) for lp in logprobs]
            meta["output_token_sampling_mask_length"] = len(tokens)
            if support:  # sampling_logprobs_mode=support: the kept set's log-probs, id-aligned
                meta["output_token_sampling_logprobs"] = [
                    _fake_support(t, ids, sel)
                    for t, ids, sel in zip(
                        tokens,
                        meta["output_token_sampling_mask"],
                        meta["output_token_sampling_logprobs"],
                        strict=True,
                    )
                ]
        if top_n:  # top_logprobs_num: [[logprob, id, null], ...] most probable first
            meta["output_top_logprobs"] = [
                [
                    [round(-0.5 - j - rng.random(), 6), (t + 3 * j) % vocab, None]
                    for j in range(top_n)
                ]
                for t in tokens
            ]
        if want_routed and self.routed_experts_enabled and finish["type"] != "abort":
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


def _fake_support(token: int, ids: list[int], selected: float) -> list[float]:
    """Log-probs of a fake kept set: ``selected`` on ``token``, the rest of the mass split
    evenly over the other ids (a normalised distribution, as the real support mode gives)."""
    import math

    rest = math.log((1 - math.exp(selected)) / max(len(ids) - 1, 1))
    return [selected if i == token else round(rest, 6) for i in ids]


def _validate_sampling(params: dict) -> str | None:
    """The real server's 400 message for a bad sampling_params dict (captured), or None."""
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            return f"unknown field `{key}`, expected one of {expected}"
        if key in INT_KEYS and isinstance(value, float):
            return f"invalid type: floating point `{value}`, expected i64"
    return None


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
        self.send_header("Content-Type", "application/json" if raw is None else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        st = self.state
        if self.path in ("/health_generate", "/health"):
            if not st.resumed.is_set():  # paused: the probe request cannot run
                time.sleep(float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)))
                self._send(503, raw=b"")
                return
            self._send(200 if st.switches["healthy"] else 503, raw=b"")
        elif self.path == "/model_info":
            self._send(
                200,
                {
                    "model_path": st.model_path,
                    "is_generation": True,
                    "weight_version": st.version,
                    "model_type": "qwen3_moe",
                },
            )
        elif self.path == "/readiness" and st.router_workers is not None:
            # only when playing sglang_router (the real server has no such route)
            n = len(st.router_workers)
            self._send(200, {"status": "ready", "healthy_workers": n, "total_workers": n})
        elif self.path == "/standin/calls":
            with st.lock:
                self._send(200, st.calls)
        elif self.path == "/weights_checker":  # GET or POST, as SGLang's api_route
            sync_routes.handle(self, self.path, {})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        st = self.state
        try:
            body = self._body()
        except json.JSONDecodeError as e:
            self._send(400, {"error": {"message": f"bad JSON: {e}"}})
            return
        st.record(self.path, body)
        if self.path == "/generate":
            self._generate(body)
        elif self.path == "/update_weights_from_disk":
            self._update(body)
        elif self.path == "/pause_generation":
            mode = body.get("mode", "abort")
            with st.lock:
                st.pause_mode = mode
                st.resumed.clear()
                for req in st.running:
                    if mode == "abort":
                        req.aborted = True
                    else:
                        req.held = True
            self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        elif self.path == "/continue_generation":
            with st.lock:
                for req in st.running:
                    # a held request continues under the scheduler's current weights
                    if req.held and st.sched_version != req.spans[-1][0]:
                        pause_at = int(st.switches["pause_at_token"])
                        req.spans.append([st.sched_version, pause_at])
                    req.held = False
                st.pause_mode = None
                st.resumed.set()
            self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        elif self.path == "/flush_cache":
            with st.lock:
                busy = st.busy()
            self._send(
                400 if busy else 200, raw=b"Flush cache failed.\n" if busy else FLUSH_OK.encode()
            )
        elif self.path in sync_routes.ROUTES:
            sync_routes.handle(self, self.path, body)
        elif self.path == "/standin/configure":
            unknown = set(body) - set(DEFAULT_SWITCHES)
            if unknown:
                self._send(400, {"message": f"unknown switches {sorted(unknown)}"})
                return
            st.switches.update(body)
            self._send(200, st.switches)
        else:
            self._send(404, {"detail": "Not Found"})

    def _update(self, body: dict) -> None:
        st = self.state
        time.sleep(st.switches["update_delay_s"])
        path = body.get("model_path", "")
        if not Path(path).is_dir():
            # the real server takes a missing folder for a hub id (captured message)
            msg = "Failed to get weights iterator: [Errno -2] Name or service not known."
            self._send(400, {"success": False, "message": msg, "num_paused_requests": 0})
            return
        new = str(body["weight_version"]) if body.get("weight_version") is not None else None
        with st.lock:
            if new is not None:
                st.sched_version = new  # the scheduler stamps before it flushes
            if body.get("flush_cache", True) and st.busy():
                self._send(
                    400, {"success": False, "message": UPDATE_NOT_FLUSHED, "num_paused_requests": 0}
                )
                return
            if new is not None:
                st.version = new
        if not st.switches["disk_stale"]:  # the weights /weights_checker then reports
            st.sync.loaded_from(path)
        msg = "Succeeded to update model weights." + (
            f" Weight version updated to {new}." if new is not None else ""
        )
        self._send(200, {"success": True, "message": msg, "num_paused_requests": 0})

    def _run(self, req: _Request) -> None:
        """Wait while paused at admission; "run" for delay_s, caught by an in_place pause."""
        st, sw = self.state, self.state.switches
        st.resumed.wait()  # queued while paused
        with st.lock:
            req.spans = [[st.sched_version, 0]]
        deadline = time.monotonic() + float(sw["delay_s"])
        while not req.aborted and time.monotonic() < deadline:
            time.sleep(min(0.02, max(deadline - time.monotonic(), 0.0)))
        while not req.aborted and not st.resumed.is_set():
            st.resumed.wait(0.02)  # held in place (or retracted) until continue

    def _generate(self, body: dict) -> None:
        st, sw = self.state, self.state.switches
        input_ids = body.get("input_ids")
        if not input_ids:
            self._send(400, {"error": {"message": "input_ids cannot be empty."}})
            return
        if isinstance(input_ids[0], int):
            input_ids = [input_ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(input_ids)
        for p in params:
            error = _validate_sampling(p)
            if error:
                self._send(400, {"error": error})
                return
        if len(params) != len(input_ids):
            self._send(500, raw=b"Internal Server Error")
            return
        req = _Request(st.sched_version)
        with st.lock:
            st.running.add(req)
        try:
            self._run(req)
        finally:
            with st.lock:
                st.running.discard(req)
        if sw["status_code"]:
            self._send(sw["status_code"], {"error": {"message": "stand-in failure"}})
            return
        items = [
            st.fake_item(
                p,
                sp,
                i,
                want_routed=bool(body.get("return_routed_experts")),
                want_mask=bool(body.get("return_sampling_mask")),
                support=body.get("sampling_logprobs_mode") == "support",
                top_n=int(body.get("top_logprobs_num") or 0),
                req=req,
            )
            for i, (p, sp) in enumerate(zip(input_ids, params, strict=True))
        ]
        for i in sw["abort_entries"]:
            meta = items[i]["meta_info"]
            meta["finish_reason"] = {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            meta.pop("routed_experts", None)
        if sw["report_version"] is not None:
            for item in items:
                item["meta_info"]["weight_version"] = sw["report_version"]
                for span in item["meta_info"].get("weight_versions", []):
                    span["version"] = sw["report_version"]
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
            items[0]["meta_info"]["weight_versions"][0]["version"] = "default"
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
        deterministic: bool = False,
        port: int = 0,
    ) -> None:
        self.state = StandinState(
            read_dims(model_path),
            routed_experts_enabled=routed_experts_enabled,
            weight_version=weight_version,
            deterministic=deterministic,
            eos_ids=model_eos_ids(model_path),
            model_path=model_path or "",
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
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--worker-urls", nargs="*")  # as sglang_router.launch_router
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-never-healthy", action="store_true")
    parser.add_argument("--standin-exit-code", type=int, default=None)
    parser.add_argument("--standin-spawn-child", action="store_true")
    parser.add_argument("--standin-ignore-sigterm", action="store_true")
    # weight-sync faults (tests/sglang_standin_sync.py): sync_fault, disk_stale, no_sync_routes
    parser.add_argument("--standin-sync-fault", default=None)
    parser.add_argument("--standin-skip-receive-s", type=float, default=30.0)
    parser.add_argument("--standin-disk-stale", action="store_true")
    parser.add_argument("--standin-no-sync-routes", action="store_true")
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
        deterministic=args.enable_deterministic_inference,
        eos_ids=model_eos_ids(args.model_path),
        model_path=args.model_path or "",
        dtype=args.dtype if args.dtype in ("bfloat16", "float16", "float32") else "bfloat16",
    )
    state.switches["healthy"] = not args.standin_never_healthy
    state.switches.update(
        sync_fault=args.standin_sync_fault,
        skip_receive_s=args.standin_skip_receive_s,
        disk_stale=args.standin_disk_stale,
        no_sync_routes=args.standin_no_sync_routes,
    )
    if args.module == "sglang_router.launch_router":
        state.router_workers = list(args.worker_urls or [])
    server = make_server(state, args.host, args.port)
    print(f"standin: serving on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
