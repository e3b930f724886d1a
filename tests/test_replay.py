"""Frozen stale-data replay (issue 33): the recording format (round trip, damage refused), a
replay with the same algorithm reproduces the recorded run's losses bit for bit, another
algorithm trains on exactly the same inputs, and `sat replay` refuses bad input with exit 2
before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import seeded_store

from sat_cli.engines.base import Sample, SamplingParams
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.loop.stream import LiveStream, RecordingStream, ReplayStream
from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
from sat_cli.replay.store import (
    RecordingError,
    StreamWriter,
    decode_step,
    encode_step,
    open_recording,
)
from tests.test_loop import Recorder, SevensTask


def _sample(v: int, n: int, routes: bool = False, tv=None, finish="stop") -> Sample:
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(4, 4 + n)),
        rollout_logp=[-0.1 * (i + 1) / 3 for i in range(n)],
        finish_reason=finish,
        weight_version=v,
        routed_experts=np.arange((2 + n) * 4 * 2, dtype=np.int32).reshape(2 + n, 4, 2)
        if routes
        else None,
        token_versions=tv,
    )


def test_step_round_trip_is_exact():
    groups = [
        [_sample(3, 2, routes=True), _sample(3, 0, routes=True)],
        [_sample(2, 3, tv=[2, 3, 3]), _sample(1, 1, finish="abort")],
    ]
    rows = [{"id": "a", "prompt": "1+", "answer": "7"}, {"id": "b", "prompt": "2+", "answer": "7"}]
    rewards = [[0.5, 1.0 / 3.0], None]
    g2, r2, w2 = decode_step(encode_step(4, groups, rows, rewards), "x")
    assert r2 == rows and w2[0] == rewards[0] and w2[1] is None
    for a, b in zip([s for g in groups for s in g], [s for g in g2 for s in g], strict=True):
        assert (a.prompt_ids, a.response_ids, a.finish_reason) == (
            b.prompt_ids,
            b.response_ids,
            b.finish_reason,
        )
        assert a.rollout_logp == b.rollout_logp  # float64: the same Python floats
        assert (a.weight_version, a.token_versions) == (b.weight_version, b.token_versions)
        if a.routed_experts is None:
            assert b.routed_experts is None
        else:
            assert np.array_equal(a.routed_experts, b.routed_experts)


def _record_dir(tmp_path: Path, steps: int = 2) -> Path:
    run = tmp_path / "run"
    w = StreamWriter(run / "replay", {"config": {}}, prompts_per_step=1, group_size=2)
    for t in range(steps):
        w.write(t, [[_sample(t, 2), _sample(t, 3)]], [{"id": str(t), "prompt": "p"}], [[0.0, 1.0]])
    return run


def test_damaged_truncated_or_missing_recordings_are_refused(tmp_path):
    run = _record_dir(tmp_path)
    rec = open_recording(run, 2)
    assert rec.steps == 2 and rec.batch(1)[1] == [{"id": "1", "prompt": "p"}]
    f = run / "replay" / "step_000001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-5])  # truncated
    with pytest.raises(RecordingError, match="truncated or damaged"):
        open_recording(run, 2)
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    with pytest.raises(RecordingError, match="SHA-256 differs"):
        open_recording(run, 2)
    f.unlink()
    with pytest.raises(RecordingError, match="is missing"):
        open_recording(run, 2)
    assert open_recording(run, 1).steps == 2  # what the replay does not need is not read
    with pytest.raises(RecordingError, match="holds 2 recorded steps; the replay needs 3"):
        open_recording(run, 3)
    m = run / "replay" / "manifest.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "version": 9}))
    with pytest.raises(RecordingError, match="format version 9"):
        open_recording(run, 1)
    m.write_text("{")
    with pytest.raises(RecordingError, match="manifest.json is not valid JSON"):
        open_recording(run, 1)
    with pytest.raises(RecordingError, match="has no recording"):
        open_recording(tmp_path / "other", 1)


class SpyTrainer:
    """Wraps a trainer and keeps every batch it is given (the data order and inputs)."""

    def __init__(self, trainer):
        self.inner, self.batches = trainer, []

    def step(self, batch, *args):
        self.batches.append(
            {k: v.clone() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
        )
        return self.inner.step(batch, *args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stream_of(recorder=None, replay=None):
    """The loop's stream: a replay of ``replay``, a recording into ``recorder``, else live."""
    if replay is not None:
        return ReplayStream(replay)
    return RecordingStream(recorder) if recorder is not None else LiveStream()


