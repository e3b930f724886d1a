"""YAML with bounded input (sweep files): ``read_yaml(path, hint)``.

``yaml.safe_load`` builds aliases as shared objects, so a "billion laughs" file (nine levels of
nine aliases) loads quickly — and then every walk over it (a message's ``repr``, hashing the
overrides, JSON) expands 10**9 nodes and eats the memory. Here the file size (1 MiB), the
nesting depth (100) and the number of nodes *after* alias expansion (100 000) are checked on
the composed node graph before any Python object is built; recursive aliases, non-UTF-8 text,
Python tags, YAML errors and a key given twice in one mapping are refused too; the
file must be a regular file (``sat_cli.util.readers``). Every refusal is a ``UserError`` (exit 2).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError

MAX_FILE_BYTES = 1 << 20  # a sweep file is a short list of overrides
MAX_NODES = 100_000  # YAML nodes after alias expansion (a "billion laughs" file has 10**9)
MAX_DEPTH = 100
_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\'\'|[^\'])*\'')


def read_yaml(p: Path, hint: str) -> Any:
    """``yaml.safe_load`` with bounded input: the file size, the nesting depth and the number of
    nodes after alias expansion are checked on the composed node graph before any Python object
    is built, so an alias bomb is refused in milliseconds instead of eating the memory."""
    import yaml

    from sat_cli.util.readers import read_text

    text = read_text(p, what=str(p), error=UserError, max_bytes=MAX_FILE_BYTES)
    if _flow_depth(text) > MAX_DEPTH:  # before the parser recurses through it (seconds)
        raise UserError(f"{p}: nested more than {MAX_DEPTH} levels deep")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, ValueError) as exc:
        raise UserError(f"{p}: not valid YAML: {_line(exc)}") from None
    except RecursionError:
        raise UserError(f"{p}: nested too deeply") from None
    if node is None:
        return None
    sizes: dict[int, int] = {}  # node id -> size with every alias expanded
    active: set[int] = set()  # nodes being sized (an alias back to one of them is a cycle)
    stack: list[tuple[Any, int, bool]] = [(node, 0, False)]
    while stack:
        n, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise UserError(f"{p}: nested more than {MAX_DEPTH} levels deep")
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
            if isinstance(n, yaml.MappingNode):
                _no_duplicate_keys(n, p)
            if any(id(c) in active or c is n for c in children):
                raise UserError(f"{p}: a YAML alias refers to a node that contains it")
            active.add(id(n))
            stack.append((n, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # ValueError: a 5000-digit int
        raise UserError(f"{p}: not valid YAML: {_line(exc)}") from None


def _flow_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside quoted strings (a bound the parser would
    otherwise find by recursing 100 000 levels)."""
    depth = deepest = 0
    for ch in re.findall(r"[\[\]{}]", _QUOTED.sub("", text)):
        depth = depth + 1 if ch in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _no_duplicate_keys(node, p: Path) -> None:
    """A mapping that names a key twice (YAML keeps the last silently) is refused."""
    seen: set[str] = set()
    for key, _ in node.value:
        if (
            key.tag.endswith(":merge")
            or not hasattr(key, "value")
            or not isinstance(key.value, str)
        ):
            continue
        if key.value in seen:
            raise UserError(
                f"{p}:{key.start_mark.line + 1}: the key {key.value!r} appears twice in one "
                "mapping (YAML would keep the last one silently)"
            )
        seen.add(key.value)
