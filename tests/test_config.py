"""Every option of every config group composes and validates; bad values fail with clear errors."""

from __future__ import annotations

import pytest

from sat_cli.config import GROUPS, ConfigError, conf_dir, group_options, load

# keys whose null the schema replaces by a derived value, written back into the config, and that
# value for every option's own YAML (the rule itself: tests/test_plan.py)
DERIVED = {
    "trainer.nproc_per_node": 1,  # the fewest ranks of a layout with all sizes 1
    "engine.dtype": "float32",  # null: by engine.device (cpu here)
}


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in GROUPS for o in group_options(g)],
)
def test_every_group_option_composes(group, option):
    """Selecting an option composes, validates, and lands every value of its YAML file."""
    import yaml
    from omegaconf import OmegaConf

    overrides = [f"{group}='{option}'" if option.isdigit() else f"{group}={option}"]
    if group == "eval" and option == "jsonl":
        overrides.append("eval.path=problems.jsonl")
    needs = {"python": "fn=r.py:f", "http": "url=http://127.0.0.1:1/", "regex": "pattern=x"}
    if group == "reward" and option in needs:
        overrides.append(f"reward.{needs[option]}")  # the setting each plugin needs
    needs = {
        "python": "reward.fn=r.py:f",
        "http": "reward.url=http://127.0.0.1:1/",
        "regex": "reward.pattern=x",
    }
    if group == "reward" and option in needs:
        overrides.append(needs[option])  # the setting each plugin needs
    if group == "algo" and option in ("m2po", "vcpo"):
        overrides.append("clip=ppo")  # no clip interval: the default clip=sat is refused
    if group == "launcher" and option == "ray":
        overrides += ["launcher.address=127.0.0.1:6379", "trainer=megatron"]  # something to place
    if group == "task" and option != "toy_add":
        # the tiny default warm-starts on the toy task only; dapo_math's 32768 new tokens need
        # more than Qwen3-0.6B's 32768 positions (config/budgets.py): the paper's model
        overrides.append("model=qwen3_30b_a3b" if option == "dapo_math" else "model=qwen3_0_6b")
    cfg, obj = load(overrides)
    text = (conf_dir() / group / f"{option}.yaml").read_text()
    values = yaml.safe_load(text) or {}
    if group == "launcher" and option == "ray":
        values.pop("address")  # null in the file; set above
    values = {k: v for k, v in values.items() if k != "defaults"}  # e.g. the settings class
    if group == "experiment" or text.startswith("# @package _global_"):  # clip=ppo_tight too
        node = OmegaConf.to_container(cfg)
    else:
        node = OmegaConf.to_container(cfg[group])
    resolved = OmegaConf.to_container(
        # eval=heldout takes the task's template and length: ${task.…} resolves against it
        OmegaConf.create(
            values | {"run": {"dir": "runs"}, "task": OmegaConf.to_container(cfg.task)}
        ),
        resolve=True,
    )

    def check(expected, actual, where):
        if isinstance(expected, dict):
            for k, v in expected.items():
                check(v, actual[k], f"{where}.{k}")
        elif expected is None and where in DERIVED:
            assert actual == DERIVED[where], where  # null: the schema derives it
        else:
            assert actual == expected, where

    resolved.pop("run")
    if "task" not in values:
        resolved.pop("task")
    check(resolved, node, group)


def test_defaults_are_the_embedded_cpu_setup():
    _, obj = load([])
    assert (obj.model.name, obj.task.name, obj.engine.name, obj.trainer.name) == (
        "tiny_moe",
        "toy_add",
        "local",
        "local",
    )
    assert obj.clip.name == "sat" and obj.clip.adaptive is True
    assert obj.algo.ratio_denominator == "rollout"
    assert obj.tracking.uri == "sqlite:///runs/mlflow.db"
    assert obj.run.dir == "runs"


def test_design_card_example():
    _, obj = load(["algo=gspo", "lag=8", "r3=true"])
    assert obj.algo.name == "gspo" and obj.lag.n == 8 and obj.r3 is True
    assert obj.clip.name == "sat"


def test_tracking_uri_follows_run_dir():
    _, obj = load(["run.dir=elsewhere"])
    assert obj.tracking.uri == "sqlite:///elsewhere/mlflow.db"


def test_lag_any_integer_and_mode():
    _, obj = load(["lag=3", "lag.mode=fixed"])
    assert (obj.lag.n, obj.lag.mode) == (3, "fixed")


