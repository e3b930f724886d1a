"""Each patch of ``cpu_launch.py`` is needed: without it the failure it works around happens in
the real SGLang environment; with it, it does not (tier ``sglang``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sglang_real import REPO, sglang_python

# one xdist worker runs the real-server tier (its module-scoped servers are started once)
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang")]

LAUNCHER = REPO / "sat_cli" / "engines" / "sglang" / "cpu_launch.py"
# argv: the launcher, the patches to apply, the checks to run, and (JSON) the argument lists the
# parser checks parse; one RESULT line per check: what it returned, or the exception it raised
# (each SGLang import costs 20-40 s on 2 cores: the default suite runs one process, the slow tests
# two more)
CHECKS = """
import argparse, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cpu_launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)  # importing applies nothing; only running it as a script does
for name in filter(None, sys.argv[2].split(",")):
    getattr(launch, "patch_" + name)()

def torchvision():
    import torchvision.transforms
    return "imported"

def state_capturer():
    from sglang.srt.state_capturer.base import BaseHostCache
    cache = BaseHostCache(num_tokens=4, num_layers=2, topk_size=2, name="t", device="cpu")
    return f"buffer {tuple(cache.buffer.shape)} {cache.buffer.is_pinned()}"

def amx_pack():
    import torch
    from sglang.srt.layers import amx_utils
    gate = torch.empty(8, 128, dtype=torch.bfloat16)  # the 8-expert router of the tiny model
    up = torch.empty(64, 128, dtype=torch.bfloat16)
    return f"packs gate: {amx_utils.dim_is_supported(gate)} up: {amx_utils.dim_is_supported(up)}"

def checksum_loaded():
    import torch
    from sglang.srt.layers import amx_utils
    from sglang.srt.utils import weight_checker as wc
    # AMX packing, as SGLang does it on AMX CPUs; here a stand-in re-layout (a transpose), since
    # the kernel's packing op needs AMX
    amx_utils.amx_process_weight_after_loading = lambda w, is_conv=False: w.t().contiguous()
    layer = torch.nn.Module()
    weight = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    loaded = wc._hash_tensor(weight)
    # packed as SGLang's linear and MoE layers do it: through the name unquant.py imported
    from sglang.srt.layers.quantization import unquant
    unquant._amx_process_weight_after_loading(layer, ["weight"])
    checker = wc.WeightChecker.__new__(wc.WeightChecker)
    checker._get_model = lambda: layer
    checker._placement = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1)
    sums = checker._compute_checksum(role="target")["checksums"]
    with torch.no_grad():  # a packed weight changed in place since (one element)
        layer.weight.data[3, 5] = 0.5  # was 324
    held = wc._hash_tensor(layer.weight.data)
    after = checker._compute_checksum(role="target")["checksums"]["weight"]
    return (f"packed: {layer.weight.shape[0] == 64} reports the loaded: {sums['weight'] == loaded}"
            f"; changed, what it holds: {after == held != loaded}")

def lora_pin():  # what SGLang's LoRA layers and torch backend do on the CPU
    import torch
    from sglang.srt.lora import layers
    from sglang.srt.lora.backend import torch_backend
    a = layers.torch.empty((3,), dtype=torch.int32, pin_memory=True)
    b = torch_backend.torch.tensor([1, 2], dtype=torch.int32, pin_memory=True, device="cpu")
    c = torch.zeros(2)
    return f"allocated {tuple(a.shape)} {tuple(b.shape)}; pin_memory() is itself: {c.pin_memory() is c}"

ARGV = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}

def server_args():  # SGLang's own parser on the command sat builds
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(ARGV["server_args"])
    return {k: str(getattr(ns, k)) for k in (
        "model_path", "host", "port", "dtype", "device", "attention_backend", "tp_size",
        "max_total_tokens", "enable_return_routed_experts", "weight_version",
        "disable_overlap_schedule", "sleep_on_idle", "enable_lora", "max_lora_rank",
        "lora_target_modules", "max_loras_per_batch", "max_loaded_loras", "lora_backend")}

def router_args():
    from sglang_router.launch_router import parse_router_args
    ra = parse_router_args(ARGV["router_args"])
    return {"worker_urls": ra.worker_urls, "port": ra.port, "policy": ra.policy,
            "health_failure_threshold": ra.health_failure_threshold,
            "health_check_timeout_secs": ra.health_check_timeout_secs}

for check in sys.argv[3].split(","):
    try:
        found = {"returned": globals()[check]()}
    except Exception as exc:
        found = {"raised": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps({check: found}), flush=True)
