"""Multi-turn runs as complete as single-turn ones (issue 57 item 2; docs/environments.md):
trajectory samples tables (every turn: what the model read, its tokens decoded, each token's
version, tool calls and results, reward parts)."""

from __future__ import annotations

import pytest
from test_multiturn_loop import SevensEnv

from sat_cli import metric_names as M
from sat_cli.config import load as load_cfg
from sat_cli.envs.registry import ENVIRONMENTS, register_env
from sat_cli.samples import Sample
from sat_cli.validate import ConfigError


@pytest.fixture
def sevens_env():
    register_env("sevens_parity")(SevensEnv)
    yield "sevens_parity"
    ENVIRONMENTS.remove("sevens_parity")


def _env_loop(tiny_dir, run_dir, env_name, lag=None, **kw):
    """test_replay's 4-step loop (2 prompts x 4 trajectories of ``env_name``, 3 turns of up to
    8 tokens) at ``lag`` (fixed lag 1 by default); ``kw``: other ``LoopSettings``."""
    from test_replay import _loop

    from sat_cli.envs import trajectory
    from sat_cli.envs.base import EnvSettings
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.multiturn import EnvRun
    from sat_cli.models.tiny_moe import build_char_tokenizer
    from sat_cli.samples import SamplingParams

    stops = tuple(range(3, len(build_char_tokenizer()), 4))
    env = EnvRun(env_name, EnvSettings(max_turns=3), trajectory.TrajectorySettings(max_turns=3))
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=stops)
    lag = lag or LagPolicy(1, "fixed")
    return _loop(tiny_dir, run_dir, "grpo", None, None, lag, sampling=sampling, env=env, **kw)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_trajectory_table_hand_case():
    """Two turns of the compact calculator exchange, by hand: a tool call at version 3, the
    tool's answer, the final answer spanning versions 3 and 4; a replayed copy (no meta) keeps
    everything but the tool results and the turn rewards."""
    from sat_cli.envs.trajectory import TurnStep
    from sat_cli.loop.trajectory_table import COLUMNS, trajectory_table
    from sat_cli.models.tiny_moe import build_char_tokenizer

    tok = build_char_tokenizer()
    prompt, call, obs, answer = _ids(tok, "1+2="), _ids(tok, "[calc:1+2]"), _ids(tok, "3="), []
    answer = _ids(tok, "\\boxed{3}")
    response = call + obs + answer
    n1, n2, no = len(call), len(answer), len(obs)
    s = Sample(
        prompt,
        response,
        [-0.5] * len(response),
        "stop",
        3,
        token_versions=[3] * (n1 + no) + [3, 3] + [4] * (n2 - 2),
        loss_mask=[1] * n1 + [0] * no + [1] * n2,
        turn_ids=[0] * (n1 + no) + [1] * n2,
        meta={
            "steps": [
                TurnStep(0.0, [{"role": "tool", "content": "3="}]),
                TurnStep(1.0, []),
            ]
        },
    )
    bare = Sample(**{**vars(s), "meta": {}})
    table = trajectory_table([[s, bare]], [{"id": "r7"}], [[1.0, 0.25]], tok, "compact")
    assert table["columns"] == COLUMNS
    calls = [{"name": "calc", "arguments": {"input": "1+2"}}]
    assert table["data"] == [
        ["r7", 0, 0, "1+2=", "[calc:1+2]", [3] * n1, calls, [], ["3="], 0.0, 1.0, "stop"],
        ["r7", 0, 1, "3=", "\\boxed{3}", [3, 3] + [4] * (n2 - 2), [], [], [], 1.0, 1.0, "stop"],
        ["r7", 1, 0, "1+2=", "[calc:1+2]", [3] * n1, calls, [], None, None, 0.25, "stop"],
        ["r7", 1, 1, "3=", "\\boxed{3}", [3, 3] + [4] * (n2 - 2), [], [], None, None, 0.25, "stop"],
    ]
    # a dropped group (None) has no trajectory reward; a malformed call is its error line
    bad = Sample(prompt, _ids(tok, "[calc"), [0.0] * 5, "length", 0, loss_mask=[1] * 5)
    (row,) = trajectory_table([[bad]], [{"id": 1}], [None], tok, "compact")["data"]
    assert row[6:8] == [[], ["malformed tool call: write [name:input]"]] and row[10] is None


