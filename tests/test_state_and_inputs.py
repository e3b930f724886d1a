"""Reliability v3 (issue 32), in process: each class of failure checked on the code path the CLI
uses, table-driven (the CLI path itself is covered once per class by the catalogue in
``tests/test_bad_input.py`` and, for faults, ``tests/test_faults.py``).

* state files of the wrong shape (loop state, trainer state, optimizer, manifest, sweep state,
  run record) are named, and a damaged checkpoint is skipped or refused;
* sweeps: grid sizes are computed without enumerating; runs of one grid that compose to the
  same config are refused naming both sources;
* NaN and infinity in any numeric setting (one rule over the composed config);
* hostile files: FIFOs are never opened for reading, NaN weights are refused, a group option
  that interpolates is checked after resolving;
* top-level settings of another command, and model × task × trainer × engine combinations
  that cannot run, are refused at compose time;
* resource errors (MemoryError, "can't allocate memory", a low ``ulimit -v``) are one line,
  exit 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_cli.config import ConfigError, load
from sat_cli.errors import RunFailed, UserError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sat_cli" / "assets" / "tiny_moe_warm"


# ----------------------------------------------------------------------------- state files

from sat_cli import records as R  # noqa: E402

RECORDS = [
    (R.LOOP_STATE, [], r"^expected an object, got list$"),
    (R.LOOP_STATE, {"step": None}, r"^step: expected an integer >= 0, got null$"),
    (R.LOOP_STATE, {}, r"the field 'step' is missing"),
    (R.LOOP_STATE, {"step": True}, r"step: expected an integer"),
    (R.LOOP_STATE, {"step": -1}, r"step: -1 is out of range"),
    (R.LOOP_STATE, {"step": 2, "pending": [[1]]}, r"pending\[0\]: expected a list of 2"),
    (R.LOOP_STATE, {"step": 2, "published": ["v1"]}, r"published\[0\]: expected an integer"),
    (R.LOOP_STATE, {"step": 2, "counters": {"x": float("nan")}}, r"counters\.x: nan"),
    (R.LOOP_STATE, {"step": 2, "eval": {"best": "high"}}, r"eval\.best: expected a finite"),
    (R.LOOP_STATE, {"step": 2, "finished": "yes"}, r"finished: expected true or false"),
    (R.LOOP_STATE, {"step": 2, "mlflow_run_id": 7}, r"mlflow_run_id: expected a string"),
    (R.TRAINER_STATE, {"param_groups": []}, r"'step_count' is missing"),
    (R.TRAINER_STATE, {"step_count": 1, "param_groups": {}}, r"param_groups: expected a list"),
    (R.TRAINER_STATE, {"step_count": 1, "param_groups": [{"lr": 1}]}, r"'params' is missing"),
    (R.TRAINER_STATE, {"step_count": 1, "param_groups": [], "tp": 0}, r"tp: 0 is out of range"),
    (R.MANIFEST, {"files": {"a": {"size": "9", "sha256": "x"}}}, r"files\.a\.size: expected"),
    (R.MANIFEST, {"files": []}, r"files: expected an object"),
    (R.SWEEP_STATE, [1], r"expected an object, got list"),
    (R.SWEEP_STATE, {"runs": []}, r"runs: expected an object"),
    (R.SWEEP_STATE, {"runs": {"r": {"status": "done"}}}, r"runs\.r\.status: \"done\" is not one"),
    (R.SWEEP_STATE, {"runs": {"r": {"pid": "12"}}}, r"runs\.r\.pid: expected an integer"),
    (R.SWEEP_STATE, {"invocations": -2}, r"invocations: -2 is out of range"),
    (R.SWEEP_RUN, {"override_hash": 5}, r"override_hash: expected a string"),
]


@pytest.mark.parametrize("schema, value, pattern", RECORDS)
def test_state_file_schemas(schema, value, pattern):
    err = R.check(schema, value)
    assert err is not None and re.search(pattern, err), err


def test_state_files_written_by_sat_pass_their_schema():
    good = {
        "step": 2,
        "pending": [[2, 1]],
        "published": [0, 1],
        "engine_version": 1,
        "min_needed": 1,
        "finished": False,
        "mlflow_run_id": None,
        "counters": {"sat_steps": 2, "sat_active_steps": 2.0},
        "eval": {"best": 1.5, "best_step": 0, "last": None, "last_step": None, "key": None},
    }
    assert R.check(R.LOOP_STATE, good) is None
    assert R.check(R.SWEEP_STATE, {"runs": {}, "parents": {}, "invocations": 0}) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint as the local trainer writes it (model, AdamW moments after one step,
    trainer and loop state, no manifest: the checks must stand without one)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from sat_cli.trainers.optim_state import optimizer_tensors

    ck = tmp_path_factory.mktemp("ck") / "checkpoints" / "step_2"
    shutil.copytree(TINY, ck / "trainer" / "model")
    model = AutoModelForCausalLM.from_pretrained(str(TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    tensors, groups = optimizer_tensors(opt)
    save_file(tensors, str(ck / "trainer" / "optimizer.safetensors"))
    state = {"step_count": 2, "param_groups": groups}
    (ck / "trainer" / "trainer_state.json").write_text(json.dumps(state))
    (ck / "loop_state.json").write_text(json.dumps({"step": 2, "pending": [], "published": [0]}))
    return ck


def _json_edit(rel: str, fn):
    def edit(ck: Path) -> None:
        p = ck / rel
        p.write_text(json.dumps(fn(json.loads(p.read_text()))))

    return edit


def _optimizer_edit(fn):
    def edit(ck: Path) -> None:
        from safetensors.torch import load_file, save_file

        p = ck / "trainer" / "optimizer.safetensors"
        sd = load_file(str(p))
        fn(sd)
        save_file(sd, str(p))

    return edit


def _reshape_first_moment(sd: dict) -> None:
    key = sorted(k for k in sd if k.endswith("/exp_avg"))[3]
    sd[key] = sd[key].flatten()[:5].clone()


def _nan_weights(ck: Path) -> None:
    from safetensors.torch import load_file, save_file

    p = ck / "trainer" / "model" / "model.safetensors"
    sd = load_file(str(p))
    sd["lm_head.weight"] = sd["lm_head.weight"] * float("nan")
    save_file(sd, str(p), metadata={"format": "pt"})


def _fifo(rel: str):
    def edit(ck: Path) -> None:
        (ck / rel).unlink()
        os.mkfifo(ck / rel)

    return edit


DAMAGE = {
    "loop-state-a-list": (
        lambda ck: (ck / "loop_state.json").write_text("[]"),
        r"loop_state\.json: expected an object, got list",
    ),
    "loop-state-step-null": (
        _json_edit("loop_state.json", lambda s: {**s, "step": None}),
        r"loop_state\.json: step: expected an integer >= 0, got null",
    ),
    "loop-state-other-step": (
        _json_edit("loop_state.json", lambda s: {**s, "step": 3}),
        r"does not describe step_2",
    ),
    "loop-state-nan": (
        lambda ck: (ck / "loop_state.json").write_text('{"step": 2, "eval": {"best": NaN}}'),
        r"eval\.best: nan is out of range",
    ),
    "trainer-state-truncated": (
        lambda ck: (ck / "trainer/trainer_state.json").write_text('{"step_co'),
        r"trainer/trainer_state\.json is unreadable \(JSONDecodeError",
    ),
    "trainer-state-no-groups": (
        _json_edit("trainer/trainer_state.json", lambda s: {"step_count": 2}),
        r"'param_groups' is missing",
    ),
    "trainer-state-fewer-params": (
        _json_edit(
            "trainer/trainer_state.json",
            lambda s: {**s, "param_groups": [{**s["param_groups"][0], "params": [0, 1]}]},
        ),
        r"parameter groups hold 2 parameters, the model has \d+",
    ),
    "optimizer-wrong-shape": (
        _optimizer_edit(_reshape_first_moment),
        r"'state/\d+/exp_avg' has shape \[5\] but the parameter has",
    ),
    "optimizer-unknown-parameter": (
        _optimizer_edit(lambda sd: sd.update({"state/9999/exp_avg": sd["rng/torch"][:1].float()})),
        r"'state/9999/exp_avg' names no parameter",
    ),
    "optimizer-no-rng": (
        _optimizer_edit(lambda sd: sd.pop("rng/torch")),
        r"no random-number state",
    ),
    "optimizer-truncated": (
        lambda ck: (ck / "trainer/optimizer.safetensors").write_bytes(b"\x10" * 20),
        r"optimizer\.safetensors is not a readable safetensors file",
    ),
    "optimizer-a-fifo": (_fifo("trainer/optimizer.safetensors"), r"is a FIFO, not a regular file"),
    "trainer-state-a-fifo": (
        _fifo("trainer/trainer_state.json"),
        r"trainer_state\.json is missing",
    ),
    "manifest-a-fifo": (
        lambda ck: os.mkfifo(ck / "manifest.json"),
        r"manifest\.json is unreadable.*FIFO",
    ),
    "manifest-wrong-shape": (
        lambda ck: (ck / "manifest.json").write_text('{"files": {"a": 1}}'),
        r"manifest\.json: files\.a: expected an object",
    ),
    "weights-nan": (_nan_weights, r"1 tensor\(s\) hold NaN or infinite values \('lm_head\.weight'"),
}


@pytest.mark.timeout(60)  # a FIFO opened for reading would block here forever
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named(case, checkpoint, tmp_path):
    from sat_cli.checkpoints.manifest import verify_checkpoint

    ck = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(checkpoint, ck, symlinks=True)
    assert verify_checkpoint(ck) is None  # the copy is good before the damage
    damage, pattern = DAMAGE[case]
    damage(ck)
    reason = verify_checkpoint(ck)
    assert reason is not None and re.search(pattern, reason), reason


def test_resume_refuses_a_checkpoint_of_another_trainer_before_writing(checkpoint, tmp_path):
    from sat_cli.checkpoints.manifest import resume_checkpoint

    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent, run / "checkpoints")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    megatron = {"backend": "megatron", "world_size": 2, "tp": 1, "ep": 2, "pp": 1}
    with pytest.raises(
        UserError,
        match=r"another trainer.*backend: 'local' in the checkpoint, "
        r"'megatron' now",
    ):
        resume_checkpoint(run, True, str(TINY), log=lambda m: None, trainer=megatron)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    ck = resume_checkpoint(run, True, str(TINY), log=lambda m: None, trainer={"backend": "local"})
    assert ck.name == "step_2"


def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one(checkpoint, tmp_path):
    from sat_cli.checkpoints.manifest import select_checkpoint
    from sat_cli.checkpoints.state import CheckpointError, read_loop_state

    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoint, root / "step_2")
    shutil.copytree(checkpoint, root / "step_3")
    (root / "step_3" / "loop_state.json").write_text('{"step": null}')
    seen: list[str] = []
    ck, damaged = select_checkpoint(root, seen.append)
    assert ck.name == "step_2" and [d.name for d in damaged] == ["step_3"]
    assert "step_3 is damaged (loop_state.json: step: expected an integer" in seen[0]
    with pytest.raises(CheckpointError, match=r"step: expected an integer >= 0, got null"):
        read_loop_state(root / "step_3")


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("[1, 2]", r"sweep_state\.json: expected an object, got list"),
        ('{"runs": {"a": {"attempts": "1"}}}', r"runs\.a\.attempts: expected an integer"),
        ("{not json", r"sweep_state\.json is unreadable"),
        (None, r"sweep_state\.json is unreadable.*FIFO"),
    ],
)
@pytest.mark.timeout(60)
def test_a_damaged_sweep_state_is_refused(tmp_path, text, pattern):
    from sat_cli.sweep.state import read_state

    path = tmp_path / "sweep_state.json"
    if text is None:
        os.mkfifo(path)
    else:
        path.write_text(text)
    with pytest.raises(UserError, match=pattern):
        read_state(tmp_path)


def test_a_damaged_run_record_is_refused(tmp_path):
    from sat_cli.sweep.state import _recorded_hash

    (tmp_path / "sweep_run.json").write_text('["not", "a", "record"]')
    with pytest.raises(UserError, match=r"run record .*sweep_run\.json: expected an object"):
        _recorded_hash(tmp_path)
    assert _recorded_hash(tmp_path / "none") is None


# ----------------------------------------------------------------------------- sweeps

SWEEP = """\
name: s
base: [experiment=cpu_smoke{base}]
axes: {axes}
methods: {methods}
seeds: [0]
"""


def _sweep(tmp_path: Path, axes: str = "{}", base: str = "", methods: str = "{A: [algo=grpo]}"):
    from sat_cli.sweep import load_sweep

    p = tmp_path / "s.yaml"
    p.write_text(SWEEP.format(axes=axes, base=base, methods=methods))
    return load_sweep(p, [f"run.dir={tmp_path / 'runs'}", "tracking=none"])


@pytest.mark.parametrize(
    "value",
    [
        "1,8",
        "range(0,10,3)",
        "range(5)",
        "range(10,0,-3)",
        "choice(a,b,c)",
        "sort(3,1,2)",
        "range(1.0,2.0,0.25)",
        "range(0,0)",
        "7",
    ],
)
def test_axis_sizes_are_computed_without_enumerating(value):
    _check_axis_size(value)


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(-50, 50),
    stop=st.integers(-50, 50),
    step=st.integers(-7, 7).filter(bool),
)
def test_integer_range_sizes_equal_their_enumeration(start, stop, step):
    """The size arithmetic (divmod, exact for any integer) against Hydra's own enumeration."""
    _check_axis_size(f"range({start},{stop},{step})")


