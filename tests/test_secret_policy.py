"""One secret policy: secrets planted in a run's inputs appear nowhere in its run folder, its
MLflow store (params, tags, artifacts: ``config.yaml``) or the terminal (a real ``sat train``)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from cli_helpers import run_sat, seeded_store

from sat_cli.commands.resume_check import differences
from sat_cli.tracking.params import redact_config

PLANTED_URL = "data.dir='https://user:{}@example.org/d?api_key={}&token={}'"
SECRETS = ["PLANTED-PW-5e1", "PLANTED-KEY-9c3", "PLANTED-TOK-7a2"]


def files_under(root: Path):
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def test_planted_secrets_reach_no_output(tmp_path):
    seeded_store(tmp_path / "runs" / "mlflow.db")
    pw, key, tok = SECRETS
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
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sat" / "planted"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["dir"] == "https://user:***@example.org/d?api_key=***&token=***"
    leaks = []
    for path in [*files_under(tmp_path / "runs")]:  # the run folder and the whole store
        data = path.read_bytes()
        leaks += [f"{path.relative_to(tmp_path)}: {s}" for s in SECRETS if s.encode() in data]
    leaks += [f"terminal: {s}" for s in SECRETS if s in out.stdout + out.stderr]
    assert leaks == []
    # a resume compares masked with masked: the same secrets, or rotated ones, differ in nothing
    new = {"data": {"dir": "https://user:OTHER@example.org/d?api_key=K2&token=T2"}}
    assert differences({"data": {"dir": config["data"]["dir"]}}, redact_config(new)) == []


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
