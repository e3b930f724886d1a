"""The device plan (``sat_cli.devices``) end to end without a GPU: the real builders start the
run's processes up to the process boundary, where the fake GPU layer (``tests/fake_gpus.py``)
records what each process is handed (``subprocess.Popen``'s argument list and environment for
SGLang servers and torchrun, the local engine worker's settings, the local trainer's torch device)
and derives the physical GPUs it would compute on. Each layout's engine and trainer GPUs must be
the plan's, inside the node and disjoint unless ``engine.colocate=true``."""

from __future__ import annotations

import multiprocessing.context
import re
import subprocess
from pathlib import Path

import pytest
from fake_gpus import (
    MEGATRON_SET_DEVICE,
    FakeCuda,
    environ_with,
    ray_assign,
    sglang_gpus,
    torchrun_gpus,
)

from sat_cli.config import ConfigError, load
from sat_cli.devices import DevicePlanError

REPO = Path(__file__).resolve().parents[1]
PAPER = ["experiment=paper_qwen3_30b_a3b", "engine.launch_prefix=[python]"]


class Captured(Exception):
    """Raised at the process boundary once the process's launch was recorded."""


@pytest.fixture
def boundary(monkeypatch):
    """Record every process the builders start (and stop there)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen: list[dict] = []

    def popen(cmd, *args, env=None, **kwargs):
        seen.append({"cmd": list(cmd), "env": dict(env or {})})
        raise Captured

    def spawn(self):
        seen.append({"engine_cfg": dict(self._args[1])})
        raise Captured

    def load_model(path, dtype, device):
        seen.append({"trainer_device": str(device)})
        raise Captured

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", spawn)
    monkeypatch.setattr("sat_cli.trainers.local.load_model", load_model)
    return seen


def _launch(obj, tmp_path, seen) -> tuple[dict, dict]:
    """(engine launch, trainer launch) as recorded at the process boundary."""
    from sat_cli.build import components as build

    out = []
    for make in (
        lambda: build.build_engine(obj, "model", tmp_path, r3=False),
        lambda: build.build_trainer(obj, "model", tmp_path),
    ):
        n = len(seen)
        with pytest.raises(Captured):
            make()
        out.append(seen[n])
    return out[0], out[1]


def _gpus(launch: dict, node_gpus: int, nproc: int = 1) -> list[int]:
    """The physical GPUs the recorded process computes on."""
    if "engine_cfg" in launch:  # the local engine's worker: torch.device(cfg["device"])
        return [FakeCuda(node_gpus).device(launch["engine_cfg"]["device"])]
    if "trainer_device" in launch:
        return [FakeCuda(node_gpus).device(launch["trainer_device"])]
    cmd, env = launch["cmd"], environ_with(launch["env"])
    if "sglang.launch_server" in cmd:
        return sglang_gpus(cmd, env, node_gpus)
    assert "torch.distributed.run" in cmd, cmd
    return torchrun_gpus(env, int(cmd[cmd.index("--nproc_per_node") + 1]), node_gpus)


def assert_disjoint(engine: list[int], trainer: list[int], node_gpus: int) -> None:
    assert len(set(engine)) == len(engine) and len(set(trainer)) == len(trainer)
    assert max(engine + trainer) < node_gpus
    assert not set(engine) & set(trainer), f"engine {engine} and trainer {trainer} share GPUs"


def test_paper_preset_on_one_8_gpu_node(tmp_path, boundary):
    _, obj = load(PAPER)
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert engine["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "--tp-size" in engine["cmd"]
    assert _gpus(engine, 8) == [0, 1, 2, 3]
    assert trainer["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert _gpus(trainer, 8) == [4, 5, 6, 7]
    assert_disjoint(_gpus(engine, 8), _gpus(trainer, 8), 8)
    from sat_cli.config.devices import device_plan

    plan = device_plan(obj)
    plan.check(8, "test")
    with pytest.raises(DevicePlanError, match=r"needs 8 GPUs on node 0 .* has 7"):
        plan.check(7, "test")


def test_overlap_without_colocation_fails_the_check(tmp_path, boundary, monkeypatch):
    """The disjointness check above fails when torchrun inherits the server's GPUs (what the
    code did before the device plan: no CUDA_VISIBLE_DEVICES for torchrun)."""
    monkeypatch.setattr("sat_cli.devices.apply.trainer_env", lambda plan: {})
    _, obj = load(PAPER)
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert _gpus(trainer, 8) == [0, 1, 2, 3]
    with pytest.raises(AssertionError, match="share GPUs"):
        assert_disjoint(_gpus(engine, 8), _gpus(trainer, 8), 8)


def test_inherited_visible_devices_are_mapped(tmp_path, boundary, monkeypatch):
    """sat itself started with CUDA_VISIBLE_DEVICES=8..15 (a 16-GPU node): the children name
    physical GPUs, so the plan's ids go through it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(8, 16))))
    _, obj = load(PAPER)
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert _gpus(engine, 16) == [8, 9, 10, 11] and _gpus(trainer, 16) == [12, 13, 14, 15]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for sat: none for its children
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert engine["env"]["CUDA_VISIBLE_DEVICES"] == trainer["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_two_nodes_of_8(tmp_path, boundary):
    """launcher=local, trainer.nnodes=2: node 0 holds the SGLang server and trainer node 0;
    node 1 (``sat worker --join``, no CUDA_VISIBLE_DEVICES) its ranks from GPU 0."""
    from sat_cli.config.devices import device_plan

    _, obj = load([*PAPER, "trainer.nnodes=2", "trainer.nproc_per_node=4"])
    plan = device_plan(obj)
    assert plan.needed() == {0: 8, 1: 4}
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert_disjoint(_gpus(engine, 8), _gpus(trainer, 8), 8)
    assert plan.find("megatron node 1").gpus == tuple(torchrun_gpus({}, 4, 8)) == (0, 1, 2, 3)
    plan.check(8, "test")
    _, obj = load([*PAPER, "trainer.nnodes=2", "trainer.nproc_per_node=8", "trainer.ep=8"])
    with pytest.raises(DevicePlanError, match=r"needs 12 GPUs on node 0"):
        device_plan(obj).check(8, "test")


def test_ray_bundles_two_nodes_of_8(tmp_path):
    """launcher=ray, 2 SGLang servers (tp 4) + 2 trainer nodes (4 ranks): four 4-GPU bundles,
    SPREAD; Ray's assignment leaves every node's GPUs used once."""
    from sat_cli.build.components import launcher_runtime
    from sat_cli.cluster.settings import bundles as placed_bundles
    from sat_cli.config.devices import device_plan, ray_strategy

    def bundles(obj):
        return placed_bundles(obj.launcher, launcher_runtime(obj))

    over = [*PAPER, "engine.num_servers=2", "trainer.nnodes=2", "trainer.nproc_per_node=4"]
    _, obj = load([*over, "launcher=ray", "launcher.address=head:6379"])
    nodes, trainer, servers, server = bundles(obj)
    assert (nodes, trainer["GPU"], servers, server["GPU"]) == (2, 4.0, 2, 4.0)
    assert ray_strategy(obj) == "SPREAD"
    assert device_plan(obj).total() == (8, 8)
    placed = ray_assign([trainer["GPU"]] * nodes + [server["GPU"]] * servers, 2, 8, "SPREAD")
    for node in (0, 1):
        ids = [g for n, v in placed if n == node for g in v.split(",")]
        assert len(ids) == len(set(ids)) == 8
    # the actors ask Ray for the bundle's GPUs (sat_cli/cluster/launcher.py)
    assert 'num_gpus=bundle.get("GPU", 0.0)' in (REPO / "sat_cli/cluster/launcher.py").read_text()
    device_plan(obj).check(8, "test")
    with pytest.raises(DevicePlanError, match="bundle asks for 4 GPUs but a node has 2"):
        device_plan(obj).check(2, "test")
    _, obj = load([*PAPER, "launcher=ray", "launcher.address=h:1"])
    assert ray_strategy(obj) == "PACK" and bundles(obj)[1]["GPU"] == 4.0


def test_one_gpu_local_engine_and_local_trainer(tmp_path, boundary):
    from sat_cli.config.devices import device_plan

    cuda = ["engine.device=cuda", "trainer.device=cuda"]
    _, obj = load(cuda)
    with pytest.raises(DevicePlanError, match="engine.colocate=true"):
        device_plan(obj).check(1, "torch sees 1 GPU(s) on this machine")
    engine, trainer = _launch(obj, tmp_path, boundary)  # two GPUs: one each
    assert (engine["engine_cfg"]["device"], trainer["trainer_device"]) == ("cuda:0", "cuda:1")
    assert_disjoint(_gpus(engine, 2), _gpus(trainer, 2), 2)
    _, obj = load([*cuda, "engine.colocate=true"])
    device_plan(obj).check(1, "test")
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert _gpus(engine, 1) == _gpus(trainer, 1) == [0]


def test_one_gpu_sglang_and_local_trainer_colocated(tmp_path, boundary):
    from sat_cli.config.devices import device_plan

    over = ["engine=sglang", "engine.launch_prefix=[python]", "trainer.device=cuda"]
    _, obj = load([*over, "engine.colocate=true"])
    plan = device_plan(obj)
    plan.check(1, "test")
    engine, trainer = _launch(obj, tmp_path, boundary)
    cmd = engine["cmd"]
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.4"  # COLOCATE_MEM_FRACTION
    assert _gpus(engine, 1) == _gpus(trainer, 1) == [0]
    assert plan.find("local trainer").mem_fraction == 0.6
    _, obj = load([*over, "engine.colocate=true", "engine.mem_fraction_static=0.3"])
    engine, _ = _launch(obj, tmp_path, boundary)
    assert engine["cmd"][engine["cmd"].index("--mem-fraction-static") + 1] == "0.3"
    _, obj = load(over)  # not colocated: GPU 0 and GPU 1
    engine, trainer = _launch(obj, tmp_path, boundary)
    assert_disjoint(_gpus(engine, 2), _gpus(trainer, 2), 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["engine.colocate=maybe"], "engine.colocate: expected a boolean"),
        (
            ["engine.colocate=true"],
            "engine.colocate=true shares GPUs .* the engine and the trainer get\\(s\\) no GPU",
        ),
        (
            ["engine=sglang", "engine.gpu_groups=['0,1']"],
            r"engine.gpu_groups\[0\]='0,1' has 2 GPU\(s\) but each server uses engine.tp × engine.dp = 1",
        ),
        (
            ["engine=sglang", "engine.gpu_groups=['0','0']"],
            "GPU 0 is in two groups",
        ),
        (
            [*PAPER, "engine.colocate=true", "launcher=ray", "launcher.address=h:1"],
            "with launcher=ray each process gets the GPUs of its own bundle",
        ),
        (
            ["engine.device=cuda", "trainer.device=cuda", "engine.colocate=true"]
            + ["engine.weight_sync=distributed"],
            "engine.weight_sync=distributed with engine.colocate=true: .* NCCL refuses two ranks",
        ),
        (
            ["engine=sglang", "trainer.device=cuda", "engine.colocate=true"]
            + ["engine.weight_sync=distributed"],
            "engine.weight_sync=distributed with engine.colocate=true",
        ),
    ],
)
def test_impossible_device_plans_are_refused_at_compose_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(overrides)


