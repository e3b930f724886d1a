"""Every input surface of `sat` is in the generated inventory (``tests/input_surfaces.py``), and
every surface in it is fuzzed (issue 45).

Coverage: a config group outside the grammar checks, a config option of a type no strategy
knows, a command option or argument without a typed spec, an environment variable without a
spec, a parser call of a format the inventory does not know, a user file format without a fuzz
target: each fails a test here.

Fuzzing (Hypothesis, in process, on the function the command line calls): hostile numbers
(NaN, infinities, huge, negative, with units), strings (paths that climb out, interpolations,
control characters, undecodable bytes, huge), wrong types, and for files: random and non-UTF-8
bytes, deep and huge documents, huge integers, forged but hash-consistent recordings, FIFOs,
symbolic links, folders. The contract: the input is taken, or refused with the surface's user
error (exit 2 at the command line) whose message is one line; never another exception (a
traceback), never longer than the case's deadline (``signal.alarm``), never more than
``MEMORY_BOUND`` of new memory (``tracemalloc``, for the file readers). A refused command line
writes nothing (``test_refused_options_write_nothing``).

Profiles: the default suite runs few examples per property (``DEFAULT``, well under 60 s on 2
cores); ``make test-full`` runs the ``slow`` variants with many more (``FULL``). Set
``SAT_FUZZ_EXAMPLES=N`` to run N examples per property in either.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import signal
import tracemalloc
import typing
from pathlib import Path

import input_surfaces as inv
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DEFAULT, FULL = 12, 300
MEMORY_BOUND = 256 << 20
PROFILES = [
    pytest.param(DEFAULT, id="default"),
    pytest.param(FULL, id="full", marks=pytest.mark.slow),
]


def _examples(n: int) -> int:
    return int(os.environ.get("SAT_FUZZ_EXAMPLES", n))


def _run(prop, n: int) -> None:
    settings(
        max_examples=_examples(n),
        deadline=None,  # the per-case deadline is the alarm below (a loaded CPU is not a hang)
        suppress_health_check=list(HealthCheck),
        derandomize=n == DEFAULT,  # the default suite is reproducible
        database=None,
    )(prop)()


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail the case if it takes longer than ``seconds`` (a hang)."""

    def on_alarm(*_):
        raise TimeoutError(f"no answer within {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_line(exc: BaseException) -> None:
    text = str(exc)
    assert text and "\n" not in text.strip() and "Traceback" not in text, text


# ----------------------------------------------------------------------------- strategies
HUGE = ["1" * 5000, "9" * 400, "1e999", "-1e999", "1e308", str(2**63), str(-(2**63) - 1)]
NUMBERS = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "+inf", "Infinity", "-0", "0", "-1", "1e-320"]),
    st.sampled_from(HUGE),
    st.sampled_from(["60s", "2m", "1h", "5 GB", "1e3", "0x10", "1_000", "3.5", "--1"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
CLIMB = ["../../etc/passwd", "/etc/passwd", "~/x", "..", "a/../../b", "\\x", "a\x00b", ""]
INTERP = ["${oc.env:HOME}", "${oc.env:NOPE_NOT_SET}", "${now:}", "${x}", "${oc.decode:'1'}"]
STRINGS = st.one_of(
    st.sampled_from(CLIMB + INTERP),
    st.sampled_from(["a\nb", "a\rb", "\x1b[31m", "\udcff\udcfe", "x" * 5000, "null", "[1,2]"]),
    st.sampled_from(["{a: 1}", "'quoted'", '"dq', "a=b", "a,b", "true", "[[[[[[[[]]]]]]]]"]),
    st.text(max_size=40),
)
HOSTILE = st.one_of(NUMBERS, STRINGS)


def value_strategy(t) -> st.SearchStrategy | None:
    """Hostile values for a config option of type ``t``; None for a type no strategy knows."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t in (int, float, bool, str):
        return HOSTILE
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        return value_strategy(inner[0]) if len(inner) == 1 else None
    if origin in (list, tuple):
        return st.lists(HOSTILE, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
    if origin is dict:
        return st.dictionaries(st.sampled_from(["a", "b"]), HOSTILE, max_size=2).map(
            lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"
        )
    return None


# ----------------------------------------------------------------------------- coverage
def test_every_config_group_goes_through_the_grammar_checks():
    """A group added later (``launcher``) escaped the checks older groups have: the grammar's
    list of groups is the folders of ``conf/``."""
    from sat_cli.config import GROUPS

    assert sorted(GROUPS) == inv.config_groups()


def test_every_config_option_has_a_fuzz_strategy():
    options = inv.config_options()
    assert len(options) > 100  # the schema walk found the schema
    # and the settings of every registered option (engine=sglang's, launcher=ray's)
    assert inv.option_needs("engine.request_timeout_s") == ["engine=sglang"]
    assert inv.option_needs("launcher.placement_timeout_s") == ["launcher=ray"]
    assert inv.option_needs("engine.weight_sync") == []
    assert inv.option_needs("trainer.lora.sync") == []  # a choice: hostile strings are fuzzed
    assert [k for k, t in options.items() if value_strategy(t) is None] == []


def test_every_command_option_and_argument_has_a_typed_spec():
    from sat_cli.util.options import Num, Text

    params = inv.cli_params()
    assert ("ui", "--port") in params and ("sweep", "--slurm-mem-gb") in params
    untyped = [k for k, v in params.items() if v is not None and not isinstance(v, Num | Text)]
    assert untyped == [], "declare these with sat_cli.cli.guard.opt(SPEC, ...) / arg(SPEC, ...)"


def test_every_environment_variable_read_has_a_spec():
    from sat_cli.util.options import ENV, ENV_FROM_LAUNCHERS

    reads = inv.env_reads()
    assert "SAT_SWEEP_GRACE_S" in reads  # the scan sees env(...) and os.environ.get(...)
    assert sorted(set(reads) - set(ENV) - set(ENV_FROM_LAUNCHERS)) == []
    assert sorted(set(ENV) - set(reads)) == []  # no spec for a variable nothing reads


def test_every_parser_call_reads_a_known_format():
    sites = inv.parser_sites()
    assert sorted(sites - set(inv.FILE_SITES)) == [], "add the site to FILE_SITES"
    assert sorted(set(inv.FILE_SITES) - sites) == [], "a listed site is gone"


# user file formats whose reader has no fuzz target yet (each has hand cases elsewhere:
# tests/test_state_and_inputs.py, tests/test_bad_input.py); the list may only shrink
NOT_YET_FUZZED = {
    "run-lock",
    "pending-status",
    "warm-start-record",
    "sweep-run-record",
    # added in parallel (reward=http): each answer goes through rewards.combine, which turns
    # anything but a finite number or a dict of them into a failed reward (tests/test_rewards.py)
    "reward-server-answer",
}


def test_every_user_file_format_is_fuzzed():
    assert sorted(set(inv.USER_FORMATS) - set(FILE_FUZZ) - NOT_YET_FUZZED) == []
    assert sorted(set(FILE_FUZZ) & NOT_YET_FUZZED) == []


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_config_options(n):
    """``key=<hostile>`` for any schema key: composed and checked, or one ConfigError line."""
    from sat_cli.config import ConfigError, load

    options = inv.config_options()
    keys = sorted(options)

    @given(
        st.sampled_from(keys).flatmap(lambda k: st.tuples(st.just(k), value_strategy(options[k])))
    )
    def prop(case):
        key, value = case
        with deadline(30):
            try:
                _, obj = load([*inv.option_needs(key), f"{key}={value}"], "config")
            except ConfigError as exc:
                one_line(exc)
                return
        for x in _numbers(obj):  # what was taken holds only finite numbers
            assert math.isfinite(x), (key, value)

    _run(prop, n)


def _numbers(obj):
    import dataclasses

    stack = [obj]
    while stack:
        o = stack.pop()
        if dataclasses.is_dataclass(o):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
        elif isinstance(o, list | tuple):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, float):
            yield o


@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_config_group_options(n):
    """``group=<hostile>`` for every group (also ``+group=``): refused in one line, or a real
    option of ``conf/<group>/``."""
    from sat_cli.config import ConfigError, group_options, load

    @given(st.sampled_from(inv.config_groups()), HOSTILE, st.sampled_from(["", "+", "++"]))
    def prop(group, value, plus):
        with deadline(30):
            try:
                load([f"{plus}{group}={value}"], "config")
            except ConfigError as exc:
                one_line(exc)
                return
        assert value.strip("'\"") in group_options(group) or (
            group == "lag" and value.strip().lstrip("-").isdigit()
        ), (group, value)

    _run(prop, n)


def test_hydra_settings_are_refused_not_ignored():
    from sat_cli.config import ConfigError, load

    for text in ("hydra.run.dir=x", "hydra.verbose=true", "+hydra.job.name=x", "~hydra"):
        with pytest.raises(ConfigError, match="hydra"):
            load([text], "config")


# ----------------------------------------------------------------------------- CLI and env
@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_command_options(n):
    """Every typed option's spec takes a value within its bounds or refuses it in one line."""
    from typer import BadParameter

    from sat_cli.util.options import Num

    params = sorted((k, v) for k, v in inv.cli_params().items() if v is not None)

    @given(st.sampled_from(params), HOSTILE)
    def prop(param, text):
        (_, _name), spec = param
        with deadline(5):
            try:
                value = spec(text)
            except BadParameter as exc:
                one_line(exc)
                return
        if isinstance(spec, Num):
            assert isinstance(value, spec.kind) and math.isfinite(value)
            assert spec.lo is None or value >= spec.lo
            assert spec.hi is None or value <= spec.hi
        else:
            assert isinstance(value, str) and "\n" not in value and "\x00" not in value

    _run(prop, n * 4)


@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_environment_variables(n, monkeypatch):
    from sat_cli.util.options import ENV, OptionError, env

    @given(st.sampled_from(sorted(ENV)), HOSTILE.filter(lambda s: "\x00" not in s))
    def prop(name, text):
        try:
            monkeypatch.setenv(name, text)
        except (UnicodeEncodeError, ValueError):
            return  # not something an environment can hold
        try:
            env(name, "default")
        except OptionError as exc:
            one_line(exc)
            assert str(exc).startswith(f"${name}: ")

    _run(prop, n * 4)


def test_units_where_natural():
    from sat_cli.util.options import SECONDS, Num

    assert SECONDS.parse("90") == 90.0 and SECONDS.parse("2m") == 120.0
    assert SECONDS.parse("1.5h") == 5400.0
    assert Num(float, 0, 1e5, unit="GB").parse("512MB") == 0.512
    for bad in ("nan", "inf", "0", "-5s", "5 parsecs", "8d"):
        with pytest.raises(ValueError):
            SECONDS.parse(bad)


# one refused value per command option, run through the real command line in process
def _refusal_cases():
    from sat_cli.util.options import Num

    required = {
        "eval": ["toy"],
        "sweep": ["sweeps/smoke.yaml"],
        "report": ["x"],
        "replay": ["runs/x"],
        "worker": ["--join", "127.0.0.1:1", "--config", "w.json"],
        "mlflow-server": ["--backend-store-uri", "sqlite:///x", "--artifacts-destination", "a"],
        "model fetch": ["org/x"],
    }
    for (cmd, name), spec in sorted(inv.cli_params().items()):
        if spec is None or not name.startswith("--"):
            continue
        bad = "nan" if isinstance(spec, Num) else "a\x01b"
        argv = [*cmd.split(), *required.get(cmd, []), name, bad]  # "model fetch": a group's
        yield pytest.param(argv, id=f"{cmd}{name}")


@pytest.mark.parametrize("argv", list(_refusal_cases()))
def test_refused_options_write_nothing(argv, tmp_path, monkeypatch):
    """Exit 2, one ``sat: error:`` line naming the option, no traceback, nothing written."""
    from typer.testing import CliRunner

    from sat_cli.cli import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sat: error: {argv[-2]}: "), res.output
    assert list(tmp_path.iterdir()) == []


def test_sweep_grace_period_is_checked_before_anything_is_written(tmp_path, monkeypatch):
    from sat_cli.sweep import run_sweep
    from sat_cli.util.options import OptionError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAT_SWEEP_GRACE_S", "nan")
    with pytest.raises(OptionError, match=r"\$SAT_SWEEP_GRACE_S: expected a number in \[0, 3600\]"):
        run_sweep(
            str(Path(__file__).parents[1] / "sweeps" / "smoke.yaml"), [], jobs=1, dry_run=False
        )
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- files
def _json_docs() -> st.SearchStrategy[bytes]:
    leaf = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
    )
    tree = st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
        ),
        max_leaves=20,
    )
    return st.one_of(
        tree.map(lambda v: json.dumps(v).encode()),
        st.sampled_from([b"[" * 100_000, b"[" * 60 + b"]" * 60, b"{" * 5000, b"NaN", b"Infinity"]),
        st.sampled_from([b"1" * 5000, b"1e999", b'{"a": 1e400}', b"\xff\xfe{}", b"", b"\x00" * 9]),
        st.binary(max_size=64),
    )


