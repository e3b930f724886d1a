"""What a cluster job asks for besides GPUs (``sat_cli.config.needs``): CPUs and host memory from
the run's device plan, printed by ``sat sweep --dry-run --executor slurm`` and written into the
sbatch script by submitit. Expected values are computed by hand from the module's stated rules
(PROCESS_GB = 2 GB per process, × 1.2, rounded up)."""

from __future__ import annotations

import math
import os

import pytest

from sat_cli.config import load

P_30B = 30_532_122_624  # Qwen3-30B-A3B's parameters (its config.json)
PER_GPU_30B = 394_868_736 + 7_247_757_312  # dense + expert per trainer GPU at tp 4 / ep 4 / etp 1
P_06B = 596_049_920  # Qwen3-0.6B (tied embeddings)

# the paper preset: 1 sat train + one SGLang server (tokenizer, detokenizer, 4 schedulers) +
# 4 Megatron ranks = 11 processes and 11 CPUs; host memory: the processes, the engine's bf16
# weights, one bf16 copy on the trainer node and the offloaded fp32 main weights + Adam moments
# (12 B per parameter per GPU, 4 GPUs)
PAPER_CPUS = 1 + (2 + 4) + 4
PAPER_GB = math.ceil(
    (11 * 2.0 + P_30B * 2 / 1e9 + P_30B * 2 / 1e9 + 4 * 12 * PER_GPU_30B / 1e9) * 1.2
)


def _needs(*overrides):
    from sat_cli.config.needs import job_needs

    _, obj = load(list(overrides), "train")
    return job_needs(obj)


def test_needs_of_the_paper_preset_and_a_small_gpu_run():
    from sat_cli.config.layout import architecture, sequence_tokens
    from sat_cli.trainers.megatron.layout import Layout, memory

    _, obj = load(["experiment=paper_qwen3_30b_a3b"], "train")
    arch = architecture(obj)[0]
    assert arch.total() == P_30B  # the inputs of the hand values above
    lay = Layout.of(obj.trainer)
    assert sum(memory(arch, lay, 1, sequence_tokens(obj)).params) == PER_GPU_30B
    n = _needs("experiment=paper_qwen3_30b_a3b")
    assert (n.cpus, n.mem_gb) == (PAPER_CPUS, PAPER_GB) == (11, 614)
    assert dict(n.cpu_parts) == {"sat train": 1, "engine": 6, "Megatron ranks": 4}
    parts = dict(n.mem_parts)
    assert parts["offloaded optimizer"] == pytest.approx(4 * 12 * PER_GPU_30B / 1e9, abs=1e-3)
    # without the offload the optimizer lives on the GPUs: not in host memory
    off = _needs(
        "experiment=paper_qwen3_30b_a3b",
        "trainer.optimizer_offload=false",
        "trainer.gpu_memory_gb=500",
    )
    assert dict(off.mem_parts)["offloaded optimizer"] == 0.0
    # Qwen3-0.6B, local engine and trainer on GPUs: 2 processes, the engine's bf16 weights (its
    # cuda default) and the trainer's fp32 weights (bf16 autocast keeps them fp32)
    n = _needs("model=qwen3_0_6b", "engine.device=cuda", "trainer.device=cuda")
    want = math.ceil((2 * 2.0 + P_06B * 2 / 1e9 + P_06B * 4 / 1e9) * 1.2)
    assert (n.cpus, n.mem_gb) == (2, want) == (2, 10)
    # on the CPU the local trainer holds fp32 weights, gradients and both AdamW moments
    n = _needs("model=qwen3_0_6b", "trainer.num_threads=3", "engine.num_threads=2")
    want = math.ceil((2 * 2.0 + P_06B * 4 / 1e9 + P_06B * 16 / 1e9) * 1.2)
    assert (n.cpus, n.mem_gb) == (3 + 2, want) == (5, 20)


def _dry_run(tmp_path, capsys, **opts) -> str:
    from test_device_plan import _sweep  # the paper preset's one-run sweep, dry run

    return _sweep(tmp_path, capsys, **opts)


def test_slurm_dry_run_prints_cpus_and_memory_and_sbatch_asks_for_them(
    tmp_path, capsys, monkeypatch
):
    """The dry-run prints the CPUs and memory beside the GPUs; the settings (and so submitit's
    sbatch script) carry them; --slurm-cpus / --slurm-mem-gb still win."""
    from sat_cli.cluster.slurm import SlurmExecutor
    from sat_cli.sweep.executor import ExecutorOptions, slurm_settings
    from sat_cli.sweep.plan import validate
    from sat_cli.sweep.spec import load_sweep

    out = _dry_run(tmp_path, capsys, name="slurm")
    assert "1 node and 8 GPU(s) per job" in out
    assert f"CPUs, memory (--executor slurm): {PAPER_CPUS} CPUs and {PAPER_GB} GB host" in out
    assert "366.8 GB offloaded optimizer" in out
    out = _dry_run(tmp_path, capsys, name="slurm", slurm_cpus=64, slurm_mem_gb=1000.0)
    assert "64 CPUs and 1000 GB host memory per job" in out

    spec = tmp_path / "sweep.yaml"
    plan = validate(load_sweep(str(spec), [f"run.dir={tmp_path}/runs"]))
    s = slurm_settings({}, ExecutorOptions(name="slurm"), 8, plan)
    assert (s.gpus_per_node, s.cpus_per_task, s.mem_gb) == (8, PAPER_CPUS, PAPER_GB)
    s2 = slurm_settings({"cpus_per_task": 32}, ExecutorOptions(name="slurm"), 8, plan)
    assert (s2.cpus_per_task, s2.mem_gb) == (32, PAPER_GB)

    # submitit writes the sbatch script only where `srun` and `sbatch` are on PATH: two files
    # that exit 1 stand in for them here (never run: nothing is submitted)
    pytest.importorskip("submitit")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "sbatch"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    ex = SlurmExecutor(s, tmp_path / "submitit")._executor("grpo-s0")
    script = ex._executor._make_submission_file_text("true", "uid")
    assert f"#SBATCH --cpus-per-task={PAPER_CPUS}\n" in script
    assert f"#SBATCH --mem={PAPER_GB}GB\n" in script
    assert "#SBATCH --gpus-per-node=8\n" in script