def test_stand_ins_match_the_sources():
    """The fake layer's rules are the real components': the Megatron worker's set_device line,
    and SGLang's scheduler placement (SGLang's own source, where its environment is here)."""
    assert MEGATRON_SET_DEVICE in (REPO / "sat_cli/trainers/megatron/runtime.py").read_text()
    found = list(
        (REPO / ".venv-sglang").glob("lib/python*/site-packages/sglang/srt/entrypoints/engine.py")
    )
    if not found:
        pytest.skip("no SGLang environment here (make sglang-cpu)")
    text = re.sub(r"\s+", " ", found[0].read_text())
    assert (
        "get_device().base_gpu_id + ((pp_rank % pp_size_per_node) * tp_size_per_node) + "
        "(tp_rank % tp_size_per_node) * get_device().gpu_id_step"
    ) in text


SWEEP = """name: gpu_sweep
base: [experiment=paper_qwen3_30b_a3b]
axes: {}
seeds: [0]
methods:
  GRPO: [algo=grpo, clip=ppo]
"""


def _sweep(tmp_path, capsys, *overrides, **opts):
    from sat_cli.sweep.executor import ExecutorOptions
    from sat_cli.sweep.run import run_sweep

    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP)
    options = ExecutorOptions(**opts)
    run_sweep(
        str(spec),
        [f"run.dir={tmp_path}/runs", *overrides],
        jobs=None,
        dry_run=True,
        executor=options,
    )
    return capsys.readouterr().out


