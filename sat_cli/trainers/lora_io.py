"""The local trainer's LoRA (``trainer.lora``): adapters on its model, published alone.

:func:`attach` wraps the model's target layers (``sat_cli.models.lora``) after torch's RNG
was seeded, so the adapters start the same for a seed; only they train. :func:`publish`
writes one weight version as an adapter folder (``sat_cli.weightsync.adapters``): the base
weights never leave the trainer after the engine started on them.
"""

from __future__ import annotations

from pathlib import Path

from sat_cli.errors import UserError


def attach(model, lora: dict | None) -> dict | None:
    """Wrap ``model``'s target layers when ``lora`` (``{rank, alpha, dropout,
    target_modules}``) has a rank; the settings, or None when LoRA is off."""
    if not lora or not int(lora.get("rank") or 0):
        return None
    from sat_cli.models.lora import LoraTargetError, apply_lora

    lora = {
        "rank": int(lora["rank"]),
        "alpha": float(lora.get("alpha", 16.0)),
        "dropout": float(lora.get("dropout", 0.0)),
        "target_modules": list(lora.get("target_modules") or ()),
        "sync": str(lora.get("sync") or "adapter"),
    }
    try:
        apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"])
    except LoraTargetError as exc:
        raise UserError(str(exc)) from None
    return lora


def publish(model, lora: dict, path: Path, version: int) -> Path:
    """Write ``model``'s adapter as weight version ``version`` at ``path`` (atomically)."""
    from sat_cli.models.lora import adapter_tensors
    from sat_cli.weightsync.adapter_probe import trainer_probe
    from sat_cli.weightsync.adapters import write_adapter

    return write_adapter(
        path,
        adapter_tensors(model),
        version=version,
        rank=lora["rank"],
        alpha=lora["alpha"],
        targets=lora["target_modules"],
        probe=trainer_probe(model),
    )


def publish_merged(model, tokenizer, path: Path) -> Path:
    """``trainer.lora.sync=merged``: write the merged model (``W + (alpha / r) B A`` in place of
    every adapted layer) as a full HF checkpoint at ``path``, for engines without adapters."""
    from sat_cli.models.lora import merged_linears
    from sat_cli.models.tiny_moe import save_hf

    with merged_linears(model):
        return save_hf(model, tokenizer, path)


def param_names(model) -> list[str]:
    """The adapter's tensor names in the order of the trainer's trainable parameters (the
    optimizer's indices): a checkpoint's ``trainer_state.json`` records it."""
    from sat_cli.models.lora import LORA_A, LORA_B, lora_layers

    return [f"{p}.{k}" for p in lora_layers(model) for k in (LORA_A, LORA_B)]


def load(model, path: Path, version: int) -> None:
    """Load a checkpoint's adapter (checked as on arrival: ``weightsync.adapters``)."""
    from sat_cli.models.lora import load_adapter_tensors
    from sat_cli.weightsync.adapters import read_adapter

    _, tensors = read_adapter(path, version)
    load_adapter_tensors(model, tensors)
