"""The model's architecture from the ``model`` section (``m``: its settings; torch-free, ``json``
only): its ``config.json`` fields (``model.path``, a local folder), the tiny default
(``sat_cli.models.arch.TINY_MOE_CONFIG`` with ``model.num_layers``/``hidden_size``/
``num_experts``/``top_k``), or, for a hub id whose files are not here, the table
``sat_cli.models.arch.KNOWN_HF_CONFIGS``. ``config/layout.py`` reads it for the config, the
trainers' compose-time checks for their rules.
"""

from __future__ import annotations

import os
from pathlib import Path

from sat_cli.models.arch import Arch


def model_config(m) -> tuple[dict | None, str]:
    """(the model's ``config.json`` fields, where they came from); (None, why) when they are
    not known here (a hub id missing from ``sat_cli.models.arch``)."""
    from sat_cli.models.arch import KNOWN_HF_CONFIGS, TINY_MOE_CONFIG

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


def architecture(m) -> tuple[Arch | None, str]:
    """(architecture, where it came from); (None, why) when it is not known here."""
    cfg, where = model_config(m)
    if cfg is None:
        return None, where
    try:
        return Arch.from_hf(cfg), where
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{where} cannot be read ({type(exc).__name__}: {exc})"
