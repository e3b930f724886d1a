"""The registries are the one place a component is chosen (docs/ARCHITECTURE.md, "How to add"):
a fake engine and a fake sweep executor, each registered from its own plugin file and nowhere
else, run through the real command line (`sat train`, `sat sweep --dry-run`); an unknown name is
refused at compose time listing the registered ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sat_cli.config import ConfigError, load

REPO = Path(__file__).resolve().parents[1]

# a rollout engine registered by a plugin file: the local engine's worker behind a class of its
# own, which writes down what it was built with and how often it was asked to generate
FAKE_ENGINE = """
from dataclasses import dataclass

from sat_cli.engines.registry import ENGINES
from sat_cli.engines.settings import EngineSettings
from sat_cli.registry import Component
from sat_cli.validate import check_range


@dataclass
class FakeEngineSettings(EngineSettings):
    name: str = "fake"
    threads: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_range("engine.threads", self.threads, 1, 4)


def build(s, rt):
    import json

    from sat_cli.engines.local.engine import LocalEngine
    from sat_cli.engines.local.settings import LocalEngineRuntime, LocalEngineSettings

    class FakeEngine(LocalEngine):
        calls = 0

        def generate_async(self, prompts, n, sampling, **kw):
            FakeEngine.calls += 1
            return super().generate_async(prompts, n, sampling, **kw)

        def close(self):
            (rt.logs / "fake.json").write_text(json.dumps(
                {"threads": s.threads, "seed": rt.seed, "calls": FakeEngine.calls}))
            super().close()

    own = LocalEngineSettings(dtype=s.dtype, device=s.device, num_threads=s.threads)
    log = str(rt.logs / "engine.log")
    return FakeEngine(own, LocalEngineRuntime(rt.model_path, rt.seed, log_file=log))


ENGINES.add("fake", Component(FakeEngineSettings, build))
"""

# a sweep executor registered by a plugin file, with its own sweep-file section
FAKE_EXECUTOR = """
from sat_cli.sweep.registry import EXECUTORS, SweepExecutor

