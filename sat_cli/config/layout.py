"""The config side of trainer layouts: the model's architecture (``model.*`` → its ``config.json``
fields → ``sat_cli.models.arch.Arch``), the sequence length of the activation estimate and the
compose-time check of a ``trainer=megatron`` config. Torch-free (``json`` only).

**Architecture.** From the model's ``config.json`` (``model.path``, a local folder), the tiny
default (``sat_cli.models.arch.TINY_MOE_CONFIG`` with ``model.num_layers``/``hidden_size``/
``num_experts``/``top_k``), or, for a hub id whose files are not here, the table
``sat_cli.models.arch.KNOWN_HF_CONFIGS`` (``Qwen/Qwen3-30B-A3B-Base``).

The layout rules and the parameter split are Megatron's (``sat_cli.trainers.megatron.layout``),
the memory estimate per rank ``sat_cli.devices.memory.megatron_rank``'s (what `sat plan` prints);
this module reads the config for them.
"""

from __future__ import annotations

import os
from pathlib import Path

from sat_cli.models.arch import Arch
from sat_cli.trainers.megatron.layout import Layout, check, params_per_gpu
from sat_cli.validate import ConfigError

PROMPT_TOKENS = 1024  # prompt allowance of a sequence in the activation estimate


def model_config(obj) -> tuple[dict | None, str]:
    """(the model's ``config.json`` fields, where they came from); (None, why) when they are
    not known here (a hub id missing from ``sat_cli.models.arch``)."""
    from sat_cli.models.arch import KNOWN_HF_CONFIGS, TINY_MOE_CONFIG

    m = obj.model
    if m.kind == "tiny" and not m.path:
        cfg = {
            **TINY_MOE_CONFIG,
            "num_hidden_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
        }
        return cfg, "the tiny model (model.*)"
    path = Path(str(m.path)).expanduser()
    if path.is_dir() or os.path.lexists(path / "config.json"):
        from sat_cli.models.hf_config import ModelConfigError, read_config_json

        try:  # bounded, its sizes checked (a FIFO, NaN, 10**9 layers: the reason)
            return read_config_json(path), str(path / "config.json")
        except ModelConfigError as exc:
            return None, str(exc)
    if m.path in KNOWN_HF_CONFIGS:
        return KNOWN_HF_CONFIGS[m.path], f"{m.path} (sat_cli/models/arch.py)"
    return None, (
        f"model.path={m.path!r} is neither a local folder with config.json nor a known hub id "
        "(sat_cli/models/arch.py)"
    )


def architecture(obj) -> tuple[Arch | None, str]:
    """(architecture, where it came from); (None, why) when it is not known here."""
    cfg, where = model_config(obj)
    if cfg is None:
        return None, where
    try:
        return Arch.from_hf(cfg), where
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{where} cannot be read ({type(exc).__name__}: {exc})"


def sequence_tokens(obj) -> int:
    return PROMPT_TOKENS + obj.task.max_new_tokens


def check_config(obj) -> None:
    """Compose-time check of a ``trainer=megatron`` config: the layout rules, then the memory
    estimate against ``trainer.gpu_memory_gb``. Models not known here get the rules that need
    no architecture (the worker checks the rest when it loads the model)."""
    lay = Layout.of(obj.trainer)
    arch, _ = architecture(obj)
    check(lay, arch)
    if arch is None:
        return
    from sat_cli.devices.memory import GB, megatron_rank

    rows, seq = obj.clip.micro_batch_size, sequence_tokens(obj)
    peak = megatron_rank(arch, lay, params_per_gpu(arch, lay), rows, seq, "rank").peak / GB
    limit = obj.trainer.gpu_memory_gb
    if peak > limit:
        raise ConfigError(
            f"trainer=megatron: the estimated peak of {peak:.1f} GB per trainer GPU "
            f"is over trainer.gpu_memory_gb={limit:g} (see `sat plan`); use more GPUs "
            "(trainer.nproc_per_node, trainer.nnodes) or larger trainer.ep / trainer.tp, "
            "trainer.optimizer_offload=true, trainer.recompute=true, or a shorter "
            "task.max_new_tokens / clip.micro_batch_size"
        )