def test_a_multiturn_run_writes_trajectory_tables(tiny_dir, tmp_path, sevens_env):
    """``tracking.samples_every=1`` with an environment: every step writes its samples table,
    one row per turn; each turn's reward is the environment's rule applied to the table's own
    decoded response (so the response is what the environment read), the trajectory reward is
    their sum, versions follow fixed lag 1, and every turn but the last got the tool's "ok"."""
    from sat_cli.loop.schedule import Every

    rec, _ = _env_loop(tiny_dir, tmp_path / "run", sevens_env, samples=Every(1))
    for t in range(1, 5):
        table = rec.dicts[M.samples_artifact("train", t)]
        cols = {c: i for i, c in enumerate(table["columns"])}
        rows = table["data"]
        assert len({r[cols["sample"]] for r in rows}) == 8  # 2 prompts x 4 trajectories
        by_sample: dict[int, list] = {}
        for r in rows:
            by_sample.setdefault(r[cols["sample"]], []).append(r)
        for turns in by_sample.values():
            assert [r[cols["turn"]] for r in turns] == list(range(len(turns)))
            total = 0.0
            for r in turns:
                text = r[cols["response"]]
                assert r[cols["reward"]] == text.count("7") / max(len(text), 1) / 3
                total += r[cols["reward"]]
                assert set(r[cols["versions"]]) <= {max(0, t - 2)}  # batch t-1 from v(t-2)
                assert len(r[cols["versions"]]) >= len(text)  # a token per character or more
            assert turns[-1][cols["trajectory_reward"]] == total
            for a, b in zip(turns, turns[1:], strict=False):
                assert a[cols["tool_results"]] == ["ok"] and "ok" in b[cols["input"]]
        assert rec.metrics[t][M.TURNS_MEAN] == len(rows) / 8


def test_env_max_tokens_must_fit_the_models_context_and_the_trainers_budget(tiny_dir):
    """A trajectory never grows past env.max_tokens, so that bound must fit the model's 512
    positions (and the trainer's token budget): 512 passes, 513 is refused naming the fix."""
    from types import SimpleNamespace

    from sat_cli.commands.preflight import check_env_context
    from sat_cli.errors import UserError

    def env(n, name="guess"):
        return SimpleNamespace(name=name, max_tokens=n)

    check_env_context(env(512), str(tiny_dir))
    check_env_context(env(4096, "none"), str(tiny_dir))  # single-turn: not this rule's
    with pytest.raises(UserError, match=r"^env.max_tokens=513 is over the model's context of 512"):
        check_env_context(env(513), str(tiny_dir))
    check_env_context(env(256), str(tiny_dir), budget=256)
    with pytest.raises(UserError, match=r"env.max_tokens=257 is over the trainer's token budget"):
        check_env_context(env(257), str(tiny_dir), budget=256)


@pytest.mark.parametrize("command", [["train", "tracking=none"], ["eval", "guess"]])
def test_a_trajectory_bound_over_the_context_is_refused_in_one_line(tmp_path, sat_cli, command):
    """``sat train env=guess`` / ``sat eval guess`` on the embedded model (512 positions) with
    the default env.max_tokens=4096: exit 2, one line, nothing written."""
    out = sat_cli(*command, "env=guess", f"run.dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "sat: error: env.max_tokens=4096 is over the model's context of 512 tokens: a "
        "trajectory (prompt, turns and observations) could grow past the model's positions; "
        "set env.max_tokens=512 or lower"
    )
    assert not (tmp_path / "runs").exists()


def _profile_lag(spec: str, cells: int = 8, turns: int = 3):
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.lag_profile import parse_profile

    profile = parse_profile(spec)
    return LagPolicy(profile.max_lag, "fixed", profile=profile, seed=3, cells=cells, turns=turns)


