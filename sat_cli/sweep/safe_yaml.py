"""YAML with bounded input (sweep files): ``read_yaml(path, hint)``.

``yaml.safe_load`` builds aliases as shared objects, so a "billion laughs" file (nine levels of
nine aliases) loads quickly — and then every walk over it (a message's ``repr``, hashing the
overrides, JSON) expands 10**9 nodes and eats the memory. Here the file size (1 MiB), the
nesting depth (100) and the number of nodes *after* alias expansion (100 000) are checked on
the composed node graph before any Python object is built; recursive aliases, non-UTF-8 text,
Python tags and YAML errors are refused too. Every refusal is a ``UserError`` (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sat_cli.errors import UserError

MAX_FILE_BYTES = 1 << 20  # a sweep file is a short list of overrides
MAX_NODES = 100_000  # YAML nodes after alias expansion (a "billion laughs" file has 10**9)


def read_yaml(p: Path, hint: str) -> Any:
    """``yaml.safe_load`` with bounded input: the file size, the nesting depth and the number of
    nodes after alias expansion are checked on the composed node graph before any Python object
    is built, so an alias bomb is refused in milliseconds instead of eating the memory."""
    import yaml

    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"{p}: {p.stat().st_size} bytes; at most 1 MiB ({hint})")
        text = p.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{p}: not valid YAML: {exc}") from None
    except RecursionError:
        raise UserError(f"{p}: nested too deeply") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read it: {exc.strerror or exc}") from None
    if node is None:
        return None
    sizes: dict[int, int] = {}  # node id -> size with every alias expanded
    active: set[int] = set()  # nodes being sized (an alias back to one of them is a cycle)
    stack: list[tuple[Any, int, bool]] = [(node, 0, False)]
    while stack:
        n, depth, done = stack.pop()
        if depth > 100:
            raise UserError(f"{p}: nested more than 100 levels deep")
        children = (
            [c for kv in n.value for c in kv]
            if isinstance(n, yaml.MappingNode)
            else (n.value if isinstance(n, yaml.SequenceNode) else [])
        )
        if done:
            active.discard(id(n))
            sizes[id(n)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(n)] > MAX_NODES:
                raise UserError(
                    f"{p}: expands to more than {MAX_NODES} YAML nodes (anchors and aliases "
                    f"repeat their content); {hint}"
                )
        elif id(n) not in sizes:
            if any(id(c) in active or c is n for c in children):
                raise UserError(f"{p}: a YAML alias refers to a node that contains it")
            active.add(id(n))
            stack.append((n, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise UserError(f"{p}: not valid YAML: {exc}") from None
