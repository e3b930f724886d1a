"""What one run's processes need of the node a cluster job gives it, besides GPUs: CPUs and host
memory, read off the composed config and its device plan (``sat_cli.devices``). ``sat sweep
--executor slurm`` asks SLURM for them (``--slurm-cpus`` / ``--slurm-mem-gb`` override), and the
dry-run prints them beside the GPUs. Torch-free.

**CPUs** (each process on the job's node, node 0 of the plan):

- ``sat train`` itself: ``trainer.num_threads`` when the local trainer runs in it, else 1;
- the local engine process: ``engine.num_threads``;
- each SGLang server started here: ``SGLANG_BASE_CPUS`` (its tokenizer and detokenizer
  processes) + one scheduler process per GPU rank (``engine.tp × engine.dp``);
- each Megatron node here: one CPU per rank (``trainer.nproc_per_node``);
- ``reward=python``: one CPU per worker process (``reward.workers``).

**Host memory** (GB = 1e9 bytes), the sum of these parts, times ``MARGIN``, rounded up:

- ``processes``: ``PROCESS_GB`` per process above (the interpreter, torch, a CUDA context);
- ``engine weights``: the model in ``engine.dtype`` once per engine process (on the CPU it lives
  there; on a GPU it passes through host memory while it loads);
- ``trainer state``: a trainer on the CPU holds everything in host memory (the local trainer:
  fp32 weights, gradients and AdamW's two moments, 16 B/parameter; Megatron ranks on gloo:
  each rank's estimated total, ``sat_cli.trainers.megatron.layout.memory``); on a GPU, one copy
  of the weights in ``trainer.dtype`` per node passes through host memory while it loads;
- ``offloaded optimizer``: ``trainer.optimizer_offload=true``: the fp32 main weights and Adam
  moments of every rank on the node (the memory estimate's host part, per GPU × ranks).

A model whose architecture is not known here (``sat plan`` says why) counts no weights: only
the processes part, and the text says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROCESS_GB = 2.0  # per process: Python, torch, a CUDA context, tokenizer
MARGIN = 1.2  # on top of the parts: allocator slack, page cache of the weights read
SGLANG_BASE_CPUS = 2  # an SGLang server's tokenizer manager and detokenizer processes
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOCAL_TRAINER_BYTES = 16  # fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq


@dataclass(frozen=True)
class JobNeeds:
    """CPUs and host memory (GB) one run needs on its job's node, and how they add up."""

    cpus: int
    mem_gb: int
    cpu_parts: tuple[tuple[str, int], ...]
    mem_parts: tuple[tuple[str, float], ...]
    weights_known: bool = True

    def text(self) -> str:
        cpus = " + ".join(f"{n} {what}" for what, n in self.cpu_parts)
        mem = " + ".join(f"{gb:.1f} GB {what}" for what, gb in self.mem_parts if gb >= 0.05)
        unknown = "" if self.weights_known else "; model size unknown here: weights not counted"
        return (
            f"{self.cpus} CPUs ({cpus}), {self.mem_gb} GB host memory "
            f"(({mem}) × {MARGIN:g}{unknown})"
        )


def _params(obj) -> int | None:
    from sat_cli.config.layout import architecture

    arch, _ = architecture(obj)
    return arch.total() if arch is not None else None


def _megatron_gb(obj) -> tuple[float, float] | None:
    """(host GB per rank of the optimizer offload, the estimated total GB per rank)."""
    from sat_cli.config.layout import architecture, sequence_tokens
    from sat_cli.trainers.megatron.layout import Layout, memory

    arch, _ = architecture(obj)
    if arch is None:
        return None
    mem = memory(arch, Layout.of(obj.trainer), obj.clip.micro_batch_size, sequence_tokens(obj))
    return mem.host_gb, mem.total_gb


def job_needs(obj, plan=None) -> JobNeeds:
    """What ``obj``'s run needs on its job's node (module docstring); ``plan``: its device
    plan (default: ``sat_cli.config.devices.device_plan(obj)``)."""
    if plan is None:
        from sat_cli.config.devices import device_plan

        plan = device_plan(obj)
    e, t = obj.engine, obj.trainer
    params = _params(obj)
    weights = params or 0
    here = [p for p in plan.procs if p.node == 0]
    cpus: dict[str, int] = {}
    mem = {"processes": 0.0, "engine weights": 0.0, "trainer state": 0.0}
    mem["offloaded optimizer"] = 0.0
    processes = 1  # sat train itself
    torchrun = bool(t.gpu_layout().get("torchrun"))  # else the trainer runs in sat train
    cpus["sat train"] = 1 if torchrun else int(getattr(t, "num_threads", 1))
    for p in here:
        if p.role == "engine":
            if p.own_visible:  # a server of its own processes: SGLang's
                layout = e.gpu_layout()
                n = SGLANG_BASE_CPUS + layout.get("tp", 1) * layout.get("dp", 1)
                processes += n  # one CPU per process
            else:
                n = int(getattr(e, "num_threads", 1))
                processes += 1
            cpus["engine"] = cpus.get("engine", 0) + n
            mem["engine weights"] += weights * DTYPE_BYTES.get(e.dtype, 4) / 1e9
        elif torchrun:
            ranks = t.nproc_per_node or 1
            processes += ranks
            cpus["Megatron ranks"] = cpus.get("Megatron ranks", 0) + ranks
            gb = _megatron_gb(obj) if params else None
            if gb is None:
                continue
            host, total = gb
            if not p.gpus:  # gloo ranks: the whole estimate is host memory
                mem["trainer state"] += total * ranks
            else:
                mem["trainer state"] += weights * DTYPE_BYTES.get(t.dtype, 4) / 1e9
                mem["offloaded optimizer"] += host * ranks
        else:  # the local trainer, in sat train's process
            bytes_ = LOCAL_TRAINER_BYTES if not p.gpus else 4  # its weights stay fp32
            mem["trainer state"] += weights * bytes_ / 1e9
    from sat_cli.rewards.registry import REWARDS

    if workers := REWARDS.get(obj.reward.name).processes(obj.reward):
        processes += workers
        cpus["reward workers"] = workers
    mem["processes"] = PROCESS_GB * processes
    total_gb = sum(mem.values()) * MARGIN
    return JobNeeds(
        cpus=sum(cpus.values()),
        mem_gb=int(math.ceil(round(total_gb, 6))),
        cpu_parts=tuple((k, v) for k, v in cpus.items()),
        mem_parts=tuple((k, round(v, 3)) for k, v in mem.items()),
        weights_known=params is not None,
    )