def _special(path: Path, kind: str) -> None:
    """``path`` made a FIFO, a folder, a link to a FIFO, a link to nowhere or a link loop."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link-to-fifo":
        os.mkfifo(path.with_name(path.name + ".fifo"))
        path.symlink_to(path.name + ".fifo")
    elif kind == "dangling-link":
        path.symlink_to("nowhere")
    elif kind == "link-loop":
        path.symlink_to(path.name)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")


SPECIAL = ["fifo", "folder", "link-to-fifo", "dangling-link", "link-loop", "dev-zero"]


def _lag_profile(folder: Path, data: bytes):
    from sat_cli.loop.lag_profile import ProfileError, read_histogram

    p = folder / "hist.json"
    if data is not None:
        p.write_bytes(data)
    return ProfileError, lambda: read_histogram(p, f"empirical:{p}"), p


def _worker_config(folder: Path, data: bytes):
    from sat_cli.commands.worker import JoinError, read_config

    p = folder / "worker_config.json"
    if data is not None:
        p.write_bytes(data)
    return JoinError, lambda: read_config(str(p)), p


def _collapse_csv(folder: Path, data: bytes):
    import scipy.stats  # noqa: F401  the report's import (seconds under tracemalloc) made first

    from sat_cli.errors import UserError
    from sat_cli.report.collapse_md import study_from_csv

    p = folder / "collapse.csv"
    if data is not None:
        p.write_bytes(data)
    return UserError, lambda: study_from_csv(p), p


def _collapse_curves_csv(folder: Path, data: bytes):
    """``sat report pilot2.csv`` reads ``pilot2_curves.csv`` beside it (the committed rows)."""
    import scipy.stats  # noqa: F401  the report's import, made first (as for collapse.csv)

    from sat_cli.errors import UserError
    from sat_cli.report.collapse_md import study_from_csv

    rows = folder / "pilot2.csv"
    rows.write_bytes((inv.SAT.parent / "docs/results/collapse_cpu/pilot2.csv").read_bytes())
    p = folder / "pilot2_curves.csv"
    if data is not None:
        p.write_bytes(data)
    return UserError, lambda: study_from_csv(rows), p


def _dataset_folder(folder: Path, data: bytes):
    """A ``datasets`` folder (one real Arrow shard) whose ``state.json`` is ``data``."""
    from types import SimpleNamespace

    import pyarrow as pa

    from sat_cli.tasks.datafiles import DataError
    from sat_cli.tasks.sources import read_rows

    d = folder / "ds"
    d.mkdir()
    table = pa.table({"question": ["1+1"], "gold": ["2"]})
    with pa.OSFile(str(d / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    p = d / "state.json"
    if data is not None:
        p.write_bytes(data)
    fields = SimpleNamespace(prompt="question", answer="gold", system=None, id=None)
    return DataError, lambda: read_rows(d, fields), p


def _sweep_yaml(folder: Path, data: bytes):
    from sat_cli.errors import UserError
    from sat_cli.util.safe_yaml import read_yaml

    p = folder / "sweep.yaml"
    if data is not None:
        p.write_bytes(data)
    return UserError, lambda: read_yaml(p, "a sweep file"), p


def _state_file(folder: Path, data: bytes):
    from sat_cli.records import LOOP_STATE, RecordError, read_json

    p = folder / "loop_state.json"
    if data is not None:
        p.write_bytes(data)
    return RecordError, lambda: read_json(p, LOOP_STATE), p


def _data_rows(folder: Path, data: bytes):
    from sat_cli.tasks.datafiles import DataError
    from sat_cli.tasks.rows import parse_row

    text = (data or b"").decode("utf-8", "surrogateescape")
    return DataError, lambda: parse_row(text, "rows.jsonl:1"), None


def _run_config(folder: Path, data: bytes):
    from sat_cli.commands.resume_check import check_same_config
    from sat_cli.errors import UserError

    p = folder / "config.yaml"
    if data is not None:
        p.write_bytes(data)
    return UserError, lambda: check_same_config(folder, {"seed": 0}, "auto"), p


def _replay_recording(folder: Path, data: bytes):
    """A forged but hash-consistent recording: the manifest names ``data`` as step 0 with its
    true size and SHA-256, so only the contents can refuse it."""
    from sat_cli.replay.store import FORMAT, VERSION, RecordingError, open_recording, step_name

    rec = folder / "run" / "replay"
    rec.mkdir(parents=True)
    if data is not None:
        (rec / step_name(0)).write_bytes(data)
        entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "steps": 1,
            "files": {step_name(0): entry},
        }
        (rec / "manifest.json").write_text(json.dumps(manifest))
    return RecordingError, lambda: open_recording(folder / "run", 1), rec / "manifest.json"


def _replay_manifest(folder: Path, data: bytes):
    from sat_cli.replay.store import RecordingError, open_recording

    rec = folder / "run" / "replay"
    rec.mkdir(parents=True)
    if data is not None:
        (rec / "manifest.json").write_bytes(data)
    return RecordingError, lambda: open_recording(folder / "run", 1), rec / "manifest.json"


def _safetensors_docs() -> st.SearchStrategy[bytes]:
    """Step files: a valid header of hostile arrays and metadata, or a forged header."""

    def build(meta_rows: str, n: int, hlen_delta: int) -> bytes:
        header = {
            "__metadata__": {"step": "0", "rows": meta_rows, "group_size": str(n)},
            "weight_version": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
        }
        h = json.dumps(header).encode()
        return (len(h) + hlen_delta).to_bytes(8, "little") + h + b"\0" * (8 * n)

    return st.one_of(
        st.builds(
            build,
            st.sampled_from(["[]", "[{}]", "[" * 50_000, "1e999", "NaN", '"x"', "[1]" * 3]),
            st.integers(0, 4),
            st.sampled_from([0, 0, 1, -1, 2**40]),
        ),
        _json_docs(),
    )


TINY = Path(__file__).resolve().parents[1] / "sat_cli" / "assets" / "tiny_moe_warm"


def _model_folder(folder: Path, name: str, data: bytes | None):
    """The shipped tiny model with its file ``name`` replaced by ``data``, read as ``model.path``
    is (``check_hf_dir``: config.json, every safetensors header, the values)."""
    from sat_cli.errors import UserError
    from sat_cli.models.weights_check import check_hf_dir

    check_hf_dir(TINY, "model.path")  # transformers' imports and the layout first (seconds)
    model = folder / "model"
    model.mkdir()
    for f in TINY.iterdir():
        if f.name != name:
            (model / f.name).write_bytes(f.read_bytes())
    if data is not None:
        (model / name).write_bytes(data)
    return UserError, lambda: check_hf_dir(model, "model.path", values=True), model / name


def _model_config(folder: Path, data: bytes | None):
    return _model_folder(folder, "config.json", data)


def _model_weights(folder: Path, data: bytes | None):
    return _model_folder(folder, "model.safetensors", data)


def _config_docs() -> st.SearchStrategy[bytes]:
    """The tiny model's config.json with one field hostile: huge, negative, of a wrong type,
    deeply nested; or any JSON document."""
    base = json.loads((TINY / "config.json").read_text())
    value = st.one_of(
        st.sampled_from([10**5, 10**9, 10**30, -1, 0, 2.5, True, "abc", [], {}, None, "../x"]),
        st.sampled_from(
            [[1], ["A"] * 3, {"rope_theta": 1e308}, [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]
        ),
        st.integers(),
    )
    keys = st.sampled_from([*base, "text_config", "quantization_config"])
    one = st.tuples(keys, value).map(lambda kv: json.dumps({**base, kv[0]: kv[1]}).encode())
    return st.one_of(one, _json_docs(), st.just(b" " * (5 << 20)))


def _weights_docs() -> st.SearchStrategy[bytes]:
    """The tiny model's weights truncated, with a forged header (offsets past the end, a
    dtype or shape that does not fit its bytes, a huge header length), or random bytes."""
    real = (TINY / "model.safetensors").read_bytes()
    n = int.from_bytes(real[:8], "little")
    header = json.loads(real[8 : 8 + n])

    def forge(key: str, field: str, value) -> bytes:
        h = {k: dict(v) if isinstance(v, dict) else v for k, v in header.items()}
        h[key][field] = value
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + real[8 + n :]

    names = sorted(k for k in header if k != "__metadata__")
    forged = st.builds(
        forge,
        st.sampled_from(names),
        st.sampled_from(["data_offsets", "shape", "dtype"]),
        st.sampled_from([[0, 2**62], [-1, 8], [0, 0], [2**40], "F32", "I64", "XX", [10**9, 10**9]]),
    )
    cut = st.integers(0, len(real) - 1).map(lambda k: real[:k])
    big = st.just((2**40).to_bytes(8, "little") + real[8:])
    return st.one_of(forged, cut, big, _json_docs())


# format -> (builder of the reader for given bytes, hostile bytes)
FILE_FUZZ = {
    "lag-profile": (_lag_profile, _json_docs),
    "worker-config": (_worker_config, _json_docs),
    "collapse-csv": (_collapse_csv, lambda: st.one_of(_json_docs(), _csv_docs())),
    "dataset-folder": (_dataset_folder, lambda: st.one_of(_json_docs(), _state_docs())),
    "collapse-curves-csv": (_collapse_curves_csv, lambda: st.one_of(_json_docs(), _curves_docs())),
    "sweep-yaml": (_sweep_yaml, lambda: st.one_of(_json_docs(), _yaml_docs())),
    "run-config": (_run_config, lambda: st.one_of(_json_docs(), _yaml_docs())),
    "state-file": (_state_file, _json_docs),
    "data-rows": (_data_rows, _json_docs),
    "replay-recording": (_replay_recording, _safetensors_docs),
    "model-config": (_model_config, _config_docs),
    "safetensors-weights": (_model_weights, _weights_docs),
}
MANIFESTS = {"replay-manifest": (_replay_manifest, _json_docs)}


def _csv_docs() -> st.SearchStrategy[bytes]:
    from sat_cli.report.collapse import COLUMNS

    head = ",".join(COLUMNS)
    cell = st.sampled_from(
        ["", "nan", "inf", "-1", "1" * 5000, "x", "1e999", '"', "0", "1", "\x1b[2J", "1_0", "\x00"]
    )
    row = st.lists(cell, min_size=len(COLUMNS) - 1, max_size=len(COLUMNS) + 1).map(",".join)
    return st.lists(row, max_size=4).map(lambda rows: "\n".join([head, *rows]).encode()) | st.just(
        (head + "\n" + "x" * 200_000).encode()
    )


def _state_docs() -> st.SearchStrategy[bytes]:
    """``state.json`` documents: data files that are not the folder's, of the wrong type."""
    name = st.sampled_from(["a.arrow", "../a.arrow", "/etc/passwd", "", ".", "a.arrow/x", 1, None])
    files = st.lists(st.fixed_dictionaries({"filename": name}), max_size=3)
    doc = st.one_of(files.map(lambda f: {"_data_files": f}), st.just({"_data_files": "a.arrow"}))
    return doc.map(lambda d: json.dumps(d).encode())


