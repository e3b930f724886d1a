"""``trainer=megatron``'s rules across config sections, its registry entry's ``check(run)``
(``run``: the whole typed config, at compose time; ``ConfigError``, exit 2), torch-free:

* the layout rules (``layout.check``) and, for a model whose architecture is known here, the
  estimated peak per trainer GPU against ``trainer.gpu_memory_gb`` (what `sat plan` prints,
  ``devices/memory.megatron_rank``);
* the model kinds it builds: all-MoE Qwen3 (``qwen3_moe``, every layer MoE), dense Qwen3
  (``qwen3``) and Llama (``llama``), with no attention or MLP bias, no sliding window, no RoPE
  scaling and SiLU (``model.check_supported``, kept in step with it here because that module
  needs torch): a ``config.json`` of another kind is refused; a hub id whose config is not
  known here is left to the worker;
* the loss additions it lacks: ``algo.replay_sampling_mask`` and ``algo.score_centering_topk``
  (the kept sets and top-k through its pipeline stages and data-parallel gathers) and
  ``algo.ledger`` (whole-model weight snapshots; its weights are sharded over ranks).
"""

from __future__ import annotations

from typing import Any

from sat_cli.validate import ConfigError

MEGATRON_FAMILIES = ("qwen3_moe", "qwen3", "llama")  # model.FAMILIES, torch-free


def megatron_model_problem(cfg: dict[str, Any]) -> str | None:
    """Why the Megatron worker cannot build the model a ``config.json`` describes, or None."""
    kind = cfg.get("model_type", "qwen3_moe")
    if kind not in MEGATRON_FAMILIES:
        return f"it builds {', '.join(MEGATRON_FAMILIES)} models only, this one is {kind!r}"
    if kind == "qwen3_moe":
        if int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) <= 1:
            return "a qwen3_moe config needs num_experts > 1"
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            return "it builds all-MoE qwen3_moe models only, this one has dense layers"
    for key in ("attention_bias", "mlp_bias", "use_sliding_window", "rope_scaling"):
        if cfg.get(key):
            return f"{key} is not supported"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act={cfg['hidden_act']!r} is not supported (SiLU only)"
    return None


def check(run) -> None:
    """The module docstring's rules, in that order."""
    check_layout(run)
    check_model_and_loss(run)


def check_layout(run) -> None:
    """The layout rules, then the memory estimate against ``trainer.gpu_memory_gb``. Models not
    known here get the rules that need no architecture (the worker checks the rest when it
    loads the model)."""
    from sat_cli.models.fields import architecture
    from sat_cli.trainers.megatron.layout import Layout, params_per_gpu
    from sat_cli.trainers.megatron.layout import check as check_rules

    lay = Layout.of(run.trainer)
    arch, _ = architecture(run.model)
    check_rules(lay, arch)
    if arch is None:
        return
    from sat_cli.devices.memory import GB, PROMPT_TOKENS, megatron_rank

    rows, seq = run.clip.micro_batch_size, PROMPT_TOKENS + run.task.max_new_tokens
    peak = megatron_rank(arch, lay, params_per_gpu(arch, lay), rows, seq, "rank").peak / GB
    limit = run.trainer.gpu_memory_gb
    if peak > limit:
        raise ConfigError(
            f"trainer=megatron: the estimated peak of {peak:.1f} GB per trainer GPU "
            f"is over trainer.gpu_memory_gb={limit:g} (see `sat plan`); use more GPUs "
            "(trainer.nproc_per_node, trainer.nnodes) or larger trainer.ep / trainer.tp, "
            "trainer.optimizer_offload=true, trainer.recompute=true, or a shorter "
            "task.max_new_tokens / clip.micro_batch_size"
        )


def check_model_and_loss(run) -> None:
    """The model kind it builds and the loss additions it lacks."""
    from sat_cli.models.fields import model_config

    m = run.model
    cfg, where = model_config(m)
    why = megatron_model_problem(cfg) if cfg is not None else None
    if why:
        raise ConfigError(
            f"trainer=megatron cannot train model={m.name} ({where}): {why}; use "
            "trainer=local, or a Qwen3-MoE, Qwen3 or Llama model"
        )
    on = [k for k in ("replay_sampling_mask", "score_centering_topk") if getattr(run.algo, k)]
    if on:
        raise ConfigError(
            f"{' and '.join(f'algo.{k}' for k in on)} need trainer=local: trainer=megatron does "
            "not replay the engine's kept sets or compute the sampler's top-k log-probs"
        )
    if run.algo.ledger:
        raise ConfigError(
            "algo.ledger=true needs trainer=local: the ledger keeps whole-model weight snapshots "
            "of recent versions, which trainer=megatron (weights sharded over ranks) does not"
        )