def test_slurm_and_ray_sweep_jobs_ask_for_the_plans_gpus(tmp_path, capsys):
    """`sat sweep --dry-run --executor slurm|ray`: each job's GPUs default to the device plan's;
    an explicit count below it, and a 2-node launcher=local run in a one-node job, are refused."""
    from sat_cli.errors import UserError
    from sat_cli.sweep.executor import ExecutorOptions, slurm_settings

    out = _sweep(tmp_path, capsys, name="slurm")
    assert "resources (--executor slurm): 1 node and 8 GPU(s) per job" in out
    out = _sweep(tmp_path, capsys, name="ray", ray_gpus=8.0)
    assert "resources (--executor ray): 1 node and 8 GPU(s) per job" in out
    with pytest.raises(UserError, match=r"--slurm-gpus=4 but run 'grpo-s0' needs 8 GPU\(s\)"):
        _sweep(tmp_path, capsys, name="slurm", slurm_gpus=4)
    with pytest.raises(UserError, match=r"--ray-gpus=0 but run 'grpo-s0' needs 8"):
        _sweep(tmp_path, capsys, "engine.device=cuda", name="ray", ray_gpus=0.0)
    with pytest.raises(UserError, match="has trainer.nnodes=2, and a sweep job is one node"):
        _sweep(tmp_path, capsys, "trainer.nnodes=2", name="slurm")
    # submitit gets the plan's count (SlurmSettings.gpus_per_node → gpus_per_node=)
    assert slurm_settings({}, ExecutorOptions(name="slurm"), 8).gpus_per_node == 8