def _curves_docs() -> st.SearchStrategy[bytes]:
    from sat_cli.report.collapse_curves import CURVE_COLUMNS

    head = ",".join(CURVE_COLUMNS)
    run = "d1-start-grpo-lag1-s3100,D1 start GRPO,1,3100"  # a run of the committed pilot2.csv
    cell = st.sampled_from(["", "nan", "-inf", "1e999", "-1", "x", "\x9b", "eval", "0", "0.5"])
    tail = st.lists(cell, min_size=2, max_size=4).map(",".join)
    lines = st.lists(tail.map(lambda t: f"{run},{t}"), max_size=6)
    return lines.map(lambda ls: "\n".join([head, *ls]).encode()) | st.just(
        (head + "\n" + run + ",eval,0," + "9" * 200_000).encode()
    )


def _yaml_docs() -> st.SearchStrategy[bytes]:
    return st.sampled_from(
        [
            b"name: a\nname: b\n",
            b"a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            + b"".join(
                f"c{i}: &c{i} [".encode() + b", ".join([b"*b"] * 9) + b"]\n" for i in range(1)
            ),
            b"!!python/object/apply:os.system ['true']",
            b"[" * 200 + b"]" * 200,
            b"a: !!binary AAAA\n",
            b"- a\n - b\n",
            b"- " * 50_000 + b"x",
            b"a: " + b"1" * 5000,
        ]
    )


