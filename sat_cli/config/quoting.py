"""Values written into Hydra overrides so that they compose back unchanged (the sweep's tags of
its children, ``sat replay``'s tags of the run it replays)."""

from __future__ import annotations

import re


def hydra_quote(text: str) -> str:
    """``text`` as a Hydra quoted value that composes back to exactly ``text`` (names with
    spaces, commas, quotes or backslashes; ``${`` is refused where the names are read)."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"
