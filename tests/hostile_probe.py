"""A hostile probe of `sat` through its real command line (issue 45): about 40 cases across the
issue's classes, each a `python -m sat_cli.cli …` subprocess in a fresh folder with a deadline.

The contract checked for every case: exit 2; exactly one line of output, ``sat: error: …``; no
``Traceback``; an answer within the deadline (no hang); the folder's tree the same before and
after (no half-made run folder, store, cache or log). Run it on the landed code::

    PYTHONPATH=$PWD .venv/bin/python tests/hostile_probe.py            # every case, 2 at a time
    PYTHONPATH=$PWD .venv/bin/python tests/hostile_probe.py -j 1 layers-1e5 ascii-output

It prints one line per case and ``N/M cases held``; the exit status is 0 only if all held.
``tests/test_hostile_probe.py`` runs the cases under pytest (``slow``; one per class in the
default suite). docs/reliability.md records the last result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
DEADLINE_S = 240  # a loaded 2-core machine imports torch in 10-20 s; a hang is minutes


@dataclass(frozen=True)
class Case:
    name: str
    cls: str  # the class
    argv: tuple[str, ...]
    pattern: str = ""  # what the one line must say (a regex)
    setup: Callable[[Path], None] | None = None
    env: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------- setups
def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def _fifo(name: str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(folder / name)

    return setup


def _model(config: dict | None = None, replace: dict[str, bytes] | None = None, special=None):
    """``m/``: the shipped tiny model with config.json fields changed, files replaced, or one
    file made a FIFO or a link to itself (``special``: (name, "fifo" | "loop"))."""

    def setup(folder: Path) -> None:
        m = folder / "m"
        shutil.copytree(TINY, m)
        if config:
            cfg = json.loads((m / "config.json").read_text())
            (m / "config.json").write_text(json.dumps({**cfg, **config}))
        for name, data in (replace or {}).items():
            (m / name).write_bytes(data)
        if special:
            name, kind = special
            (m / name).unlink()
            if kind == "fifo":
                os.mkfifo(m / name)
            else:
                (m / name).symlink_to(name)

    return setup


def _weights_cut(n: int) -> bytes:
    return (TINY / "model.safetensors").read_bytes()[:n]


def _weights_forged() -> bytes:
    """The tiny model's weights with one tensor's data offsets past the end of the file."""
    real = (TINY / "model.safetensors").read_bytes()
    n = int.from_bytes(real[:8], "little")
    header = json.loads(real[8 : 8 + n])
    key = sorted(k for k in header if k != "__metadata__")[0]
    header[key]["data_offsets"] = [0, 2**62]
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + real[8 + n :]


def _ckpt(folder: Path) -> None:
    """``ck/``: a checkpoint folder whose model has forged weights."""
    m = folder / "ck" / "trainer" / "model"
    shutil.copytree(TINY, m)
    (m / "model.safetensors").write_bytes(_weights_forged())


def _store(evals: bool) -> Callable[[Path], None]:
    """``mlflow.db``: a real MLflow store with two finished runs of experiment ``x`` (GRPO, PPO
    clip, lag 1, seeds 0 and 1), with evaluations or without any (no outcome to decide)."""

    def setup(folder: Path) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
        exp = client.create_experiment("x")
        for seed in (0, 1):
            run = client.create_run(exp, run_name=f"grpo-s{seed}")
            params = {"algo.name": "grpo", "clip.name": "ppo", "lag.n": "1", "seed": str(seed)}
            params |= {"model.name": "tiny_moe", "task.name": "toy_add", "eval.name": "toy"}
            for k, v in params.items():
                client.log_param(run.info.run_id, k, v)
            for step in (0, 5) if evals else ():
                client.log_metric(run.info.run_id, "eval/toy/avg_at_8", 10.0 + step, step=step)
            client.set_terminated(run.info.run_id, "FINISHED")

    return setup


DEEP = "[" * 100_000 + "]" * 100_000
SMOKE = str(REPO / "sweeps" / "smoke.yaml")

CASES = [
    # a config group added later escapes the grammar
    Case("launcher-int", "group grammar", ("config", "launcher=1"), r"launcher"),
    Case("reward-climbs-out", "group grammar", ("config", "reward=../algo/grpo"), r"conf/reward/"),
    Case("launcher-interp", "group grammar", ("config", "launcher=${oc.env:HOME}"), r"launcher"),
    Case("plus-reward-unknown", "group grammar", ("config", "+reward=nope"), r"reward"),
    Case("eval-group-list", "group grammar", ("config", "eval=[toy,gsm8k]"), r"eval"),
    # settings silently ignored, duplicate keys
    Case("hydra-run-dir", "ignored settings", ("config", "hydra.run.dir=x"), r"hydra"),
    Case("hydra-plus", "ignored settings", ("config", "++hydra.job.chdir=true"), r"hydra"),
    Case(
        "sweep-duplicate-key",
        "ignored settings",
        ("sweep", "s.yaml", "--dry-run"),
        r"twice|duplicate",
        _write("s.yaml", "name: a\nname: b\naxes: {}\nmethods: {A: []}\nseeds: [0]\n"),
    ),
    # user files without schema or bounds
    Case(
        "lag-profile-deep",
        "user files",
        ("config", "lag.profile=empirical:h.json"),
        r"h\.json",
        _write("h.json", DEEP),
    ),
    Case(
        "lag-profile-fifo",
        "user files",
        ("config", "lag.profile=empirical:h.json"),
        r"regular file|FIFO",
        _fifo("h.json"),
    ),
    Case("replay-no-recording", "user files", ("replay", "r"), r"r", _write("r/config.yaml", "")),
    Case(
        "replay-forged-manifest",
        "user files",
        ("replay", "r"),
        r"manifest",
        _write("r/replay/manifest.json", '{"format": 1, "steps": 1e999}'),
    ),
    Case(
        "worker-config-deep",
        "user files",
        ("worker", "--join", "127.0.0.1:1", "--config", "w.json"),
        r"w\.json",
        _write("w.json", DEEP),
    ),
    Case(
        "worker-config-fifo",
        "user files",
        ("worker", "--join", "127.0.0.1:1", "--config", "w.json"),
        r"w\.json",
        _fifo("w.json"),
    ),
    *(
        Case(name, "model folder", ("train", "model.path=m", "max_steps=1"), pattern, setup)
        for name, pattern, setup in [
            (
                "model-layers-1e5",
                r"num_hidden_layers must be an integer",
                _model({"num_hidden_layers": 100_000}),
            ),
            (
                "model-config-nan",
                r"NaN is not a JSON number",
                _model({"rope_parameters": {"rope_theta": float("nan")}}),
            ),
            ("model-config-fifo", r"config\.json", _model(special=("config.json", "fifo"))),
            ("model-config-link-loop", r"config\.json", _model(special=("config.json", "loop"))),
            (
                "model-weights-truncated",
                r"not a readable safetensors file",
                _model(replace={"model.safetensors": _weights_cut(1000)}),
            ),
        ]
    ),
    Case(
        "model-wrong-type",
        "model folder",
        ("eval", "toy", "model.path=m"),
        r"hidden_size must be an integer",
        _model({"hidden_size": "abc"}),
    ),
    Case(
        "ckpt-weights-forged",
        "model folder",
        ("eval", "toy", "ckpt=ck"),
        r"not a readable safetensors file",
        _ckpt,
    ),
    # options outside the Hydra config
    Case("ui-port-range", "command options", ("ui", "--port", "99999"), r"--port"),
    Case("ui-port-nan", "command options", ("ui", "--port", "nan"), r"--port"),
    Case("report-last-k-inf", "command options", ("report", "x", "--last-k", "inf"), r"--last-k"),
    Case(
        "report-collapse-below-nan",
        "command options",
        ("report", "x", "--collapse-below", "nan"),
        r"--collapse-below",
    ),
    Case(
        "sweep-grace-nan",
        "command options",
        ("sweep", SMOKE),
        r"SAT_SWEEP_GRACE_S",
        env={"SAT_SWEEP_GRACE_S": "nan"},
    ),
    Case("sweep-jobs-huge", "command options", ("sweep", SMOKE, "--jobs", "1e9"), r"--jobs"),
    Case(
        "mlflow-server-port",
        "command options",
        (
            "mlflow-server",
            "--backend-store-uri",
            "sqlite:///x.db",
            "--artifacts-destination",
            "a",
            "--port",
            "-1",
        ),
        r"--port",
    ),
    Case(
        "worker-wait-units",
        "command options",
        ("worker", "--join", "127.0.0.1:1", "--config", "w.json", "--wait", "5 parsecs"),
        r"--wait",
    ),
    # sanity of derived settings
    Case(
        "sync-timeout-1e300",
        "derived settings",
        ("config", "engine.weight_sync_timeout_s=1e300"),
        r"must lie in",
    ),
    Case(
        "sync-address-unresolvable",
        "derived settings",
        (
            "train",
            "engine.weight_sync=distributed",
            "engine.weight_sync_master_addr=no-such-host.invalid",
            "max_steps=1",
        ),
        r"does not resolve",
    ),
    Case("eval-top-k-zero", "derived settings", ("config", "eval.top_k=0"), r"eval\.top_k"),
    Case("seed-2-63", "derived settings", ("config", f"seed={2**63}"), r"seed"),
    # the environment
    Case(
        "ascii-output",
        "environment",
        ("config", "algo=nöpe"),
        r"algo",
        env={"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "ascii"},
    ),
    Case(
        "sqlite-path-too-long",
        "environment",
        ("train", "run.dir=" + "d/" * 300, "max_steps=1"),
        r"sqlite",
    ),
    # refusals that leave state
    Case("train-max-steps-0", "refusals leave nothing", ("train", "max_steps=0"), r"max_steps"),
    Case(
        "train-run-name-climbs", "refusals leave nothing", ("train", "run.name=../x"), r"run\.name"
    ),
    Case("replay-section-value", "refusals leave nothing", ("config", "replay=x"), r"is a section"),
    # reports on nothing
    Case("report-empty-store", "reports on nothing", ("report", "nope"), r"no MLflow store"),
    Case(
        "report-no-outcome",
        "reports on nothing",
        ("report", "x", "--tracking-uri", "sqlite:///mlflow.db"),
        r"cannot decide an outcome",
        _store(evals=False),
    ),
    Case(
        "report-pair-unknown-arm",
        "reports on nothing",
        ("report", "x", "--tracking-uri", "sqlite:///mlflow.db", "--pair", "NOPE@1:GRPO@1"),
        r"NOPE",
        _store(evals=True),
    ),
    # issue 53: study CSVs, data side files, model folders, damaged stores, remote text
    Case(
        "study-csv-inf",
        "study CSVs",
        ("report", "p.csv"),
        r"p\.csv: .*line 3, column eval_best: 'inf'",
        lambda f: _write("p.csv", _pilot2_damaged())(f),
    ),
    Case(
        "datasets-state-fifo",
        "data side files",
        ("train", "task.path=ds", "task.fields.prompt=q", "task.fields.answer=a", "model.path=m"),
        r"state\.json",
        lambda f: (_model()(f), _fifo("ds/state.json")(f)),
    ),
    Case(
        "chat-template-raises",
        "model folder consistency",
        ("train", "task.path=t.jsonl", "task.fields.prompt=q", "task.fields.answer=a")
        + ("task.template=chat", "model.path=m", "tracking.uri=none"),
        r"task\.template=chat: the chat template of m .*broken",
        lambda f: (
            _model(replace={"chat_template.jinja": b"{{ raise_exception('broken') }}"})(f),
            _write("t.jsonl", '{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "4"}\n')(f),
        ),
    ),
    Case(
        "store-garbage",
        "damaged stores",
        ("train", "run.dir=runs", "max_steps=1"),
        r"runs/mlflow\.db is not an SQLite database",
        _write("runs/mlflow.db", b"\x00not a database" * 300),
    ),
    Case(
        "mlflow-server-store-folder",
        "damaged stores",
        ("mlflow-server", "--backend-store-uri", "sqlite:///s.db", "--port", "58741")
        + ("--artifacts-destination", "art"),
        r"is a folder, not a database file",
        lambda f: (f / "s.db").mkdir(),
    ),
    Case(
        "columns-in-two-roles",
        "cross settings",
        ("config", "task.path=t.jsonl", "task.fields.prompt=q", "task.fields.answer=q")
        + ("model.path=m",),
        r"task\.fields\.answer and task\.fields\.prompt name the same column",
        _write("t.jsonl", '{"q": "1"}\n'),
    ),
]


def _pilot2_damaged() -> str:
    """The committed pilot-2 rows with line 3's ``eval_best`` set to ``inf``."""
    import csv
    import io

    rows = list(
        csv.reader(io.StringIO((REPO / "docs/results/collapse_cpu/pilot2.csv").read_text()))
    )
    rows[2][rows[0].index("eval_best")] = "inf"
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


