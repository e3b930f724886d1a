"""Which architectures the installed SGLang can serve, read from its source without importing it.

SGLang registers a model class per module of ``sglang/srt/models`` through a module-level
``EntryClass = Name`` or ``EntryClass = [Name, Other]`` (``sglang/srt/models/registry.py``,
``import_model_classes``). :func:`supported_architectures` collects those names from the files of
the SGLang that ``python`` would import (found with ``importlib.util.find_spec``, which does not
import the package: a fraction of a second instead of SGLang's start-up), so `sat train` /
`sat eval` can refuse, before anything starts, a model whose ``config.json`` ``architectures``
it cannot serve, naming them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_ENTRY = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|[A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def architectures_in(models_dir: Path) -> set[str]:
    """The ``EntryClass`` names of the model modules in ``models_dir``."""
    names: set[str] = set()
    for module in sorted(models_dir.glob("*.py")):
        try:
            text = module.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for entry in _ENTRY.findall(text):
            names.update(_NAME.findall(entry))
    return names


def models_dir(python: str, timeout_s: float = 30.0) -> Path | None:
    """``sglang/srt/models`` of the SGLang that ``python`` imports, or None when not found."""
    code = (
        "import importlib.util as u; s = u.find_spec('sglang'); "
        "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    root = out.stdout.strip()
    path = Path(root) / "srt" / "models" if root else None
    return path if path is not None and path.is_dir() else None


def unsupported(architectures: list[str], python: str) -> str | None:
    """Why SGLang at ``python`` cannot serve a model of ``architectures``, or None (also when
    its model folder cannot be found: the server then reports it)."""
    folder = models_dir(python)
    if folder is None or not architectures:
        return None
    known = architectures_in(folder)
    if not known or any(a in known for a in architectures):
        return None
    return (
        f"SGLang ({folder.parents[1]}) has no model class for {', '.join(architectures)} "
        f"(config.json 'architectures'; it knows {len(known)} others)"
    )
