"""What a tool call may ask for, checked before anything of the call is made
(``sandbox.run_tool``): arguments ``exec`` can take, and the host paths the strict sandbox's
root shows (``isolate.py``)."""

from __future__ import annotations

import os
import shutil

from sat_cli.envs import isolate


def visible_paths(args: list[str], env: dict[str, str], visible: tuple[str, ...]) -> list[str]:
    """The host paths the strict sandbox's root shows: the system folders and this Python's
    prefixes (``isolate.default_visible``), the tool's program (found on the tool's ``PATH``)
    and ``visible``, the caller's own (checked by ``isolate.check_visible``; ValueError)."""
    if isinstance(visible, str) or not isinstance(visible, tuple | list):
        raise ValueError(f"visible must be a list of paths, not {type(visible).__name__}")
    if len(visible) > isolate.MAX_VISIBLE:
        raise ValueError(f"at most {isolate.MAX_VISIBLE} visible paths, got {len(visible)}")
    extra = [isolate.check_visible(p) for p in visible]
    program = shutil.which(args[0], path=env.get("PATH", "")) if "/" not in args[0] else args[0]
    if program and os.path.isabs(program):
        extra.append(os.path.normpath(program))
    return isolate.default_visible() + extra


def unpassable(args: list[str]) -> str | None:
    """Why ``args`` cannot be an argument list of ``exec`` (a NUL character, a lone surrogate
    that the file-system encoding cannot write: model text can hold both), or None."""
    for i, arg in enumerate(args):
        if "\0" in arg:
            return f"tool argument {i} holds a NUL character"
        try:
            os.fsencode(arg)
        except UnicodeEncodeError as e:
            return f"tool argument {i} cannot be encoded ({e.reason} at {e.start})"
    return None