# ----------------------------------------------------------------------------- run
def _tree(folder: Path) -> dict[str, tuple]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = Path(root) / n
            st = p.lstat()
            out[str(p.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def run_case(case: Case, base: Path | None = None) -> tuple[bool, str, float]:
    """(held, why, seconds) for one case (module docstring)."""
    folder = Path(tempfile.mkdtemp(prefix=f"probe-{case.name}-", dir=base))
    try:
        if case.setup:
            case.setup(folder)
        before = _tree(folder)
        env = {**os.environ, "PYTHONPATH": str(REPO), **case.env}
        env.pop("SAT_CONF_DIR", None)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sat_cli.cli", *case.argv],
                cwd=folder,
                env=env,
                capture_output=True,
                timeout=DEADLINE_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False, f"no answer within {DEADLINE_S} s (a hang)", DEADLINE_S
        took = time.monotonic() - t0
        out = (proc.stdout + proc.stderr).decode("utf-8", "backslashreplace")
        lines = [ln for ln in out.splitlines() if ln.strip()]
        problems = []
        if proc.returncode != 2:
            problems.append(f"exit {proc.returncode}")
        if "Traceback" in out:
            problems.append("a traceback")
        if len(lines) != 1 or not lines[0].startswith("sat: error: "):
            problems.append(f"{len(lines)} lines, not one 'sat: error:' line")
        elif case.pattern and not re.search(case.pattern, lines[0]):
            problems.append(f"the line does not say /{case.pattern}/")
        after = _tree(folder)
        if after != before:
            changed = sorted(set(after) ^ set(before)) or sorted(
                k for k in after if after[k] != before.get(k)
            )
            problems.append(f"wrote {', '.join(changed[:3])}")
        first = lines[0][:160] if lines else "(no output)"
        return not problems, ("; ".join(problems) + " | " if problems else "") + first, took
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    chosen = [c for c in CASES if not args.cases or c.name in args.cases]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(run_case, chosen))
    for case, (ok, why, took) in zip(chosen, results, strict=True):
        print(f"{'held' if ok else 'FAIL'}  {case.cls:<24} {case.name:<28} {took:5.1f}s  {why}")
    held = sum(ok for ok, _, _ in results)
    print(f"{held}/{len(chosen)} cases held")
    return 0 if held == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