def test_run_time_check_uses_the_gpus_torch_sees(monkeypatch):
    """`sat train` / `sat eval` (commands/common.check_devices): node 0 of the plan must fit the
    GPUs torch sees here; a one-GPU machine refuses local engine + trainer unless colocated."""
    import torch

    from sat_cli.commands.common import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: True)
    _, obj = load(["engine.device=cuda", "trainer.device=cuda"])
    with pytest.raises(DevicePlanError, match=r"torch sees 1 GPU\(s\) on this machine.*colocate"):
        check_devices(obj)
    check_devices(obj, trainer=False)  # sat eval starts the engine only: GPU 0
    _, obj = load(["engine.device=cuda", "trainer.device=cuda", "engine.colocate=true"])
    check_devices(obj)
    _, obj = load(PAPER)  # the paper layout on a one-GPU machine
    with pytest.raises(DevicePlanError, match="needs 8 GPUs on node 0"):
        check_devices(obj)


def test_plan_command_refuses_a_layout_over_the_node(tmp_path):
    from cli_helpers import run_sat

    res = run_sat("plan", "experiment=paper_qwen3_30b_a3b", "--gpus-per-node", "4", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("sat: error: the device plan needs 8 GPUs on node 0")
    res = run_sat("plan", "--gpus-per-node", "0", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "--gpus-per-node" in res.stderr


def test_colocation_is_suggested_only_where_it_fits():
    from sat_cli.devices import EngineSpec, TrainerSpec, make_plan

    engine = EngineSpec(
        name="sglang", device="cuda", dtype="bfloat16", servers=2, tp=4, label="server {i}"
    )
    trainer = TrainerSpec(
        name="megatron", device="cuda", nproc_per_node=4, torchrun=True, label="node {node}"
    )
    plan = make_plan(engine, trainer)
    assert [(p.name, p.gpus) for p in plan.procs] == [
        ("server 0", (0, 1, 2, 3)),
        ("server 1", (4, 5, 6, 7)),
        ("node 0", (8, 9, 10, 11)),
    ]
    assert plan.needed() == {0: 12}
    with pytest.raises(
        DevicePlanError, match=r"needs 12 GPUs .* has 8 \(test\): use fewer GPUs.*colocate"
    ):
        plan.check(8, "test")  # colocated: max(8, 4) = 8 fits
    with pytest.raises(DevicePlanError, match=r"has 6 \(test\): use fewer GPUs \(") as err:
        plan.check(6, "test")  # colocated it would still need 8
    assert "colocate" not in str(err.value)
