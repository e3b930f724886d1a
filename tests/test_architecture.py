"""The package's shape (docs/ARCHITECTURE.md), checked statically so that it stays true: only the
edge modules read the config library, no import cycle between modules (lazy imports inside
functions included), no module over 400 lines."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import sat_cli

PKG = Path(sat_cli.__file__).parent
EDGE = ("cli/", "build/", "commands/", "config/", "sweep/")  # may import omegaconf / hydra
MAX_LINES = 400


def _modules(root: Path = PKG) -> dict[str, Path]:
    """Every module of the package at ``root`` by its dotted name (``sat_cli.…``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = ["sat_cli", *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The sat_cli modules ``name`` imports anywhere in its body (``from x import y`` counts
    ``x.y`` when that is a module, else ``x``)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def _third_party(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_edge_reads_the_config_library():
    offenders = []
    for path in _modules().values():
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(EDGE):
            continue
        if _third_party(path) & {"omegaconf", "hydra"}:
            offenders.append(rel)
    assert offenders == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``graph`` meets (each as ``[a, …, a]``); [] if none."""
    state: dict[str, int] = {}
    cycles = []

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    return cycles


def _module_graph(root: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(root)
    known = set(mods)
    graph = {n: _imports(n, p, known) for n, p in mods.items()}
    # a package's __init__ that re-exports its submodules is not a cycle with them
    return {n: {m for m in ms if not n.startswith(m + ".")} for n, ms in graph.items()}


def test_no_import_cycle_between_modules():
    assert _cycles(_module_graph()) == []


def test_the_graph_sees_real_edges():
    """The cycle check is not vacuous: it sees imports, relative and lazy ones included."""
    mods = _modules()
    g = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    assert "sat_cli.trainers.step" in g["sat_cli.trainers.megatron.actor"]  # absolute
    assert "sat_cli.trainers.megatron.convert" in g["sat_cli.trainers.megatron.actor"]  # relative
    assert "sat_cli.rl.registry" in g["sat_cli.trainers.step"]
    assert "sat_cli.metric_names" in g["sat_cli.loop.steps"]


# The config object (``SatConfig``, or the DictConfig it is composed into) stops at the edge: the
# command line (cli/), composition and checks (config/), the builders (build.py), the commands
# (commands/) and the sweep runner (sweep/, which composes its runs). Below it (loop, trainers,
# engines, rl, tasks, models, tracking, report, ...) functions take plain values or small frozen
# settings dataclasses built at the edge (e.g. loop.train.LoopSettings).
CONFIG_EDGE = ("cli/", "build/", "commands/", "config/", "sweep/")
CONFIG_NAMES = ("obj", "cfg", "config")  # what the edge calls the config object


def _config_schema() -> tuple[set[str], set[str]]:
    """(the config's top-level fields, the schema's class names plus DictConfig)."""
    from sat_cli.config import schema

    fields = {f.name for f in dataclasses.fields(schema.SatConfig)}
    classes = {  # the schema's own sections; a component's settings class is its own input
        n
        for n, v in vars(schema).items()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == schema.__name__
    }
    return fields, classes | {"DictConfig"}


def _config_uses(path: Path, fields: set[str], classes: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value  # obj.<group>.<x> / cfg.<group>.<x>
            if (
                isinstance(inner.value, ast.Name)
                and inner.value.id in CONFIG_NAMES
                and inner.attr in fields
            ):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "obj" and node.attr in fields:  # obj.seed, obj.max_steps
                out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                names = (
                    {
                        n.id if isinstance(n, ast.Name) else n.attr
                        for n in ast.walk(arg.annotation)
                        if isinstance(n, ast.Name | ast.Attribute)
                    }
                    if arg.annotation is not None
                    else set()
                )
                if names & classes or (
                    isinstance(arg.annotation, ast.Constant) and arg.annotation.value in classes
                ):
                    out.append(f"{node.lineno}: parameter {arg.arg} typed as the config")
    return out


def test_the_config_object_stops_at_the_edge():
    fields, classes = _config_schema()
    offenders = {
        rel: found
        for path in _modules().values()
        if not (rel := path.relative_to(PKG).as_posix()).startswith(CONFIG_EDGE)
        and (found := _config_uses(path, fields, classes))
    }
    assert offenders == {}


def test_the_config_rule_sees_real_uses(tmp_path):
    """The edge rule is not vacuous: it flags chains, bare fields and typed parameters."""
    fields, classes = _config_schema()
    assert {"trainer", "seed"} <= fields and "SatConfig" in classes
    f = tmp_path / "m.py"
    f.write_text(
        "def a(obj):\n    return obj.trainer.lr, obj.seed\n"
        "def b(x: 'SatConfig', y: ModelConfig): return cfg.engine.dtype\n"
        "def c(cfg): return cfg.algo, config.lr\n"  # a LossConfig's field: no chain, allowed
    )
    found = {u.split(": ", 1)[1] for u in _config_uses(f, fields, classes)}
    assert found == {
        "obj.trainer.lr",
        "obj.trainer",
        "obj.seed",
        "parameter x typed as the config",
        "parameter y typed as the config",
        "cfg.engine.dtype",
    }


# A name with a leading underscore is private to its module: no other module imports it (make it
# public, or move the code to where it is used). Tests may still reach into a module.
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()  # (importing module, "module.name")


def _private_imports() -> set[tuple[str, str]]:
    mods = _modules()
    found = set()
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("sat_cli"):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.add((name, f"{base}.{a.name}"))
    return found


def test_no_private_name_is_imported_across_modules():
    assert _private_imports() == PRIVATE_IMPORTS_ALLOWED


# `loop/` is only the loop: these commands reach checkpoints, the final run status and the
# pre-flight checks through checkpoints/, tracking/ and commands/, never through loop/
LOOP_FREE = ("commands/eval.py", "evaluation", "sweep/", "report/")


def test_eval_sweep_and_report_do_not_import_the_loop():
    mods = _modules()
    known = set(mods)
    offenders = {
        p.relative_to(PKG).as_posix(): sorted(m for m in found if m.startswith("sat_cli.loop"))
        for n, p in mods.items()
        if p.relative_to(PKG).as_posix().startswith(LOOP_FREE)
        and (found := _imports(n, p, known | {"sat_cli.loop"}))
        and any(m.startswith("sat_cli.loop") for m in found)
    }
    assert offenders == {}


def test_no_module_over_400_lines():
    long = {
        p.relative_to(PKG).as_posix(): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_loss_functions_stay_small():
    """No function in ``sat_cli/rl`` takes more than 8 parameters or spans more than 80 lines
    (settings travel in ``LossConfig``, tensors in ``LossInputs``)."""
    big = []
    for path in sorted((PKG / "rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                n_params = len(a.posonlyargs + a.args + a.kwonlyargs)
                n_params += (a.vararg is not None) + (a.kwarg is not None)
                n_lines = node.end_lineno - node.lineno + 1
                if n_params > 8 or n_lines > 80:
                    name = getattr(node, "name", "<lambda>")
                    big.append(
                        f"rl/{path.name}:{node.lineno} {name}: {n_params} params, {n_lines} lines"
                    )
    assert big == []


# Packages in layers, lowest first (docs/ARCHITECTURE.md, "Layers"). A module imports only its own
# package and packages of lower layers; the packages of one layer are independent of each other.
# A loose module (``errors.py``, ``records.py``, ...) is a package of its own, ``sat_cli/__init__.py``
# is ``sat_cli``. The imports counted are those of the cycle rule (relative and lazy ones too).
LAYERS = (
    {"sat_cli", "errors", "metric_names", "numerics", "samples", "validate"},  # no other sat_cli
    {"util", "devices", "registry"},  # files, processes, signals; the device plan; registries
    {"records", "rl", "tasks", "tracking", "envs"},  # schemas, loss math, tasks, MLflow, envs
    {"models", "rewards"},  # the model, its weights on disk, R3; reward plugins
    {"checkpoints", "replay", "weightsync"},  # what a run keeps and sends
    {"engines", "trainers"},  # the two components, independent of each other
    {"evaluation", "loop", "report", "cluster"},  # what drives the components
    {"config"},  # the edge: the typed config (it checks lag profiles with loop/lag_profile.py)
    {"build"},  # config in, components out
    {"commands"},
    {"sweep"},  # runs `sat train` as children, reuses `sat replay`'s preparation
    {"cli"},  # the command line: the app, sat sweep/worker/mlflow-server/model, errors as a line
)
# The loose modules (files directly in sat_cli/ besides __init__.py): the vocabulary every layer
# shares stays loose; a module only some packages use lives in the package of its users (the
# command line's guard and commands in cli/). A new one is listed here, within the cap.
LOOSE_MODULES = {
    "errors.py",
    "metric_names.py",
    "numerics.py",
    "records.py",
    "registry.py",
    "samples.py",
    "validate.py",
}
MAX_LOOSE_MODULES = 7


def _loose_modules(root: Path = PKG) -> set[str]:
    return {p.name for p in root.glob("*.py") if p.name != "__init__.py"}


def test_few_loose_top_level_modules():
    assert _loose_modules() == LOOSE_MODULES
    assert len(LOOSE_MODULES) <= MAX_LOOSE_MODULES


# (importing package, imported package) edges that break the layers and are known, with why;
# each one also stays out of the package cycle rule
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph(root: Path = PKG) -> dict[str, dict[str, list[str]]]:
    """package → imported package → the module imports behind that edge (``a -> b``)."""
    out: dict[str, dict[str, list[str]]] = {}
    for n, ms in _module_graph(root).items():
        edges = out.setdefault(_package(n), {})
        for m in sorted(ms):
            if _package(m) != _package(n):
                edges.setdefault(_package(m), []).append(f"{n} -> {m}")
    return out


def _package_cycles(root: Path = PKG, exceptions=()) -> list[list[str]]:
    graph = _package_graph(root)
    return _cycles({a: {b for b in bs if (a, b) not in exceptions} for a, bs in graph.items()})


def _upward_imports(root: Path = PKG, layers=LAYERS, exceptions=()) -> dict[str, list[str]]:
    """``"a -> b"`` (packages) → its module imports, for every import of a package that is not
    in a lower layer than the importer's (packages missing from ``layers`` are reported by
    ``test_every_package_has_a_layer``)."""
    layer = {p: i for i, ps in enumerate(layers) for p in ps}
    return {
        f"{a} -> {b}": why
        for a, bs in _package_graph(root).items()
        for b, why in bs.items()
        if a in layer and b in layer and layer[b] >= layer[a] and (a, b) not in exceptions
    }


def test_every_package_has_a_layer():
    packages = set(_package_graph())
    listed = set().union(*LAYERS)
    assert sum(map(len, LAYERS)) == len(listed), "a package is in two layers"
    assert packages - listed == set(), "add the new package to LAYERS (and docs/ARCHITECTURE.md)"
    assert listed - packages == set(), "LAYERS names a package that does not exist"


def test_no_import_cycle_between_packages():
    assert _package_cycles(exceptions=LAYER_EXCEPTIONS) == []


def test_no_upward_import():
    """An import of a package of the same or a higher layer: move the code it needs down (to
    the lowest package that uses it), or the importing code up (docs/ARCHITECTURE.md, "Layers")."""
    assert _upward_imports(exceptions=LAYER_EXCEPTIONS) == {}


def test_the_layer_exceptions_are_still_needed():
    """An exception that no import needs any more is removed, so that it cannot come back."""
    graph = _package_graph()
    stale = [e for e in LAYER_EXCEPTIONS if e[1] not in graph.get(e[0], {})]
    assert stale == [], "no import needs these any more: remove them from LAYER_EXCEPTIONS"


def _documented_layers(text: str) -> dict[int, set[str]]:
    """The table of docs/ARCHITECTURE.md's "Layers" section: layer number → packages (a line
    ``N name/ name.py …  description``)."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    out = {}
    for line in block.strip().splitlines():
        num, *words = line.split()
        names = []
        for w in words:
            m = re.fullmatch(r"(\w+)(/|\.py)|sat_cli/__init__\.py", w)
            if m is None:
                break
            names.append("sat_cli" if m[1] is None else m[1])
        out[int(num)] = set(names)
    return out


def test_the_layer_table_is_documented():
    doc = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    assert _documented_layers(doc) == dict(enumerate(LAYERS))


def test_the_documented_table_is_read():
    text = "## Layers\n```\n 1 util/ cli.py   the things\n 0 sat_cli/__init__.py errors.py x\n```"
    assert _documented_layers(text) == {1: {"util", "cli"}, 0: {"sat_cli", "errors"}}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_package_rules_catch_a_violation(tmp_path):
    """A package cycle no module cycle shows (util/a.py → engines/e.py, engines/f.py →
    util/b.py; the second import lazy, inside a function) is found by the package rules and
    missed by the module rule; the upward import is named with its module import."""
    root = _write(
        tmp_path / "sat_cli",
        {
            "__init__.py": "",
            "errors.py": "",
            "util/__init__.py": "",
            "util/a.py": "from sat_cli.engines import e\n",
            "util/b.py": "from .. import errors\n",
            "engines/__init__.py": "",
            "engines/e.py": "",
            "engines/f.py": "def g():\n    from ..util import b\n",
        },
    )
    layers = ({"sat_cli", "errors"}, {"util"}, {"engines"})
    assert _cycles(_module_graph(root)) == []
    assert _package_cycles(root) == [["engines", "util", "engines"]]
    assert _upward_imports(root, layers) == {
        "util -> engines": ["sat_cli.util.a -> sat_cli.engines.e"]
    }
    # the same import listed as an exception is let through by both rules
    assert _package_cycles(root, {("util", "engines")}) == []
    assert _upward_imports(root, layers, {("util", "engines")}) == {}


def test_packages_of_one_layer_may_not_import_each_other(tmp_path):
    root = _write(
        tmp_path / "sat_cli",
        {
            "__init__.py": "",
            "engines/__init__.py": "import sat_cli.trainers\n",
            "trainers/__init__.py": "",
        },
    )
    assert _upward_imports(root, ({"sat_cli"}, {"engines", "trainers"})) == {
        "engines -> trainers": ["sat_cli.engines -> sat_cli.trainers"]
    }
    assert _upward_imports(root, ({"sat_cli"}, {"trainers"}, {"engines"})) == {}


def test_the_environments_are_never_committed():
    """`.venv` and `.venv-sglang` are ignored as folders *and* as links (a worktree links them):
    a committed link replaced the main checkout's real `.venv` with a link to itself."""
    import shutil
    import subprocess

    root = PKG.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "--", ".venv", ".venv-sglang"], cwd=root, capture_output=True, text=True
    ).stdout.split()
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", ".venv", ".venv-sglang"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert tracked == [] and ignored == [".venv", ".venv-sglang"]
    patterns = (root / ".gitignore").read_text().split()
    assert ".venv" in patterns and ".venv-sglang" in patterns  # no trailing '/': links too