def _check_axis_size(value):
    from sat_cli.sweep.overrides import axis_size, override_parser

    parser = override_parser()
    ov = parser.parse_override(f"x={value}")
    n = len(list(ov.sweep_string_iterator())) if ov.is_sweep_override() else 1
    assert axis_size(parser, "x", value, "w") == n


@pytest.mark.parametrize(
    "axes, pattern",
    [
        ('{trainer.lr: "range(0,1000000000)"}', r"1000000000 runs .*more than max_runs=2000"),
        ('{lag: "range(0,100)", trainer.lr: "range(0,100)"}', r"10000 runs"),
        ('{lag: "shuffle(1,2)"}', r"shuffle\(\) gives another order"),
        ('{trainer.lr: "interval(0,1)"}', r"interval\(\) is a continuous range"),
        ('{lag: "range(0,10,0)"}', r"has no finite list of values"),
        (
            '{lag: "range(0,99999999999999999999999999999999)"}',
            r"the grid has 1e\+32 runs",
        ),
        ('{trainer.lr: "range(0,1e308,1e-308)"}', r"has more values than any sweep can hold"),
        ('{trainer.lr: "range(0,10,1e-320)"}', r"has more values than any sweep can hold"),
        ('{"++seed": "1,2"}', r"axes\.\+\+seed sets 'seed', which the sweep sets"),
        ('{trainer.lr: "0.1,0.2", "++trainer.lr": "0.3,0.4"}', r"both set 'trainer\.lr'"),
    ],
)
def test_sweep_grids_refused_at_once(tmp_path, axes, pattern):
    t0 = time.monotonic()
    with pytest.raises(UserError, match=pattern):
        _sweep(tmp_path, axes=axes)
    assert time.monotonic() - t0 < 10  # never enumerated


