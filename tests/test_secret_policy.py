"""One secret policy: secrets planted in a run's inputs appear nowhere in its run folder, its
MLflow store (params, tags, artifacts: ``config.yaml``) or the terminal (a real ``sat train``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml
from cli_helpers import run_sat, seeded_store

from sat_cli.commands.resume_check import differences
from sat_cli.tracking.params import redact_config

PLANTED_URL = "data.dir='https://user:{}@example.org/d?api_key={}&token={}'"
# one per input surface, all synthetic: a URL's password, two secret query keys, a secret-named
# config key, the value after a secret flag (which the SGLang server prints in its log), an
# environment variable named like a secret (a reward plug-in quotes it in its error: the
# samples table; and a tag that holds it under an ordinary name)
SECRETS = [
    "PLANTED-PW-5e1",
    "PLANTED-KEY-9c3",
    "PLANTED-TOK-7a2",
    "PLANTED-CFG-4d8",
    "PLANTED-FLAG-2b6",
    "PLANTED-ENV-8f0",
]
STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
LEAKY_REWARD = """import os


def score(prompt, response, row):
    raise RuntimeError("the grading service refused key " + os.environ["SAT_TEST_API_TOKEN"])
"""


def files_under(root: Path):
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def test_planted_secrets_reach_no_output(tmp_path):
    seeded_store(tmp_path / "runs" / "mlflow.db")
    (tmp_path / "leaky_reward.py").write_text(LEAKY_REWARD)
    pw, key, tok, cfg, flag, env = SECRETS
    out = run_sat(
        "train",
        "experiment=cpu_smoke",
        "task.prompts_per_step=2",
        "task.samples_per_prompt=2",
        "eval.every=0",
        "run.dir=runs",
        "max_steps=1",
        "run.name=planted",
        PLANTED_URL.format(pw, key, tok),
        f"+tracking.tags.api_key={cfg}",
        f"+tracking.tags.note={env}",
        "tracking.samples_every=1",
        "engine=sglang",
        "engine.device=cpu",
        f"engine.launch_prefix=[{sys.executable},{STANDIN}]",
        "engine.use_router=false",
        f"engine.extra_args=[--api-key,{flag}]",
        "reward=python",
        "reward.fn=leaky_reward.py:score",
        "reward.max_error_frac=1.0",
        cwd=tmp_path,
        env={"SAT_TEST_API_TOKEN": env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sat" / "planted"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["dir"] == "https://user:***@example.org/d?api_key=***&token=***"
    assert config["tracking"]["tags"] == {"api_key": "***", "note": "***"}
    # the surfaces were reached (the test is not vacuous): the server's log quotes its
    # arguments, the samples table the plug-in's error
    assert "'--api-key', '***'" in (run_dir / "logs" / "sglang_0.log").read_text()
    (table,) = (tmp_path / "runs").rglob("samples/train_step_000001.json")
    assert "the grading service refused key ***" in table.read_text()
    leaks = []
    for path in [*files_under(tmp_path / "runs")]:  # the run folder and the whole store
        data = path.read_bytes()
        leaks += [f"{path.relative_to(tmp_path)}: {s}" for s in SECRETS if s.encode() in data]
    leaks += [f"terminal: {s}" for s in SECRETS if s in out.stdout + out.stderr]
    assert leaks == []
    # a resume compares masked with masked: the same secrets, or rotated ones, differ in nothing
    new = {"data": {"dir": "https://user:OTHER@example.org/d?api_key=K2&token=T2"}}
    assert differences({"data": {"dir": config["data"]["dir"]}}, redact_config(new)) == []


def test_sat_plan_masks_the_secrets_it_would_print(tmp_path):
    """`sat plan` names the model: a URL's password and token, and an environment secret's
    value in it, are masked (they were printed as given)."""
    out = run_sat(
        "plan",
        "model.path='https://u:PW-PLAN-31@example.org/PLAN-ENV-77/m?token=TOK-PLAN-5'",
        cwd=tmp_path,
        env={"MY_SERVICE_KEY": "PLAN-ENV-77"},
    )
    assert out.returncode == 0, out.stderr
    assert "model     https://u:***@example.org/***/m?token=*** architecture unknown" in out.stdout
    for secret in ("PW-PLAN-31", "TOK-PLAN-5", "PLAN-ENV-77"):
        assert secret not in out.stdout + out.stderr


def test_environment_variables_named_like_secrets():
    from sat_cli.tracking.params import is_secret_env_name

    named = ["HF_TOKEN", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "MY_KEY"]
    named += ["PGPASSWORD", "DB_PASSWORD_FILE", "CLIENT_SECRET", "SSH_AUTH_SOCK", "GH_PAT"]
    plain = ["PATH", "HOME", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "KEYBOARD", "TOKEN_COUNT"]
    plain += ["CUDA_VISIBLE_DEVICES", "HF_HOME", "PYTHONHASHSEED", "MONKEY", "PWD", "OLDPWD"]
    assert [n for n in named if not is_secret_env_name(n)] == []
    assert [n for n in plain if is_secret_env_name(n)] == []


def test_a_log_is_rewritten_masked_and_only_when_it_holds_a_secret(tmp_path, monkeypatch):
    """``scrub_logs``: the name rules and known values on each line, the file's mode kept; a
    clean file, a link and a FIFO are left as they are."""
    from sat_cli.tracking import params
    from sat_cli.tracking.secret_logs import scrub_logs

    monkeypatch.setattr(params, "_KNOWN", set())
    params.remember_secrets({"tracking": {"tags": {"hf_token": "KNOWN-VALUE-1"}}})
    logs = tmp_path / "logs"
    (logs / "sub").mkdir(parents=True)
    leaky = logs / "sglang_0.log"
    leaky.write_bytes(b"args: --api-key S3CRET-9 x\nheader KNOWN-VALUE-1 \xff end\nclean\n")
    leaky.chmod(0o640)
    clean = logs / "sub" / "megatron_node0.log"
    clean.write_text("nothing secret here: max_new_tokens=8\n")
    before = clean.stat().st_mtime_ns
    os.mkfifo(logs / "fifo.log")
    (logs / "link.log").symlink_to(leaky)
    assert scrub_logs(logs) == [leaky]
    assert leaky.read_bytes() == b"args: --api-key *** x\nheader *** \xff end\nclean\n"
    assert leaky.stat().st_mode & 0o777 == 0o640
    assert clean.stat().st_mtime_ns == before
    assert sorted(p.name for p in logs.iterdir()) == ["fifo.log", "link.log", "sglang_0.log", "sub"]


def test_an_error_that_quotes_the_command_line_masks_its_secrets(tmp_path):
    """Hydra cannot parse an unquoted '=' in a value: the message quotes the overrides; an
    unknown key's message quotes the override."""
    out = run_sat(
        "train",
        "run.dir=runs",
        "data.dir=https://user:PW-1@example.org/d?api_key=KEY-1&x=1",
        "engine.extra_args=[--api-key,FLAG-1]",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "cannot parse override" in out.stderr
    assert "user:***@" in out.stderr and "--api-key,***" in out.stderr
    again = run_sat("train", "run.dir=runs", "+engine.api_key=ASSIGN-1", cwd=tmp_path)
    assert again.returncode == 2 and "'+engine.api_key=***'" in again.stderr
    for secret in ("PW-1", "KEY-1", "FLAG-1", "ASSIGN-1"):
        assert secret not in out.stderr + out.stdout + again.stderr + again.stdout
    assert not (tmp_path / "runs").exists()


def test_sat_config_prints_the_config_with_its_secrets_masked(tmp_path):
    out = run_sat("config", "data.dir='https://u:PW-2@example.org/d?token=T-2&n=3'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "dir: https://u:***@example.org/d?token=***&n=3" in out.stdout
    assert "PW-2" not in out.stdout + out.stderr and "T-2" not in out.stdout + out.stderr


def test_hyphenated_words_are_not_taken_for_secret_flags():
    """'per-token profiles' is prose, not the flag -token with the value 'profiles' (the
    masking hid the word in `sat train`'s lag-profile message); real flags stay masked."""
    from sat_cli.tracking.params import redact_text

    assert redact_text("per-token profiles are not implemented") == (
        "per-token profiles are not implemented"
    )
    assert redact_text("run --token abc and -token=def") == "run --token *** and -token=***"


def test_the_run_folders_lock_records_the_command_masked(tmp_path, monkeypatch):
    """Probe (issue 53 v5): ``<run>/.sat.lock`` (mode 0644, on disk for the whole run and after
    a kill until the next run in the folder) recorded ``sys.argv`` as given: a URL's password,
    its ``token`` query value and an environment secret's value under an ordinary name."""
    import json

    from sat_cli.commands.runlock import LOCK_NAME, RunLock
    from sat_cli.tracking import params

    monkeypatch.setenv("MY_API_TOKEN", "LOCK-ENV-41a")
    monkeypatch.setattr(params, "_ENV_KNOWN", [])
    argv = [
        "sat",
        "train",
        "reward.url='http://user:LOCK-PW-9d2@127.0.0.1:1/score?token=LOCK-TOK-3c7'",
        "+tracking.tags.note=LOCK-ENV-41a",
        "engine.api_key=LOCK-CFG-77e",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with RunLock(tmp_path, log=lambda *a: None):
        text = (tmp_path / LOCK_NAME).read_text()
    assert json.loads(text)["argv"] == [
        "sat",
        "train",
        "reward.url='http://user:***@127.0.0.1:1/score?token=***'",
        "+tracking.tags.note=***",
        "engine.api_key=***",
    ]
