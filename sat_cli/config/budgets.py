"""Token and memory budgets across sections, refused at compose time (issue 53, class 7): each
is one line naming the settings that contradict each other, from `sat config`, `sat plan` and
`sat train` alike (``ConfigError``, exit 2). Torch-free; the model's numbers come from its
``config.json`` as ``config.layout.model_config`` reads it (a local folder, the tiny model, a
known hub id; nothing is checked when they are not known here).

* ``task.max_new_tokens`` against the model's ``max_position_embeddings``: a sample is one prompt
  token at least and up to ``task.max_new_tokens`` new ones, so ``max_new_tokens + 1`` positions
  must exist (``model=qwen3_0_6b task=dapo_math``: 32768 new tokens in 32768 positions);
* a multi-turn run (``env=…``): the model's own turns, ``env.max_turns × task.max_new_tokens``
  tokens after one prompt token, may run past the model's positions unless ``env.max_tokens``
  (the trajectory's budget) stops them first;
* ``engine.max_total_tokens`` (SGLang's KV pool, in tokens) must hold one sample:
  ``task.max_new_tokens + 1``;
* ``engine.colocate=true`` with ``trainer=megatron``: SGLang keeps its share of each shared GPU
  (``engine.mem_fraction_static``, ``devices.COLOCATE_MEM_FRACTION`` when unset) and the trainer
  gets the rest, so the trainer's estimated peak (``sat plan``) must fit in that rest of
  ``trainer.gpu_memory_gb`` (the two shares would add up to more than the GPU).

The trainer's own token budgets (``trainer.max_tokens_per_row`` / ``max_tokens_per_micro_batch``
below one sample) are ``trainers.settings.check_token_budgets``; the held-out file, the data
fields and the templates are ``config/task.py`` and ``config/compat.py``.
"""

from __future__ import annotations

from sat_cli.validate import ConfigError

NONE_ENV = "none"


def model_positions(c) -> tuple[int | None, str]:
    """(``max_position_embeddings`` of the model, where it was read); (None, why) if unknown."""
    from sat_cli.config.layout import model_config

    cfg, where = model_config(c)
    value = (cfg or {}).get("max_position_embeddings")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None, where
    return value, where


def check_budgets(c) -> None:
    """The rules of the module docstring (``c``: a ``SatConfig``)."""
    n = c.task.max_new_tokens
    positions, where = model_positions(c)
    if positions is not None and n + 1 > positions:
        raise ConfigError(
            f"task.max_new_tokens={n} does not fit the model's max_position_embeddings="
            f"{positions} ({where}): a sample is a prompt token and up to {n} new tokens; "
            f"set task.max_new_tokens to at most {positions - 1}"
        )
    env = getattr(c, "env", None)
    if positions is not None and env is not None and env.name != NONE_ENV:
        turns = env.max_turns * n
        if turns + 1 > positions and env.max_tokens > positions:
            raise ConfigError(
                f"env.max_turns={env.max_turns} × task.max_new_tokens={n} = {turns} tokens of "
                f"the model's turns can run past the model's max_position_embeddings={positions} "
                f"({where}), and env.max_tokens={env.max_tokens} does not stop them; set "
                f"env.max_tokens to at most {positions}, or fewer turns or new tokens"
            )
    kv = getattr(c.engine, "max_total_tokens", None)
    if kv is not None and kv < n + 1:
        raise ConfigError(
            f"engine.max_total_tokens={kv} (the KV pool) cannot hold one sample of "
            f"task.max_new_tokens={n} new tokens after a prompt token ({n + 1}); raise "
            "engine.max_total_tokens or lower task.max_new_tokens"
        )
    _check_colocated_memory(c)


def _check_colocated_memory(c) -> None:
    """``engine.colocate=true``: the engine's share of each shared GPU plus the trainer's
    estimated peak per rank (as a share of ``trainer.gpu_memory_gb``) must not exceed 1."""
    # a trainer of torchrun ranks (Megatron's): its per-rank peak is devices/memory.megatron_rank
    if not (c.engine.colocate and c.trainer.gpu_layout().get("torchrun")):
        return
    from sat_cli.config.devices import device_plan
    from sat_cli.config.layout import architecture, sequence_tokens

    trainer = device_plan(c).of("trainer")
    rest = trainer[0].mem_fraction if trainer else None  # what the engine leaves the trainer
    arch, _ = architecture(c)
    if rest is None or arch is None:
        return
    from sat_cli.devices.memory import GB, megatron_rank
    from sat_cli.trainers.megatron.layout import Layout, params_per_gpu

    lay = Layout.of(c.trainer)
    rows, seq = c.clip.micro_batch_size, sequence_tokens(c)
    peak = megatron_rank(arch, lay, params_per_gpu(arch, lay), rows, seq, "rank").peak / GB
    share, gpu = round(1 - rest, 4), c.trainer.gpu_memory_gb
    need = peak / gpu
    if share + need > 1:
        named = "engine.mem_fraction_static" if c.engine.mem_fraction_static else "the default"
        raise ConfigError(
            f"engine.colocate=true: the engine's share {share:g} of each shared GPU ({named}) "
            f"and the Megatron trainer's estimated peak of {peak:.1f} GB of trainer.gpu_memory_gb="
            f"{gpu:g} ({need:.2f}) add up to {share + need:.2f} (see `sat plan`); lower "
            "engine.mem_fraction_static, shrink the trainer's peak, or drop engine.colocate"
        )
