"""`sat plan`'s memory model (``sat_cli/devices/memory.py``) against the measured peak of the real
local trainer on the CPU, shape by shape (docs/gpus.md "Memory per process").

    PYTHONPATH=. .venv/bin/python bench/plan_memory.py [--shape NAME ...] [--json]

Per shape, a random-initialised Qwen3 (dense) or Qwen3-MoE of that shape is written to a
temporary folder; a fresh child process imports torch, transformers and
``sat_cli``, builds the batch, resets its resident-set high-water mark (``/proc/self/clear_refs``
5) and reads its resident set (the baseline: interpreter, torch, transformers, the batch), then
builds ``LocalTrainer`` from the folder and runs ``--steps`` GRPO steps (one thread, glibc's
mmap threshold fixed at 64 KiB so freed tensors leave the resident set). Measured = ``VmHWM``
after the steps − that of the ``floor`` shape run the same way (a model and batch of a few kB:
the lazy imports and file maps of building a trainer); estimate = the model's local-trainer
peak on the CPU (no
overhead part). Ratio = estimate / measured; the model's bar is ±15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name: the model's config.json fields (dense: intermediate_size; MoE: experts) and the batch:
# rows of `seq` tokens (ragged by a few tokens: a padding mask), the trainer's token budgets
BASE = dict(vocab=8192, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768)
SHAPES: dict[str, dict] = {
    "dense-base": dict(BASE, rows=16, seq=256),
    "dense-wide": dict(BASE, hidden=512, ffn=1536, heads=8, kv_heads=4, rows=8, seq=256),
    "dense-deep-long": dict(BASE, layers=8, rows=4, seq=1024),
    "dense-vocab-chunked": dict(BASE, vocab=65536, rows=8, seq=256),
    "dense-micro": dict(BASE, rows=32, seq=256, micro=2048),
    "moe-base": dict(BASE, experts=8, top_k=2, moe_ffn=256, rows=16, seq=256),
    "dense-packed": dict(BASE, rows=32, seq=128, ragged=64, row=224, micro=1792),
    "dense-bf16": dict(BASE, rows=16, seq=256, dtype="bfloat16"),
}
# the floor: the same process with a model and batch of a few kB (lazy imports, file maps)
FLOOR = dict(
    vocab=128, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=64, rows=2, seq=16
)
SHAPES["floor"] = FLOOR
STEPS = 3


def hf_config(s: dict) -> dict:
    cfg = dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["ffn"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if s.get("experts"):
        cfg.update(
            model_type="qwen3_moe",
            num_experts=s["experts"],
            num_experts_per_tok=s["top_k"],
            moe_intermediate_size=s["moe_ffn"],
            norm_topk_prob=True,
        )
    else:
        cfg["model_type"] = "qwen3"
    return cfg


def forward_shape(s: dict) -> tuple[int, int]:
    """(rows, width) of the trainer's largest forward with gradient for this shape."""
    if s.get("row"):  # packed rows of at most `row` tokens, `micro` tokens per forward
        return s["micro"] // s["row"], s["row"]
    if s.get("micro"):
        return s["micro"] // s["seq"], s["seq"]
    return s["rows"], s["seq"]


def estimate(s: dict) -> float:
    from sat_cli.devices.memory import local_trainer
    from sat_cli.models.arch import Arch

    rows, width = forward_shape(s)
    bf16 = s.get("dtype") == "bfloat16"
    return local_trainer(Arch.from_hf(hf_config(s)), rows, width, bf16=bf16).peak


def _save(folder: str, name: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = hf_config(SHAPES[name])
    config = AutoConfig.for_model(**cfg, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _batch(s: dict):
    import torch

    from sat_cli.engines.base import Sample
    from sat_cli.trainers.batch import collate

    g = torch.Generator().manual_seed(0)
    samples, ragged = [], s.get("ragged", 3)
    for i in range(s["rows"]):
        n = s["seq"] - (i * 7) % ragged  # lengths of a few different widths: a padding mask
        prompt = torch.randint(3, s["vocab"], (n // 4,), generator=g).tolist()
        resp = torch.randint(3, s["vocab"], (n - n // 4,), generator=g).tolist()
        logp = (-4.0 + 0.1 * torch.randn(len(resp), generator=g)).tolist()
        samples.append(Sample(prompt, resp, logp, "length", 0))
    adv = [(-1.0) ** i * (1 + i % 3) / 3 for i in range(s["rows"])]
    return collate(samples, adv, pad_id=0)


def _measure(folder: str, name: str, steps: int) -> dict:
    import torch

    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.local import LocalTrainer

    torch.set_num_threads(1)
    s = SHAPES[name]
    batch = _batch(s)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
    base = _status("VmRSS")
    trainer = LocalTrainer(
        folder,
        loss=LossConfig(algo="grpo"),
        lr=1e-4,
        seed=0,
        max_tokens_per_row=s.get("row", 0),
        max_tokens_per_micro_batch=s.get("micro", 0),
        dtype=s.get("dtype", "float32"),
    )
    built = _status("VmHWM")
    for _ in range(steps):
        trainer.step(batch)
    hwm = _status("VmHWM")
    return {"baseline": base, "built": built - base, "hwm": hwm, "measured": hwm - base}


def run_shape(
    name: str, steps: int = STEPS, timeout: float = 600, floor: int | None = None
) -> dict:
    """Both children for ``name``; the estimate, the measurement (peak − the floor's peak,
    ``floor``: measured when not given) and their ratio."""
    if floor is None and name != "floor":
        floor = run_shape("floor", steps, timeout)["hwm"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    me = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as tmp:
        _save(tmp, name)  # here: the measuring child only reads the folder
        out = subprocess.run(
            [sys.executable, me, "--measure", tmp, name, str(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode:
            raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if floor is not None:
        got["measured"] = got["hwm"] - floor
    est = estimate(SHAPES[name])
    return {"shape": name, "estimate": est, **got, "ratio": est / got["measured"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", nargs=3, metavar=("DIR", "SHAPE", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(_measure(a.measure[0], a.measure[1], int(a.measure[2]))))
        return 0
    print("| shape | rows × width per forward | estimate (MB) | measured (MB) | ratio |")
    print("|---|---|---|---|---|")
    floor = run_shape("floor", a.steps)["hwm"]
    for name in a.shape or [n for n in SHAPES if n != "floor"]:
        r = run_shape(name, a.steps, floor=floor)
        rows, width = forward_shape(SHAPES[name])
        if a.json:
            print(json.dumps(r))
        print(
            f"| {name} | {rows} × {width} | {r['estimate'] / 1e6:.0f} | "
            f"{r['measured'] / 1e6:.0f} | {r['ratio']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