# Choice by option name: which engine, trainer, launcher, sweep executor, task source, evaluation
# source, reward or environment runs is decided by its registry entry (settings class,
# build/resources/check, capability attributes), never by comparing its name or by a table keyed
# by the names. The names are read from the registries themselves; a comparison against one of
# them outside the registry modules is a site; the allowlist names each one that stays, with its
# reason, and only shrinks.
def _registries() -> dict:
    from sat_cli.cluster.registry import LAUNCHERS
    from sat_cli.engines.registry import ENGINES
    from sat_cli.envs.registry import ENVIRONMENTS
    from sat_cli.rewards.registry import REWARDS
    from sat_cli.sweep.registry import EXECUTORS
    from sat_cli.tasks.registry import EVAL_SOURCES, TASK_SOURCES
    from sat_cli.trainers.registry import TRAINERS

    regs = (ENGINES, TRAINERS, LAUNCHERS, EXECUTORS, TASK_SOURCES, EVAL_SOURCES, REWARDS)
    return {r.group: frozenset(r.names()) for r in (*regs, ENVIRONMENTS)}


REGISTRY_MODULES = ("registry.py",)  # sat_cli/registry.py and every <package>/registry.py
NAME_DISPATCH_ALLOWED = {
    # the "backend" tag a checkpoint's trainer_state.json carries on disk: checkpoints/ sits
    # below trainers/ and reads checkpoints of either trainer (the local one's optimizer is keyed
    # by HF parameter index, Megatron's by its own names)
    "checkpoints/manifest.py": 1,
    # the Megatron trainer refusing a checkpoint whose tag is not its own
    "trainers/megatron/checkpoint.py": 1,
    # not option names, the same words: a URL's scheme ("http"), the sandbox's network mode
    # ("python": the tool's interpreter may reach the network) and a row split ("heldout")
    "engines/sglang/client.py": 1,
    "envs/sandbox.py": 1,
    "envs/base.py": 1,
}
MAX_NAME_DISPATCH = 5


