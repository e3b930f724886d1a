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
    }
    try:
        apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"])
    except LoraTargetError as exc:
        raise UserError(str(exc)) from None
    return lora


def publish(model, lora: dict, path: Path, version: int) -> Path:
    """Write ``model``'s adapter as weight version ``version`` at ``path`` (atomically)."""
    from sat_cli.models.lora import adapter_tensors
    from sat_cli.weightsync.adapters import write_adapter

    return write_adapter(
        path,
        adapter_tensors(model),
        version=version,
        rank=lora["rank"],
        alpha=lora["alpha"],
        targets=lora["target_modules"],
    )
