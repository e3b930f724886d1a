"""The CLI's input rules for the scripts outside it (``scripts/``, ``bench/``; issue 53, class
10): an output path a script is given is checked before the script does any work (every
existing part a folder, each name within ``NAME_MAX``, the nearest existing folder writable:
:func:`sat_cli.util.fsio.check_output_dir`; an output file is not a folder), relative paths are
the caller's (the shell wrappers that change folder make them absolute first), and a refusal is
one ``<script>: error: …`` line with exit 2, never a traceback."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn


def fail(prog: str, message: str) -> NoReturn:
    """``<prog>: error: <message>`` on standard error, exit 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def output_dir(prog: str, text: str, what: str = "the output folder") -> Path:
    """``text`` as an absolute folder that exists (created) and can be written into."""
    from sat_cli.errors import UserError
    from sat_cli.util.fsio import check_output_dir

    path = Path(os.path.abspath(text))
    try:
        check_output_dir(path, f"{what}:")
        path.mkdir(parents=True, exist_ok=True)
    except UserError as exc:
        fail(prog, str(exc))
    except OSError as exc:
        fail(prog, f"{what}: {text}: {exc.strerror or exc}")
    return path


def output_file(prog: str, text: str, what: str = "the output file") -> Path:
    """``text`` as an absolute file path whose folder can be written into (created) and which
    is not a folder or another non-regular file."""
    path = Path(os.path.abspath(text))
    if os.path.lexists(path) and not (path.is_file() and not path.is_symlink()):
        fail(prog, f"{what}: {text} exists and is not a regular file")
    output_dir(prog, str(path.parent), what)
    return path