def _check_reader(folder: Path, build, data) -> None:
    error, read, _ = build(folder, data)
    tracemalloc.start()
    try:
        with deadline(20):
            try:
                read()
            except error as exc:
                one_line(exc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("fmt", sorted({**FILE_FUZZ, **MANIFESTS}))
@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_file_readers(fmt, n, tmp_path_factory):
    build, docs = {**FILE_FUZZ, **MANIFESTS}[fmt]

    @given(docs())
    def prop(data):
        _check_reader(tmp_path_factory.mktemp(fmt), build, data)

    _run(prop, n)


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("fmt", sorted(set(FILE_FUZZ) - {"data-rows"}))
def test_file_readers_refuse_what_is_not_a_regular_file(fmt, kind, tmp_path):
    """A FIFO (which would block the reader), a folder, links to them or to nowhere: the
    reader's user error, at once."""
    error, read, target = FILE_FUZZ[fmt][0](tmp_path, None)
    _special(target, kind)
    with deadline(10), pytest.raises(error) as info:
        read()
    one_line(info.value)


@pytest.mark.parametrize("kind", SPECIAL)
def test_the_optional_model_config_reads_are_bounded_too(kind, tmp_path):
    """The checks that only consult a model's ``config.json`` when it is there (the context
    length, the tokenizer's vocabulary, resume's same-model check, the weight sender's tied
    embeddings, Megatron's model check) read it through the bounded reader too: a FIFO there
    blocked a plain ``read_text`` forever; now it counts as no usable config, at once."""
    from sat_cli.commands.preflight import context_length
    from sat_cli.models.hf_config import config_if_usable

    (tmp_path / "m").mkdir()
    _special(tmp_path / "m" / "config.json", kind)
    with deadline(10):
        assert config_if_usable(tmp_path / "m") is None
        assert context_length(str(tmp_path / "m")) is None
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text('{"max_position_embeddings": 512}')
    assert context_length(str(tmp_path / "ok")) == 512


def test_an_ascii_output_gets_escapes_not_a_crash():
    """``LC_ALL=C`` with ``PYTHONUTF8=0`` (or ``PYTHONIOENCODING=ascii``) made the first
    progress line of `sat train` a ``UnicodeEncodeError``; `sat`'s ``main`` escapes instead."""
    import subprocess
    import sys

    text = "'d\\u0304\\u03c0 \\xb1 \\u2192'"  # the source stays ASCII for the C locale
    code = f"from sat_cli.cli import safe_streams; safe_streams(); print({text})"
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONUTF8": "0", "LC_ALL": "C"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout == b"d\\u0304\\u03c0 \\xb1 \\u2192\n"


def test_a_store_path_sqlite_cannot_open_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
    """A run.dir whose mlflow.db path is over sqlite's 512 characters: MLflow retried it for
    minutes; now one line, exit 2, and the run folder is never created."""
    from typer.testing import CliRunner

    from sat_cli.cli import app

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / ("a" * 200) / ("b" * 200) / ("c" * 200)
    res = CliRunner().invoke(app, ["train", "experiment=cpu_smoke", f"run.dir={run_dir}"])
    assert res.exit_code == 2, res.output
    assert "sqlite opens at most 511" in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


def test_every_duration_is_bounded():
    """Every duration key of the schema (``*_s``, from the inventory) refuses 1e300 s and a
    negative value: 1e300 overflowed a socket's or a process group's timeout mid-run."""
    from sat_cli.config import ConfigError, load

    durations = [k for k in inv.config_options() if k.endswith("_s")]
    assert "engine.weight_sync_timeout_s" in durations and "engine.request_timeout_s" in durations
    for key in durations:
        for value in ("1e300", "-1"):
            with pytest.raises(
                ConfigError, match=rf"{re.escape(key)}=.*must lie in \[0, 2592000\]"
            ):
                load([*inv.option_needs(key), f"{key}={value}"], "config")


# a model folder's config.json: one case of each kind the fuzzing found or the issue named
HOSTILE_CONFIGS = {
    "layers-1e5": ({"num_hidden_layers": 100_000}, r"num_hidden_layers must be an integer in"),
    "experts-x-layers": (
        {"num_hidden_layers": 1024, "num_local_experts": 4096},
        r"more than 32768 expert layers",
    ),
    "wrong-type": ({"hidden_size": "abc"}, r"hidden_size must be an integer in \[1, 262144\]"),
    "bool-size": ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer"),
    "nested-size": ({"text_config": {"vocab_size": 10**30}}, r"text_config\.vocab_size must be"),
    "architectures": ({"architectures": [1]}, r"architectures must be a list of names"),
    "model-type": ({"model_type": "../../x"}, r"model_type must be a name"),
    "nan": ({"rope_parameters": {"rope_theta": float("nan")}}, r"NaN is not a JSON number"),
    "multi-line-cause": ({"attention_bias": 100_000}, r"does not describe a causal LM"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CONFIGS))
def test_a_hostile_model_config_is_one_line_at_once(case, tmp_path):
    """``num_hidden_layers: 100000`` built a meta-device model for minutes; a wrong type gave
    transformers' message over two lines; NaN was taken: each is one line, within seconds."""
    from sat_cli.errors import UserError

    change, pattern = HOSTILE_CONFIGS[case]
    config = {**json.loads((TINY / "config.json").read_text()), **change}
    error, read, _ = _model_config(tmp_path, json.dumps(config).encode())
    with deadline(20), pytest.raises(UserError, match=pattern) as info:
        read()
    one_line(info.value)


def test_a_sampling_setting_has_one_rule_in_every_section():
    """A setting that ``task`` (the rollouts) and ``eval`` share is refused or taken alike in
    both, the fields from the schema: ``eval.top_k=0`` was taken, ``task.top_k=0`` refused."""
    import dataclasses

    from sat_cli.config.schema import EvalConfig, TaskConfig
    from sat_cli.validate import ConfigError

    shared = {f.name for f in dataclasses.fields(TaskConfig)} & {
        f.name for f in dataclasses.fields(EvalConfig)
    }
    assert {"temperature", "top_p", "top_k", "max_new_tokens"} <= shared

    def outcome(cls, section: str, name: str, value) -> str:
        try:
            cls(**{name: value})
        except ConfigError as exc:
            return str(exc).replace(f"{section}.", "<section>.")
        return "taken"

    hints = typing.get_type_hints(TaskConfig)
    numbers, texts = [0, -1, -2, 1, 0.5, 1.5, math.nan, math.inf], ["plain", "nope", "{problem}?"]
    for name in sorted(shared - {"path"}):
        for v in texts if hints[name] is str else numbers:
            task, ev = outcome(TaskConfig, "task", name, v), outcome(EvalConfig, "eval", name, v)
            assert task == ev, (name, v, task, ev)


def test_an_unusable_weight_sync_address_is_refused_at_start():
    """``engine.weight_sync_master_addr`` that does not resolve, or is not this machine's, failed
    every version's broadcast after the timeout and then went through the disk: refused before
    anything is written, as a port in use is."""
    from types import SimpleNamespace

    from sat_cli.errors import UserError
    from sat_cli.weightsync.spec import check_port

    def settings(addr: str, port: int = 0):
        return SimpleNamespace(
            weight_sync="distributed", weight_sync_master_addr=addr, weight_sync_port=port
        )

    with pytest.raises(UserError, match=r"'no-such-host\.invalid' does not resolve"):
        check_port(settings("no-such-host.invalid"), True)
    with pytest.raises(UserError, match=r"'192\.0\.2\.1': cannot listen on 192\.0\.2\.1:0"):
        check_port(settings("192.0.2.1"), True)  # TEST-NET-1: never this machine's
    check_port(settings("127.0.0.1"), True)
    check_port(settings("no-such-host.invalid"), False)  # the Megatron worker listens elsewhere


def test_an_unknown_top_level_key_names_every_group_and_key():
    """`sat config launchr=ray` answered with a list of the top-level keys that lacked
    ``launcher`` and ``replay``: the hint names every group of ``conf/`` and every other
    top-level key of the schema."""
    import dataclasses

    from sat_cli.config import ConfigError, load
    from sat_cli.config.schema import SatConfig

    with pytest.raises(ConfigError) as info:
        load(["launchr=ray"], "config")
    one_line(info.value)
    hint = str(info.value)
    groups = re.search(r"Top-level keys are the groups \(([^)]*)\)", hint).group(1).split(", ")
    assert sorted(groups) == inv.config_groups()
    others = hint[hint.index(") and ") + 6 :].split(". To list")[0].split(", ")
    top = {f.name for f in dataclasses.fields(SatConfig)} - set(groups)
    assert sorted(k.removesuffix(".*") for k in others) == sorted(top)
    assert "replay.*" in others and "launcher" in groups


def _sections() -> list[str]:
    """Every section of the schema that is not a config group: a nested settings class
    (``run``, ``task.fields``) or a free-form map (``tracking.tags``)."""
    import dataclasses

    from sat_cli.config.schema import SatConfig

    out, stack = [], [(SatConfig, "")]
    while stack:
        cls, prefix = stack.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t, key = hints[f.name], prefix + f.name
            if dataclasses.is_dataclass(t):
                stack.append((t, key + "."))
                out += [key] if key not in inv.config_groups() else []
            elif typing.get_origin(t) is dict:
                out.append(key)
    return sorted(out)


def test_a_section_given_a_value_is_named_as_a_section():
    """``replay=x`` answered with OmegaConf's "str is not a subclass of ReplayConfig": every
    section of the schema given a value says it is a section, in one line."""
    from sat_cli.config import ConfigError, load

    sections = _sections()
    assert {"run", "replay", "task.fields", "tracking.tags"} <= set(sections)
    for key in sections:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is a section of settings"):
            load([f"{key}=x"], "config")


def test_utf8_arguments_under_an_ascii_locale_are_what_they_say():
    """Under an ASCII (C/POSIX) locale Python hands ``sat`` the UTF-8 bytes of ``run.name='café'``
    as lone surrogates, and the typed-option layer refused them as "not valid UTF-8": they are
    taken as the text they encode; bytes that are not UTF-8 are still refused."""
    from sat_cli.util.options import OVERRIDE

    assert OVERRIDE.parse("run.name='caf\udcc3\udca9'") == "run.name='café'"
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        OVERRIDE.parse("run.name=\udcff")


def test_the_megatron_loaders_header_reader_is_bounded(tmp_path):
    """The Megatron worker reads safetensors headers itself (plain reads, no memory map): a
    forged length of 2**60 was read as asked (a MemoryError in the worker); a length past the
    file's end or a header that is not an object is a ValueError naming the file."""
    from sat_cli.trainers.megatron.hf_io import read_header

    real = (TINY / "model.safetensors").read_bytes()
    start, header = read_header(TINY / "model.safetensors")
    assert start == 8 + int.from_bytes(real[:8], "little") and "lm_head.weight" in header
    for name, data in {
        "huge": (2**60).to_bytes(8, "little") + real[8:],
        "past-end": (len(real)).to_bytes(8, "little") + real[8:],
        "list": (2).to_bytes(8, "little") + b"[]",
    }.items():
        (tmp_path / name).write_bytes(data)
        with deadline(10), pytest.raises(ValueError, match="is not a safetensors file"):
            read_header(tmp_path / name)


def test_every_script_output_is_checked_before_the_work():
    """Each script in scripts/ or bench/ with an output argument (``--out``, ``--json``, …)
    checks it with ``sat_cli.util.script_args`` (one ``<script>: error:`` line, exit 2, before
    the work; ``tests/test_script_inputs.py`` runs them): a new script that writes where it is
    told is listed here until it does."""
    found = inv.script_outputs()
    assert len(found) >= 8, found  # the inventory sees the scripts
    unchecked = sorted(f"{path} {args}" for path, (args, ok) in found.items() if not ok)
    assert unchecked == [], "check these outputs with sat_cli.util.script_args"


# ----------------------------------------------------------------------------- other processes
# issue 53, class 13: a model's output parsed as tool calls, an environment's answers, a
# plug-in's results, a remote peer's text (inventory: tests/input_surfaces.py)
_TAGS = ["<tool_call>", "</tool_call>", "[", "]", ":", "{", "}", '"name"', '"arguments"']
_JSONISH = st.sampled_from(
    [
        '{"name": "calculator", "arguments": {"expression": "1+1"}}',
        '{"name": "calculator", "arguments": {"expression": "' + "9" * 5000 + '"}}',
        '{"name": ' + "1" * 5000 + "}",  # past Python's int conversion limit
        '{"name": NaN, "arguments": Infinity}',
        '{"name": "\\ud800", "arguments": {}}',  # a lone surrogate
        "[" * 30000 + "]" * 30000,  # nested past the recursion limit, under the size cap
        '{"a":' * 10000 + "1" + "}" * 10000,
        '{"name": "x", "arguments": [1, 2]}',
        '{"name": "x" "arguments": {}}',
        "calc:" + "(" * 3000 + "1" + ")" * 3000,
        "calc:" + "9" * 5000 + "**" + "9" * 5000,
        "calc:" + "9**" * 200 + "9",
    ]
)
HOSTILE_OUTPUT = st.one_of(
    st.lists(st.one_of(st.sampled_from(_TAGS), _JSONISH, st.text(max_size=40)), max_size=12).map(
        "".join
    ),
    _JSONISH.map(lambda j: f"<tool_call>{j}</tool_call>"),
    _JSONISH.map(lambda j: f"[{j}]" if j.startswith("calc:") else f"[calc:{j}]"),
    st.integers(1, 40).map(lambda n: "<tool_call>" * n),  # never closed
    st.integers(17, 400).map(lambda n: "[calc:1+1]" * n),  # more calls than MAX_CALLS
    st.sampled_from(["x" * 70000, "<tool_call>" + "x" * 70000, "[calc:" + "1" * 70000 + "]"]),
)


def _check_parsed(parsed) -> None:
    from sat_cli.envs.toolcalls import Parsed, ToolCall

    assert isinstance(parsed, Parsed) and isinstance(parsed.content, str)
    assert all(isinstance(c, ToolCall) and isinstance(c.name, str) for c in parsed.calls)
    assert all(isinstance(c.arguments, dict) for c in parsed.calls)
    assert all(isinstance(e, str) and "\n" not in e for e in parsed.errors)


@pytest.mark.parametrize("n", PROFILES)
@pytest.mark.parametrize("parser", inv.tool_call_parsers())
def test_every_tool_call_parser_takes_hostile_model_output(parser, n):
    """Huge, deeply nested and malformed tool calls in a model's turn: every registered format
    parses them into calls or one-line errors, within a second, never an exception."""
    from sat_cli.envs.toolcalls import parse

    @given(HOSTILE_OUTPUT)
    def prop(text):
        with deadline(2):
            _check_parsed(parse(parser, text))

    _run(prop, n)


@pytest.mark.parametrize("n", PROFILES)
@pytest.mark.parametrize(
    ("env", "parser"), [(e, p) for e in inv.environments() for p in inv.tool_call_parsers()]
)
def test_every_environment_answers_hostile_model_output(env, parser, n):
    """Every registered environment, fed hostile turns until its trajectory ends: each step's
    result passes the trajectory's own check (``envs.results.check_step``: a finite reward,
    chat-role messages of strings, bounded), within two seconds, never an exception."""
    from sat_cli.envs import registry
    from sat_cli.envs.base import EnvSettings
    from sat_cli.envs.results import check_step

    settings_ = EnvSettings(max_turns=3, parser=parser, sandbox="unsafe_local")

    @given(st.lists(HOSTILE_OUTPUT, min_size=1, max_size=3))
    def prop(turns):
        e = registry.make(env, settings_)
        row = type(e).rows("train", 1)[0] if hasattr(type(e), "rows") else {}
        with deadline(2):
            e.reset(row)
            for text in turns:
                step = check_step(e.step(text), e)
                if step.done:
                    break

    _run(prop, n)


class _HostileEnv:
    """A plug-in environment whose first step returns ``result`` (a ``Step``'s fields)."""

    max_turns = 2

    def __init__(self, result):
        self.result = result

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        return self.result


HOSTILE_STEPS = [
    (([], float("nan"), True, {}), "reward=nan: not a finite number"),
    (([], "1.0", True, {}), "reward='1.0': not a finite number"),
    (([], 1.0, 1, {}), "done=1: not a bool"),
    (([], 1.0, False, [("a", 1)]), "not a mapping with string keys"),
    (([{"role": "tool"}], 0.0, False, {}), "not {'role', 'content'} strings"),
    (([{"role": "tool", "content": "x" * (1 << 21)}], 0.0, False, {}), "over 1048576"),
    ((None, 0.0), "not a Step(observation, reward, done, info)"),
]


@pytest.mark.xdist_group("tiny_engine")
@pytest.mark.parametrize(("result", "message"), HOSTILE_STEPS)
def test_a_plugin_environments_unusable_result_stops_the_trajectory_naming_it(
    tiny_engine, result, message
):
    """A real trajectory (the tiny model on the local engine) of a plug-in environment whose
    step returns what the trajectory cannot use: one line naming the environment and the
    field (a NaN reward used to reach the advantages; a string one, a traceback)."""
    from sat_cli.engines.base import SamplingParams
    from sat_cli.envs.results import EnvironmentResultError
    from sat_cli.envs.trajectory import TrajectorySettings, run_trajectory
    from sat_cli.models.tiny_moe import build_char_tokenizer

    sampling = SamplingParams(max_new_tokens=4, seed=1)
    with pytest.raises(EnvironmentResultError) as err:
        run_trajectory(
            tiny_engine,
            _HostileEnv(result),
            build_char_tokenizer(),
            {"prompt": "1+1="},
            sampling,
            TrajectorySettings(max_turns=2, max_tokens=64),
        )
    assert str(err.value).startswith("environment _HostileEnv: step() returned ")
    assert message in str(err.value)
    one_line(err.value)


# every variation point a plug-in can fill -> where its results are checked, and the test
PLUGIN_POINTS = {
    "rewards.registry:<module>": "rewards.combine: every value and component finite in float32, "
    "names bounded (tests/test_rewards.py::test_values_the_trainer_cannot_hold_are_errors, "
    "test_fuzz_plugin_reward_results below)",
    "envs.registry:<module>": "envs.results.check_step on every step "
    "(test_a_plugin_environments_unusable_result_stops_the_trajectory_naming_it)",
    "engines.registry:<module>": "in-process code of sat's own engine protocol (samples are "
    "checked by the trainer's batch: tests/test_trainer_step.py); no plug-in text is shown",
    "trainers.registry:<module>": "in-process code returning metrics the loop logs as numbers "
    "(non-finite ones counted: tests/test_tracking.py)",
    "cluster.registry:<module>": "in-process launcher code; its errors reach sat: error: "
    "(escaped, masked: tests/test_remote_text.py::test_every_sat_error_paragraph_is_escaped)",
    "tasks.registry:<module>": "in-process code building the task object; the shipped sources' "
    "rows and a user's file are read by tasks.sources / tasks.data, each row checked and named "
    "(tests/test_custom_tasks.py::test_damaged_files_are_refused_naming_file_and_row)",
    "sweep.registry:_executors": "in-process executor code; child runs are `sat train` "
    "processes whose logs are read as remote text (REMOTE_READS)",
}


def test_every_plugin_point_is_classified():
    points = inv.plugin_points()
    assert sorted(points - set(PLUGIN_POINTS)) == [], "add the registry to PLUGIN_POINTS"
    assert sorted(set(PLUGIN_POINTS) - points) == [], "a listed registry is gone"


@pytest.mark.parametrize("n", PROFILES)
def test_fuzz_plugin_reward_results(n):
    """Whatever a reward plug-in returns (numbers past float32, NaN, huge or nested dicts,
    strings, lists, huge integers): one score or a failed reward, never an exception."""
    from sat_cli.rewards import BadReward, combine, error_text

    leaf = st.one_of(NUMBERS, STRINGS, st.none(), st.booleans(), st.integers(-(10**400), 10**400))
    result = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=70), inner, max_size=5)
        ),
        max_leaves=12,
    )

    @given(result)
    def prop(value):
        with deadline(2):
            try:
                score, parts = combine(value, {})
            except BadReward as exc:  # the sample's failed reward, its one line
                text = error_text(exc, "reward.fn=r.py:f")
                assert text.startswith("reward.fn=r.py:f ") and "\n" not in text
                return
        for v in [score, *parts.values()]:
            assert isinstance(v, float) and abs(v) <= 3.4028e38, value

    _run(prop, n)


