"""Combinations of model, task, trainer, engine and device that `sat train` cannot run.

Each section of the config checks its own fields; the rules here span sections, and used to be
found only when `sat train` reached the part that failed (after the run folder was written, or as
"cannot load the model"): `sat config`, `sat plan` and `sat train --dry-run` accepted them. They
run at compose time (:class:`sat_cli.config.schema.SatConfig`), so every command refuses them
the same way (``ConfigError``, exit 2):

* ``model=tiny_moe`` without ``model.path`` is warm-started on the toy task or on a user's file
  (``task.path``, :mod:`sat_cli.build.task_warmstart`): a shipped data set (``task=gsm8k``
  without ``task.path``) needs ``model.path``;
* ``trainer=megatron`` builds all-MoE Qwen3 models (``qwen3_moe``, every layer MoE), dense Qwen3
  (``qwen3``) and Llama (``llama``) models, with no attention or MLP bias, no sliding window, no
  RoPE scaling and SiLU (``sat_cli.trainers.megatron.model.check_supported``, kept in step with
  it here because that module needs torch): a ``config.json`` of another kind is refused; a hub
  id whose config is not known here is left to the worker;
* ``r3=true`` replays MoE routes: a model whose ``config.json`` (or known architecture) has no
  experts is refused, whatever ``model.num_experts`` says;
* ``engine=sglang`` with in-flight updates that recompute the cache (``lag.inflight_cache=
  recompute``, SGLang's ``retract`` pause) cannot keep R3's routes (``r3=true``);
* ``algo.replay_sampling_mask`` and ``algo.score_centering_topk`` are wired into
  ``trainer=local`` only (``trainer=megatron`` would need the kept sets and top-k through its
  pipeline stages and data-parallel gathers);
* ``algo.ledger`` (weight snapshots of recent versions) is wired into ``trainer=local`` only;
* ``eval=toy`` evaluates the toy task's held-out problems: a data task (``task.kind`` other than
  ``toy``, or ``task.path``) evaluates its own held-out split (``eval=heldout``, chosen for it
  when no evaluation is named) or a benchmark;
* ``run.portable_numerics`` pins torch's CPU code paths: ``engine=local`` on the CPU only.
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


def r3_problem(c) -> str | None:
    """Why ``r3=true`` cannot run on the model (no experts in its config), or None."""
    from sat_cli.config.layout import architecture

    arch, where = architecture(c)
    if arch is not None and not arch.experts:
        return f"r3=true replays MoE routes, but model={c.model.name} ({where}) is dense: drop r3"
    return None


def check_compat(c) -> None:
    """Refuse the combinations of the module docstring that span no one component (``c``: a
    ``SatConfig``); each component's own rules are its registry entry's ``check``."""
    m = c.model
    if m.kind == "tiny" and not m.path and c.task.kind != "toy" and not c.task.path:
        raise ConfigError(
            f"model={m.name} is warm-started on the toy task or a file of yours (task.path=<file>) "
            f"only; task.kind={c.task.kind} needs model.path=<an HF folder or hub id> (e.g. "
            "model=qwen3_0_6b)"
        )
    if c.eval.benchmark == "toy" and c.task.kind != "toy":
        raise ConfigError(
            f"eval=toy evaluates the toy task's held-out problems, not task.kind={c.task.kind}'s: "
            "use eval=heldout (the task's own held-out split, the default when no eval= is "
            "given) or a benchmark (eval=gsm8k, eval=jsonl eval.path=<file>)"
        )
    if c.eval.benchmark == "toy" and c.eval.template == "chat":  # as task.template=chat
        raise ConfigError(
            "eval.template=chat with eval=toy: the toy task's evaluation is for the char-level "
            "model, which has no chat template (task.template=chat is refused with the toy task "
            "too); use eval.template=plain, or a data task (task.path=…) with its own evaluation"
        )
    if c.run.portable_numerics and (
        not type(c.engine).PINS_NUMERICS or c.engine.device == "cuda" or c.trainer.on_gpu()
    ):
        raise ConfigError(
            "run.portable_numerics=true pins torch's CPU code paths; it needs engine=local "
            "on the CPU (SGLang's kernels and CUDA devices are not pinned)"
        )
    if c.r3 and (why := r3_problem(c)):
        raise ConfigError(why)
    e, t = c.engine, c.trainer
    if is_megatron(t):  # the model kind it builds, its limits
        check_megatron(c)
    if e.weight_sync == "distributed" and e.device == "cuda" and not t.on_gpu():
        if type(t).SENDER_IN_PROCESS:
            raise ConfigError(
                "engine.weight_sync=distributed with engine.device=cuda broadcasts over NCCL, "
                f"which needs the trainer's weights on a GPU: trainer.device={t.device}; set "
                "trainer.device=cuda or engine.weight_sync=disk"
            )


def is_megatron(trainer) -> bool:
    from sat_cli.trainers.megatron.settings import MegatronTrainerSettings

    return isinstance(trainer, MegatronTrainerSettings)


def check_layout(c) -> None:
    """``trainer=megatron``: the layout rules and the memory estimate (``sat plan``)."""
    if is_megatron(c.trainer):
        from sat_cli.config.layout import check_config

        check_config(c)


def check_megatron(c) -> None:
    """``trainer=megatron``: the model kind it builds and the loss additions it lacks."""
    m = c.model
    from sat_cli.config.layout import model_config

    cfg, where = model_config(c)
    why = megatron_model_problem(cfg) if cfg is not None else None
    if why:
        raise ConfigError(
            f"trainer=megatron cannot train model={m.name} ({where}): {why}; use "
            "trainer=local, or a Qwen3-MoE, Qwen3 or Llama model"
        )
    on = [k for k in ("replay_sampling_mask", "score_centering_topk") if getattr(c.algo, k)]
    if on:
        raise ConfigError(
            f"{' and '.join(f'algo.{k}' for k in on)} need trainer=local: trainer=megatron does "
            "not replay the engine's kept sets or compute the sampler's top-k log-probs"
        )
    if c.algo.ledger:
        raise ConfigError(
            "algo.ledger=true needs trainer=local: the ledger keeps whole-model weight snapshots "
            "of recent versions, which trainer=megatron (weights sharded over ranks) does not"
        )
