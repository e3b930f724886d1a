"""Pieces the `sat train` and `sat eval` commands share: loading models, the pids file."""

from __future__ import annotations

import os
from pathlib import Path

from sat_cli.errors import UserError


def loading(path: str, build):
    """Build a trainer/engine; a model that fails to load is the user's input: ``UserError``."""
    from sat_cli.engines.base import EngineError

    try:
        return build()
    except EngineError as exc:
        msg = str(exc)
        if "failed during engine startup" not in msg:  # died, timed out: a runtime fault
            raise
        lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        raise UserError(f"cannot load the model at {path}: {lines[-1][:500]}") from None
    except (OSError, ValueError, RuntimeError) as exc:
        if type(exc).__name__ in ("TrainerError", "EngineError"):
            raise
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        raise UserError(f"cannot load the model at {path}: {type(exc).__name__}: {first}") from None


def write_pids(logs: Path, engine) -> None:
    """``logs/pids.json``: this process and the engine's process (fault tests, soak runs)."""
    import json

    from sat_cli.loop.state import atomic_write_text

    pids = {"orchestrator": os.getpid(), "engine": getattr(engine, "pid", None)}
    atomic_write_text(logs / "pids.json", json.dumps(pids))