# every read of another process's or host's output -> how its text reaches the user
REMOTE_READS = {
    "cluster.hosts:recv": "bytes of a node's command channel, parsed as messages (not shown)",
    "cluster.remote:log_tail": "escape_controls on the tail (shown in a sat: error: paragraph)",
    "cluster.slurm:_queued": "squeue's job ids and states, compared, not shown",
    "commands.ui:_healthy": "an HTTP status only",
    "engines.local.engine:_recv": "the engine worker's messages; an error's text reaches sat: "
    "error: (escaped, masked in cli.guard)",
    "engines.local.inflight:serve": "the orchestrator's commands to the worker (sat's own)",
    "engines.local.worker:worker_main": "the orchestrator's commands to the worker (sat's own)",
    "engines.sglang.client:_once": "escape_controls in engines.sglang.wire.wire_excerpt "
    "(tests/test_remote_text.py::test_an_sglang_servers_error_body_is_escaped)",
    "engines.sglang.models:models_dir": "a path printed by the SGLang interpreter, used as a path",
    "engines.managed_server:log_tail": "escape_controls on the tail (shown in a sat: error: "
    "paragraph)",
    "engines.sglang.server:ready": "the readiness answer's JSON status, not shown",
    "envs.confine:_probe_net": "the probe child's exit and marker, not shown",
    "envs.confine:_strict_probe": "the probe child's one-line reason, shown through sat: error:",
    "rewards.http_client:_exchange": "escape_controls on the reason phrase and errors; the answer "
    "through rewards.combine (tests/test_remote_text.py::test_a_reward_servers_text_is_escaped)",
    "rewards.pool:_receive": "a reward worker's answer: JSON checked as [kind, index, payload], "
    "else the sample's failed reward (test_a_plugins_own_value_types_and_garbage_are_results_"
    "not_exceptions); the ready message (sat's own); the plug-in's results then go through "
    "rewards.combine, its errors through rewards.error_text (escape_controls; "
    "test_a_plugins_error_string_is_escaped)",
    "rewards.pool:_serve": "the parent's calls to the reward worker (sat's own)",
    "sweep.clean_tree:_git": "git's own output about the checkout, compared, not shown",
    "sweep.jobs:finish_run": "sweep.children.tail_text: escape_controls and redact_text on a "
    "child's log tail (test_a_sweep_childs_log_tail_is_escaped_and_masked)",
    "sweep.jobs:warm_start": "sweep.children.tail_text, as finish_run",
    "tracking.environment:git_commit": "a commit hash recorded as a param (masked, truncated)",
    "tracking.environment:sglang_version": "a version string recorded as a param (masked)",
    "trainers.megatron.calls:_read_reply": "the Megatron worker's messages; an error's text "
    "reaches sat: error: (escaped, masked in cli.guard)",
    "trainers.megatron.pipeline:backward": "tensors between pipeline stages",
    "trainers.megatron.pipeline:token_logprobs": "tensors between pipeline stages",
    "util.procs:http_get_status": "an HTTP status only",
}


def test_every_remote_read_is_classified():
    reads = inv.remote_reads()
    assert sorted(reads - set(REMOTE_READS)) == [], "add the read to REMOTE_READS"
    assert sorted(set(REMOTE_READS) - reads) == [], "a listed read is gone"


def test_a_sweep_childs_log_tail_is_escaped_and_masked(tmp_path, monkeypatch):
    """A failed sweep run's log tail is printed on the sweep's terminal: a plug-in's control
    sequences and a secret in it (the child's own output, or its plug-ins') do not get there."""
    from sat_cli.sweep.children import tail_text

    monkeypatch.setenv("MY_SERVICE_TOKEN", "TAIL-SECRET-1")
    monkeypatch.setattr("sat_cli.tracking.params._ENV_KNOWN", [])
    log = tmp_path / "sweep_child.log"
    log.write_text("ok\n\x1b[2J\x1b]0;title\x07cleared\nkey TAIL-SECRET-1 --api-key K-2\n")
    tail = tail_text(log)
    assert tail == (
        "    | ok\n    | \\x1b[2J\\x1b]0;title\\x07cleared\n    | key *** --api-key ***"
    )