EXECUTORS.add("fake", SweepExecutor(keys=("queue",)))
"""


def _sat(tmp_path: Path, plugin: str | None, *args: str) -> subprocess.CompletedProcess:
    """`sat <args>` in a subprocess that first imports ``plugin`` (its source) as a module."""
    code = "import sys; from sat_cli.cli import app; app(sys.argv[1:])"
    if plugin is not None:
        (tmp_path / "plugin.py").write_text(textwrap.dedent(plugin))
        code = "import plugin; " + code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )


def test_a_fake_engine_trains_through_the_registry_alone(tmp_path):
    steps = ["max_steps=2", "task.prompts_per_step=4", "task.samples_per_prompt=2"]
    args = ["train", "engine=fake", "engine.threads=2", *steps, "eval.every=0", "run.dir=runs"]
    args += ["run.name=fake", "tracking=none", "checkpoint.every=0"]
    out = _sat(tmp_path, FAKE_ENGINE, *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "runs/sat/fake/logs/fake.json").read_text())
    assert record == {"threads": 2, "seed": 0, "calls": 2}  # one batch per step
    config = (tmp_path / "runs/sat/fake/config.yaml").read_text()
    assert "name: fake" in config and "threads: 2" in config
    bad = _sat(tmp_path, FAKE_ENGINE, "config", "engine=fake", "engine.threads=9")
    assert bad.returncode == 2 and "engine.threads=9 is out of range" in bad.stderr


def test_sat_plan_describes_a_fake_engine_by_its_settings_class(tmp_path):
    """`sat plan` asks the chosen option's settings for its lines and its processes
    (``plan_lines``, ``gpu_layout``): a new engine gets the neutral defaults, not another
    engine's branch (before the registries it fell into SGLang's and failed on engine.urls)."""
    out = _sat(tmp_path, FAKE_ENGINE, "plan", "engine=fake", "engine.device=cuda")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1] == "engines   fake: 1 process(es) on the GPU, bfloat16"  # cuda default
    engine = "  node 0     fake engine       GPU 0            cuda:0, bfloat16; in its own process"
    assert engine in lines
    trainer = (
        "  node 0     local trainer     CPU              cpu, float32; in the orchestrator process"
    )
    assert trainer in lines


def test_an_unknown_engine_is_refused_listing_the_registered_ones(tmp_path):
    out = _sat(tmp_path, FAKE_ENGINE, "config", "engine=nope")
    assert out.returncode == 2, out.stderr
    assert "Valid options for 'engine': fake, local, sglang" in out.stderr
    assert "Traceback" not in out.stderr
    plain = _sat(tmp_path, None, "config", "engine=fake")  # not registered: not an option
    assert plain.returncode == 2 and "Valid options for 'engine': local, sglang" in plain.stderr


def test_a_name_that_is_not_its_class_is_refused():
    with pytest.raises(ConfigError, match="engine.name='sglang' names another rollout engine"):
        load(["engine.name=sglang"])


def test_a_key_of_another_option_names_the_option():
    with pytest.raises(ConfigError, match=r"engine.tp=2 needs engine=sglang: engine.tp is not a"):
        load(["engine.tp=2"])


SWEEP = "name: fk\naxes: {}\nmethods: {A: [algo=grpo]}\nseeds: [0]\nfake: {queue: short}\n"


def test_a_fake_sweep_executor_through_the_registry_alone(tmp_path):
    (tmp_path / "s.yaml").write_text(SWEEP)
    out = _sat(tmp_path, FAKE_EXECUTOR, "sweep", "s.yaml", "--dry-run", "--executor", "fake")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1  a-s0  A  pending  algo=grpo seed=0" in out.stdout
    (tmp_path / "bad.yaml").write_text(SWEEP.replace("queue", "qeue"))
    bad = _sat(tmp_path, FAKE_EXECUTOR, "sweep", "bad.yaml", "--dry-run", "--executor", "fake")
    assert bad.returncode == 2 and "fake: unknown key(s) 'qeue'; known: queue" in bad.stderr
    # without a build it cannot start runs: refused before anything is written, never run here
    real = _sat(tmp_path, FAKE_EXECUTOR, "sweep", "s.yaml", "--executor", "fake")
    assert real.returncode == 2, real.stderr[-3000:]
    assert real.stderr.strip().splitlines()[-1] == (
        "sat: error: --executor='fake' cannot start runs: its registry entry has no build "
        "(SweepExecutor(build=...), sat_cli/sweep/registry.py); nothing was written"
    )
    assert not (tmp_path / "runs").exists() and real.stdout == ""
    plain = _sat(tmp_path, None, "sweep", "s.yaml", "--dry-run", "--executor", "fake")
    assert plain.returncode == 2
    assert (
        "--executor='fake' is not a registered sweep executor; registered: local, slurm, ray"
        in (plain.stderr)
    )
    local = _sat(tmp_path, None, "sweep", "s.yaml", "--dry-run")  # its section: an unknown key
    assert local.returncode == 2 and "unknown key(s) 'fake'" in local.stderr


def _how_to_add() -> str:
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    start = text.index("## How to add an engine / trainer / executor / loss")
    return text[start : text.index("\n## ", start + 1)]


def test_how_to_add_names_files_that_exist_and_the_registries_follow_it():
    """The doc's recipe is the code's: every file it names exists, it names every registry, and
    each registered engine's settings live where it says (``engines/<name>/settings.py``)."""
    import re

    from sat_cli.engines.registry import ENGINES

    section = _how_to_add()
    named = set(re.findall(r"`(sat_cli/[\w/<>.]+)`", section))
    concrete = {p for p in named if "<" not in p}
    missing = sorted(p for p in concrete if not (REPO / p).exists())
    assert missing == [], missing
    for path in ("engines", "trainers", "cluster", "sweep"):
        assert f"sat_cli/{path}/registry.py" in named, path
    assert "sat_cli/engines/<name>/settings.py" in named
    # the recipe is for engines shipped in the package; a plug-in registered from outside it
    # (tests/engine_plugin.py, imported by another test in this worker) lives where its user wants
    shipped = [n for n in ENGINES.names() if ENGINES.get(n).build.__module__.startswith("sat_cli.")]
    assert {"local", "sglang"} <= set(shipped), shipped
    for name in shipped:
        settings = ENGINES.get(name).settings
        assert settings.__module__ == f"sat_cli.engines.{name}.settings", name
        assert f"sat_cli/engines/{name}/settings.py" in concrete, name


