"""`sat sweep`: grid expansion, validation, run state, stopping children, and end-to-end runs.

Default tests are in-process (expansion, composition of every sweep file in sweeps/, malformed
files, status from checkpoints) plus real child processes for the Ctrl-C path. The `slow` tests
run real `sat sweep` subprocesses on a random tiny model (model.path) with MLflow in a tmp
sqlite store: a 2 x 2 grid x 1 step, re-run skipping, a run killed mid-way and resumed, Ctrl-C.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_helpers import seeded_store

from sat_cli.errors import UserError
from sat_cli.sweep import (
    Child,
    load_sweep,
    override_hash,
    run_status,
    run_sweep,
    stop_children,
    validate,
)

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))
SAT = [sys.executable, "-m", "sat_cli.cli"]


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


GRID = """\
    name: grid
    base: [experiment=cpu_smoke, max_steps=1]
    axes:
      lag: "1,8"
    methods:
      GRPO: [algo=grpo, clip=ppo]
      SAT-GSPO w/ R3: [algo=gspo, clip=sat, r3=true]
    seeds: [0, 3]
"""


# ----------------------------------------------------------------------------- expansion


def test_expansion_names_overrides_and_hashes(tmp_path):
    sw = load_sweep(write(tmp_path, GRID), ["max_steps=2", "run.dir=out"])
    # seed-major, then method, then axis point
    assert [r.name for r in sw.runs] == [
        "grpo-lag1-s0",
        "grpo-lag8-s0",
        "sat-gspo-w-r3-lag1-s0",
        "sat-gspo-w-r3-lag8-s0",
        "grpo-lag1-s3",
        "grpo-lag8-s3",
        "sat-gspo-w-r3-lag1-s3",
        "sat-gspo-w-r3-lag8-s3",
    ]
    r = sw.runs[3]
    assert r.method == "SAT-GSPO w/ R3" and r.axes == {"lag": "8"} and r.seed == 0
    # base, method, axis point, command line (max_steps=2 replaces the base's max_steps=1), then
    # the sweep's own keys
    assert r.overrides == [
        "experiment=cpu_smoke",
        "algo=gspo",
        "clip=sat",
        "r3=true",
        "lag=8",
        "max_steps=2",
        "run.dir=out",
        "seed=0",
        "run.name=sat-gspo-w-r3-lag8-s0",
        "run.experiment=grid",
        "resume=auto",
    ]
    assert (
        r.hash
        == hashlib.sha256(
            json.dumps(sorted(r.overrides), separators=(",", ":")).encode()
        ).hexdigest()
    )
    assert r.hash == override_hash(list(reversed(r.overrides)))  # order-free
    # the sweep id depends on the expanded run list: same file and overrides -> same id
    again = load_sweep(write(tmp_path, GRID), ["max_steps=2", "run.dir=out"])
    assert again.id == sw.id and sw.id.startswith("grid-") and len(sw.id) == len("grid-") + 10
    assert load_sweep(write(tmp_path, GRID), ["max_steps=3", "run.dir=out"]).id != sw.id


def test_axes_use_hydra_sweep_syntax(tmp_path):
    p = write(
        tmp_path,
        """\
        name: g
        axes:
          trainer.lr: "range(1,3)"
          algo.eps_high: "choice(0.1,0.3)"
        methods: {A: []}
        seeds: [0]
        """,
    )
    sw = load_sweep(p)
    assert sw.axes == {"trainer.lr": ["1", "2"], "algo.eps_high": ["0.1", "0.3"]}
    assert [r.name for r in sw.runs] == [
        "a-lr1-eps-high0.1-s0",
        "a-lr1-eps-high0.3-s0",
        "a-lr2-eps-high0.1-s0",
        "a-lr2-eps-high0.3-s0",
    ]
    assert "trainer.lr=2" in sw.runs[3].overrides and "algo.eps_high=0.3" in sw.runs[3].overrides


# the largest grids compose many configs (6-25 s each on 2 cores): make test-full; the default
# suite keeps the class with the smaller grids (smoke, regime_map_cpu)
BIG_SWEEPS = {
    "sat_power_cpu.yaml",
    "paper_table1_cpu.yaml",
    "paper_table1.yaml",
    "sat_power_lr_check_cpu.yaml",
    "collapse_pilot_cpu.yaml",
    "sat_lag_v5_cpu.yaml",
    "sat_lag_v5_optional_cpu.yaml",
}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in BIG_SWEEPS else p for p in SWEEPS],
    ids=[p.name for p in SWEEPS],
)
def test_every_sweep_file_expands_and_composes(path, tmp_path):
    head = path.read_text().splitlines()[0]
    assert head.startswith(f"# sat sweep sweeps/{path.name}"), head  # the command that uses it
    cli = []
    if path.name.startswith("collapse_pilot2_d1_"):  # starts from the start sweep's final weights
        start = tmp_path / "collapse_pilot2_start_cpu" / "d1-start-grpo-lag1-s3100"
        model = start / "checkpoints" / "step_150" / "trainer" / "model"
        shutil.copytree(REPO / "sat_cli" / "assets" / "tiny_moe_warm", model)
        cli = [f"run.dir={tmp_path}"]
        with pytest.raises(UserError, match="not an HF checkpoint folder"):
            validate(load_sweep(path, [f"run.dir={tmp_path / 'elsewhere'}"]))
    sw = load_sweep(path, cli)
    if path.name == "collapse_pilot2_start_cpu.yaml":  # lag 1 only: the start of candidate D1
        assert [r.name for r in sw.runs] == ["d1-start-grpo-lag1-s3100"]
        validate(sw)
        return
    plan = validate(sw)  # composes every run with sat_cli.config.load
    assert len(plan.run_dirs) == len(sw.runs)
    # lag is an axis, or (the powered test: lag 1 only for its reference arm) set per method
    lags = {
        r.axes.get("lag") or next(o.split("=", 1)[1] for o in r.overrides if o.startswith("lag="))
        for r in sw.runs
    }
    # a calibration run records the lag-8 base arm only (study v5); follow-up F1 runs its new
    # lag-8 arm only and compares it with the study's own S8 runs
    lag8_only = path.name.endswith("_calib_cpu.yaml") or path.name.startswith("sat_lag_v5_f1_")
    assert lags == ({"8"} if lag8_only else {"1", "8"})


def test_paper_table1_rows_map_to_the_right_configs():
    from sat_cli.config import load

    expected = {  # method -> (algo, correction, clip.adaptive, r3)
        "GRPO": ("grpo", "none", False, False),
        "GSPO": ("gspo", "none", False, False),
        "GRPO w/ R3": ("grpo", "none", False, True),
        "GSPO w/ R3": ("gspo", "none", False, True),
        "GRPO w/ TIS": ("grpo", "tis", False, False),
        "GSPO w/ TIS": ("gspo", "tis", False, False),
        "GRPO w/ TIS w/ R3": ("grpo", "tis", False, True),
        "GSPO w/ TIS w/ R3": ("gspo", "tis", False, True),
        "DPPO (TV)": ("dppo_tv", "none", False, False),
        "SAT-GRPO": ("grpo", "none", True, False),
        "SAT-GSPO": ("gspo", "none", True, False),
        "SAT-GRPO w/ R3": ("grpo", "none", True, True),
        "SAT-GSPO w/ R3": ("gspo", "none", True, True),
    }
    gpu = load_sweep(REPO / "sweeps" / "paper_table1.yaml")
    cpu = load_sweep(REPO / "sweeps" / "paper_table1_cpu.yaml")
    assert list(gpu.methods) == list(expected)  # the paper's row order
    beyond = {
        "SAT-GRPO (anchored, beyond the paper)": ("grpo", "none", True, False),
        "SAT-GSPO (anchored, beyond the paper)": ("gspo", "none", True, False),
        "A-3PO (beyond the paper)": ("a3po", "none", False, False),
        "VCPO (beyond the paper)": ("vcpo", "none", False, False),
    }
    assert list(cpu.methods) == [*expected, *beyond]
    assert len(gpu.runs) == 13 * 2 and len(cpu.runs) == 17 * 2 * 2
    for sw in (gpu, cpu):
        for r in sw.runs:
            if r.seed != sw.seeds[0] or r.axes["lag"] != "8":
                continue
            _, obj = load(r.overrides)
            want = {**expected, **beyond}[r.method]
            got = (obj.algo.name, obj.algo.correction, obj.clip.adaptive, obj.r3)
            assert got == want, r.method
            assert obj.lag.n == 8 and obj.run.experiment == sw.name and obj.resume == "auto"
            if sw is gpu:
                assert obj.engine.name == "sglang" and obj.trainer.name == "megatron"
            elif "anchored" in r.method:
                assert obj.clip.anchor == "min_q_eps"


# ----------------------------------------------------------------------------- malformed files


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "name: x\naxes: {}\nmethods: {A: []}\nseeds: [0]\nmethod: {}\n",
            "unknown key(s) 'method'",
        ),
        ("name: x\nmethods: {A: []}\nseeds: [0]\n", "missing key(s) axes"),
        (
            "name: x\naxes: {}\nmethods: {A: [algo==grpo]}\nseeds: [0]\n",
            "methods.A: cannot parse override 'algo==grpo'",
        ),
        (
            "name: x\naxes: {}\nmethods: {A: algo=grpo}\nseeds: [0]\n",
            "methods.A: expected a list of overrides",
        ),
        ("name: x\naxes: {}\nmethods: {}\nseeds: [0]\n", "methods must be a non-empty mapping"),
        (
            "name: x\naxes: {lag: [1, 8]}\nmethods: {A: []}\nseeds: [0]\n",
            'axes.lag: give a Hydra sweep string such as "1,8"',
        ),
        ("name: x\naxes: {lag: '1,1'}\nmethods: {A: []}\nseeds: [0]\n", "repeats a value"),
        ("name: x\naxes: {seed: '1,2'}\nmethods: {A: []}\nseeds: [0]\n", "axes.seed sets 'seed'"),
        (
            "name: x\naxes: {lag: 'glob(*)'}\nmethods: {A: []}\nseeds: [0]\n",
            "axes.lag: cannot expand",
        ),
        (
            "name: x\naxes: {lag: '1,8'}\nmethods: {A: [lag=2]}\nseeds: [0]\n",
            "'lag', which is an axis",
        ),
        (
            "name: x\nbase: [seed=3]\naxes: {}\nmethods: {A: []}\nseeds: [0]\n",
            "sets 'seed', which the sweep sets",
        ),
        (
            "name: x\naxes: {}\nmethods: {A: ['lag=1,8']}\nseeds: [0]\n",
            "is a sweep (several values)",
        ),
        ("name: x\naxes: {}\nmethods: {A: []}\nseeds: [0, 0]\n", "seeds must be a non-empty list"),
        (
            "name: 'a b'\naxes: {}\nmethods: {A: []}\nseeds: [0]\n",
            "name must be a folder-safe word",
        ),
        (
            "name: x\naxes: {}\nmethods: {A-1: [], 'A 1': []}\nseeds: [0]\n",
            "two runs get the same name 'a-1-s0'",
        ),
        ("- 1\n", "a sweep file is a mapping"),
    ],
)
def test_malformed_sweep_files(tmp_path, text, needle):
    with pytest.raises(UserError) as exc:
        load_sweep(write(tmp_path, text))
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    "method, needle",
    [
        (
            "[algo=nope]",
            "run 'a-s0' (method 'A') does not compose: algo='nope' is not a known option",
        ),
        (
            "[algo.nope=1]",
            "run 'a-s0' (method 'A') does not compose: unknown config key 'algo.nope'",
        ),
        ("[algo.eps_high=-1]", "run 'a-s0' (method 'A') does not compose: algo.eps_high=-1"),
    ],
)
def test_runs_that_do_not_compose_are_named(tmp_path, method, needle):
    sw = load_sweep(write(tmp_path, f"name: x\naxes: {{}}\nmethods: {{A: {method}}}\nseeds: [0]\n"))
    with pytest.raises(UserError) as exc:
        validate(sw)
    assert needle in str(exc.value)


def test_cli_bad_sweep_exits_2_without_traceback(tmp_path):
    p = write(tmp_path, "name: x\naxes: {lag: '1,8'}\nmethods:\n  GRPO: [algo=nope]\nseeds: [0]\n")
    r = subprocess.run(
        [*SAT, "sweep", str(p), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "run 'grpo-lag1-s0' (method 'GRPO') does not compose: algo='nope' is not a known option"
        in r.stderr
    )
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- status, dry run


def _fake_checkpoint(run_dir: Path, step: int, finished: bool) -> None:
    ck = run_dir / "checkpoints" / f"step_{step}"
    (ck / "trainer").mkdir(parents=True)
    (ck / "loop_state.json").write_text(json.dumps({"step": step, "finished": finished}))


def test_status_from_checkpoints_and_dry_run(tmp_path, capsys):
    sweep_file = write(tmp_path, GRID)
    args = [f"run.dir={tmp_path / 'runs'}", "tracking=none"]
    sw = load_sweep(sweep_file, args)
    plan = validate(sw)
    d = plan.run_dirs
    assert d["grpo-lag1-s0"] == tmp_path / "runs" / "grid" / "grpo-lag1-s0"
    _fake_checkpoint(d["grpo-lag1-s0"], 1, True)
    _fake_checkpoint(d["grpo-lag8-s0"], 1, False)
    _fake_checkpoint(d["grpo-lag8-s0"], 2, False)
    state = {"runs": {"grpo-lag1-s3": {"status": "failed"}, "grpo-lag8-s3": {"status": "running"}}}
    got = {r.name: run_status(r, d[r.name], state) for r in sw.runs}
    assert got["grpo-lag1-s0"] == "finished"
    assert got["grpo-lag8-s0"] == "resume (step 2)"  # the latest complete checkpoint
    assert got["grpo-lag1-s3"] == "rerun (failed)"
    assert got["grpo-lag8-s3"] == "rerun (interrupted)"
    assert got["sat-gspo-w-r3-lag1-s0"] == "pending"

    run_sweep(str(sweep_file), args, jobs=1, dry_run=True)
    out = capsys.readouterr().out
    assert f"sweep grid  id {sw.id}" in out and "8 runs = 2 methods × lag(2) × 2 seeds" in out
    rows = {
        line.split()[1]: line.split() for line in out.splitlines() if line[:3].strip().isdigit()
    }
    assert rows["grpo-lag1-s0"][2:] == [
        "GRPO",
        "finished",
        "algo=grpo",
        "clip=ppo",
        "lag=1",
        "seed=0",
    ]
    assert rows["grpo-lag8-s0"][2:5] == ["GRPO", "resume", "(step"]
    assert rows["sat-gspo-w-r3-lag8-s3"][2:] == [
        *"SAT-GSPO w/ R3".split(),
        "pending",
        *"algo=gspo clip=sat r3=true lag=8 seed=3".split(),
    ]
    assert "status: finished 1, pending 6, resume 1" in out
    assert not (
        tmp_path / "runs" / "grid" / "sweep_state.json"
    ).exists()  # a dry run writes nothing


def test_changed_overrides_are_refused(tmp_path):
    sweep_file = write(tmp_path, GRID)
    args = [f"run.dir={tmp_path / 'runs'}", "tracking=none"]
    sw = load_sweep(sweep_file, args)
    run_dir = validate(sw).run_dirs["grpo-lag1-s0"]
    _fake_checkpoint(run_dir, 1, False)
    old = [o for o in sw.runs[0].overrides if o != "max_steps=1"] + ["max_steps=5"]
    (run_dir / "sweep_run.json").write_text(
        json.dumps({"override_hash": override_hash(old), "overrides": old})
    )
    assert run_status(sw.runs[0], run_dir, {}) == "conflict"
    with pytest.raises(UserError) as exc:
        run_sweep(str(sweep_file), args, jobs=1, dry_run=False)
    msg = str(exc.value)
    assert "run 'grpo-lag1-s0'" in msg and "was: max_steps=5" in msg and "now: max_steps=1" in msg
    assert not (run_dir / "logs").exists()  # nothing was launched


def test_runs_left_running_by_a_dead_sweep_are_refused(tmp_path):
    sweep_file = write(tmp_path, GRID)
    args = [f"run.dir={tmp_path / 'runs'}", "tracking=none"]
    root = tmp_path / "runs" / "grid"
    root.mkdir(parents=True)
    # a live process whose command line names the run, as a `sat train` child would
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "run.name=grpo-lag8-s0"]
    )
    try:
        state = {"runs": {"grpo-lag8-s0": {"status": "running", "pid": orphan.pid}}}
        (root / "sweep_state.json").write_text(json.dumps(state))
        with pytest.raises(UserError, match=rf"still running: grpo-lag8-s0 \(pid {orphan.pid}\)"):
            run_sweep(str(sweep_file), args, jobs=1, dry_run=False)
    finally:
        orphan.kill()
        orphan.wait()
    assert not (root / "grpo-lag1-s0").exists()  # nothing was launched


# ----------------------------------------------------------------------------- stopping children

_CHILD = r"""
import os, signal, subprocess, sys, time
mode, marker = sys.argv[1], sys.argv[2]
# a grandchild in the same process group (like the engine process of `sat train`)
gc = subprocess.Popen([sys.executable, "-c", "import time, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
open(marker + ".gc", "w").write(str(gc.pid))
if mode == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:  # like `sat train` (signals.orderly_stop), also when started with SIGINT ignored (nohup &)
    signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    open(marker + ".ready", "w").write("1")
    time.sleep(600)
except KeyboardInterrupt:
    open(marker, "w").write("clean")
    sys.exit(130)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_stop_children_sigint_then_sigkill(tmp_path):
    from sat_cli.sweep import SweepRun
    from sat_cli.sweep.local import LocalJob, stop_local

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    children = []
    for mode in ("clean", "ignore"):
        marker = tmp_path / mode
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(marker)], start_new_session=True
        )
        run = SweepRun(mode, mode, {}, 0, [], "")
        children.append((Child(run, LocalJob(proc), time.perf_counter()), marker))
    for _, marker in children:
        deadline = time.monotonic() + 60
        while not Path(str(marker) + ".ready").exists():
            assert time.monotonic() < deadline, "child did not start"
            time.sleep(0.05)
    t0 = time.monotonic()
    stop_children([c for c, _ in children], 5.0, lambda m: None, stop_local)
    waited = time.monotonic() - t0
    clean, ignore = children
    assert clean[0].poll() == 130 and clean[1].read_text() == "clean"  # SIGINT handled
    assert ignore[0].poll() == -signal.SIGKILL  # ignored SIGINT: killed after the grace
    assert not ignore[1].exists()
    assert 5.0 <= waited < 40
    for _, marker in children:  # grandchildren in the process groups are gone too
        gc = int(Path(str(marker) + ".gc").read_text())
        deadline = time.monotonic() + 10
        while _alive(gc) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(gc)