def _loop(
    tiny_dir, run_dir, algo: str, recorder=None, replay=None, lag=LagPolicy(2, "fixed"), **kw
):
    """4 steps of 2 prompts x 4 samples; ``kw``: other ``LoopSettings`` (``sampling``, ``env``)."""
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    trainer = SpyTrainer(
        LocalTrainer(str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo=algo, adaptive=True))
    )
    rec = Recorder()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=4, stop_token_ids=(trainer.tokenizer.eos_token_id,)
    )
    kw.setdefault("sampling", sampling)
    s = LoopSettings(
        max_steps=4,
        prompts_per_step=2,
        group_size=4,
        lag=lag,
        run_dir=run_dir,
        seed=3,
        histograms=Every(0),
        **kw,
    )
    engine = None  # replay: no engine
    if replay is None:
        engine = LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0))
    try:
        stream = stream_of(recorder, replay)
        parts = RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer, stream=stream)
        TrainLoop(s, parts).run()
    finally:
        if engine is not None:
            engine.close()
    return rec, trainer


def test_replay_reproduces_losses_bit_for_bit_and_feeds_every_algorithm_the_same_data(
    tiny_dir, tmp_path
):
    """Record 4 steps at fixed lag 2 (GRPO); replaying with GRPO gives the same losses, rewards
    and weights bit for bit; replaying with GSPO trains on the same batches (ids, masks,
    behaviour log-probs, versions, advantages), in the same order, and differs only in the
    loss."""
    run = tmp_path / "orig"
    writer = StreamWriter(run / "replay", {}, prompts_per_step=2, group_size=4)
    orig, t_orig = _loop(tiny_dir, run, "grpo", recorder=writer)
    assert writer.manifest["steps"] == 4 and writer.bytes_written > 0
    same, t_same = _loop(tiny_dir, tmp_path / "same", "grpo", replay=open_recording(run, 4))
    other, t_other = _loop(tiny_dir, tmp_path / "gspo", "gspo", replay=open_recording(run, 4))
    for t in range(1, 5):
        for key in (
            "loss/policy",
            "loss/grad_norm",
            "rollout/reward_mean",
            "rollout/prompt_digest",
            "staleness/version_lag_mean",
        ):
            assert same.metrics[t][key] == orig.metrics[t][key], (t, key)
    assert [orig.metrics[t]["staleness/version_lag_max"] for t in range(1, 5)] == [0, 1, 2, 2]
    for k, v in t_orig.model.state_dict().items():
        assert torch.equal(v, t_same.model.state_dict()[k]), k
    # the other algorithm: identical inputs, step by step, in the same order
    assert len(t_other.batches) == len(t_orig.batches) == 4
    for a, b in zip(t_orig.batches, t_other.batches, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for t in range(1, 5):
        assert other.metrics[t]["rollout/prompt_digest"] == orig.metrics[t]["rollout/prompt_digest"]
    assert any(
        other.metrics[t]["loss/policy"] != orig.metrics[t]["loss/policy"] for t in range(1, 5)
    )


# ----------------------------------------------------------------------------- sat replay (CLI)

SMOKE = ["experiment=cpu_smoke", "run.dir=runs"]


def _fake_run(tmp_path: Path, steps: int = 3) -> Path:
    """A run folder with a valid recording of `sat train experiment=cpu_smoke` (synthetic
    samples: the checks before training read only the manifest, the config and the files)."""
    from omegaconf import OmegaConf

    from sat_cli.config import load

    cfg, _ = load([*SMOKE, "run.name=rec", "replay.record=true"], "train")
    run = tmp_path / "runs" / "sat" / "rec"
    header = {
        "overrides": [*SMOKE, "replay.record=true"],
        "run": "rec",
        "mlflow_run_id": None,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    w = StreamWriter(run / "replay", header, prompts_per_step=8, group_size=4)
    for t in range(steps):
        rows = [{"id": str(i), "prompt": "1+1=", "answer": "2"} for i in range(8)]
        w.write(t, [[_sample(t, 2) for _ in range(4)] for _ in range(8)], rows, [[1.0] * 4] * 8)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run


def _refused(tmp_path: Path, *args: str, says: str) -> None:
    from tests.cli_helpers import run_sat

    before = sorted(p.name for p in (tmp_path / "runs" / "sat").iterdir())
    r = run_sat("replay", *args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sat: error: ") and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    # nothing written: no new run folder, no MLflow store
    assert sorted(p.name for p in (tmp_path / "runs" / "sat").iterdir()) == before
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_sat_replay_refuses_bad_input_before_anything_is_written(tmp_path):
    run = _fake_run(tmp_path)
    (tmp_path / "runs" / "sat" / "plain").mkdir()
    _refused(tmp_path, "runs/sat/plain", says="has no recording")
    _refused(tmp_path, str(run), "model.path=/x", says="'model.path=/x' would change the recorded")
    _refused(tmp_path, str(run), "max_steps=5", says="max_steps=5 is above the recording's 3")
    _refused(tmp_path, str(run), "algo=nope", says="algo='nope' is not a known option")
    # the recorded config no longer matches what its overrides compose to (another model)
    m = run / "replay" / "manifest.json"
    good = m.read_text()
    doc = json.loads(good)
    doc["header"]["config"]["model"]["num_layers"] = 99
    m.write_text(json.dumps(doc))
    _refused(tmp_path, str(run), says="cannot match the recording: model.num_layers")
    m.write_text(good)
    f = run / "replay" / "step_000002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _refused(tmp_path, str(run), "algo=gspo", says="truncated or damaged")
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 0x20]))
    _refused(tmp_path, str(run), "algo=gspo", says="SHA-256 differs")


