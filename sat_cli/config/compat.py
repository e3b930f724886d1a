"""Combinations of model, task, trainer, engine and device that `sat train` cannot run.

Each section of the config checks its own fields; the rules here span sections, and used to be
found only when `sat train` reached the part that failed (after the run folder was written, or as
"cannot load the model"): `sat config`, `sat plan` and `sat train --dry-run` accepted them. They
run at compose time (:class:`sat_cli.config.schema.SatConfig`), so every command refuses them
the same way (``ConfigError``, exit 2):

* ``model=tiny_moe`` without ``model.path`` is warm-started on the toy task or on a user's file
  (``task.path``, :mod:`sat_cli.build.task_warmstart`): a shipped data set (``task=gsm8k``
  without ``task.path``) needs ``model.path``;
* ``r3=true`` replays MoE routes: a model whose ``config.json`` (or known architecture) has no
  experts is refused, whatever ``model.num_experts`` says;
* ``engine=sglang`` with in-flight updates that recompute the cache (``lag.inflight_cache=
  recompute``, SGLang's ``retract`` pause) cannot keep R3's routes (``r3=true``);
* ``eval=toy`` evaluates the toy task's held-out problems: a data task (``task.kind`` other than
  ``toy``, or ``task.path``) evaluates its own held-out split (``eval=heldout``, chosen for it
  when no evaluation is named) or a benchmark;
* ``run.portable_numerics`` pins torch's CPU code paths: ``engine=local`` on the CPU only.

A component's own rules across sections are its registry entry's ``check(run)``, run just before
these (``trainer=megatron``'s model kinds, layout, memory estimate and the loss additions it
lacks: ``sat_cli.trainers.megatron.checks``).
"""

from __future__ import annotations

from sat_cli.tasks.registry import eval_source
from sat_cli.validate import ConfigError


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
    evaluation = eval_source(c.eval.benchmark)
    if m.kind == "tiny" and not m.path and c.task.is_data and not c.task.path:
        raise ConfigError(
            f"model={m.name} is warm-started on the toy task or a file of yours (task.path=<file>) "
            f"only; task.kind={c.task.kind} needs model.path=<an HF folder or hub id> (e.g. "
            "model=qwen3_0_6b)"
        )
    if evaluation.generator and c.task.is_data:
        raise ConfigError(
            f"eval=toy evaluates the toy task's held-out problems, not task.kind={c.task.kind}'s: "
            "use eval=heldout (the task's own held-out split, the default when no eval= is "
            "given) or a benchmark (eval=gsm8k, eval=jsonl eval.path=<file>)"
        )
    if evaluation.generator and c.eval.template == "chat":  # as task.template=chat
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
    if e.weight_sync == "distributed" and e.device == "cuda" and not t.on_gpu():
        if type(t).SENDER_IN_PROCESS:
            raise ConfigError(
                "engine.weight_sync=distributed with engine.device=cuda broadcasts over NCCL, "
                f"which needs the trainer's weights on a GPU: trainer.device={t.device}; set "
                "trainer.device=cuda or engine.weight_sync=disk"
            )