def _component_names() -> frozenset[str]:
    return frozenset().union(*_registries().values())


def _name_constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for elt in node.elts for s in _name_constants(elt)]
    return []


def _name_dispatch(root: Path = PKG, names: frozenset[str] | None = None) -> dict[str, list[int]]:
    """``{file: [line, ...]}`` of comparisons (``==``, ``!=``, ``in``, ``not in``, ``is``) whose
    operands hold an option name (``names``: every registry's) as a string literal; ``match``
    cases on them count too."""
    names = _component_names() if names is None else names
    out: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name in REGISTRY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                operands = [node.value]
            else:
                continue
            if any(s in names for o in operands for s in _name_constants(o)):
                out.setdefault(path.relative_to(root).as_posix(), []).append(node.lineno)
    return out


def test_components_are_chosen_by_their_registry_not_by_name():
    sites = _name_dispatch()
    extra = {f: lines for f, lines in sites.items() if len(lines) > NAME_DISPATCH_ALLOWED.get(f, 0)}
    assert not extra, f"choice by component name outside the registries: {extra}"
    stale = {f: n for f, n in NAME_DISPATCH_ALLOWED.items() if len(sites.get(f, [])) < n}
    assert not stale, f"allowed name comparisons that are gone (shrink the list): {stale}"
    assert sum(len(v) for v in sites.values()) <= MAX_NAME_DISPATCH
    assert sum(NAME_DISPATCH_ALLOWED.values()) <= MAX_NAME_DISPATCH


