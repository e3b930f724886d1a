"""Pieces the `sat train` and `sat eval` commands share: loading models, the pids file."""

from __future__ import annotations

import os
from pathlib import Path

from sat_cli.errors import TrainerError, UserError


def loading(path: str, build):
    """Build a trainer/engine. A model the engine could not load (``EngineStartError``) or a
    library error while building in this process is the user's input: ``UserError`` "cannot load
    the model". A trainer or engine that failed otherwise (``TrainerError``, e.g. a Megatron
    worker that died at start-up, or ``EngineError``) is a runtime fault and passes through."""
    from sat_cli.engines.base import EngineError, EngineStartError

    try:
        return build()
    except EngineStartError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise UserError(f"cannot load the model at {path}: {lines[-1][:500]}") from None
    except (TrainerError, EngineError):
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        raise UserError(f"cannot load the model at {path}: {type(exc).__name__}: {first}") from None


def write_pids(logs: Path, engine) -> None:
    """``logs/pids.json``: this process and the engine's process (fault tests, soak runs)."""
    import json

    from sat_cli.loop.state import atomic_write_text

    pids = {"orchestrator": os.getpid(), "engine": getattr(engine, "pid", None)}
    atomic_write_text(logs / "pids.json", json.dumps(pids))
