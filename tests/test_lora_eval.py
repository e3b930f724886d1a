"""`sat eval ckpt=<a LoRA checkpoint>`: the configured base with the checkpoint's adapter,
loaded through the engine's adapter path (checked on arrival: a damaged adapter is one line,
exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