def test_experiment_overlay_changes_only_its_values():
    _, obj = load(["experiment=paper_qwen3_30b_a3b", "algo=gspo", "lag=8", "r3=true"])
    assert obj.model.path == "Qwen/Qwen3-30B-A3B-Base"
    assert (obj.engine.name, obj.trainer.name) == ("sglang", "megatron")
    assert obj.trainer.lr == 1e-6 and obj.trainer.betas == [0.9, 0.98]
    assert (obj.task.prompts_per_step, obj.task.samples_per_prompt) == (256, 16)
    assert obj.algo.name == "gspo" and obj.lag.n == 8


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algo=nope", "Valid options for 'algo': a3po, dapo, decoupled_ppo, dppo_tv, grpo, gspo"),
        ("lag=-1", "lag.n=-1 is out of range"),
        ("lag=abc", "Valid options for 'lag': 0, 1, 2, 4, 8"),
        ("algo.eps_high=2", "algo.eps_high=2.0 is out of range: need 0 < algo.eps_high < 1"),
        ("lag=[1,", "cannot parse override 'lag=[1,'"),
        ("unknownkey=3", "unknown config key 'unknownkey'"),
        ("r3=maybe", "r3: expected a boolean (true or false), got 'maybe'"),
        ("clip.quantile=1.5", "clip.quantile=1.5 is out of range"),
        ("clip.exponent=0", "clip.exponent=0.0 is out of range"),
        ("task.prompts_per_step=0", "task.prompts_per_step=0 is out of range"),
        ("lag.mode=sometimes", "choose one of: interval, fixed, bounded"),
        ("algo.loss_agg=sum", "choose one of: token-mean, seq-mean-token-mean"),
        ("run.name=../../x", "not a safe name"),
        ("trainer.lr=abc", "trainer.lr: expected a number, got 'abc'"),
        ("seed=abc", "seed: expected an integer"),
        ("algo.correction=magic", "choose one of: none, tis, mis, icepop"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load([override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["engine=sglang", "engine.device=cpu", "engine.dtype=float32"],
            "needs engine.dtype=bfloat16",
        ),
        (
            ["engine=sglang", "engine.device=cpu", "engine.deterministic=true"],
            "needs a GPU attention",
        ),
        (["engine=sglang", "engine.device=tpu"], "engine.device='tpu' is not valid"),
        (["engine=local", "engine.device=tpu"], "engine.device='tpu' is not valid"),
        (["engine=sglang", "engine.urls=[localhost:30000]"], "is not http://host:port"),
        (
            ["engine=sglang", "engine.urls=[http://a:1]", "engine.num_servers=2"],
            "started elsewhere",
        ),
        (
            ["engine=sglang", "engine.num_servers=3", "engine.gpu_groups=[0,1]"],
            "one server per group",
        ),
        (
            ["engine=sglang", "engine.device=cpu", "engine.gpu_groups=[0]"],
            "needs engine.device=cuda",
        ),
    ],
)
def test_sglang_settings_that_cannot_work_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load(overrides)


def test_sglang_derived_settings():
    _, obj = load(["engine=sglang"])
    assert (obj.engine.device, obj.engine.dtype, obj.engine.servers) == ("cuda", "bfloat16", 1)
    assert obj.engine.seeded and not obj.engine.router  # deterministic on GPU; one server
    _, obj = load(["engine=sglang", "engine.device=cpu", "engine.num_servers=2"])
    assert not obj.engine.seeded and obj.engine.router and obj.engine.servers == 2
    _, obj = load(["engine=sglang", "engine.urls=[http://10.0.0.2:30000]"])
    assert obj.engine.servers == 0 and not obj.engine.router


@pytest.mark.parametrize("algo", ["m2po", "vcpo"])
def test_sat_on_an_unclipped_algorithm_is_refused(algo):
    with pytest.raises(ConfigError, match=f"algo={algo} has no clip interval"):
        load([f"algo={algo}"])
    load([f"algo={algo}", "clip=ppo"])


def test_new_options_validated():
    with pytest.raises(ConfigError, match="clip.q_scope"):
        load(["clip.q_scope=rank"])
    with pytest.raises(ConfigError, match="clip.micro_batch_size"):
        load(["clip.micro_batch_size=0"])
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        load(["algo=vcpo", "clip=ppo", "algo.loss_agg=token-mean"])
    with pytest.raises(ConfigError, match="algo.vcpo_ess_base"):
        load(["algo=vcpo", "clip=ppo", "algo.vcpo_ess_base=2"])
    with pytest.raises(ConfigError, match="algo.behav_mode"):
        load(["algo=a3po", "algo.behav_mode=drop"])
    with pytest.raises(ConfigError, match="eval.final_n"):
        load(["eval.final_n=0"])
    _, obj = load(["eval.final_n=8", "clip.q_scope=micro_batch", "clip.micro_batch_size=4"])
    assert (obj.eval.final_n, obj.clip.q_scope, obj.clip.micro_batch_size) == (8, "micro_batch", 4)


def test_grader_timeout_reaches_the_benchmark_grader():
    from sat_cli.build.parts import eval_problems
    from sat_cli.tasks.reward import grade

    _, obj = load(["eval=aime24", "eval.grader_timeout_s=0.25"])
    problems, grader, _ = eval_problems(obj, None)
    assert len(problems) == 30
    assert grader.func is grade and grader.keywords == {"timeout_s": 0.25}
    assert grader("The answer is \\boxed{204}", "204") and not grader("\\boxed{7}", "204")
    with pytest.raises(ConfigError, match="eval.grader_timeout_s"):
        load(["eval.grader_timeout_s=0"])
    with pytest.raises(ConfigError, match="node_rank"):
        load(["trainer.node_rank=1"])


@pytest.mark.parametrize(
    "overrides",
    [["engine=sglang"], ["trainer.device=cuda"], ["engine.device=cuda"]],
)
def test_portable_numerics_needs_the_local_engine_on_the_cpu(overrides):
    """A cross-section rule (config/compat.py): portable numerics pin torch's CPU code paths."""
    with pytest.raises(ConfigError, match="run.portable_numerics=true pins torch's CPU code"):
        load(["run.portable_numerics=true", *overrides])
    load(["run.portable_numerics=true"])  # the default engine and devices are accepted