def test_the_name_dispatch_rule_catches_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "engines/build.py": 'def build(e):\n    return 1 if e.name == "sglang" else 2\n',
            "sweep/x.py": 'def f(s):\n    if s.kind not in ("slurm", "other"):\n        pass\n',
            "sweep/m.py": 'def g(k):\n    match k:\n        case "ray":\n            return 1\n',
            "cluster/ok.py": 'def h(s):\n    return s.name == "ray-cluster" or s.places\n',
            "engines/registry.py": 'def f(n):\n    return n == "local"\n',
        },
    )
    assert _name_dispatch(root) == {
        "engines/build.py": [2],
        "sweep/m.py": [3],
        "sweep/x.py": [2],
    }


def test_the_dispatch_rule_reads_its_names_from_the_registries():
    """Every registry's names are in the rule, a newly registered option's too (a plugin's
    name is held to the same rule as the shipped ones)."""
    from sat_cli.envs.calculator import CalculatorEnv
    from sat_cli.envs.registry import ENVIRONMENTS

    regs = _registries()
    assert {"sglang", "megatron", "slurm", "dapo_math", "heldout", "python"} <= _component_names()
    assert regs["environment"] == {"calculator", "guess"} and "exact" in regs["reward"]
    ENVIRONMENTS.add("a-plugin-env", CalculatorEnv)
    try:
        assert "a-plugin-env" in _component_names()
    finally:
        ENVIRONMENTS.remove("a-plugin-env")


