"""The stand-in against what a real SGLang 0.5.23 server sent (tests/data/sglang_captured/).

Each captured request is replayed against the stand-in serving the same tiny model; status
codes, error bodies and the set of keys (and value types) of every answer must match the real
server's, so the stand-in has no route or field the real server lacks and lacks none it has.
The captures come from ``scripts/sglang_capture.py`` run against a real server on this CPU.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sglang_standin import Standin

REPO = Path(__file__).resolve().parents[1]
CAPTURED = REPO / "tests" / "data" / "sglang_captured"
MODEL = REPO / "sat_cli" / "assets" / "tiny_moe_warm"


def load(name: str) -> dict:
    return json.loads((CAPTURED / f"{name}.json").read_text())


def call(url: str, method: str, path: str, payload=None, timeout: float = 60.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode()
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = text
    return {"status": status, "body": body}


def replay(standin: Standin, name: str, **kw) -> tuple[dict, dict]:
    real = load(name)
    r = real["request"]
    payload = r["payload"]
    if isinstance(payload, dict) and "model_path" in payload:
        payload = {**payload, "model_path": payload["model_path"].replace("<model>", str(MODEL))}
    return real, call(standin.url, r["method"], r["path"], payload, **kw)


# keys whose value type follows the sampled values: a stop or a length finish; cache hit details
# are null when no token was cached
VALUE_DEPENDENT = {
    "finish_reason": lambda v: (
        {
            "stop": ["type", "matched"],
            "length": ["type", "length"],
            "abort": ["type", "message", "status_code", "err_type"],
        }[v["type"]]
        == list(v)
    ),
    "cached_tokens_details": lambda v: v is None or set(v) == {"device", "host"},
}


def shape(obj):
    """Keys and value types, recursively (values themselves vary between runs)."""
    if isinstance(obj, dict):
        return {
            k: (VALUE_DEPENDENT[k](v) if k in VALUE_DEPENDENT else shape(v)) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    return type(obj).__name__


@pytest.fixture
def standin():
    with Standin(str(MODEL)) as s:
        yield s


@pytest.mark.parametrize(
    "name",
    ["generate_plain", "generate_r3", "generate_sampling_mask", "generate_length"],
)
def test_generate_answers_have_the_real_servers_shape(standin, name):
    real, got = replay(standin, name)
    assert got["status"] == real["status"] == 200
    assert len(got["body"]) == len(real["body"])
    for mine, theirs in zip(got["body"], real["body"], strict=True):
        assert shape(mine) == shape(theirs)
        # output_ids end with the matched stop token; a length stop says its length
        fin = theirs["meta_info"]["finish_reason"]
        assert set(mine["meta_info"]["finish_reason"]) <= {"type", "matched", "length"}
        if fin["type"] == "stop":
            assert theirs["output_ids"][-1] == fin["matched"]
        span = theirs["meta_info"]["weight_versions"]
        assert span == [{"version": "0", "start": 0, "end": len(theirs["output_ids"])}]
        assert mine["meta_info"]["weight_versions"][-1]["end"] == len(mine["output_ids"])


@pytest.mark.parametrize(
    "name",
    [
        "error_unknown_key",
        "error_float_int",
        "error_empty_input",
        "error_length_mismatch",
        "error_unknown_route",
        "get_weight_version",
        "flush_idle",
    ],
)
def test_errors_and_plain_routes_answer_exactly_as_the_real_server(standin, name):
    real, got = replay(standin, name)
    assert (got["status"], got["body"]) == (real["status"], real["body"])


def test_model_info_reports_the_version(standin):
    real, got = replay(standin, "model_info")
    assert got["status"] == 200 and real["body"]["weight_version"] == "0"
    assert got["body"]["weight_version"] == "0"
    assert set(got["body"]) <= set(real["body"])  # no field the real server lacks


def test_weight_updates_answer_as_the_real_server(standin):
    real, got = replay(standin, "update_ok")
    assert (got["status"], got["body"]) == (real["status"], real["body"])
    real, got = replay(standin, "update_missing_path")
    assert (got["status"], got["body"]) == (real["status"], real["body"])
    assert call(standin.url, "GET", "/model_info")["body"]["weight_version"] == "1"


def _long_request(standin: Standin, name: str, results: dict) -> threading.Thread:
    """The captures' long request (400 tokens, ignore_eos) running in the background."""
    body = {
        "input_ids": [[5, 6, 7]],
        "sampling_params": [{"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}],
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    th = threading.Thread(
        target=lambda: results.__setitem__(name, call(standin.url, "POST", "/generate", body))
    )
    th.start()
    time.sleep(0.3)
    return th


def test_busy_flush_and_an_update_paused_in_place_behave_as_the_real_server(standin, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")  # the real one waits 20 s
    real_meta = load("generate_across_update")["body"][0]["meta_info"]
    pause_at = real_meta["weight_versions"][0]["end"]  # where the real pause caught the request
    standin.configure(delay_s=2.0, pause_at_token=pause_at)
    results: dict = {}
    th = _long_request(standin, "busy", results)
    real = load("flush_busy")
    got = call(standin.url, "POST", "/flush_cache")
    assert (got["status"], got["body"]) == (real["status"], real["body"]) == (400, real["body"])
    th.join()

    call(
        standin.url,
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(MODEL), "weight_version": "1", "flush_cache": True},
    )
    th = _long_request(standin, "inflight", results)
    for name in ("pause_in_place", "health_generate_paused", "health_paused"):
        real, got = replay(standin, name)
        assert got["status"] == real["status"], name
    real, got = replay(standin, "update_in_place_flush")
    assert (got["status"], got["body"]) == (real["status"], real["body"])
    # The weights (and the scheduler's stamps) moved; the tokenizer's version did not.
    real_info = load("model_info_after_in_place_flush")["body"]["weight_version"]
    assert call(standin.url, "GET", "/model_info")["body"]["weight_version"] == real_info == "1"
    real, got = replay(standin, "continue")
    assert (got["status"], got["body"]) == (real["status"], real["body"])
    th.join()
    mine = results["inflight"]["body"][0]["meta_info"]
    assert real_meta["weight_versions"] == [
        {"version": "1", "start": 0, "end": pause_at},
        {"version": "2", "start": pause_at, "end": 400},
    ]
    assert mine["weight_versions"] == real_meta["weight_versions"]
    assert shape(results["inflight"]["body"]) == shape(load("generate_across_update")["body"])


def test_an_abort_pause_ends_running_requests_as_the_real_server(standin):
    tokens_before_abort = len(load("generate_aborted")["body"][0]["output_ids"])
    standin.configure(delay_s=5.0, pause_at_token=tokens_before_abort)
    results: dict = {}
    th = _long_request(standin, "aborted", results)
    real, got = replay(standin, "pause_abort")
    assert (got["status"], got["body"]) == (real["status"], real["body"])
    th.join(timeout=10)
    real_item = load("generate_aborted")["body"][0]
    mine = results["aborted"]["body"][0]
    assert mine["meta_info"]["finish_reason"] == real_item["meta_info"]["finish_reason"]
    assert shape(mine) == shape(real_item)
    call(standin.url, "POST", "/continue_generation", {})


WS_CAPTURES = (
    "ws_destroy_missing",
    "ws_update_outside_session",
    "ws_end_without_session",
    "ws_init",
    "ws_begin",
    "ws_begin_twice",
    "ws_update_ok",
    "ws_end",
    "ws_model_info_after",
    "ws_checksum",
    "ws_compare_cpu",
    "ws_update_sender_gone",
    "ws_model_info_after_failure",
    "ws_destroy",
)


@pytest.fixture
def standin_process(tmp_path):
    """The stand-in as its own process, as sat launches it (a gloo group cannot have both of its
    ends, under one name, in one process)."""
    from sglang_standin_sync import standin_process

    with standin_process(MODEL, tmp_path / "standin.log") as url:
        yield url


def test_weight_sync_routes_answer_as_the_real_server(standin_process):
    """The capture script's weight-sync sequence (a real gloo group with this process as the
    sender), run against the stand-in: the same status codes and bodies as the real server's,
    the checksums to the last digit (the same weights in the same dtype), except the port in
    the message of a receive whose sender went away."""
    import importlib.util

    url = standin_process

    spec = importlib.util.spec_from_file_location("capture", REPO / "scripts" / "sglang_capture.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    got: dict[str, dict] = {}
    capture.capture_weight_sync(url, str(MODEL), lambda name, rec: got.__setitem__(name, rec))
    assert sorted(got) == sorted(WS_CAPTURES)
    for name in WS_CAPTURES:
        real = load(name)
        assert got[name]["status"] == real["status"], name
        if name == "ws_update_sender_gone":
            prefix = "Failed to receive weights: "
            assert real["body"]["message"].startswith(prefix)
            assert got[name]["body"]["message"].startswith(prefix)
            assert "Connection closed by peer" in got[name]["body"]["message"]
        elif name.startswith("ws_model_info"):
            assert got[name]["body"]["weight_version"] == real["body"]["weight_version"] == "5"
        else:
            assert got[name]["body"] == real["body"], name
