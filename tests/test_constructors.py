"""Narrow constructors (issue 40): a component is built from its settings class and one runtime
object (what only the run knows), so no ``__init__`` in ``sat_cli`` names more than six
parameters besides ``self``, counted on the source's syntax tree (positional and keyword-only:
the issue's measure, 21 for ``SGLangEngine`` before). A ``**kwargs`` catch-all is allowed only
where it forwards the fields of one dataclass that the receiver refuses by name otherwise
(listed below with the reason); everything else names its parameters."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "sat_cli"
MAX_PARAMS = 6
STEP_OPTIONS = (
    "the step options: the fields of trainers.step.StepSettings, which "
    "PolicyTrainer._init_step refuses by name otherwise (TypeError)"
)
CATCH_ALL = {
    "LocalTrainer": STEP_OPTIONS,
    "MegatronActor": STEP_OPTIONS,
    # a proxy: the keywords of LocalChannel, passed unchanged to the Ray actor that opens it
    "RemoteChannel": "LocalChannel's keywords, forwarded to the node's actor",
}


def constructors(root: Path) -> list[tuple[str, str, int, bool]]:
    """``(file, class, named parameters besides self, takes *args or **kwargs)`` of every
    ``__init__`` below ``root`` (nested classes included)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for f in node.body:
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name == "__init__":
                    a = f.args
                    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1  # self
                    rest = a.vararg is not None or a.kwarg is not None
                    out.append((path.relative_to(root).as_posix(), node.name, n, rest))
    return out


def test_no_constructor_takes_more_than_six_parameters():
    wide = [(f, c, n) for f, c, n, _ in constructors(PKG) if n > MAX_PARAMS]
    assert wide == [], f"constructors wider than {MAX_PARAMS} (take a settings/runtime object)"


def test_keyword_catch_alls_only_where_listed():
    found = {c for _, c, _, kw in constructors(PKG) if kw}
    assert found == set(CATCH_ALL), "a */** catch-all constructor not listed (or one gone)"


def test_the_walk_finds_a_planted_wide_constructor_and_catch_all(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "wide.py").write_text(
        "class Narrow:\n"
        "    def __init__(self, settings, runtime):\n"
        "        pass\n"
        "\n"
        "def make():\n"
        "    class Wide:\n"  # nested in a function: found as well
        "        def __init__(self, a, b, /, c, d, *e, f, g=1, h=2, **i):\n"
        "            pass\n"
        "    return Wide\n"
    )
    got = constructors(tmp_path)
    assert got == [("pkg/wide.py", "Narrow", 2, False), ("pkg/wide.py", "Wide", 7, True)]
    assert [c for _, c, n, _ in got if n > MAX_PARAMS] == ["Wide"]
