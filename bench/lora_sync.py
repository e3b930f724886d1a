"""Adapter-only weight sync (``trainer.lora``) against a full sync, on Qwen3-0.6B's shape.

Side by side in one run: a Qwen3-0.6B-shaped model (``sat_cli/assets/arch/qwen3_0_6b.json``,
the config of ``model=qwen3_0_6b``; random weights, nothing downloaded) in fp32, as the local
trainer holds it, published the two ways the trainer publishes a weight version:

* full: ``save_hf`` (``weights/v<N>`` of a run without LoRA: every tensor);
* adapter: ``trainers.lora_io.publish`` after ``trainer.lora`` wrapped the model (rank and
  target modules below; ``weights/v<N>`` of a LoRA run: the adapter alone).

The figure is the bytes of each folder's safetensors files (what ``weights/sync_bytes`` counts
per version), their ratio, and the seconds each write took (one write each; the machine is
shared, so the times are indicative, the bytes are exact). The engine reads the same files.

Run: ``python bench/lora_sync.py [--rank 16] [--targets q_proj,k_proj,v_proj,o_proj]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from sat_cli.models.arch import QWEN3_0_6B
    from sat_cli.models.tiny_moe import save_hf
    from sat_cli.trainers import lora_io

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**QWEN3_0_6B, "torch_dtype": "float32"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    lora = {"rank": args.rank, "alpha": args.alpha, "dropout": 0.0}
    lora["target_modules"] = args.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="sat-bench-lora-") as tmp:
        t0 = time.perf_counter()
        full = save_hf(model, None, Path(tmp) / "full")
        full_s = time.perf_counter() - t0
        full_b = folder_bytes(full)
        lora = lora_io.attach(model, lora)
        adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        t0 = time.perf_counter()
        ad = lora_io.publish(model, lora, Path(tmp) / "adapter", 1)
        ad_s = time.perf_counter() - t0
        ad_b = folder_bytes(ad)
    print(f"Qwen3-0.6B shape, fp32: {params / 1e6:.1f} M parameters; LoRA rank {args.rank} on ")
    print(f"{args.targets}: {adapter_params / 1e6:.2f} M adapter parameters")
    print("| sync | bytes per version | write (s) | ratio (bytes) |")
    print("|---|---|---|---|")
    print(f"| full (save_hf) | {full_b:,} | {full_s:.1f} | 1.0000 |")
    print(f"| adapter only | {ad_b:,} | {ad_s:.2f} | {ad_b / full_b:.4f} |")


if __name__ == "__main__":
    main()
