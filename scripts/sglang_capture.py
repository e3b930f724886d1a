"""Capture what a real SGLang server sends, for the stand-in's tests (tests/data/sglang_captured/).

Run against a server of the tiny model started with R3 on (``make sglang-cpu`` first)::

    SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python sat_cli/engines/sglang/cpu_launch.py \
        -m sglang.launch_server --model-path sat_cli/assets/tiny_moe_warm --host 127.0.0.1 \
        --port 31002 --device cpu --dtype bfloat16 --attention-backend torch_native \
        --disable-overlap-schedule --max-total-tokens 4096 --enable-return-routed-experts \
        --weight-version 0
    .venv/bin/python scripts/sglang_capture.py --url http://127.0.0.1:31002 \
        --model sat_cli/assets/tiny_moe_warm --out tests/data/sglang_captured

``--weight-sync`` captures only the weight-sync routes instead (``ws_*.json``): the script then
joins the server's weight-update group as the trainer's sender (``sat_cli.weightsync``, gloo)
and sends the served model's own weights as version 5, so the checksums it captures are those
of the model folder in the server's dtype.

Each file holds ``{"request": ..., "status": ..., "body": ..., "elapsed_s": ...}`` (``body`` is
parsed JSON, or text when the server sent text). Time stamps and ids vary between captures; the
shapes, keys, status codes and messages are what the tests rely on. The server is left at weight
version 2 and unpaused.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def call(url: str, method: str, path: str, payload=None, timeout: float = 120.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"} if data is not None else {},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except TimeoutError:
        status, raw = None, b""
    text = raw.decode("utf-8", errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = text
    return {
        "request": {"method": method, "path": path, "payload": payload},
        "status": status,
        "body": body,
        "elapsed_s": round(time.monotonic() - t0, 3),
    }


def gen(prompts, **params) -> dict:
    sp = {"temperature": 1.0, "max_new_tokens": 8, **params}
    return {
        "input_ids": prompts,
        "sampling_params": [dict(sp) for _ in prompts],
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="the served model's folder (for updates)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--weight-sync", action="store_true", help="the ws_*.json captures only")
    args = ap.parse_args()
    from sat_cli.util.script_args import output_file  # checked before the capture

    args.out = str(output_file("scripts/sglang_capture.py", args.out, "--out"))
    url, out = args.url, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(Path(args.model).resolve())

    def save(name: str, record: dict) -> None:
        # the model's absolute path (this machine's) is replaced by a placeholder
        text = json.dumps(record, indent=1).replace(model, "<model>")
        (out / f"{name}.json").write_text(text + "\n")
        print(f"{name}: HTTP {record['status']} in {record['elapsed_s']} s")

    if args.weight_sync:
        capture_weight_sync(url, model, save)
        return
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    save("model_info", call(url, "GET", "/model_info"))
    save("get_weight_version", call(url, "GET", "/get_weight_version"))
    save("generate_plain", call(url, "POST", "/generate", gen(prompts)))
    save(
        "generate_r3",
        call(url, "POST", "/generate", {**gen(prompts), "return_routed_experts": True}),
    )
    save(
        "generate_sampling_mask",
        call(
            url,
            "POST",
            "/generate",
            {**gen(prompts, top_p=0.8, top_k=5), "return_sampling_mask": True},
        ),
    )
    save(
        "generate_length",
        call(url, "POST", "/generate", gen(prompts, ignore_eos=True, max_new_tokens=4)),
    )
    save("error_unknown_key", call(url, "POST", "/generate", gen(prompts, bogus=1)))
    save("error_float_int", call(url, "POST", "/generate", gen(prompts, max_new_tokens=5.0)))
    save("error_empty_input", call(url, "POST", "/generate", gen([])))
    bad_len = gen(prompts)
    bad_len["sampling_params"] = bad_len["sampling_params"][:1]
    save("error_length_mismatch", call(url, "POST", "/generate", bad_len))
    save("error_unknown_route", call(url, "POST", "/no_such_route", {}))
    save("flush_idle", call(url, "POST", "/flush_cache"))
    save(
        "update_ok",
        call(
            url,
            "POST",
            "/update_weights_from_disk",
            {"model_path": model, "weight_version": "1", "flush_cache": True},
        ),
    )
    save(
        "update_missing_path",
        call(
            url,
            "POST",
            "/update_weights_from_disk",
            {"model_path": model + "-missing", "weight_version": "9", "flush_cache": True},
        ),
    )

    # A long request in the background for the busy-server behaviours.
    long_req = gen([[5, 6, 7]], ignore_eos=True, max_new_tokens=400)
    results: dict[str, dict] = {}

    def background(name: str, payload: dict) -> threading.Thread:
        th = threading.Thread(
            target=lambda: results.__setitem__(name, call(url, "POST", "/generate", payload))
        )
        th.start()
        time.sleep(1.0)
        return th

    th = background("busy", long_req)
    save("flush_busy", call(url, "POST", "/flush_cache"))
    th.join()

    # Paused in place with a request running: health, then an update with flush_cache=true.
    th = background("inflight", long_req)
    save("pause_in_place", call(url, "POST", "/pause_generation", {"mode": "in_place"}))
    save("health_generate_paused", call(url, "GET", "/health_generate", timeout=60))
    save("health_paused", call(url, "GET", "/health", timeout=60))
    save(
        "update_in_place_flush",
        call(
            url,
            "POST",
            "/update_weights_from_disk",
            {"model_path": model, "weight_version": "2", "flush_cache": True},
        ),
    )
    save("model_info_after_in_place_flush", call(url, "GET", "/model_info"))
    save("continue", call(url, "POST", "/continue_generation", {}))
    th.join()
    save("generate_across_update", results["inflight"])

    # Paused with mode abort while a request runs.
    th = background("aborted", long_req)
    save("pause_abort", call(url, "POST", "/pause_generation", {"mode": "abort"}))
    th.join()
    save("generate_aborted", results["aborted"])
    call(url, "POST", "/continue_generation", {})
    save("flush_after", call(url, "POST", "/flush_cache"))


def capture_weight_sync(url: str, model: str, save) -> None:
    """The weight-sync routes in SGLang 0.5.23's order, with this script as the sender."""
    from sat_cli.trainers.megatron.hf_io import read_all
    from sat_cli.weightsync.sender import WeightSender

    sender = WeightSender(dtype="bfloat16", source_dir=model, bucket_bytes=1 << 40)
    sender.capture(5, sorted(read_all(model).items()))
    bucket = sender.plan(5)[0]
    update = {
        **bucket.request(),
        "group_name": "sat_capture",
        "load_format": "flattened_bucket",
        "flush_cache": True,
        "weight_version": "5",
    }
    save(
        "ws_destroy_missing",
        call(url, "POST", "/destroy_weights_update_group", {"group_name": "sat_probe"}),
    )
    save("ws_update_outside_session", call(url, "POST", "/update_weights_from_distributed", update))
    save("ws_end_without_session", call(url, "POST", "/end_weight_update", {}))
    port = sender.listen("127.0.0.1", 0, 2, 60.0)
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "sat_capture",
        "backend": "gloo",
    }
    out: dict[str, dict] = {}

    def bg(name: str, path: str, payload: dict) -> threading.Thread:
        th = threading.Thread(
            target=lambda: out.__setitem__(name, call(url, "POST", path, payload))
        )
        th.start()
        return th

    th = bg("init", "/init_weights_update_group", init)
    sender.connect("sat_capture", "gloo")
    th.join()
    save("ws_init", out["init"])
    save("ws_begin", call(url, "POST", "/begin_weight_update", {}))
    save("ws_begin_twice", call(url, "POST", "/begin_weight_update", {}))
    th = bg("update", "/update_weights_from_distributed", update)
    time.sleep(0.5)
    sender.send(5, 0)
    th.join()
    save("ws_update_ok", out["update"])
    save("ws_end", call(url, "POST", "/end_weight_update", {}))
    save("ws_model_info_after", call(url, "GET", "/model_info"))
    save("ws_checksum", call(url, "POST", "/weights_checker", {"action": "checksum"}))
    save("ws_compare_cpu", call(url, "POST", "/weights_checker", {"action": "compare"}))
    # the sender closes the group instead of broadcasting: the server's receive fails at once
    call(url, "POST", "/begin_weight_update", {})
    th = bg("gone", "/update_weights_from_distributed", {**update, "weight_version": "6"})
    time.sleep(1.0)
    sender.abort()
    th.join()
    save("ws_update_sender_gone", out["gone"])
    call(url, "POST", "/end_weight_update", {})
    save("ws_model_info_after_failure", call(url, "GET", "/model_info"))
    save(
        "ws_destroy",
        call(url, "POST", "/destroy_weights_update_group", {"group_name": "sat_capture"}),
    )


if __name__ == "__main__":
    main()
