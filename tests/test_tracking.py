"""Tests of sat_cli.tracking and sat_cli.tracking.histograms against a real MLflow sqlite store (no mocks).

One store per module (creating the sqlite schema takes ~1.5 s); each test uses its own
experiment/run. Values are read back with ``MlflowClient`` and compared with what was logged.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sat_cli.tracking import (
    MAX_PARAM_VALUE_LEN,
    NONFINITE_KEY,
    Tracker,
    TrackerSettings,
    TrackingError,
    default_artifact_root,
    flatten_config,
    is_secret_key,
    mlflow_key,
    redact_uri,
    ui_command,
)
from sat_cli.tracking.histograms import histogram_png, histogram_stats

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

# the module's store is created once: its tests run on one xdist worker
pytestmark = pytest.mark.xdist_group("tracking_store")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mlstore")
    return f"sqlite:///{root / 'sub' / 'mlflow.db'}"


@pytest.fixture(scope="module")
def client(store) -> MlflowClient:
    return MlflowClient(tracking_uri=store)


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# --------------------------------------------------------------------------- flatten / redact


def test_flatten_config_hand_case():
    cfg = {
        "algo": {"name": "gspo", "eps": {"low": 3e-4, "high": 4e-4}, "use_kl": False},
        "lag": 8,
        "eval": {"benchmarks": ["aime24", "aime25"], "extra": {}},
        "model": {"path": None, "tokenizer": {"pad_token": "<pad>", "eos_token_id": 2}},
        "engine": {"sampling": {"max_new_tokens": 64}},
        "tracking": {
            "uri": "postgresql://alice:hunter2@db.local:5432/mlflow",
            "hf_token": "hf_abcdef",
            "auth": {"user": "alice", "pass": "x"},
            "apiKey": "k-123",
            "mirrors": ["https://bob:pa55@mirror/x", "https://plain/y"],
        },
    }
    assert flatten_config(cfg) == {
        "algo.name": "gspo",
        "algo.eps.low": "0.0003",
        "algo.eps.high": "0.0004",
        "algo.use_kl": "false",
        "lag": "8",
        "eval.benchmarks": '["aime24", "aime25"]',
        "eval.extra": "{}",
        "model.path": "null",
        "model.tokenizer.pad_token": "<pad>",  # a special-token name, not a credential
        "model.tokenizer.eos_token_id": "2",
        "engine.sampling.max_new_tokens": "64",  # "tokens" is a count, not a secret
        "tracking.uri": "postgresql://alice:***@db.local:5432/mlflow",
        "tracking.hf_token": "***",
        "tracking.auth": "***",  # a secret section collapses to one entry
        "tracking.apiKey": "***",
        "tracking.mirrors": '["https://bob:***@mirror/x", "https://plain/y"]',
    }
    assert flatten_config({"a": {"b": 1}}, sep="/") == {"a/b": "1"}


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("hf_token", True),
        ("token", True),
        ("access_token", True),
        ("password", True),
        ("db_password", True),
        ("client_secret", True),
        ("api_key", True),
        ("apikey", True),
        ("OPENAI_API_KEY", True),
        ("authorization", True),
        ("max_new_tokens", False),
        ("pad_token", False),
        ("eos_token_id", False),
        ("tokenizer", False),
        ("author", False),
        ("keys", False),
    ],
)
def test_is_secret_key(key, secret):
    assert is_secret_key(key) is secret


def test_redact_uri_and_truncation():
    assert (
        redact_uri("http://u:p%40ss@h:1/x and s3://k:v@b") == "http://u:***@h:1/x and s3://k:***@b"
    )
    assert redact_uri("http://h:5000/path") == "http://h:5000/path"  # a port is not a password
    long = flatten_config({"s": "x" * 7000})["s"]
    assert len(long) == MAX_PARAM_VALUE_LEN and long.endswith("...[truncated]")
    assert mlflow_key("eval/aime24/avg@8") == "eval/aime24/avg_at_8"
    assert mlflow_key("a b:c/d-e.f_g") == "a b:c/d-e.f_g"  # all legal already
    assert mlflow_key("x{y}") == "x_y_"


# --------------------------------------------------------------------------- params and metrics


def test_params_logged_flattened_and_redacted(store, client):
    cfg = {
        "tracking": {"uri": "https://alice:hunter2@mlflow.example/x", "password": "hunter3"},
        "many": {f"p{i:03d}": i for i in range(230)},  # > 2 batches of 100 params
        "long": "y" * 7000,
    }
    params = flatten_config(cfg)
    with Tracker(TrackerSettings(store, "params"), "r", params=params, tags={"algo": "grpo"}) as tr:
        run_id = tr.run_id
    run = client.get_run(run_id)
    got = run.data.params
    assert got == params
    assert len(got) == 230 + 3
    assert got["many.p229"] == "229"
    assert got["tracking.uri"] == "https://alice:***@mlflow.example/x"
    assert all("hunter" not in v for v in got.values())
    assert len(got["long"]) == 6000
    assert run.data.tags["algo"] == "grpo"
    assert run.info.status == "FINISHED"


def test_metrics_one_point_per_step_and_nonfinite(store, client):
    many = {f"w/k{i:04d}": float(i) for i in range(1100)}  # > one batch of 1000 points
    with Tracker(TrackerSettings(store, "metrics"), "r") as tr:
        for step in range(3):
            tr.log_metrics({"loss/policy": 0.1 * step + 0.3, "eval/aime24/avg@8": step / 8}, step)
        tr.log_metrics(many, step=3)
        tr.log_metrics({"sat/q": float("nan"), "loss/kl_k3": float("inf"), "ok": 1.0}, step=4)
        tr.log_metrics({"sat/q": np.float32(0.25)}, step=5)
        run_id = tr.run_id
        assert tr.nonfinite_total == 2
    # float64 values round-trip bit-exactly through the sqlite store
    assert _history(client, run_id, "loss/policy") == [(s, 0.1 * s + 0.3) for s in range(3)]
    assert _history(client, run_id, "eval/aime24/avg_at_8") == [(0, 0.0), (1, 0.125), (2, 0.25)]
    assert _history(client, run_id, "w/k1099") == [(3, 1099.0)]
    assert _history(client, run_id, "w/k0000") == [(3, 0.0)]
    # the NaN at step 4 is skipped, the count logged instead; inf never reaches the store
    assert _history(client, run_id, "sat/q") == [(5, 0.25)]
    assert _history(client, run_id, "loss/kl_k3") == []
    assert _history(client, run_id, NONFINITE_KEY) == [(4, 2.0)]
    assert len(client.get_run(run_id).data.metrics) == 1100 + 5
    with (
        Tracker(TrackerSettings(store, "metrics"), "bad-step") as tr,
        pytest.raises(ValueError, match="int64"),
    ):
        tr.log_metrics({"a": 1.0}, 2**63)  # would poison the retry buffer if it reached the store
    assert tr.buffered_metrics == 0


# --------------------------------------------------------------------------- histograms


def test_histogram_image_steps_and_table(store, client, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in ./mlruns of the cwd
    rng = np.random.default_rng(0)
    data = {0: rng.exponential(0.05, 500), 7: rng.exponential(0.08, 800)}
    data[7][:3] = np.nan
    with Tracker(TrackerSettings(store, "hist"), "r") as tr:
        for step, vals in data.items():
            table = tr.log_histogram(
                "staleness/abs_logratio", vals, step, marks={"q": 0.1}, bins=20
            )
            assert table["counts"] == np.histogram(vals[np.isfinite(vals)], bins=20)[0].tolist()
        run_id = tr.run_id
    assert not (tmp_path / "mlruns").exists()

    images = [f.path for f in client.list_artifacts(run_id, "images")]
    pat = re.compile(r"images/staleness~abs_logratio\+step\+(\d+)\+timestamp\+\d+\+[0-9a-f-]+")
    png_steps = sorted(int(pat.match(p).group(1)) for p in images if p.endswith(".png"))
    webp_steps = sorted(int(pat.match(p).group(1)) for p in images if p.endswith(".webp"))
    assert png_steps == [0, 7] and webp_steps == [0, 7]
    assert client.get_run(run_id).data.tags.get("mlflow.loggedImages") == "True"

    art_dir = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    assert art_dir.is_relative_to(Path(default_artifact_root(store)))
    from PIL import Image

    png = next(p for p in images if p.endswith(".png") and "+step+7+" in p)
    assert Image.open(art_dir / png).size == (640, 400)

    tables = [f.path for f in client.list_artifacts(run_id, "tables/staleness/abs_logratio")]
    assert tables == [
        "tables/staleness/abs_logratio/step_0.json",
        "tables/staleness/abs_logratio/step_7.json",
    ]
    for step, vals in data.items():
        t = json.loads((art_dir / f"tables/staleness/abs_logratio/step_{step}.json").read_text())
        finite = vals[np.isfinite(vals)]
        counts, edges = np.histogram(finite, bins=20)
        assert t["counts"] == counts.tolist()
        np.testing.assert_allclose(t["edges"], edges, rtol=0, atol=0)
        assert (t["n"], t["nonfinite"]) == (finite.size, vals.size - finite.size)
        assert t["mean"] == pytest.approx(finite.mean(), rel=1e-12)
        assert t["p90"] == pytest.approx(np.quantile(finite, 0.9), rel=1e-12)
        assert (t["step"], t["key"], t["marks"]) == (step, "staleness/abs_logratio", {"q": 0.1})


def test_histogram_helpers_hand_case():
    # values 0,1,1,2,nan with bins [0,1,2]: numpy puts 0 in [0,1), 1,1,2 in [1,2] (last bin closed)
    s = histogram_stats([0.0, 1.0, 1.0, 2.0, float("nan")], bins=[0.0, 1.0, 2.0])
    assert (s["counts"], s["edges"], s["n"], s["nonfinite"]) == ([1, 3], [0.0, 1.0, 2.0], 4, 1)
    assert s["mean"] == 1.0 and s["min"] == 0.0 and s["max"] == 2.0
    assert s["std"] == pytest.approx(np.sqrt(0.5))  # deviations -1,0,0,1 → var 2/4
    torch = pytest.importorskip("torch")
    t = torch.tensor([0.0, 1.0, 1.0, 2.0], requires_grad=True)
    assert histogram_stats(t, bins=[0.0, 1.0, 2.0])["counts"] == [1, 3]
    empty = histogram_stats([])
    assert empty["counts"] == [] and empty["mean"] is None
    from PIL import Image

    png = histogram_png([1, 2, 2], title="t", marks={"q": 1.5}, bins=2)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(io.BytesIO(png)).size == (640, 400)


# --------------------------------------------------------------------------- resume and statuses


def test_resume_continues_same_run(store, client):
    params = {"algo.name": "grpo", "lag": "8"}
    with Tracker(TrackerSettings(store, "resume"), "r", params=params) as tr:
        tr.log_metrics({"loss/policy": 1.0}, 0)
        tr.log_metrics({"loss/policy": 2.0}, 1)
        tr.log_histogram("sat/contraction", [0.5, 0.7], 1)
        run_id = tr.run_id
    assert client.get_run(run_id).info.status == "FINISHED"

    changed = {"algo.name": "grpo", "lag": "4", "new.key": "x"}
    tr = Tracker(TrackerSettings(store, "resume"), "r", run_id=run_id, params=changed)
    assert tr.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    # resumed from a checkpoint at step 0: step 1 was already logged and is kept once
    tr.log_metrics({"loss/policy": 20.0}, 1)
    tr.log_histogram("sat/contraction", [0.1], 1)
    tr.log_metrics({"loss/policy": 3.0}, 2)
    tr.log_metrics({"loss/policy": 4.0}, 3)
    assert tr.skipped_relogged == 2
    tr.end()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _history(client, run_id, "loss/policy") == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]
    assert run.data.params == {"algo.name": "grpo", "lag": "8", "new.key": "x"}
    assert run.data.tags["sat.resume.changed_params"] == "lag"
    assert run.data.tags["sat.resume.skipped_relogged_points"] == "2"
    assert len(client.list_artifacts(run_id, "tables/sat/contraction")) == 1
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_resume_unknown_or_deleted_run_raises(store, client):
    with pytest.raises(TrackingError, match="cannot resume MLflow run 0123456789abcdef"):
        Tracker(TrackerSettings(store, "resume"), "r", run_id="0123456789abcdef")
    with Tracker(TrackerSettings(store, "resume"), "deleted") as tr:
        pass
    client.delete_run(tr.run_id)
    with pytest.raises(TrackingError, match="MLflow rejected the run setup"):
        Tracker(TrackerSettings(store, "resume"), "deleted", run_id=tr.run_id)


def test_end_statuses(store, client):
    with pytest.raises(KeyboardInterrupt):
        with Tracker(TrackerSettings(store, "status"), "killed") as tr:
            killed = tr.run_id
            raise KeyboardInterrupt
    with pytest.raises(ValueError):
        with Tracker(TrackerSettings(store, "status"), "failed") as tr:
            failed = tr.run_id
            raise ValueError("boom")
    tr = Tracker(TrackerSettings(store, "status"), "twice")
    tr.end("FAILED")
    tr.end("FINISHED")  # idempotent: the first status stays
    tr.log_metrics({"x": 1.0}, 0)  # after end: ignored
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(failed).info.status == "FAILED"
    assert client.get_run(tr.run_id).info.status == "FAILED"
    assert _history(client, tr.run_id, "x") == []
    with pytest.raises(ValueError, match="status must be one of"):
        tr.end("DONE")


def test_experiment_reused_with_artifact_location(store, client):
    with Tracker(TrackerSettings(store, "reuse"), "a") as a:
        pass
    with Tracker(TrackerSettings(store, "reuse"), "b") as b:
        pass
    assert a.experiment_id == b.experiment_id
    exp = client.get_experiment(a.experiment_id)
    assert exp.artifact_location == default_artifact_root(store)
    assert default_artifact_root(store) == str(
        Path(store.removeprefix("sqlite:///")).parent / "mlartifacts"
    )


def test_disabled_tracker_is_noop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for tr in (
        Tracker(TrackerSettings(None, "e"), "r"),
        Tracker(TrackerSettings("none", "e"), "r"),
        Tracker(TrackerSettings(f"sqlite:///{tmp_path}/x.db", "e", enabled=False), "r"),
    ):
        with tr:
            assert tr.run_id is None and not tr.enabled
            tr.log_metrics({"a": 1.0}, 0)
            assert tr.log_histogram("h", [1.0, 2.0], 0) is None
            tr.log_dict({"a": 1}, "a.json")
            tr.log_text("t", "t.txt")
            tr.log_artifact(tmp_path)
            tr.set_tags({"a": "b"})
        tr.end()
    assert list(tmp_path.iterdir()) == []


def test_artifacts_text_dict_tags(store, client, tmp_path):
    f = tmp_path / "note.txt"
    f.write_text("hello")
    with Tracker(TrackerSettings(store, "artifacts"), "r") as tr:
        tr.log_artifact(f, "files")
        tr.log_dict({"a": [1, 2]}, "cfg/resolved.json")
        tr.log_text("lag: 8\n", "config.yaml")
        tr.set_tags({"sweep": "table1", "db_url": "mysql://u:pw9@h/db", "api_token": "abc"})
        run_id = tr.run_id
    with (
        Tracker(TrackerSettings(store, "artifacts"), "missing") as tr,
        pytest.raises(FileNotFoundError),
    ):
        tr.log_artifact(tmp_path / "nope.txt")
    assert tr.dropped_artifacts == 0
    art = Path(client.get_run(run_id).info.artifact_uri)
    assert (art / "files/note.txt").read_text() == "hello"
    assert json.loads((art / "cfg/resolved.json").read_text()) == {"a": [1, 2]}
    assert (art / "config.yaml").read_text() == "lag: 8\n"
    tags = client.get_run(run_id).data.tags
    assert (tags["sweep"], tags["db_url"], tags["api_token"]) == (
        "table1",
        "mysql://u:***@h/db",
        "***",
    )


# --------------------------------------------------------------------------- unreachable store


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket closes


def test_unreachable_store_at_start_raises_quickly():
    before = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_TIMEOUT",)}
    uri = f"http://alice:s3cretpw@127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrackingError) as info:
        Tracker(TrackerSettings(uri, "e", http_timeout_s=2, http_max_retries=0), "r")
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 10, elapsed
    assert msg.startswith("cannot use the MLflow tracking store at http://alice:***@127.0.0.1:")
    assert "s3cretpw" not in msg
    assert "tracking.uri=none" in msg
    # the HTTP timeout variables the tracker set are gone again
    assert {k: os.environ.get(k) for k in before} == before


def test_experiments_are_tagged_as_model_training(store, client):
    """New experiments are created with mlflow.experimentKind=custom_model_development; existing
    ones get it when they have no kind or an inferred one; a kind someone chose is kept."""
    kind = "mlflow.experimentKind"
    with Tracker(TrackerSettings(store, "kind-new"), "r") as tr:
        assert client.get_experiment(tr.experiment_id).tags[kind] == "custom_model_development"
    untagged = client.create_experiment("kind-old", artifact_location=default_artifact_root(store))
    inferred = client.create_experiment("kind-inferred", tags={kind: "genai_development_inferred"})
    chosen = client.create_experiment("kind-chosen", tags={kind: "genai_development"})
    for name, exp_id in (("kind-old", untagged), ("kind-inferred", inferred)):
        assert client.get_experiment(exp_id).tags.get(kind) != "custom_model_development"
        with Tracker(TrackerSettings(store, name), "r") as tr:
            assert tr.experiment_id == exp_id
        assert client.get_experiment(exp_id).tags[kind] == "custom_model_development"
    with Tracker(TrackerSettings(store, "kind-chosen"), "r"):
        pass
    assert client.get_experiment(chosen).tags[kind] == "genai_development"


def test_ui_command_binds_localhost(store):
    cmd = ui_command(store, port=5123)
    db = Path(store.removeprefix("sqlite:///")).resolve()
    assert cmd[0].endswith("mlflow") or cmd[1:3] == ["-m", "mlflow"]
    args = cmd[cmd.index("server") :]
    assert args == [
        "server",
        "--backend-store-uri",
        f"sqlite:///{db}",
        "--artifacts-destination",
        str(db.parent / "mlartifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        "5123",
        "--workers",
        "1",
    ]
    with pytest.raises(ValueError, match="local sqlite store"):
        ui_command("http://127.0.0.1:5000")


def test_two_trackers_in_threads_do_not_clash(store, client):
    results: dict[str, str] = {}

    def work(name: str, offset: float) -> None:
        with Tracker(TrackerSettings(store, "threads", retry_interval_s=0), name) as tr:
            for step in range(15):
                tr.log_metrics({"loss/policy": offset + step}, step)
            results[name] = tr.run_id

    threads = [threading.Thread(target=work, args=(n, o)) for n, o in (("a", 0.0), ("b", 100.0))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results["a"] != results["b"]
    assert _history(client, results["a"], "loss/policy") == [(s, float(s)) for s in range(15)]
    assert _history(client, results["b"], "loss/policy") == [(s, 100.0 + s) for s in range(15)]


def _start_one(args):
    db_dir, i = args
    from sat_cli.tracking import Tracker, TrackerSettings

    with Tracker(TrackerSettings(f"sqlite:///{db_dir}/mlflow.db", "race"), f"r{i}") as tr:
        tr.log_metrics({"x": float(i)}, step=0)
        return tr.run_id


def test_parallel_processes_create_one_fresh_store(tmp_path):
    """Parallel `sat train` runs share a fresh sqlite store: start-up is serialised on a lock
    file (without it MLflow's schema migration races and one process fails)."""
    import multiprocessing as mp

    from mlflow import MlflowClient

    with mp.get_context("spawn").Pool(3) as pool:
        run_ids = pool.map(_start_one, [(str(tmp_path), i) for i in range(3)])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("race")
    assert sorted(r.info.run_id for r in client.search_runs([exp.experiment_id])) == sorted(run_ids)
