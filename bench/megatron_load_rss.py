"""Per-rank peak RSS of the megatron worker at model load, by layout (docs/megatron.md).

    PYTHONPATH=. python bench/megatron_load_rss.py [--layouts 1,1,1 2,2,1 2,1,2] [--out DIR]

Builds a random Qwen3-MoE large enough that the weights dominate (hidden 512, 4 layers, 32
experts of intermediate size 384, vocabulary 16000: 95 M parameters, 380 MB in fp32; experts
are 80 % of it), saves it once with ``save_pretrained`` and starts the trainer for each layout
``nproc,ep,tp`` (CPU, gloo), reading each rank's line "peak RSS after model load X MiB, before
Y MiB" from the worker log ("before": imports and process groups, before the actor is built).
Runs whichever ``sat_cli`` is on ``PYTHONPATH`` (so the same script measures an older commit).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_experts=32,
    moe_intermediate_size=384,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=16000,
)


def build(path: Path) -> int:
    from transformers import Qwen3MoeForCausalLM

    from sat_cli.models.tiny_moe import build_config

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(build_config(**CONFIG))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def measure(model: Path, work: Path, nproc: int, ep: int, tp: int) -> list[tuple[float, float]]:
    from sat_cli.trainers.megatron.client import MegatronTrainer
    from sat_cli.trainers.megatron.settings import MegatronRuntime, MegatronTrainerSettings

    settings = MegatronTrainerSettings(nproc_per_node=nproc, ep=ep, tp=tp)
    with MegatronTrainer(settings, MegatronRuntime(str(model), work)) as tr:
        tr.ping()
    log = (work / "logs" / "megatron_trainer.log").read_text()
    rows = re.findall(
        r"rank (\d+): peak RSS after model load (\d+) MiB(?:, before (\d+) MiB)?", log
    )
    return [(float(a), float(b or "nan")) for _, a, b in sorted(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,1", "2,2,1", "2,1,2"])
    ap.add_argument("--out", default=None, help="folder for the model (default: a temp dir)")
    args = ap.parse_args()
    if args.out:  # checked (and created) before the work (sat_cli.util.script_args)
        from sat_cli.util.script_args import output_dir

        args.out = str(output_dir("bench/megatron_load_rss.py", args.out, "--out"))
    root = Path(args.out or tempfile.mkdtemp(prefix="sat_rss_"))
    model = root / "model"
    if not (model / "config.json").exists():
        n = build(model)
        print(f"model: {n / 1e6:.1f} M parameters, {n * 4 / 2**20:.0f} MiB fp32 at {model}")
    print("| ranks | ep | tp | peak RSS after load per rank (MiB) | before load (MiB) | s |")
    print("|---|---|---|---|---|---|")
    for i, layout in enumerate(args.layouts):
        nproc, ep, tp = (int(x) for x in layout.split(","))
        t0 = time.monotonic()
        rows = measure(model, root / f"w{i}", nproc, ep, tp)
        after = ", ".join(f"{a:.0f}" for a, _ in rows)
        before = ", ".join(f"{b:.0f}" for _, b in rows)
        print(f"| {nproc} | {ep} | {tp} | {after} | {before} | {time.monotonic() - t0:.0f} |")


if __name__ == "__main__":
    main()