@pytest.mark.slow
def test_sat_replay_of_a_recorded_run_reproduces_its_losses(tmp_path):
    """`sat train … replay.record=true`, then `sat replay RUN`: the same loss/policy and eval
    at every step, read back from MLflow; `sat replay RUN algo=gspo` runs on the same prompts."""
    from mlflow import MlflowClient

    from tests.cli_helpers import run_sat

    r = run_sat("train", *SMOKE, "run.name=rec", "replay.record=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for extra in (["run.name=same"], ["run.name=gspo", "algo=gspo"]):
        r = run_sat("replay", "runs/sat/rec", *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    c = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("sat").experiment_id
    runs = {x.info.run_name: x for x in c.search_runs([exp])}

    def hist(name, key):
        return [
            (m.step, m.value)
            for m in sorted(c.get_metric_history(runs[name].info.run_id, key), key=lambda m: m.step)
        ]

    for key in ("loss/policy", "loss/grad_norm", "eval/toy/avg_at_2", "rollout/prompt_digest"):
        assert hist("same", key) == hist("rec", key) and hist("rec", key), key
    assert hist("gspo", "rollout/prompt_digest") == hist("rec", "rollout/prompt_digest")
    assert hist("gspo", "loss/policy") != hist("rec", "loss/policy")
    assert runs["same"].data.tags["replay_of"] == "rec"
    assert runs["same"].data.tags["replay_of_run_id"] == runs["rec"].info.run_id


# ----------------------------------------------------------------------------- sweep and report


def test_sweep_with_a_replay_source_runs_sat_replay_on_the_recording(tmp_path, monkeypatch):
    """A sweep file's `replay:` key: every run composes through `sat replay`'s checks and starts
    as `sat replay <run> <its overrides>`; a seed other than the recorded one is refused."""
    from sat_cli.errors import UserError
    from sat_cli.sweep import jobs, local
    from sat_cli.sweep.plan import validate
    from sat_cli.sweep.spec import load_sweep

    monkeypatch.chdir(tmp_path)
    run = _fake_run(tmp_path)
    doc = (
        f"name: rp\nreplay: {run}\naxes: {{}}\nseeds: [0]\n"
        "methods:\n  GRPO: [algo=grpo]\n  GRPO+TIS: [algo=grpo, algo.correction=tis]\n"
    )
    (tmp_path / "rp.yaml").write_text(doc)
    plan = validate(load_sweep(tmp_path / "rp.yaml"))
    assert sorted(plan.run_dirs) == ["grpo+tis-s0", "grpo-s0"]
    assert plan.needs_warm_start == []  # the recorded run's start checkpoint is used
    cmds = []
    monkeypatch.setattr(local, "launch_child", lambda cmd, *a: (cmds.append(cmd) or _Proc(), None))
    tis = next(r for r in plan.sweep.runs if r.method == "GRPO+TIS")
    jobs.start_run(plan, {"runs": {}}, tis, None, lambda *_: None, local.LocalExecutor())
    assert cmds[0][3:5] == ["replay", str(run)] and "algo.correction=tis" in cmds[0]
    (tmp_path / "rp1.yaml").write_text(doc.replace("seeds: [0]", "seeds: [1]"))
    with pytest.raises(UserError, match="cannot match the recording: seed"):
        validate(load_sweep(tmp_path / "rp1.yaml"))
    (tmp_path / "rp2.yaml").write_text(doc.replace("algo=grpo]", "algo=grpo, lag=4]", 1))
    with pytest.raises(UserError, match="'lag=4' would change the recorded data"):
        validate(load_sweep(tmp_path / "rp2.yaml"))


class _Proc:
    pid = 1


def test_report_pairs_each_replay_with_its_recorded_run(tmp_path):
    """`sat report`'s replay rows: final values of the replay and of the run it replays (found
    by the replay_of_run_id tag), and their difference, from a real MLflow store."""
    from mlflow import MlflowClient

    from sat_cli.report.replays import replay_csv, replay_markdown, replay_rows
    from sat_cli.report.tables import RunData

    c = MlflowClient(f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}")
    exp = c.create_experiment("x", artifact_location=str(tmp_path / "art"))
    orig = c.create_run(exp, run_name="rec").info.run_id
    rep = c.create_run(
        exp, run_name="rec-replay", tags={"replay_of": "rec", "replay_of_run_id": orig}
    ).info.run_id
    plain = c.create_run(exp, run_name="other").info.run_id
    for rid, vals in ((orig, (0.5, 0.25, 40.0)), (rep, (0.75, 0.125, 42.5)), (plain, (1, 1, 1))):
        for step, scale in ((1, 2.0), (3, 1.0)):  # the last step counts
            c.log_metric(rid, "loss/policy", vals[0] * scale, step=step)
            c.log_metric(rid, "rollout/reward_mean", vals[1] * scale, step=step)
            c.log_metric(rid, "eval/toy/avg_at_8", vals[2] * scale, step=step)

    def data(rid, name):
        return RunData(
            run_id=rid,
            name=name,
            status="FINISHED",
            start_time=0,
            method="GSPO",
            lag="1",
            seed="0",
            row="GSPO",
            eval_key="eval/toy/avg_at_8",
        )

    rows = replay_rows(c, [data(rep, "rec-replay"), data(plain, "other")])
    got = {r["metric"]: (r["replay_value"], r["recorded"], r["difference"]) for r in rows}
    assert got == {
        "eval/toy/avg_at_8": (42.5, 40.0, 2.5),
        "loss/policy": (0.75, 0.5, 0.25),
        "rollout/reward_mean": (0.125, 0.25, -0.125),
    }
    assert {r["replay"] for r in rows} == {"rec-replay"} and rows[0]["replay_of"] == "rec"
    md = replay_markdown(rows)
    assert "| rec-replay | GSPO | rec | loss/policy | 0.75 | 0.5 | 0.25 |" in md
    assert replay_csv(rows).splitlines()[0] == (
        "replay,method,replay_of,metric,replay_value,recorded,difference"
    )
    assert replay_markdown([]) == ""


@pytest.mark.slow  # two sat processes, ~70 s on the loaded 2-core machine
def test_sat_replay_inherits_the_recordings_numerics_pins(tmp_path):
    """A recording made with run.portable_numerics=true is replayed under the same pins (the
    replay composes the recorded config and pins before torch is imported), read back from the
    run's logged environment: the same numeric variables and torch CPU code path as the
    recording, and not the unpinned ones."""
    from mlflow import MlflowClient

    from tests.cli_helpers import run_sat

    rec = ["max_steps=2", "run.name=rec", "replay.record=true", "run.portable_numerics=true"]
    r = run_sat("train", *SMOKE, *rec, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_sat("replay", "runs/sat/rec", "run.name=same", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    c = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("sat").experiment_id
    runs = {x.info.run_name: x.data.params for x in c.search_runs([exp])}
    assert runs["rec"]["machine.torch.cpu_capability"] == "AVX2"
    for key in ("machine.numeric_env", "machine.torch.cpu_capability", "machine.torch.num_threads"):
        assert runs["same"][key] == runs["rec"][key], key
    assert "ATEN_CPU_CAPABILITY=avx2" in runs["same"]["machine.numeric_env"]


# ----------------------------------------------------------------------------- secrets


SECRET_URL = "http://user:S3cretPW@127.0.0.1:9/x?token=T0kenVal"


def test_a_recording_keeps_no_secret_and_the_replay_asks_for_it_again(tmp_path):
    """Probe (issue 53 v5): the manifest held the run's overrides and config in the clear. It
    now holds them masked, as config.yaml and the params do; `sat replay` asks for each masked
    override again, and compares the recorded config masked."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from sat_cli.commands.replay import check_match, masked_keys, replay_overrides
    from sat_cli.commands.run import _stream
    from sat_cli.config import load
    from sat_cli.config.quoting import hydra_quote
    from sat_cli.errors import UserError

    overrides = [*SMOKE, "replay.record=true", f"+tracking.tags.src={hydra_quote(SECRET_URL)}"]
    cfg, obj = load([*overrides, "run.name=rec"], "train")
    config = OmegaConf.to_container(cfg, resolve=True)
    run_dir = tmp_path / "runs" / "sat" / "rec"
    run = SimpleNamespace(replay=None, obj=obj, overrides=tuple(overrides), run_dir=run_dir)
    stream = _stream(run, config, "id0")
    stream.writer.write(
        0, [[_sample(0, 2)] * 4] * 8, [{"prompt": "1+1=", "answer": "2"}] * 8, [[1.0] * 4] * 8
    )
    text = (run_dir / "replay" / "manifest.json").read_text()
    assert "S3cretPW" not in text and "T0kenVal" not in text
    header = json.loads(text)["header"]
    assert header["overrides"][-1] == "+tracking.tags.src='http://user:***@127.0.0.1:9/x?token=***'"
    assert header["config"]["tracking"]["tags"]["src"] == "http://user:***@127.0.0.1:9/x?token=***"
    # the replay: the masked override must be given again, and the given value is the one used
    assert masked_keys(header["overrides"]) == ["tracking.tags.src"]
    with pytest.raises(UserError, match=r"keeps no secrets; give tracking.tags.src again"):
        replay_overrides(header["overrides"], [], "r")
    given = [f"tracking.tags.src={hydra_quote(SECRET_URL)}"]
    got = replay_overrides(header["overrides"], given, "r")
    assert [ov for ov in got if "tags.src" in ov] == given
    with pytest.raises(UserError, match="would change the recorded data"):
        replay_overrides(header["overrides"], [*given, "model.path=/x"], "r")
    # the masked recorded config matches the config composed with the secret given again
    check_match(header["config"], config, 1, 1)
    other = json.loads(json.dumps(config))
    other["engine"]["dtype"] = "bfloat16"
    with pytest.raises(UserError, match="engine.dtype"):
        check_match(header["config"], other, 1, 1)