"""
ALL = ["torchvision", "state_capturer", "amx_pack", "checksum_loaded", "lora_pin"]
LORA_PINNED = "allocated (3,) (2,); pin_memory() is itself: True"
# a packed weight reports the hash it was loaded with (packed through the name SGLang's layers
# imported), and after a change in place the hash of what it holds, not the loaded one
LOADED_AND_CHANGED = "packed: True reports the loaded: True; changed, what it holds: True"
PARSERS = ["server_args", "router_args"]


def run_checks(
    patches: list[str], checks: list[str], argv: dict[str, list[str]] | None = None
) -> dict[str, dict]:
    cmd = [sglang_python(), "-c", CHECKS, str(LAUNCHER), ",".join(patches), ",".join(checks)]
    out = subprocess.run(
        [*cmd, json.dumps(argv or {})],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            found |= json.loads(line[len("RESULT ") :])
    assert sorted(found) == sorted(checks), out.stdout[-2000:] + out.stderr[-2000:]
    return found


@pytest.fixture(scope="module")
def bare():
    """Each failure without its patch (SGLang itself cannot be imported without torchvision's,
    so the other two are checked with that one only)."""
    return run_checks([], ["torchvision"]) | run_checks(["torchvision"], ALL[1:])


def sat_commands(tmp: Path) -> dict[str, list[str]]:
    """The arguments sat's server and router commands pass to SGLang's own entry points."""
    from sat_cli.engines.sglang.lora import server_lora_args
    from sat_cli.engines.sglang.runtime import ProcessLaunch, ServerRuntime
    from sat_cli.engines.sglang.server import SGLangRouter, SGLangServer
    from sat_cli.engines.sglang.settings import SGLangEngineSettings

    cpu = SGLangEngineSettings(device="cpu", dtype="bfloat16", max_total_tokens=4096)
    lora = server_lora_args({"rank": 4, "target_modules": ["q_proj", "v_proj"]}, 3, "cpu")
    at = ServerRuntime("m", tmp / "s.log", "py", port=31000, r3=True, lora_args=tuple(lora))
    server = SGLangServer(cpu, at)
    urls = ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    router = SGLangRouter(urls, ProcessLaunch(tmp / "r.log", "py", device="cpu", port=30999))

    def after(command: list[str], module: str) -> list[str]:
        return command[command.index(module) + 1 :]

    return {
        "server_args": after(server.command, "sglang.launch_server"),
        "router_args": after(router.command, "sglang_router.launch_router"),
    }


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """Every patch applied, every check and SGLang's parsers on sat's commands: one process."""
    return run_checks(ALL, ALL + PARSERS, sat_commands(tmp_path_factory.mktemp("commands")))


def test_every_patch_takes_effect(patched):
    """The default suite's half: each patch does what it is for (the tests below also show each
    failure without its patch)."""
    assert {k: patched[k] for k in ALL} == {
        "torchvision": {"returned": "imported"},
        "state_capturer": {"returned": "buffer (4, 2, 2) False"},
        "amx_pack": {"returned": "packs gate: False up: True"},
        "checksum_loaded": {"returned": LOADED_AND_CHANGED},
        "lora_pin": {"returned": LORA_PINNED},
    }


@pytest.mark.slow  # the failure without the patch: two more SGLang imports (~40 s)
def test_torchvision_imports_only_with_the_patch(bare, patched):
    assert "operator torchvision::nms does not exist" in bare["torchvision"]["raised"]
    assert patched["torchvision"] == {"returned": "imported"}


@pytest.mark.slow  # the failure without the patch: two more SGLang imports (~40 s)
def test_routed_experts_buffer_allocates_on_cpu_only_with_the_patch(bare, patched):
    assert "Torch not compiled with CUDA enabled" in bare["state_capturer"]["raised"]
    assert patched["state_capturer"] == {"returned": "buffer (4, 2, 2) False"}


@pytest.mark.slow  # the failure without the patch: two more SGLang imports (~40 s)
def test_the_router_gate_is_not_amx_packed_with_the_patch(bare, patched):
    # Packed, the 8-row gate is stored transposed and /update_weights_from_disk then kills the
    # server (its end-to-end check: test_sglang_real.py::test_weight_update_changes_...). SGLang
    # packs only on AMX CPUs; the shape test it uses is the same everywhere.
    assert bare["amx_pack"] == {"returned": "packs gate: True up: True"}
    assert patched["amx_pack"] == {"returned": "packs gate: False up: True"}


@pytest.mark.slow  # the failure without the patch: two more SGLang imports (~40 s)
def test_checksums_of_amx_packed_weights_are_the_loaded_ones_with_the_patch(bare, patched):
    # engine.verify_weights compares them with what the trainer sent (weightsync/layouts.py)
    assert bare["checksum_loaded"] == {
        "returned": "packed: True reports the loaded: False; changed, what it holds: True"
    }
    assert patched["checksum_loaded"] == {"returned": LOADED_AND_CHANGED}


@pytest.mark.slow  # the failure without the patch: two more SGLang imports (~40 s)
def test_lora_layers_allocate_on_cpu_only_with_the_patch(bare, patched):
    # without it the LoRA server dies at start in LoRAManager.init_lora_modules (docs/sglang.md
    # "LoRA"); its end-to-end check: tests/test_sglang_lora.py
    assert "requires a CUDA or other accelerator backend" in bare["lora_pin"]["raised"]
    assert patched["lora_pin"] == {"returned": LORA_PINNED}


def test_sglangs_own_parsers_accept_the_commands_sat_builds(patched):
    assert patched["server_args"] == {
        "returned": {
            "model_path": "m",
            "host": "127.0.0.1",
            "port": "31000",
            "dtype": "bfloat16",
            "device": "cpu",
            "attention_backend": "torch_native",
            "tp_size": "1",
            "max_total_tokens": "4096",
            "enable_return_routed_experts": "True",
            "weight_version": "0",
            "disable_overlap_schedule": "True",
            "sleep_on_idle": "True",
            "enable_lora": "True",
            "max_lora_rank": "4",
            "lora_target_modules": "['q_proj', 'v_proj']",
            "max_loras_per_batch": "3",
            "max_loaded_loras": "3",
            "lora_backend": "torch_native",
        }
    }
    assert patched["router_args"] == {
        "returned": {
            "worker_urls": ["http://127.0.0.1:31000", "http://127.0.0.1:31001"],
            "port": 30999,
            "policy": "round_robin",
            "health_failure_threshold": 10,
            "health_check_timeout_secs": 60,
        }
    }
