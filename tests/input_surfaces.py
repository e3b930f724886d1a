"""The input-surface inventory of `sat`, generated from the code, not kept by hand.

* **config options**: every leaf of the typed schema (:class:`sat_cli.config.schema.SatConfig`,
  the dataclasses registered in Hydra's ConfigStore) with its type; every config **group** (a
  folder of ``conf/``);
* **command-line options and arguments**: every parameter of every command of the typer app,
  with the :mod:`sat_cli.util.options` spec that parses it (none for a boolean flag);
* **environment variables**: every name ``sat_cli`` reads (``os.environ``, ``os.getenv``,
  ``util.options.env``), found in the source;
* **file formats**: every call of a parser (``json.load(s)``, ``yaml.safe_load``,
  ``csv.reader``/``DictReader``, ``safetensors``' ``load_file``/``safe_open``) in ``sat_cli``,
  by module and function, mapped to the format it reads in :data:`FILE_SITES`.

``tests/test_input_surfaces.py`` fails for a surface this inventory does not cover, and fuzzes
what it covers. Covering a new surface is one line: a config option needs a type the fuzz
strategies know (``int``, ``float``, ``bool``, ``str``, optional, lists and maps of those); a
command option is declared with ``cli.guard.opt(SPEC, …)``; an environment variable gets its
spec in ``util.options.ENV``; a parser call gets its entry in :data:`FILE_SITES`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

SAT = Path(__file__).resolve().parents[1] / "sat_cli"


# ----------------------------------------------------------------------------- config
def config_options() -> dict[str, typing.Any]:
    """Dotted key -> type annotation for every leaf of the schema, and of the settings class of
    every registered option of ``engine``, ``trainer`` and ``launcher`` (``engine=sglang``'s
    ``engine.request_timeout_s``: :func:`option_needs` names the override that makes it a key)."""
    return {k: t for k, (t, _) in _options().items()}


def option_needs(key: str) -> list[str]:
    """The group override a key needs (``["engine=sglang"]``), ``[]`` for a key of the default
    config."""
    return _options()[key][1]


@functools.cache
def _options() -> dict[str, tuple[typing.Any, list[str]]]:
    from sat_cli.config.options import registries
    from sat_cli.config.schema import SatConfig

    out: dict[str, tuple[typing.Any, list[str]]] = {}

    def walk(cls, prefix: str, needs: list[str]) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.", needs)
            elif prefix + f.name not in out:
                out[prefix + f.name] = (t, needs)

    import yaml

    from sat_cli.config import conf_dir

    chosen = {}  # conf/config.yaml's defaults: group -> option
    for d in yaml.safe_load((conf_dir() / "config.yaml").read_text())["defaults"]:
        chosen.update(d if isinstance(d, dict) else {})
    walk(SatConfig, "", [])
    for group, reg in registries().items():
        default = [n for n in reg.names() if n == chosen.get(group)]
        for name in default + [n for n in reg.names() if n not in default]:
            walk(
                reg.get(name).settings, f"{group}.", [] if name in default else [f"{group}={name}"]
            )
    return out


def config_groups() -> list[str]:
    from sat_cli.config import conf_dir

    return sorted(p.name for p in conf_dir().iterdir() if p.is_dir())


# ----------------------------------------------------------------------------- CLI
def cli_params() -> dict[tuple[str, str], typing.Any]:
    """(command, option or ARGUMENT) -> its spec (None for a boolean flag; ``MISSING`` for a
    parameter without a :mod:`sat_cli.util.options` spec)."""
    from typer.main import get_command

    from sat_cli.cli import app

    out = {}
    commands = dict(get_command(app).commands)
    for group, cmd in list(commands.items()):  # a group's commands: "model fetch"
        commands.update({f"{group} {n}": c for n, c in getattr(cmd, "commands", {}).items()})
    for name, cmd in commands.items():
        for prm in cmd.params:
            key = prm.opts[0] if prm.param_type_name == "option" else prm.name.upper()
            if getattr(prm, "is_bool_flag", False):
                out[(name, key)] = None
                continue
            parser = prm.type_descriptor.parameter_info.parser
            out[(name, key)] = parser if parser is not None else MISSING
    return out


MISSING = object()


# ----------------------------------------------------------------------------- environment
def _constants(tree: ast.Module) -> dict[str, str]:
    return {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def env_reads() -> dict[str, list[str]]:
    """Environment variable -> the modules that read it (``os.environ.get(X)``,
    ``os.environ[X]``, ``os.getenv(X)``, ``X in os.environ``, ``env(X)``); writes
    (``os.environ[X] = …``, ``setdefault``) are not reads."""
    out: dict[str, list[str]] = {}
    for path in sorted(SAT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = _constants(tree)
        mod = path.relative_to(SAT).with_suffix("").as_posix()

        def name_of(node, consts=consts):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                return consts.get(node.id)
            return None

        stores = {
            id(t)
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign | ast.AugAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        }
        for n in ast.walk(tree):
            found = None
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)) or (
                    isinstance(f, ast.Attribute) and f.attr == "getenv"
                ):
                    found = n.args[0] if n.args else None
                elif isinstance(f, ast.Name) and f.id == "env" and mod == "util/options":
                    continue
                elif (
                    isinstance(f, ast.Name | ast.Attribute)
                    and getattr(f, "id", getattr(f, "attr", "")) == "env"
                ):
                    found = n.args[0] if n.args else None
            elif isinstance(n, ast.Subscript) and _is_environ(n.value) and id(n) not in stores:
                found = n.slice
            elif (
                isinstance(n, ast.Compare)
                and len(n.ops) == 1
                and isinstance(n.ops[0], ast.In)
                and _is_environ(n.comparators[0])
            ):
                found = n.left
            name = name_of(found) if found is not None else None
            if name:
                out.setdefault(name, []).append(mod)
    return out


# ----------------------------------------------------------------------------- files
PARSERS = {
    ("json", "loads"),
    ("json", "load"),
    ("yaml", "safe_load"),
    ("yaml", "load"),
    ("csv", "reader"),
    ("csv", "DictReader"),
}
# and the bounded readers of sat_cli.util.readers / sat_cli.records
PARSER_NAMES = {
    "load_file",
    "safe_open",
    "read_json",
    "read_text",
    "read_bytes",
    "parse_json",
    "read_yaml",
    "read_checked",
}


def _is_parser(f: ast.AST) -> bool:
    return (
        isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Name)
        and (f.value.id, f.attr) in PARSERS
    ) or (isinstance(f, ast.Name) and f.id in PARSER_NAMES)


def parser_sites() -> set[str]:
    """``module:function`` of every parser call in ``sat_cli``."""
    return _sites(lambda call: _is_parser(call.func))


# Every parser call site -> the format it reads. A format in USER_FORMATS is a file a user can
# hand `sat` (a path in the config or on the command line, or a file in a folder `sat` reads
# back); every other format is internal (a message of sat's own processes, an HTTP answer, a
# constant), listed with why.
FILE_SITES = {
    "models.hf_config:read_config_json": "model-config",
    "checkpoints.manifest:_same_trainer": "state-file",
    "checkpoints.manifest:_shapes": "safetensors-weights",
    "checkpoints.manifest:trainer_problem": "state-file",
    "checkpoints.manifest:verify_checkpoint": "state-file",
    "checkpoints.state:read_loop_state": "state-file",
    "engines.sglang.settings:check_model": "model-config",
    "commands.replay:prepare": "replay-recording",
    "commands.resume_check:check_same_config": "run-config",
    "commands.runlock:_read": "run-lock",
    "commands.runlock:live_holder": "run-lock",
    "commands.worker:read_config": "worker-config",
    "envs.launch:main": "internal: the tool sandbox's launch spec, written by sat's own sandbox",
    "envs.toolcalls:_one_call": "internal: a tool call in the model's own output (an error string)",
    "engines.sglang.client:json_or_raise": "internal: the SGLang server's HTTP answers",
    "engines.sglang.server:ready": "internal: the SGLang server's HTTP answers",
    "engines.sglang.routes:read_moe_dims": "model-config",
    "loop.lag_profile:read_histogram": "lag-profile",
    "models.arch:<module>": "internal: a constant of the source",
    "models.stopping:model_stop_ids": "model-config",
    "models.env_warmstart:env_warm_start": "warm-start-record",
    "models.warmstart:is_complete": "warm-start-record",
    "build.task_warmstart:_base_identity": "warm-start-record",
    "models.weights_check:check_finite_values": "safetensors-weights",
    "models.weights_check:read_headers": "safetensors-weights",
    "records:read_json": "state-file",
    "replay.store:__init__": "replay-recording",
    "replay.store:decode_step": "replay-recording",
    "replay.store:open_recording": "replay-recording",
    "report.collapse:read_rows": "collapse-csv",
    "report.collapse_md:study_from_csv": "collapse-csv",
    "report.collapse_md:_pilot2_record": "collapse-curves-csv",
    "report.collapse_curves:read_curves": "collapse-curves-csv",
    "report.study_parts:_curves_reader": "collapse-curves-csv",
    "report.hist:download_json": "internal: a histogram artifact sat logged to MLflow",
    "report.run:build_report": "internal: MLflow tags sat set on the sweep's parent run",
    "sweep.plan:conflict_message": "sweep-run-record",
    "util.safe_yaml:read_yaml": "sweep-yaml",
    "sweep.spec:load_sweep": "sweep-yaml",
    "sweep.run:_open_parent": "sweep-yaml",
    "sweep.state:_recorded_hash": "sweep-run-record",
    "sweep.state:read_state": "state-file",
    "rewards.http_client:_attempt": "reward-server-answer",
    "rewards.pool:_receive": "internal: a reward worker's answer over its pipe (JSON, at most "
    "16 MiB; sat's own worker, which runs the plug-in)",
    "tasks.rows:parse_row": "data-rows",
    "tasks.sources:_side_file": "dataset-folder",
    "tracking.final_status:apply_pending": "pending-status",
    "tracking.outage:read_spool": "pending-status",
    "trainers.local:load": "state-file",
    "trainers.megatron.checkpoint:load": "state-file",
    "trainers.megatron.convert:read_hf_config": "model-config",
    "trainers.megatron.hf_io:__init__": "model-config",
    "trainers.megatron.hf_io:read_header": "safetensors-weights",
    "trainers.megatron.protocol:decode": "internal: the Megatron worker's pipe messages",
    "trainers.megatron.protocol:read_tensors": "internal: tensors sat's own worker wrote",
    "trainers.megatron.worker:main": "internal: worker_config.json as checked by `sat worker`",
    "util.readers:parse_json": "internal: the bounded reader itself",
    "util.readers:read_json": "internal: the bounded reader itself",
    "util.readers:read_text": "internal: the bounded reader itself",
    "util.readers:safetensors_header": "internal: the bounded reader itself",
    "weightsync.service:_answer": "internal: the weight-sync service's socket messages",
    "weightsync.service:_call": "internal: the weight-sync service's socket messages",
    "weightsync.adapters:read_adapter": "safetensors-weights",
    "commands.eval:_load_adapter": "state-file",
}
USER_FORMATS = sorted({v for v in FILE_SITES.values() if not v.startswith("internal")})


# ----------------------------------------------------------------------------- scripts
# an argument of a script in scripts/ or bench/ that names where it writes (issue 53, class 10)
OUTPUT_ARGS = {"out", "--out", "--json", "--run-dir", "--output", "--out-dir", "--report", "--csv"}
SCRIPT_CHECKS = {"output_file", "output_dir"}  # sat_cli.util.script_args


FLAG_ACTIONS = ("store_true", "store_false")


def script_outputs() -> dict[str, tuple[list[str], bool]]:
    """``scripts/x.py`` / ``bench/x.py`` -> (its output arguments, whether it calls
    ``script_args.output_file`` / ``output_dir``), for every script with an output argument."""
    out = {}
    root = SAT.parent
    for path in sorted([*root.glob("scripts/*.py"), *root.glob("bench/*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        args, checked = [], False
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            name = getattr(n.func, "attr", getattr(n.func, "id", ""))
            first = n.args[0] if n.args else None
            if name == "add_argument" and isinstance(first, ast.Constant):
                action = next((k.value for k in n.keywords if k.arg == "action"), None)
                flag = isinstance(action, ast.Constant) and action.value in FLAG_ACTIONS
                if first.value in OUTPUT_ARGS and not flag:  # a switch (--json) names no path
                    args.append(first.value)
            checked |= name in SCRIPT_CHECKS
        if args:
            out[path.relative_to(root).as_posix()] = (args, checked)
    return out


# ----------------------------------------------------------------------------- other processes
# (issue 53, class 13) what enters `sat` from code or peers it does not control: a model's
# output parsed as tool calls, an environment's answers, a plug-in's results, a remote peer's
# text. The registries are generated from sat_cli; tests/test_input_surfaces.py fuzzes each
# registered parser and environment, and fails for a plug-in point or a remote read this
# inventory has not classified.
def tool_call_parsers() -> list[str]:
    """Every tool-call format sat_cli registers (``envs.toolcalls.PARSERS``)."""
    from sat_cli.envs.toolcalls import PARSERS

    return sorted(n for n, fn in PARSERS.items() if fn.__module__.startswith("sat_cli."))


def environments() -> list[str]:
    """Every environment sat_cli registers (``envs.registry.ENVIRONMENTS``; not a test's)."""
    from sat_cli.envs.registry import ENVIRONMENTS

    return sorted(
        n for n in ENVIRONMENTS.names() if ENVIRONMENTS.get(n).__module__.startswith("sat_cli.")
    )


def _sites(match) -> set[str]:
    """``module:function`` of every call in ``sat_cli`` for which ``match(call)`` holds."""
    out = set()
    for path in sorted(SAT.rglob("*.py")):
        mod = path.relative_to(SAT).with_suffix("").as_posix().replace("/", ".")

        def visit(node, fn, mod=mod):
            for ch in ast.iter_child_nodes(node):
                inner = ch.name if isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef) else fn
                if isinstance(ch, ast.Call) and match(ch):
                    out.add(f"{mod}:{fn}")
                visit(ch, inner, mod)

        visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return out


def _call_name(call: ast.Call) -> str:
    return getattr(call.func, "attr", getattr(call.func, "id", ""))


def plugin_points() -> set[str]:
    """Every variation point a plug-in can fill: each ``Registry(...)`` of sat_cli, by site."""
    return _sites(lambda c: _call_name(c) == "Registry")


# calls through which bytes or text of another process or host reach sat: an HTTP answer, a
# pipe or socket message, a server's log, a child's captured output
REMOTE_CALLS = {"getresponse", "urlopen", "recv", "recv_bytes", "tail_lines", "tail_text"}
REMOTE_CALLS |= {"communicate", "check_output"}


def _captures(call: ast.Call) -> bool:
    """``subprocess.run(..., capture_output=True)`` or ``stdout=subprocess.PIPE``."""
    if _call_name(call) != "run":
        return False
    for k in call.keywords:
        if k.arg == "capture_output" and isinstance(k.value, ast.Constant) and k.value.value:
            return True
        if k.arg == "stdout" and getattr(k.value, "attr", "") == "PIPE":
            return True
    return False


def remote_reads() -> set[str]:
    """``module:function`` of every read of another process's or host's output in sat_cli."""
    return _sites(lambda c: _call_name(c) in REMOTE_CALLS or _captures(c))