@pytest.mark.parametrize(
    "section, pattern",
    [
        (
            "slurm: {partition: [a, b]}",
            r"slurm\.partition must be a single value, got \['a', 'b'\]",
        ),
        ('slurm: {gpus_per_node: "x"}', r"slurm\.gpus_per_node must be a number"),
        ("slurm: {time_min: true}", r"slurm\.time_min must be a number"),
        ('slurm: {setup: "module load cuda"}', r"slurm\.setup must be a list of strings"),
        ("slurm: {setup: {a: 1}}", r"slurm\.setup must be a list of strings"),
        ("slurm: {additional: 5}", r"slurm\.additional must be a mapping KEY: VALUE"),
        ("slurm: {additional: [qos]}", r"slurm\.additional must be a mapping"),
        ("slurm: {additional: {qos: [a]}}", r"slurm\.additional must be a mapping"),
        ("ray: {address: [1]}", r"ray\.address must be a single value"),
        ("ray: {resources: 5}", r"ray\.resources must be a mapping"),
        ('ray: {num_cpus: "a"}', r"ray\.num_cpus must be a number"),
    ],
)
def test_executor_sections_of_the_wrong_shape_are_refused_when_read(tmp_path, section, pattern):
    """A scalar where a list or a mapping belongs (or the reverse) is refused by load_sweep
    itself, whatever --executor is chosen: `setup: "module load cuda"` was taken as the 16 lines
    'm', 'o', 'd', ... and a list partition was sent as its repr."""
    from sat_cli.sweep import load_sweep

    (tmp_path / "s.yaml").write_text(
        SWEEP.format(axes="{}", base="", methods="{A: [algo=grpo]}") + section + "\n"
    )
    with pytest.raises(UserError, match=pattern):
        load_sweep(tmp_path / "s.yaml")