def _name_tables(root: Path = PKG, registries: dict | None = None) -> dict[str, list[int]]:
    """``{file: [line, ...]}`` of dict displays keyed by two or more names of one registry (a
    table of the options, as ``{"calculator": …, "guess": …}``) outside the registry modules."""
    registries = _registries() if registries is None else registries
    out: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name in REGISTRY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Dict):
                continue
            keys = {s for k in node.keys if k is not None for s in _name_constants(k)}
            if any(len(keys & names) >= 2 for names in registries.values()):
                out.setdefault(path.relative_to(root).as_posix(), []).append(node.lineno)
    return out


# tables the rule sees that are not tables of options, with why
NAME_TABLES_ALLOWED = {
    # the hub copies of data sets, by their `hf:<name>` names (gsm8k and dapo_math are also
    # task kinds, whose entries read them through load_benchmark / load_dapo_math)
    "tasks/data.py": 1,
}


def test_no_table_keyed_by_option_names():
    """What differs between options lives in their entries (an environment's rows, teacher and
    warm start are its class's attributes), not in tables beside them."""
    assert {f: len(lines) for f, lines in _name_tables().items()} == NAME_TABLES_ALLOWED


EXECUTOR_NAMES = ("executor", "ex")


def _executor_none(root: Path = PKG) -> list[str]:
    """``executor is None`` / ``ex is not None`` tests in ``root/sweep``: the local executor is
    an object like the cluster ones (``sweep/local.py``), so nothing asks whether there is one."""
    found = []
    for path in sorted((root / "sweep").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            none = any(isinstance(o, ast.Constant) and o.value is None for o in operands)
            named = any(
                (isinstance(o, ast.Name) and o.id in EXECUTOR_NAMES)
                or (isinstance(o, ast.Attribute) and o.attr in EXECUTOR_NAMES)
                for o in operands
            )
            if none and named:
                found.append(f"sweep/{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_local_sweep_executor_is_an_object():
    assert _executor_none() == []


def test_the_table_and_executor_rules_catch_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "envs/plain.py": 'T = {"calculator": 1, "guess": 2}\nI = {"guess": 3, "turn": 1}\n',
            "rewards/x.py": 'NEED = {"python": "fn", "http": "url"}\n',
            "sweep/run.py": "def f(executor, ex):\n    return executor is None or ex is not None\n",
            "sweep/ok.py": "def g(self, job):\n    return job is None\n",
            "envs/registry.py": 'E = {"calculator": 1, "guess": 2}\n',
        },
    )
    regs = {
        "environment": frozenset({"calculator", "guess"}),
        "reward": frozenset({"python", "http"}),
    }
    assert _name_tables(root, regs) == {"envs/plain.py": [1], "rewards/x.py": [1]}
    assert _executor_none(root) == [
        "sweep/run.py:2 executor is None",
        "sweep/run.py:2 ex is not None",
    ]