# ----------------------------------------------------------------------------- end to end (slow)


def _sweep_file(tmp_path, name, tiny_dir, steps, extra=()):
    base = [
        "experiment=cpu_smoke",
        f"model.path={tiny_dir}",
        f"max_steps={steps}",
        "eval.every=1",
        "eval.n=2",
        "eval.limit=8",
        "tracking.histogram_every=1",
        *extra,
    ]
    return write(
        tmp_path,
        f"""\
        # sat sweep {name}.yaml
        name: {name}
        base: [{", ".join(base)}]
        axes:
          lag: "1,2"
        methods:
          GRPO: [algo=grpo, clip=ppo]
          SAT-GRPO: [algo=grpo, clip=sat]
        seeds: [0]
        """,
        f"{name}.yaml",
    )


def _sat(args, cwd, timeout=900, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAT_SWEEP_GRACE_S": "20"}
    return subprocess.run(
        [*SAT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, **kw
    )


def _client(runs: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")


def _state(root: Path) -> dict:
    return json.loads((root / "sweep_state.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_grid_end_to_end_rerun_skips_and_report(tmp_path, tiny_dir):
    runs = tmp_path / "runs"
    f = _sweep_file(tmp_path, "e2e", tiny_dir, 1)
    r = _sat(["sweep", str(f), "--jobs", "2", f"run.dir={runs}"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    root = runs / "e2e"
    st = _state(root)
    names = ["grpo-lag1-s0", "grpo-lag2-s0", "sat-grpo-lag1-s0", "sat-grpo-lag2-s0"]
    assert sorted(st["runs"]) == names
    assert all(
        st["runs"][n]["status"] == "finished" and st["runs"][n]["attempts"] == 1 for n in names
    )
    for n in names:
        ck = json.loads((root / n / "checkpoints" / "step_1" / "loop_state.json").read_text())
        assert ck["finished"] is True and ck["step"] == 1
        assert "run.name=" + n in (root / n / "logs" / "sweep_child.log").read_text()

    client = _client(runs)
    exp = client.get_experiment_by_name("e2e")
    all_runs = client.search_runs([exp.experiment_id])
    parents = [x for x in all_runs if x.data.tags.get("sat.sweep_role") == "parent"]
    assert len(parents) == 1 and parents[0].info.run_name == "sweep-e2e"
    parent = parents[0]
    sweep_id = parent.data.tags["sat.sweep_id"]
    assert sweep_id == st["sweep_id"] and st["parents"][sweep_id] == parent.info.run_id
    assert parent.info.status == "FINISHED"
    children = [x for x in all_runs if x is not parent and x.info.run_id != parent.info.run_id]
    assert sorted(c.info.run_name for c in children) == names
    for c in children:
        assert c.info.status == "FINISHED"
        assert c.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert c.data.tags["sat.sweep_id"] == sweep_id
        assert c.data.tags["sat.override_hash"] == st["runs"][c.info.run_name]["override_hash"]
        assert c.data.tags["sat.method"] == (
            "SAT-GRPO" if c.info.run_name.startswith("sat") else "GRPO"
        )

    # re-running skips both... all four finished runs: nothing launched, no new MLflow runs
    r2 = _sat(["sweep", str(f), "--jobs", "2", f"run.dir={runs}"], tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "all 4 runs are finished; nothing to do" in r2.stdout
    st2 = _state(root)
    assert all(st2["runs"][n]["attempts"] == 1 for n in names) and st2["invocations"] == 2
    assert len(client.search_runs([exp.experiment_id])) == 5

    rep = _sat(
        [
            "report",
            sweep_id,
            "--tracking-uri",
            f"sqlite:///{runs / 'mlflow.db'}",
            "--out",
            str(tmp_path / "rep"),
        ],
        tmp_path,
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    import csv

    with open(tmp_path / "rep" / "table.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(x["row"], x["lag"], x["n_seeds"]) for x in rows] == [
        ("GRPO", "1", "1"),
        ("GRPO", "2", "1"),
        ("SAT-GRPO", "1", "1"),
        ("SAT-GRPO", "2", "1"),
    ]
    for x in rows:  # evaluations at steps 0 and 1
        ev = client.get_metric_history(
            next(c.info.run_id for c in children if c.info.run_name == x["runs"]),
            "eval/toy/avg_at_2",
        )
        assert float(x["best_mean"]) == max(m.value for m in ev)
        assert float(x["last_mean"]) == max(ev, key=lambda m: m.step).value
    assert (tmp_path / "rep" / "staleness_hist.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killed_run_is_resumed_alone(tmp_path, tiny_dir):
    runs = tmp_path / "runs"
    f = write(
        tmp_path,
        f"""\
        name: kill
        base: [experiment=cpu_smoke, model.path={tiny_dir}, max_steps=6, checkpoint.every=1, eval.every=0]
        axes: {{lag: "1,2"}}
        methods: {{GRPO: [algo=grpo, clip=ppo]}}
        seeds: [0]
        """,
    )
    root = runs / "kill"
    victim = root / "grpo-lag2-s0"
    proc = subprocess.Popen(
        [*SAT, "sweep", str(f), "--jobs", "2", f"run.dir={runs}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 600
        while not (victim / "checkpoints" / "step_1" / "loop_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.05)
        pid = _state(root)["runs"]["grpo-lag2-s0"]["pid"]
        os.killpg(pid, signal.SIGKILL)  # the child and its engine process, mid-run
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]  # one run did not finish
    st = _state(root)
    assert st["runs"]["grpo-lag2-s0"]["status"] == "killed"
    assert st["runs"]["grpo-lag1-s0"]["status"] == "finished"
    killed_ckpt = st["runs"]["grpo-lag2-s0"]["checkpoint_step"]
    assert 1 <= killed_ckpt < 6

    r = _sat(["sweep", str(f), "--jobs", "2", f"run.dir={runs}"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resume (step {killed_ckpt})" in r.stdout
    st = _state(root)
    assert st["runs"]["grpo-lag1-s0"]["attempts"] == 1  # finished: not run again
    assert (
        st["runs"]["grpo-lag2-s0"]["attempts"] == 2
        and st["runs"]["grpo-lag2-s0"]["status"] == "finished"
    )
    log = (victim / "logs" / "sweep_child.log").read_text()
    assert f"(resuming from step_{killed_ckpt})" in log and "sweep attempt 2" in log
    assert json.loads((victim / "checkpoints" / "step_6" / "loop_state.json").read_text())[
        "finished"
    ]
    # the resumed run continued the same MLflow run: one run per name, each step logged once
    client = _client(runs)
    exp = client.get_experiment_by_name("kill")
    mine = [x for x in client.search_runs([exp.experiment_id]) if x.info.run_name == "grpo-lag2-s0"]
    assert len(mine) == 1 and mine[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(mine[0].info.run_id, "rollout/reward_mean")]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_stops_children_and_marks_parent_killed(tmp_path, tiny_dir):
    runs = tmp_path / "runs"
    f = write(
        tmp_path,
        f"""\
        name: stop
        base: [experiment=cpu_smoke, model.path={tiny_dir}, max_steps=200, eval.every=0]
        axes: {{}}
        methods: {{GRPO: [algo=grpo, clip=ppo]}}
        seeds: [0]
        """,
    )
    log = runs / "stop" / "grpo-s0" / "logs" / "sweep_child.log"
    proc = subprocess.Popen(
        [*SAT, "sweep", str(f), f"run.dir={runs}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SAT_SWEEP_GRACE_S": "60"},
    )
    try:
        deadline = time.monotonic() + 600
        while not (log.exists() and "step " in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "child made no step"
            time.sleep(0.1)
        pid = _state(runs / "stop")["runs"]["grpo-s0"]["pid"]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "stopping 1 run(s)" in out
    assert not _alive(pid)
    st = _state(runs / "stop")
    assert st["runs"]["grpo-s0"]["status"] == "killed"
    client = _client(runs)
    exp = client.get_experiment_by_name("stop")
    by_name = {x.info.run_name: x for x in client.search_runs([exp.experiment_id])}
    assert by_name["sweep-stop"].info.status == "KILLED"
    assert by_name["grpo-s0"].info.status == "KILLED"  # `sat train` ended its run on SIGINT


@pytest.mark.parametrize(
    "method",
    [
        # quotes, braces, '=' and backslashes keep the class; the plainer names: make test-full
        pytest.param("SAT-GSPO (anchored, beyond the paper)", marks=pytest.mark.slow),
        "it's a \\ name, lr=1e-3 {x: y}",
        "ends with a backslash \\",
        pytest.param("GRPO · trainer.lr=0.0003", marks=pytest.mark.slow),
    ],
)
def test_sweep_tags_reach_the_child_as_config(tmp_path, method):
    """A sweep child gets its sweep metadata as `tracking.tags` overrides (no environment
    variables); `sat train` logs them as MLflow tags and never as params."""
    from mlflow import MlflowClient
    from omegaconf import OmegaConf

    from sat_cli.build.run import make_tracker as _tracker
    from sat_cli.config import load
    from sat_cli.sweep import SweepRun, tag_overrides

    seeded_store(tmp_path / "mlflow.db")  # a store already there (creating one: test_tracking)
    run = SweepRun("r", method, {}, 0, ["seed=0"], "h0123")
    cfg, obj = load([f"run.dir={tmp_path}", *tag_overrides("sw-1", run, "parent-9")])
    assert obj.tracking.tags == {
        "sweep_id": "sw-1",
        "override_hash": "h0123",
        "method": method,
        "parent_run_id": "parent-9",
    }
    tr = _tracker(obj, OmegaConf.to_container(cfg, resolve=True), "r", None)
    tr.end("FINISHED")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (got,) = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    tags = got.data.tags
    assert (tags["sat.sweep_id"], tags["sat.override_hash"], tags["sat.method"]) == (
        "sw-1",
        "h0123",
        method,
    )
    assert tags["mlflow.parentRunId"] == "parent-9"
    assert not [k for k in got.data.params if k.startswith("tracking.tags")]
    assert got.data.params["trainer.lr"] == "0.0003"


def test_sweep_method_names_that_cannot_be_tags_are_refused(tmp_path):
    from sat_cli.errors import UserError
    from sat_cli.sweep import load_sweep

    for bad in ("a ${x}", "tab\there", " "):
        f = tmp_path / "s.yaml"
        f.write_text(
            "name: s\naxes: {}\nseeds: [0]\nmethods:\n  " + json.dumps(bad) + ": [algo=grpo]\n"
        )
        with pytest.raises(UserError, match="method name"):
            load_sweep(f)


def test_sweep_files_by_name_and_the_listing(tmp_path, monkeypatch):
    """`sat sweep --list` names the project's sweep files with their first description line;
    `sat sweep smoke` is `sat sweep sweeps/smoke.yaml` from any folder."""
    from typer.testing import CliRunner

    from sat_cli.cli import app

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    listing = CliRunner().invoke(app, ["sweep", "--list"])
    assert listing.exit_code == 0, listing.output
    names = [line.split()[0] for line in listing.output.splitlines()]
    assert names == sorted(p.stem for p in (repo / "sweeps").glob("*.yaml"))
    assert "smoke  " in listing.output and "A 2 x 2 grid (GRPO vs SAT-GRPO" in listing.output
    by_name = CliRunner().invoke(app, ["sweep", "smoke", "--dry-run"])
    by_path = CliRunner().invoke(app, ["sweep", str(repo / "sweeps" / "smoke.yaml"), "--dry-run"])
    assert by_name.exit_code == by_path.exit_code == 0, by_name.output
    assert by_name.output == by_path.output and "status: pending 4" in by_name.output
    missing = CliRunner().invoke(app, ["sweep", "smok", "--dry-run"])
    assert missing.exit_code == 2 and "sat sweep --list" in missing.output


def test_a_sweeps_secrets_are_masked_in_its_plan_records_and_artifact(tmp_path, capsys):
    """Probe (issue 53 v5): a sweep's overrides with a URL password and a ``token`` query value
    reached the terminal (the plan's ``base:`` line), ``sweep_state.json``, each run's
    ``sweep_run.json``, the parent run's ``runs.json`` and its copy of the sweep file as given
    (a real 1-run sweep: the 4 files and the terminal; ``sat train`` itself held)."""
    from sat_cli.sweep.run import _open_parent

    url = "'http://user:SWEEP-PW-61a@127.0.0.1:9/score?token=SWEEP-TOK-2f0'"
    masked = "'http://user:***@127.0.0.1:9/score?token=***'"
    sweep_file = write(
        tmp_path,
        f"""\
        name: sec
        base: [experiment=cpu_smoke, max_steps=1, reward=http, "reward.url={url}"]
        axes: {{}}
        methods: {{A: []}}
        seeds: [0]
        """,
    )
    seeded_store(tmp_path / "runs" / "mlflow.db")
    args = [f"run.dir={tmp_path / 'runs'}"]
    run_sweep(str(sweep_file), args, jobs=1, dry_run=True)
    out = capsys.readouterr().out
    assert f"reward.url={masked}" in out and "SWEEP-" not in out
    sw = load_sweep(sweep_file, args)
    assert f"reward.url={url}" in sw.runs[0].overrides  # what the run is started with
    assert f"reward.url={masked}" in sw.runs[0].record()["overrides"]
    assert sw.runs[0].record()["override_hash"] == sw.runs[0].hash  # collisions: unchanged
    parent = _open_parent(validate(sw), {"parents": {}}, print)
    parent.end()
    stored = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "s.yaml" for p in stored) and any(p.name == "runs.json" for p in stored)
    assert [p for p in stored if b"SWEEP-" in p.read_bytes()] == []