def test_executor_sections_of_the_right_shape_are_read(tmp_path):
    from sat_cli.sweep import load_sweep

    section = (
        "slurm: {partition: gpu, time_min: 60, mem_gb: 64.5, setup: ['module load cuda'], "
        "additional: {qos: high}}\nray: {address: 'h:1', num_cpus: 2, resources: ['TPU=1']}\n"
    )
    (tmp_path / "s.yaml").write_text(
        SWEEP.format(axes="{}", base="", methods="{A: [algo=grpo]}") + section
    )
    sweep = load_sweep(tmp_path / "s.yaml", [f"run.dir={tmp_path / 'runs'}", "tracking=none"])
    assert sweep.executors["slurm"]["setup"] == ["module load cuda"]
    assert sweep.executors["slurm"]["additional"] == {"qos": "high"}
    assert sweep.executors["ray"]["resources"] == ["TPU=1"]


def test_max_runs_is_the_sweep_files_to_raise(tmp_path):
    (tmp_path / "s.yaml").write_text(
        SWEEP.format(axes='{lag: "range(0,3)"}', base="", methods="{A: [algo=grpo]}")
        + "max_runs: 2\n"
    )
    from sat_cli.sweep import load_sweep

    with pytest.raises(
        UserError,
        match=r"3 runs \(1 methods × lag\(3\) × 1 seeds\), more than "
        r"max_runs=2.*set max_runs: 3",
    ):
        load_sweep(tmp_path / "s.yaml")