def _settings_classes() -> frozenset[str]:
    """The names of the registered options' settings classes (engines, trainers, launchers)."""
    from sat_cli.cluster.registry import LAUNCHERS
    from sat_cli.engines.registry import ENGINES
    from sat_cli.trainers.registry import TRAINERS

    return frozenset(
        r.get(n).settings.__name__ for r in (ENGINES, TRAINERS, LAUNCHERS) for n in r.names()
    )


def _type_dispatch(root: Path = PKG, classes=None, names=None) -> list[str]:
    """``isinstance(x, <an option's settings class>)`` and ``x.startswith("<an option's name>")``
    outside the registry modules and the option's own package (``trainers/megatron/`` may know
    its own class): an option is recognised by its entry, not by its type or a name prefix."""
    classes = _settings_classes() if classes is None else classes
    names = _component_names() if names is None else names
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name in REGISTRY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "isinstance" and len(node.args) == 2:
                hit = {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in ast.walk(node.args[1])
                    if isinstance(n, ast.Name | ast.Attribute)
                } & classes
                own = any(rel.startswith(_own_package(c)) for c in hit)
                if hit and not own:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(f, ast.Attribute) and f.attr == "startswith" and node.args:
                if set(_name_constants(node.args[0])) & names:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def _own_package(settings_class: str) -> str:
    """The folder of an option whose settings class is ``settings_class``, or a path nothing
    starts with (a settings class of a shared module, as the local trainer's)."""
    own = {
        "MegatronTrainerSettings": "trainers/megatron/",
        "SGLangEngineSettings": "engines/sglang/",
    }
    return own.get(settings_class, "\0")


def test_options_are_not_recognised_by_type_or_name_prefix():
    assert _type_dispatch() == []


