"""`sat eval ckpt=<a LoRA checkpoint>`: the configured base with the checkpoint's adapter,
loaded through the engine's adapter path (checked on arrival: a damaged adapter is one line,
exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import seeded_store

from sat_cli.samples import Sample
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _lora_checkpoint(root: Path) -> Path:
    """A checkpoint folder as a LoRA run writes it (trainer/adapter, optimizer, state) after
    one step of the shipped tiny model on two hand-made samples."""
    trainer = LocalTrainer(str(TINY), lr=1e-2, lora=LORA)
    ids = trainer.tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    samples = [
        Sample(ids, [7, 8, 9], [-1.0, -1.0, -1.0], "length", 0),
        Sample(ids, [10, 11, 12], [-1.0, -1.0, -1.0], "length", 0),
    ]
    trainer.step(collate(samples, [1.0, -1.0], pad_id=0))
    ck = root / "checkpoints" / "step_1"
    trainer.save(ck / "trainer")
    return ck


def test_sat_eval_takes_an_adapter_checkpoint(tmp_path, sat_cli, monkeypatch):
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)
    ck = _lora_checkpoint(tmp_path)
    out = sat_cli("eval", "aime24", "eval.n=1", "eval.limit=2", f"ckpt={ck}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    adapter = ck / "trainer" / "adapter"
    assert f"eval: adapter {adapter} (weight version 1) on the base {TINY}" in out.stdout
    (folder,) = sorted((tmp_path / "runs" / "eval").glob("aime24-*"))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] and summary["num_problems"] == 2


@pytest.mark.slow  # ~15 s: the refusal of a damaged adapter (the engine's check: test_lora_sync)
def test_sat_eval_refuses_a_damaged_adapter_in_one_line(tmp_path, sat_cli, monkeypatch):
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)
    ck = _lora_checkpoint(tmp_path)
    f = ck / "trainer" / "adapter" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-2] ^= 0x10
    f.write_bytes(bytes(data))
    out = sat_cli("eval", "aime24", "eval.n=1", "eval.limit=2", f"ckpt={ck}", cwd=tmp_path)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert "its adapter was refused" in out.stderr and "is damaged" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # ~100 s on 2 loaded cores: the whole `sat train` path with LoRA, and resume
def test_sat_train_with_lora_publishes_adapters_and_resumes(tmp_path, sat_cli):
    """`sat train trainer.lora.rank=8 lag=2`: every published version and every checkpoint
    holds an adapter, the weight-sync metrics count adapter bytes, and `resume=auto` goes on
    from the adapter checkpoint."""
    import sqlite3

    from sat_cli.weightsync.adapters import ADAPTER_FILE, is_adapter

    seeded_store(tmp_path / "runs" / "mlflow.db")
    args = ["trainer.lora.rank=8", "lag=2", "run.name=l", "checkpoint.every=2", "eval.every=0"]
    out = sat_cli("train", "max_steps=4", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "sat" / "l"
    weights = sorted((run / "weights").iterdir())
    assert weights and all(is_adapter(p) for p in weights)
    adapter_bytes = (weights[-1] / ADAPTER_FILE).stat().st_size
    ck = run / "checkpoints" / "step_4" / "trainer"
    assert (ck / "adapter").is_dir() and not (ck / "model").exists()
    db = sqlite3.connect(tmp_path / "runs" / "mlflow.db")
    sent = [v for (v,) in db.execute("select value from metrics where key='weights/sync_bytes'")]
    db.close()
    assert sent and all(v == adapter_bytes for v in sent)  # one adapter per load, no base
    out = sat_cli("train", "max_steps=6", *args, "resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from step_4" in out.stdout and "done: 6 steps" in out.stdout