@pytest.mark.parametrize(
    "axes, base, methods, pattern",
    [
        (
            '{lag: "1,8"}',
            ", lag.n=2",
            "{A: [algo=grpo]}",
            r"runs 'a-lag1-s0' and 'a-lag8-s0' are the same config .*axes: lag=1, axes: lag=8; "
            r"base: lag\.n=2 sets the same setting in both",
        ),
        (
            '{lag: "1,8", lag.n: "2,3"}',
            "",
            "{A: [algo=grpo]}",
            r"'a-lag1-n2-s0' and 'a-lag8-n2-s0' are the same config.*axes: lag\.n=2 sets the same",
        ),
        (
            "{}",
            "",
            "{A: [algo=grpo], B: [algo=grpo, clip=sat]}",
            r"'a-s0' and 'b-s0' are the same config \(they differ only in methods\.B: clip=sat; "
            r"the difference changes nothing",
        ),
        ('{tracking.histogram_every: "5,10"}', ", tracking=none", "{A: [algo=grpo]}", None),
    ],
)
def test_runs_of_a_grid_that_are_the_same_config_are_refused(
    tmp_path, axes, base, methods, pattern
):
    from sat_cli.sweep import validate

    sweep = _sweep(tmp_path, axes=axes, base=base, methods=methods)
    if pattern is None:  # a real difference: both runs stay
        assert len(validate(sweep).run_dirs) == 2
        return
    with pytest.raises(UserError, match=pattern):
        validate(sweep)