def test_the_type_rule_catches_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "config/compat.py": (
                "from sat_cli.trainers.megatron.settings import MegatronTrainerSettings as M\n"
                "def f(t, p):\n"
                "    return isinstance(t, (M, MegatronTrainerSettings)) or p.startswith('megatron')\n"
            ),
            "trainers/megatron/x.py": "def g(t):\n    return isinstance(t, MegatronTrainerSettings)\n",
            "sweep/ok.py": "def h(p):\n    return p.startswith('megatron-core') or isinstance(p, int)\n",
        },
    )
    found = _type_dispatch(root, frozenset({"MegatronTrainerSettings"}), frozenset({"megatron"}))
    assert [x.split(" ", 1)[0] for x in found] == ["config/compat.py:3", "config/compat.py:3"]


# The run is an object (docs/ARCHITECTURE.md, "The run"): the loop's stages are methods of
# ``TrainLoop`` over the typed ``LoopState``, its helpers take few parameters and return values;
# no stage reads or writes the loop's state through string keys.
MAX_LOOP_PARAMS = 6
# string-keyed reads the loop may do on data from outside it: task rows, the loss's per-token
# diagnostics, the rollout timing, a profile's JSON table, a sample's environment meta
OUTSIDE_RECORDS = {"row", "r", "diag", "table", "timing", "meta"}


