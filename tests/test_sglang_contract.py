"""Contract tests: request building and response parsing against SGLang's wire format.

Field names verified in sgl-project/sglang (main, 2026):
- python/sglang/srt/managers/io_struct.py, ``GenerateReqInput``: ``input_ids`` (list of lists
  = a batch), ``sampling_params`` (a dict or one dict per entry), ``return_logprob``,
  ``logprob_start_len`` (-1 = output tokens only), ``return_routed_experts``.
  ``UpdateWeightFromDiskReqInput``: ``model_path``, ``weight_version`` (Optional[str]),
  ``flush_cache``, ``abort_all_requests``. ``PauseGenerationReqInput.mode`` in
  {"abort", "retract", "in_place"}.
- python/sglang/srt/sampling/sampling_params.py, ``SamplingParams``: ``max_new_tokens``,
  ``stop_token_ids``, ``temperature``, ``top_p``, ``top_k`` (-1 = whole vocabulary), ``n``,
  ``sampling_seed``.
- python/sglang/srt/managers/tokenizer_manager.py, ``_handle_batch_output``: each output is
  ``{"text", "output_ids", "meta_info"}`` with ``meta_info`` keys ``id``, ``finish_reason``,
  ``prompt_tokens``, ``weight_version`` (server_args.weight_version, a string),
  ``completion_tokens``, ``cached_tokens``, ``output_token_logprobs`` (``[logprob, token_id,
  text_or_None]``) and ``routed_experts`` = ``pybase64.b64encode(tensor.numpy().tobytes())`` of
  int32 ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]``
  (layers/moe/routed_experts_capturer.py).
- python/sglang/srt/entrypoints/http_server.py: ``/update_weights_from_disk`` answers
  ``{"success", "message", "num_paused_requests"}`` with 200, or 400 when not successful.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest

from sat_cli.engines.base import EngineError, SamplingParams
from sat_cli.engines.managed_server import ManagedServer
from sat_cli.engines.sglang.routes import MoEDims, decode_routed_experts, read_moe_dims
from sat_cli.engines.sglang.runtime import ProcessLaunch, ServerRuntime
from sat_cli.engines.sglang.server import SGLangRouter, SGLangServer
from sat_cli.engines.sglang.settings import SGLangEngineSettings
from sat_cli.engines.sglang.wire import (
    build_generate_payload,
    entry_seeds,
    parse_finish_reason,
    parse_generate_item,
    parse_weight_version_spans,
    sampling_params_to_wire,
    update_weights_payload,
)

# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


def test_sampling_params_wire_keys_and_values():
    sp = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=(2, 5)
    )
    assert sampling_params_to_wire(sp) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 16,
        "stop_token_ids": [2, 5],
    }
    # top_k=-1 is SGLang's "no filter" too; a seed becomes sampling_seed.
    assert sampling_params_to_wire(SamplingParams(), seed=11) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 64,
        "sampling_seed": 11,
    }


def test_generate_payload_is_a_batch_with_logprobs_and_optional_routing():
    params = [{"max_new_tokens": 4}, {"max_new_tokens": 4}]
    payload = build_generate_payload([[1, 2], [3]], params, return_routed_experts=False)
    assert payload == {
        "input_ids": [[1, 2], [3]],
        "sampling_params": {"max_new_tokens": 4},  # equal for all entries: one dict
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    seeded = [{"max_new_tokens": 4, "sampling_seed": 1}, {"max_new_tokens": 4, "sampling_seed": 2}]
    assert (
        build_generate_payload([[1], [2]], seeded, return_routed_experts=False)["sampling_params"]
        == seeded
    )  # per-entry seeds: a list
    with_r3 = build_generate_payload([[1, 2]], params[:1], return_routed_experts=True)
    assert with_r3["return_routed_experts"] is True
    # A single prompt is still sent as a list of lists, so SGLang answers with a list.
    assert with_r3["input_ids"] == [[1, 2]]
    json.dumps(with_r3)  # plain JSON
    with pytest.raises(ValueError):
        build_generate_payload([[1]], [], return_routed_experts=False)


def test_entry_seeds_prompt_major_and_distinct():
    # 2 prompts x 3 samples, seed 100: entries (p0,s0) (p0,s1) (p0,s2) (p1,s0) ... -> 100..105
    assert entry_seeds(100, 2, 3) == [100, 101, 102, 103, 104, 105]
    assert entry_seeds(None, 2, 2) == [None] * 4


def test_update_weights_payload_carries_version_as_string():
    assert update_weights_payload("/ckpt/v7", 7) == {
        "model_path": "/ckpt/v7",
        "weight_version": "7",
        "flush_cache": True,
    }


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------


def sglang_item(output_ids, logprobs, *, finish=None, version="3", routed=None):
    """One element of a batched /generate answer, laid out like tokenizer_manager builds it."""
    meta = {
        "id": "4f1c",
        "finish_reason": finish or {"type": "length", "length": len(output_ids)},
        "prompt_tokens": 3,
        "weight_version": version,
        "total_retractions": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "e2e_latency": 0.02,
        "output_token_logprobs": [
            [lp, t, None] for lp, t in zip(logprobs, output_ids, strict=True)
        ],
    }
    if routed is not None:
        meta["routed_experts"] = routed
    return {"text": "ab", "output_ids": list(output_ids), "meta_info": meta}


def test_routed_experts_hand_decoded():
    # int32 little-endian 1, 2, 3, 0 -> bytes 01000000 02000000 03000000 00000000
    # base64 of those 16 bytes is "AQAAAAIAAAADAAAAAAAAAA==": 2 tokens x 1 layer x 2 experts.
    out = decode_routed_experts("AQAAAAIAAAADAAAAAAAAAA==", num_tokens=2, num_layers=1, top_k=2)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [[[1, 2]], [[3, 0]]])


def test_routed_experts_errors_are_loud():
    b64 = "AQAAAAIAAAADAAAAAAAAAA=="  # 4 int32 values
    with pytest.raises(EngineError, match="not divisible"):
        decode_routed_experts(b64, num_tokens=1, num_layers=1, top_k=3)
    with pytest.raises(EngineError, match="covers 2 tokens, expected .* = 3"):
        decode_routed_experts(b64, num_tokens=3, num_layers=1, top_k=2)
    with pytest.raises(EngineError, match="outside"):
        decode_routed_experts(b64, num_tokens=2, num_layers=1, top_k=2, num_experts=3)
    with pytest.raises(EngineError, match="base64"):
        decode_routed_experts("not base64!", num_tokens=2, num_layers=1, top_k=2)
    with pytest.raises(EngineError, match="whole number of int32"):
        decode_routed_experts("AQID", num_tokens=1, num_layers=1, top_k=1)  # 3 bytes


def test_parse_item_length_finish_and_logprobs():
    item = sglang_item([7, 8], [-0.5, -1.25])
    s = parse_generate_item(item, [1, 2, 3])
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [7, 8]
    assert s.rollout_logp == [-0.5, -1.25]
    assert s.finish_reason == "length"
    assert s.weight_version == 3  # the string "3" from meta_info
    assert s.routed_experts is None


def test_parse_item_with_r3_decodes_prompt_plus_completion_minus_one_rows():
    # prompt 3 + completion 2 - 1 = 4 rows, 2 layers, top-2 -> 16 int32 values
    values = np.arange(16, dtype="<i4") % 8
    b64 = base64.b64encode(values.tobytes()).decode()
    item = sglang_item([7, 8], [-0.5, -1.0], finish={"type": "stop", "matched": 8}, routed=b64)
    s = parse_generate_item(item, [1, 2, 3], moe=MoEDims(num_layers=2, top_k=2, num_experts=8))
    assert s.finish_reason == "stop"
    assert s.routed_experts.shape == (4, 2, 2)
    np.testing.assert_array_equal(s.routed_experts.reshape(-1), values)
    # R3 on and no routed_experts: loud error naming the launch flag.
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        parse_generate_item(sglang_item([7, 8], [-0.5, -1.0]), [1, 2, 3], moe=MoEDims(2, 2))


def test_parse_item_rejects_inconsistent_payloads():
    with pytest.raises(EngineError, match="disagree"):
        item = sglang_item([7, 8], [-0.5, -1.0])
        item["meta_info"]["output_token_logprobs"][1][1] = 9
        parse_generate_item(item, [1])
    with pytest.raises(EngineError, match="output_token_logprobs"):
        item = sglang_item([7], [-0.5])
        del item["meta_info"]["output_token_logprobs"]
        parse_generate_item(item, [1])
    with pytest.raises(EngineError, match="not an integer"):
        parse_generate_item(sglang_item([7], [-0.5], version="default"), [1])
    with pytest.raises(EngineError, match="unknown finish_reason"):
        parse_generate_item(sglang_item([7], [-0.5], finish={"type": "eos"}), [1])
    with pytest.raises(EngineError, match="no meta_info"):
        parse_generate_item({"text": "x"}, [1])


def test_parse_item_abort_is_a_sample_not_an_error():
    item = sglang_item([7], [-0.5], finish={"type": "abort", "message": "Abort by pause"})
    del item["meta_info"]["output_token_logprobs"]
    s = parse_generate_item(item, [1, 2], moe=MoEDims(2, 2))
    assert s.finish_reason == "abort"
    assert s.response_ids == [7]
    assert math.isnan(s.rollout_logp[0])
    assert s.routed_experts is None


def test_finish_reason_accepts_dict_or_string():
    assert parse_finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert parse_finish_reason("length") == "length"


def test_output_ids_fallback_from_logprobs():
    # Older SGLang versions omit output_ids; the ids then come from output_token_logprobs.
    item = sglang_item([4, 5], [-0.1, -0.2])
    del item["output_ids"]
    assert parse_generate_item(item, [1]).response_ids == [4, 5]


def test_read_moe_dims_from_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 8})
    )
    assert read_moe_dims(tmp_path) == MoEDims(num_layers=4, top_k=2, num_experts=8)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 4, "num_local_experts": 16})
    )
    assert read_moe_dims(tmp_path) == MoEDims(num_layers=2, top_k=4, num_experts=16)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(EngineError, match="num_experts_per_tok"):
        read_moe_dims(tmp_path)


# --------------------------------------------------------------------------------------------
# launch commands
# --------------------------------------------------------------------------------------------


def test_server_command_is_an_argument_list(tmp_path):
    settings = SGLangEngineSettings(
        launch_prefix=["/envs/sglang/bin/python"],
        tp=2,
        dp=1,
        ep=2,
        mem_fraction_static=0.5,
        extra_args=["--disable-cuda-graph"],
        deterministic=False,
        verify_weights="off",  # tp x ep > 1: SGLang's checksums are per rank shard
    )
    server = SGLangServer(
        settings, ServerRuntime("/models/tiny", tmp_path / "s.log", port=31000, r3=True)
    )
    assert server.command == [
        "/envs/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--dp-size",
        "1",
        "--ep-size",
        "2",
        "--mem-fraction-static",
        "0.5",
        "--enable-return-routed-experts",
        "--weight-version",
        "0",
        "--disable-cuda-graph",
    ]
    assert server.url == "http://127.0.0.1:31000"


def test_cpu_server_command_runs_through_the_launcher_with_cpu_flags(tmp_path):
    cpu = SGLangEngineSettings(device="cpu", dtype="bfloat16")  # the KV pool: 4096 tokens
    runtime = ServerRuntime("m", tmp_path / "s.log", "/envs/sglang/bin/python", port=31000)
    server = SGLangServer(cpu, runtime)
    cmd = server.command
    assert cmd[0] == "/envs/sglang/bin/python"
    assert cmd[1].endswith("sat_cli/engines/sglang/cpu_launch.py") and Path(cmd[1]).is_file()
    assert cmd[2:4] == ["-m", "sglang.launch_server"]
    i = cmd.index("--device")
    assert cmd[i : i + 6] == [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-overlap-schedule",
        "--sleep-on-idle",
    ]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert "--enable-deterministic-inference" not in cmd
    assert server.env["SGLANG_USE_CPU_ENGINE"] == "1"
    with pytest.raises(ValueError, match="device"):
        SGLangServer(SGLangEngineSettings(device="tpu"), runtime)


def test_server_defaults_pick_a_free_port_and_a_plain_python(tmp_path):
    plain = SGLangEngineSettings(deterministic=False)
    server = SGLangServer(plain, ServerRuntime("m", tmp_path / "s.log", weight_version=None))
    assert server.command[:3] == ["python", "-m", "sglang.launch_server"]
    assert 0 < server.port < 65536
    assert "--enable-return-routed-experts" not in server.command
    assert "--weight-version" not in server.command
    with pytest.raises(ValueError, match="127.0.0.1"):  # an SGLang process binds only it
        ManagedServer(
            host="0.0.0.0",
            port=None,
            log_path=tmp_path / "s.log",
            health_path="/health",
            startup_timeout_s=1.0,
            env=None,
        )
    with pytest.raises(ValueError, match="tp"):
        SGLangServer(SGLangEngineSettings(tp=0), ServerRuntime("m", tmp_path / "s.log"))


def test_router_command(tmp_path):
    router = SGLangRouter(
        ["http://127.0.0.1:31000", "http://127.0.0.1:31001"],
        ProcessLaunch(tmp_path / "r.log", "/envs/sglang/bin/python", port=30999),
    )
    assert router.command == [
        "/envs/sglang/bin/python",
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        "http://127.0.0.1:31000",
        "http://127.0.0.1:31001",
        "--host",
        "127.0.0.1",
        "--port",
        "30999",
        "--policy",
        "round_robin",
        "--health-check-timeout-secs",
        "60",
        "--health-failure-threshold",
        "10",
    ]
    assert router.health_path == "/health"


def test_weight_version_spans_give_per_token_versions():
    # Newer SGLang (utils/weight_versions.py): spans over output tokens when weights changed
    # mid-request; weight_version is then the last span's. Tokens 0-1 by v3, token 2 by v4.
    item = sglang_item([7, 8, 9], [-0.1, -0.2, -0.3], version="4")
    item["meta_info"]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 3},
    ]
    s = parse_generate_item(item, [1])
    assert s.weight_version == 3  # the first token's version (base.Sample's convention)
    assert s.token_versions == [3, 3, 4]
    # A single span: no mixing, token_versions stays None.
    assert parse_weight_version_spans([{"version": "5", "start": 0, "end": 2}], 2) == (5, None)
    with pytest.raises(EngineError, match="do not tile"):
        parse_weight_version_spans(
            [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 2, "end": 3}], 3
        )
    with pytest.raises(EngineError, match="cover 2 tokens, the output has 3"):
        parse_weight_version_spans([{"version": "3", "start": 0, "end": 2}], 3)