def test_lag_profile_with_an_environment_draws_every_turns_version(tiny_dir, tmp_path, sevens_env):
    """``env=… lag.profile=uniform:0-2``: every generation call (turn ``j`` of trajectory ``i``
    of batch ``k``) comes from version ``max(0, k - l)``, ``l`` the profile's draw for it: each
    model token the trainer got carries exactly that version (not a statistical check). Turn 0
    draws what a single-turn sample of the batch would; some trajectories span versions, and
    ``staleness/lag_profile_tv`` compares the profile with the lags of the calls, counted here
    by hand."""
    from sat_cli.loop.lag_profile import tv_distance

    lag = _profile_lag("uniform:0-2")
    rec, trainer = _env_loop(tiny_dir, tmp_path / "run", sevens_env, lag=lag)
    assert lag.profile.versions(3, 2, 8, 0) == lag.sample_versions(2)  # turn 0: the sample's
    counts = [0, 0, 0]
    spans = calls = 0
    for k, b in enumerate(trainer.batches):
        draws = [lag.profile.versions(3, k, 8, j) for j in range(3)]
        assert b["loss_mask"].shape[0] == 8
        spans_before = spans
        for i in range(8):
            model = b["loss_mask"][i].bool()
            tv = (
                b["token_versions"][i]
                if "token_versions" in b
                else b["versions"][i].expand(model.shape)
            )
            turns, versions = b["turn_ids"][i][model].tolist(), tv[model].tolist()
            assert versions == [draws[j][i] for j in turns], (k, i)
            for j in sorted(set(turns)):
                counts[k - draws[j][i]] += 1
                calls += 1
            spans += len(set(versions)) > 1
        assert rec.metrics[k + 1][M.LAG_PROFILE_TV] == tv_distance(lag.profile.pmf, counts)
        # responses whose tokens span versions: counted here, logged by the loop
        assert rec.metrics[k + 1][M.MIXED_VERSION_FRAC] == (spans - spans_before) / 8
    assert spans > 0 and calls > 32  # some trajectories' turns came from different versions
    assert [d for k in range(4) for d in lag.profile.draws(3, k, 8, 1)] != [
        d for k in range(4) for d in lag.profile.draws(3, k, 8, 0)
    ]  # turns draw independently


def test_env_with_a_lag_profile_composes_and_abort_is_refused():
    from sat_cli.build.run import lag_policy

    _, obj = load_cfg(["env=guess", "env.max_turns=3", "lag.profile=uniform:0-2"])
    lag = lag_policy(obj)
    assert (lag.turns, lag.cells, lag.profile.max_lag) == (3, obj.task.prompts_per_step * 8, 2)
    with pytest.raises(ConfigError, match=r"^env.partial=abort cannot be combined with lag.pro"):
        load_cfg(["env=guess", "env.partial=abort", "lag.profile=uniform:0-2"])
    _, plain = load_cfg(["lag.profile=uniform:0-2"])
    assert lag_policy(plain).turns == 1  # single-turn: one draw per sample, as before