def _loop_functions_over(root: Path, limit: int) -> list[str]:
    """Functions of ``root/loop`` with more than ``limit`` parameters (``self``/``cls`` not
    counted)."""
    big = []
    for path in sorted((root / "loop").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                n = len([x for x in names if x not in ("self", "cls")])
                n += (a.vararg is not None) + (a.kwarg is not None)
                if n > limit:
                    big.append(f"loop/{path.name}:{node.lineno} {node.name}: {n} params")
    return big


def _string_keyed_state(root: Path) -> list[str]:
    """``x["key"]`` in ``root/loop`` (read or written) where ``x`` is a name or attribute that is
    not a record from outside the loop (``OUTSIDE_RECORDS``)."""
    found = []
    for path in sorted((root / "loop").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                continue
            base = node.value  # a call's result (a tokenizer's encoding) is not loop state
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if not isinstance(base, ast.Call) and name not in OUTSIDE_RECORDS:
                found.append(f"loop/{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_loop_functions_take_few_parameters():
    assert _loop_functions_over(PKG, MAX_LOOP_PARAMS) == []


def test_the_loop_keeps_no_state_in_dicts():
    assert _string_keyed_state(PKG) == []


def test_the_loop_rules_catch_a_violation(tmp_path):
    root = _write(
        tmp_path / "sat_cli",
        {
            "loop/a.py": (
                "def f(s, t, st, trainer, buf, thread, pub):\n"
                "    st['step'] = t\n"
                "    return row['prompt'], self.ev['best']\n"
                "class C:\n"
                "    def m(self, a, b, c, d, e, f):\n"
                "        return diag['q']\n"
            )
        },
    )
    assert _loop_functions_over(root, MAX_LOOP_PARAMS) == ["loop/a.py:1 f: 7 params"]
    assert _string_keyed_state(root) == ["loop/a.py:2 st['step']", "loop/a.py:3 self.ev['best']"]


# the run's own objects: every field says what it holds (issue 52: "loose fields of the run's
# inputs"); Any inside a container of plain JSON values (dict[str, Any]) is allowed
RUN_OBJECT_FILES = ("loop/*.py", "commands/run.py", "checkpoints/loop_state.py")


def _loose_fields(root: Path) -> list[str]:
    """Dataclass fields of the run's objects whose annotation is ``Any`` (or a union with it)."""
    loose = []
    for pattern in RUN_OBJECT_FILES:
        for path in sorted(root.glob(pattern)):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef) or not any(
                    "dataclass" in ast.unparse(d) for d in cls.decorator_list
                ):
                    continue
                for node in cls.body:
                    if isinstance(node, ast.AnnAssign):
                        parts = [x.strip() for x in ast.unparse(node.annotation).split("|")]
                        if "Any" in parts or "typing.Any" in parts:
                            where = path.relative_to(root).as_posix()
                            loose.append(f"{where}:{node.lineno} {cls.name}.{node.target.id}")
    return loose


def test_the_runs_objects_have_no_loose_fields():
    assert _loose_fields(PKG) == []


def test_the_loose_field_rule_catches_a_violation(tmp_path):
    root = _write(
        tmp_path / "sat_cli",
        {
            "loop/a.py": (
                "@dataclass(frozen=True)\n"
                "class P:\n"
                "    engine: Any\n"
                "    task: Task | Any = None\n"
                "    config: dict[str, Any]\n"
                "class Plain:\n"
                "    x: Any\n"
            )
        },
    )
    assert _loose_fields(root) == ["loop/a.py:3 P.engine", "loop/a.py:4 P.task"]


def _function_lines(path: Path, name: str) -> int:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path.name} has no function {name}")


def test_the_run_is_assembled_in_one_step():
    """`sat train`'s ``_run`` is lock → assemble → run → end; the headline of an evaluation is
    named by the evaluator (``EvalScores.headline``), never guessed from a metric's name."""
    assert _function_lines(PKG / "commands" / "train.py", "_run") <= 40
    guesses = [
        f"{p.relative_to(PKG)}:{node.lineno} {ast.unparse(node)}"
        for p in sorted(PKG.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Constant)
        and isinstance(node.left.value, str)
        and node.left.value.startswith(("avg@", "pass@"))
        and isinstance(node.ops[0], (ast.In, ast.NotIn))
    ]
    assert guesses == []


# Every engine declares how its weights are verified (sat_cli/engines/verification.py): a class
# of a registered engine's package that is a RolloutEngine (directly or through its package's
# mixins) assigns ``weight_verification`` a value other than None in its own body or a base's;
# none is silently never verified.
def _engine_classes(pkg: Path) -> dict[str, tuple[list[str], bool]]:
    """``{class: (base names, declares weight_verification)}`` of the modules under ``pkg``."""
    out: dict[str, tuple[list[str], bool]] = {}
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            declares = False
            for stmt in node.body:
                target, value = None, None
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target, value = stmt.targets[0], stmt.value
                elif isinstance(stmt, ast.AnnAssign):
                    target, value = stmt.target, stmt.value
                if (
                    isinstance(target, ast.Name)
                    and target.id == "weight_verification"
                    and value is not None
                    and not (isinstance(value, ast.Constant) and value.value is None)
                ):
                    declares = True
            out[node.name] = (bases, declares)
    return out


def _undeclared_verification(pkg: Path) -> list[str]:
    """The RolloutEngine classes under ``pkg`` that declare no verification, or ``["no
    engine class"]`` when it has none."""
    classes = _engine_classes(pkg)

    def engine(name: str, seen=()) -> bool:
        bases = classes.get(name, ([], False))[0]
        return "RolloutEngine" in bases or any(
            engine(b, (*seen, name)) for b in bases if b in classes and b not in seen
        )

    def declared(name: str, seen=()) -> bool:
        bases, own = classes.get(name, ([], False))
        return own or any(declared(b, (*seen, name)) for b in bases if b not in seen)

    engines = [c for c in classes if engine(c)]
    if not engines:
        return ["no engine class"]
    return [c for c in engines if not declared(c)]


def test_every_registered_engine_declares_its_weight_verification():
    from sat_cli.engines.registry import ENGINES

    problems = {}
    for name in ENGINES.names():
        missing = _undeclared_verification(PKG / "engines" / name)
        if missing:
            problems[name] = missing
    assert problems == {}
    assert len(ENGINES.names()) >= 2  # local and SGLang at least: the rule reads something


def test_the_verification_rule_catches_a_violation(tmp_path):
    root = _write(
        tmp_path,
        {
            "a/engine.py": (
                "class Mixin:\n    weight_verification = Checksums('hf')\n"
                "class Good(Mixin, RolloutEngine):\n    pass\n"
                "class Bad(RolloutEngine):\n    weight_verification = None\n"
                "class Worse(Bad):\n    pass\n"
                "class Helper:\n    pass\n"
            ),
            "b/engine.py": "class Helper:\n    weight_verification = Unverified('x')\n",
        },
    )
    assert _undeclared_verification(root / "a") == ["Bad", "Worse"]
    assert _undeclared_verification(root / "b") == ["no engine class"]