def test_a_sweep_run_with_an_option_of_another_command_is_refused(tmp_path):
    from sat_cli.sweep import validate

    with pytest.raises(
        UserError,
        match=r"does not compose: 'ckpt=x': ckpt is a setting of "
        r"`sat eval`; `sat train` does not use it",
    ):
        validate(_sweep(tmp_path, base=", ckpt=x"))


# ----------------------------------------------------------------------------- numbers


def test_every_numeric_setting_is_checked_for_nan_by_one_rule():
    """Every float of the composed default config, set to NaN and to infinity, is refused by
    the one walk (no field escapes it: the walk does not know the fields)."""
    from omegaconf import OmegaConf

    from sat_cli.config import compose
    from sat_cli.validate import check_finite

    base = OmegaConf.to_container(
        compose(["trainer=megatron", "engine=sglang", "engine.dtype=bfloat16"]), resolve=True
    )

    def floats(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from floats(v, f"{key}.{k}" if key else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from floats(v, f"{key}[{i}]")
        elif isinstance(node, float):
            yield key

    keys = list(floats(base))
    assert len(keys) >= 30 and "trainer.betas[0]" in keys and "trainer.gpu_memory_gb" in keys
    for key in keys:
        for bad in (float("nan"), float("inf"), float("-inf")):
            c = json.loads(json.dumps(base))
            node, *path = [c], *re.findall(r"[^.\[\]]+", key)
            for part in path[:-1]:
                node = [node[-1][int(part) if part.isdigit() else part]]
            node[-1][int(path[-1]) if path[-1].isdigit() else path[-1]] = bad
            with pytest.raises(ConfigError, match=re.escape(f"{key}={bad} is not a finite")):
                check_finite(c)


@pytest.mark.parametrize(
    "override, key",
    [("algo.icepop_low=nan", "algo.icepop_low"), ("trainer.betas=[0.9,inf]", "trainer.betas[1]")],
)
def test_nan_and_infinity_are_refused_at_compose_time(override, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=-?(nan|inf) is not a finite number"):
        load([override])


# ----------------------------------------------------------------------------- commands, combinations


@pytest.mark.parametrize(
    "command, override, pattern",
    [
        ("train", "ckpt=runs/x", r"ckpt is a setting of `sat eval`; `sat train` does not use"),
        ("plan", "+ckpt=runs/x", r"ckpt is a setting of `sat eval`; `sat plan`"),
        ("pretrain", "ckpt=x", r"`sat pretrain` does not use"),
        ("eval", "resume=auto", r"resume is a setting of `sat train` and `sat plan`"),
        ("eval", "checkpoint.every=5", r"checkpoint is a setting of `sat train`"),
        ("eval", "lag=8", r"'lag=8': lag is a setting of `sat train`"),
        ("eval", "max_steps=3", r"max_steps is a setting"),
        ("eval", "r3=true", r"r3 is a setting"),
        ("eval", "algo=gspo", r"algo is a setting"),
    ],
)
def test_settings_of_another_command_are_refused(command, override, pattern):
    from sat_cli.config.grammar import check_command_keys

    with pytest.raises(ConfigError, match=pattern):
        check_command_keys([override], command)


def test_settings_each_command_takes_are_accepted():
    from sat_cli.config.grammar import check_command_keys

    check_command_keys(["ckpt=x", "eval.n=2", "trainer.device=cuda", "run.dir=r"], "eval")
    check_command_keys(["resume=auto", "max_steps=3", "lag=8", "checkpoint.every=1"], "train")
    check_command_keys(["ckpt=x", "resume=auto"], "config")  # prints any config
    check_command_keys(["max_steps=3", "checkpoint.every=1", "algo=gspo"], "pretrain")  # a sweep's
    with pytest.raises(ConfigError, match=r"ckpt is a setting of `sat eval`"):
        load(["ckpt=x"], "train")


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            ["trainer=megatron", "model=qwen3_0_6b", "r3=true"],
            r"r3=true needs a Mixture-of-Experts model",
        ),
        (
            ["task=gsm8k"],
            r"model=tiny_moe is warm-started on the toy task or a file of yours \(task\.path=<file>\) only; task\.kind=gsm8k",
        ),
        (
            [
                "engine=sglang",
                "engine.device=cpu",
                "engine.dtype=bfloat16",
                "lag=2",
                "lag.mode=bounded",
                "lag.inflight_updates=true",
                "r3=true",
            ],
            r"lag\.inflight_cache=recompute re-prefills running requests.*R3",
        ),
    ],
)
def test_combinations_train_cannot_run_are_refused_at_compose_time(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load(overrides)


MEGATRON_MODELS = [
    ({"model_type": "mistral"}, r"qwen3_moe, qwen3, llama models only, this one is 'mistral'"),
    ({"model_type": "qwen3"}, None),
    ({"model_type": "llama", "tie_word_embeddings": True}, None),
    ({"model_type": "llama", "mlp_bias": True}, r"mlp_bias"),
    ({"model_type": "llama", "hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}}, r"rope_scaling"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [0]}, r"dense layers"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "decoder_sparse_step": 2}, r"dense layers"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "attention_bias": True}, r"attention_bias"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "use_sliding_window": True}, r"sliding"),
    ({"model_type": "qwen3_moe", "num_experts": 8}, None),
]


@pytest.mark.parametrize("config, problem", MEGATRON_MODELS)
def test_megatron_model_rules_at_compose_time(config, problem):
    from sat_cli.trainers.megatron.checks import megatron_model_problem

    got = megatron_model_problem(config)
    assert (got is None) if problem is None else re.search(problem, got), got


@pytest.mark.slow
@pytest.mark.parametrize("config, problem", MEGATRON_MODELS)
def test_megatron_model_rules_follow_the_worker(config, problem):
    """The compose-time rule says what the worker's ``check_supported`` says (it needs torch
    and megatron-core, so the config cannot import it)."""
    pytest.importorskip("megatron.core")
    from sat_cli.trainers.megatron.model import check_supported

    if problem is None:
        check_supported(config)
    else:
        with pytest.raises(NotImplementedError):
            check_supported(config)


def test_a_model_folder_of_another_kind_is_refused_for_megatron(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(
        ConfigError,
        match=r"trainer=megatron cannot train .*config\.json\): it "
        r"builds qwen3_moe, qwen3, llama models only, this one is 'mistral'",
    ):
        load(["trainer=megatron", "model=qwen3_0_6b", f"model.path={tmp_path}"])


def _dense_model_folder(path, family="qwen3"):
    from sat_cli.models.tiny_dense import TINY_DENSE_CONFIG

    path.mkdir(exist_ok=True)
    cfg = {"model_type": family, **TINY_DENSE_CONFIG, "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dense_models_compose_for_megatron_and_refuse_r3(tmp_path, family):
    model = ["model.kind=hf", f"model.path={_dense_model_folder(tmp_path / family, family)}"]
    load(["trainer=megatron", "trainer.tp=2", *model])  # a dense Qwen3 or Llama: accepted
    # r3: model.num_experts (8, the tiny model's default) says MoE, the folder says dense
    for trainer in ("megatron", "local"):
        with pytest.raises(
            ConfigError,
            match=r"^r3=true replays MoE routes, but model=tiny_moe "
            r"\(.*config\.json\) is dense: drop r3$",
        ):
            load([f"trainer={trainer}", *model, "r3=true"])


def test_r3_on_a_dense_model_folder_exits_2_with_one_line(tmp_path):
    from cli_helpers import run_sat

    folder = _dense_model_folder(tmp_path / "dense")
    out = run_sat(
        "plan", "trainer=megatron", "model.kind=hf", f"model.path={folder}", "r3=true", cwd=tmp_path
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "is dense: drop r3" in out.stderr
    assert "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- hostile files


@pytest.mark.timeout(60)
def test_fifos_are_never_opened_for_reading(tmp_path):
    from sat_cli.models.weights_check import check_hf_dir
    from sat_cli.records import LOOP_STATE, RecordError, read_json
    from sat_cli.tasks.data import load_jsonl
    from sat_cli.tasks.datafiles import DataError, benchmark_file

    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        saved = (model / name).read_bytes()
        (model / name).unlink()
        os.mkfifo(model / name)
        with pytest.raises(UserError, match=rf"'{re.escape(name)}' is not a regular file"):
            check_hf_dir(model, "model.path")
        (model / name).unlink()
        (model / name).write_bytes(saved)
    os.mkfifo(tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match=r"rows\.jsonl: is a FIFO, not a regular file"):
        load_jsonl(tmp_path / "rows.jsonl")
    os.mkfifo(tmp_path / "aime24.jsonl")
    with pytest.raises(DataError, match=r"aime24\.jsonl is not a regular file"):
        benchmark_file("aime24", tmp_path)
    os.mkfifo(tmp_path / "loop_state.json")
    with pytest.raises(RecordError, match=r"unreadable \(NotRegularFile: is a FIFO"):
        read_json(tmp_path / "loop_state.json", LOOP_STATE)


def test_nan_weights_are_refused_before_sampling(tmp_path):
    from safetensors.torch import load_file, save_file

    from sat_cli.models.weights_check import check_hf_dir

    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    check_hf_dir(model, "model.path", values=True)
    sd = load_file(str(model / "model.safetensors"))
    sd["model.norm.weight"][3] = float("inf")
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    check_hf_dir(model, "model.path")  # the header check alone does not read values
    with pytest.raises(
        UserError,
        match=r"1 tensor\(s\) hold NaN or infinite values "
        r"\('model\.norm\.weight'; 1 in 'model\.norm\.weight'\)",
    ):
        check_hf_dir(model, "model.path", values=True)


def test_group_options_are_checked_after_interpolation(monkeypatch):
    monkeypatch.setenv("SAT_TEST_OPTION", "../../../../../../../../tmp/x/evil")
    with pytest.raises(ConfigError, match=r"\(resolves to '\.\./\.\..*conf/algo/ \(no '\.\.'"):
        load(["algo=${oc.env:SAT_TEST_OPTION}"])
    with pytest.raises(ConfigError, match=r"interpolation only if it resolves on its own"):
        load(["algo=${oc.env:SAT_TEST_UNSET_VARIABLE}"])
    monkeypatch.setenv("SAT_TEST_OPTION", "gspo")
    assert load(["algo=${oc.env:SAT_TEST_OPTION}"])[1].algo.name == "gspo"


# ----------------------------------------------------------------------------- resources


@pytest.mark.parametrize(
    "exc, pattern",
    [
        (MemoryError(), r"^out of memory \(MemoryError\); .*ulimit -v"),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"),
            r"^out of memory \(RuntimeError: DefaultCPUAllocator",
        ),
        (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), r"^out of memory"),
        (RuntimeError("can't start new thread"), r"^out of memory \(RuntimeError: can't start"),
        (ImportError("libx.so: failed to map segment from shared object"), r"failed to map"),
        (OSError(12, "Cannot allocate memory"), r"^Cannot allocate memory \(OSError\)"),
        (OSError(24, "Too many open files"), r"Too many open files.*ulimit -n"),
    ],
)
def test_resource_errors_are_one_line_exit_1(exc, pattern):
    from sat_cli.errors import as_failure

    err = as_failure(exc)
    assert isinstance(err, RunFailed) and err.code == 1 and re.search(pattern, str(err)), err
    assert "resume=auto" in str(err)


def test_memory_error_in_a_command_is_one_line(capsys):
    from sat_cli.cli.guard import guard as _guard

    def body():
        raise MemoryError()

    with pytest.raises(typer.Exit) as info:
        _guard(body)
    err = capsys.readouterr().err
    assert info.value.exit_code == 1 and err.startswith("sat: error: out of memory")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_low_address_space_limit_is_refused_up_front(monkeypatch):
    import resource

    from sat_cli.commands import preflight

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1 << 30, resource.RLIM_INFINITY))
    with pytest.raises(
        RunFailed,
        match=r"address-space limit of this process is 1\.00 GiB "
        r"\(ulimit -v 1048576\); `sat train` needs at least 2 GiB",
    ):
        preflight.check_address_space("train")
    monkeypatch.setattr(resource, "getrlimit", lambda w: (resource.RLIM_INFINITY,) * 2)
    preflight.check_address_space("train")