def test_sat_report_shows_per_turn_staleness(tmp_path):
    """``sat report``'s per-turn section on a real MLflow store with known histories: the lag of
    turn ``k`` weighted by its tokens, d̄π where logged, the run's mean mixed-version fraction;
    a single-turn run gets no row."""
    from cli_helpers import seeded_store
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    from sat_cli.report import run_report

    uri = f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mt", artifact_location=str(tmp_path / "art"))
    series = {
        "eval/toy/avg_at_2": [(0, 10.0), (2, 20.0)],
        M.TURN_TOKENS.format(0): [(1, 10.0), (2, 30.0)],
        M.TURN_TOKEN_LAG_MEAN.format(0): [(1, 0.0), (2, 2.0)],
        M.TURN_TOKENS.format(1): [(1, 4.0), (2, 4.0)],
        M.TURN_TOKEN_LAG_MEAN.format(1): [(1, 1.0), (2, 0.5)],
        M.TURN_DPI_MU.format(1): [(2, 0.25)],
        M.MIXED_VERSION_FRAC: [(1, 0.0), (2, 0.5)],
    }
    for name, keys in (("multi", series), ("single", {"eval/toy/avg_at_2": [(0, 5.0)]})):
        rid = client.create_run(exp, run_name=name).info.run_id
        points = [
            Metric(k, v, 1000 + i, s) for k, vs in keys.items() for i, (s, v) in enumerate(vs)
        ]
        tags = [RunTag("sat.method", "GRPO"), RunTag("lag", "profile"), RunTag("seed", name)]
        client.log_batch(rid, metrics=points, tags=tags)
        client.set_terminated(rid, "FINISHED")
    run_report("mt", out=str(tmp_path / "rep"), tracking_uri=uri)
    rows = (tmp_path / "rep" / "turns.csv").read_text().splitlines()
    assert rows == [
        "run,method,lag,turn,steps,tokens_per_step,token_version_lag,dpi_mu,mixed_version_frac",
        f"multi,GRPO,profile,0,2,20.0,{(10 * 0.0 + 30 * 2.0) / 40},,0.25",
        f"multi,GRPO,profile,1,2,4.0,{(4 * 1.0 + 4 * 0.5) / 8},0.25,0.25",
    ]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Per-turn staleness (multi-turn runs)" in md
    assert "| multi | GRPO | profile | 0 | 2 | 20 | 1.5 | — | 0.25 |" in md


MIXED_KEY = M.MIXED_VERSION_FRAC  # an MLflow key as it is (no characters to replace)

# docs/environments.md, "Responses that span weight versions": the recipe, word for word
RECIPE = (
    "experiment=cpu_smoke env=guess env.parser=compact env.max_tokens=128 task.max_new_tokens=24 "
    "lag.profile=uniform:0-2 max_steps=4 tracking.samples_every=1 tracking.histogram_every=1 "
    "run.name=mixed"
).split()


def test_the_recipe_is_the_documented_one():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "environments.md").read_text()
    assert "sat train " + " ".join(RECIPE[:6]) + " \\\n    " + " ".join(RECIPE[6:]) in doc


@pytest.mark.slow  # ~70 s on the 2-core machine: the documented recipe through the CLI
def test_the_documented_mixed_version_recipe(tmp_path, sat_cli):
    """The documented recipe, as a user runs it (then ``sat report sat``): batch 0 can only come
    from version 0 (no response spans versions), later ones do (``mixed_version_frac`` > 0), the
    samples tables show every turn of ``env=guess`` generated by exactly the profile's draw for
    it and turns of one trajectory from different versions, and the report's per-turn section
    carries the run's mean mixed-version fraction."""
    import csv
    import json

    from mlflow import MlflowClient

    out = sat_cli("train", *RECIPE, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, MIXED_KEY)}
    assert hist[1] == 0.0 and max(hist.values()) > 0.0, hist
    lag = _profile_lag("uniform:0-2", cells=8 * 4, turns=4)  # cpu_smoke: 8 prompts x 4
    spans = 0
    for t in range(1, 5):
        path = client.download_artifacts(run.info.run_id, M.samples_artifact("train", t))
        table = json.loads(open(path).read())
        col = {c: i for i, c in enumerate(table["columns"])}
        per_sample: dict[int, set] = {}
        for r in table["data"]:
            i, k, versions = r[col["sample"]], r[col["turn"]], r[col["versions"]]
            # env=guess through the CLI: each turn's tokens from the profile's draw, exactly
            drawn = lag.profile.versions(0, t - 1, 32, k)[i]  # seed 0, batch t - 1
            assert versions == [drawn] * len(versions) and versions, (t, i, k)
            per_sample.setdefault(i, set()).update(versions)
        assert len(per_sample) == 32
        spans += sum(len(v) > 1 for v in per_sample.values())
    assert spans > 0
    rep = sat_cli("report", "sat", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert "## Per-turn staleness (multi-turn runs)" in rep.stdout
    rows = list(csv.DictReader((tmp_path / "runs" / "reports" / "sat" / "turns.csv").open()))
    assert [int(r["turn"]) for r in rows] == list(range(len(rows))) and len(rows) >= 2
    mean = sum(hist.values()) / len(hist)
    assert all(float(r["mixed_version_frac"]) == mean for r in rows)