def test_the_doc_check_fails_on_a_missing_file(tmp_path, monkeypatch):
    """Not vacuous: a recipe naming a file that does not exist fails the check above."""
    doc = tmp_path / "docs/ARCHITECTURE.md"
    doc.parent.mkdir()
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    doc.write_text(text.replace("sat_cli/engines/registry.py", "sat_cli/engines/gone.py", 1))
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "sat_cli").symlink_to(REPO / "sat_cli")
    with pytest.raises(AssertionError, match="gone.py"):
        test_how_to_add_names_files_that_exist_and_the_registries_follow_it()


def _trainer_state(tmp_path: Path, **meta) -> Path:
    ckpt = tmp_path / "step_1"
    (ckpt / "trainer").mkdir(parents=True)
    (ckpt / "trainer" / "trainer_state.json").write_text(json.dumps(meta))
    return ckpt


def test_a_checkpoint_is_matched_by_the_trainers_own_keys(tmp_path):
    """``resume`` compares a checkpoint's trainer state with the chosen trainer's
    ``checkpoint_kind()`` key by key (absent keys of older files: local, 1, float32); another
    backend is named alone."""
    from sat_cli.checkpoints.manifest import _STATE_DEFAULTS, _same_trainer
    from sat_cli.trainers.megatron.settings import MegatronTrainerSettings
    from sat_cli.trainers.settings import LocalTrainerSettings

    kind = MegatronTrainerSettings(nproc_per_node=2, ep=2, dtype="bfloat16").checkpoint_kind()
    want = {"backend": "megatron", "world_size": 2, "tp": 1, "ep": 2, "pp": 1, "dtype": "bfloat16"}
    assert kind == want
    same = _trainer_state(tmp_path / "a", backend="megatron", world_size=2, ep=2, dtype="bfloat16")
    assert _same_trainer(same, kind) is None  # tp, pp absent: 1
    old = _trainer_state(tmp_path / "b", backend="megatron", world_size=2, ep=2, tp=1, pp=1)
    assert _same_trainer(old, kind) == "dtype: 'float32' in the checkpoint, 'bfloat16' now"
    moved = _trainer_state(tmp_path / "c", backend="megatron", world_size=4, tp=2, ep=2)
    assert _same_trainer(moved, kind) == (
        "world_size: 4 in the checkpoint, 2 now, tp: 2 in the checkpoint, 1 now, "
        "dtype: 'float32' in the checkpoint, 'bfloat16' now"
    )
    local = _trainer_state(tmp_path / "d", step_count=3)  # no backend: the local trainer's
    assert _same_trainer(local, kind) == "backend: 'local' in the checkpoint, 'megatron' now"
    assert _same_trainer(local, LocalTrainerSettings().checkpoint_kind()) is None
    assert _same_trainer(moved, {"backend": "local"}) == (
        "backend: 'megatron' in the checkpoint, 'local' now"
    )
    assert _STATE_DEFAULTS["backend"] == "local"


def test_a_running_job_of_another_cluster_executor_is_found_by_its_entry():
    """`sat sweep` refuses to start a run whose job another cluster executor may still run; the
    sweep's own subprocesses (``cluster=False``) are found by their pid instead, and an executor
    that is not registered now counts as a cluster (its job may run)."""
    from sat_cli.sweep.run import _submitted_elsewhere

    cases = {
        (None, "local"): False,  # a record of a sweep before executors were recorded
        ("local", "slurm"): False,  # a subprocess: its pid decides
        ("slurm", "slurm"): False,  # adopted by this executor
        ("slurm", "ray"): True,
        ("ray", "local"): True,
        ("gone", "local"): True,
    }
    assert {k: _submitted_elsewhere(*k) for k in cases} == cases
