"""Weight sync: the disk path against the broadcast (engine.weight_sync=disk|distributed).

Side by side in one run, on the same trainer and one local engine per path (CPU, gloo), for the
tiny Qwen3-MoE (1.0 M parameters) and a ~100 M-parameter Qwen3-MoE of the same shape family
(hidden 512, 8 layers, 16 experts of 512; random weights): per weight version what the loop
does (``sat_cli.loop.weightsync.WeightSync``):

* disk: the trainer writes ``weights/v<N>`` (``save_pretrained``) and the engine loads it;
* distributed: the trainer captures the version in its sender (in memory) and the engine's
  worker receives it by broadcast in ``engine.weight_sync_bucket_mb`` buckets; where the bytes
  arrive in the model's memory order (as here) the received buffers become its weights, no
  copy ("engine receive").

The versions alternate between the paths (disk, broadcast, disk, ...) so load spikes from
other jobs hit both; each figure is the median over ``--versions`` versions, with the split
into assemble (write / capture + flatten), wire (load / broadcast, and a copy into the model where it needs one) and
pause (group set-up). The broadcast's group is made before the first timed version (once per
run in ``sat train``). GB/s = the version's bytes (fp32) / its seconds. At the end each
engine's served weights are checked against the last version (``engine.verify_weights``).

Run: ``python bench/weight_sync.py`` (about 3 min on 2 cores); ``--write`` appends the table
to bench/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.loop.weightsync import GroupSpec, SyncSettings, WeightSync
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.models.warmstart import SHIPPED
from sat_cli.trainers.local import LocalTrainer
from sat_cli.weightsync.sender import WeightSender

CONFIGS = {
    "tiny": None,  # the shipped warm start
    "100m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_experts=16,
        moe_intermediate_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
README = Path(__file__).with_name("README.md")


def model_dir(name: str, root: Path) -> str:
    if CONFIGS[name] is None:
        return str(SHIPPED)
    return str(save_hf(build_tiny_moe(0, **CONFIGS[name]), build_char_tokenizer(), root / name))


def run(name: str, versions: int, bucket_mb: int, root: Path) -> dict:
    path = model_dir(name, root)
    sender = WeightSender(dtype="float32", source_dir=path, bucket_bytes=bucket_mb * 2**20)
    trainer = LocalTrainer(path, weight_sender=sender)
    params = sum(p.numel() for p in trainer.model.parameters())
    group = GroupSpec(timeout_s=300.0)
    out: dict = {"config": name, "params": params, "disk": [], "distributed": []}
    with (
        LocalEngine(LocalEngineSettings(), LocalEngineRuntime(path)) as e_disk,
        LocalEngine(LocalEngineSettings(), LocalEngineRuntime(path)) as e_dist,
    ):
        paths = {
            "disk": WeightSync(
                SyncSettings(mode="disk", verify="off"),
                e_disk,
                trainer,
                root / name / "disk",
                log=print,
            ),
            "distributed": WeightSync(
                SyncSettings(mode="distributed", verify="off", group=group),
                e_dist,
                trainer,
                root / name / "distributed",
                log=print,
            ),
        }
        paths["distributed"].write(1)  # the group forms once, before the timed versions
        paths["distributed"].load(1)
        paths["distributed"].metrics()
        for v in range(2, 2 + 2 * versions):
            with torch.no_grad():  # a new version of the weights
                for p in trainer.model.parameters():
                    p.mul_(0.999)
            kind = "disk" if v % 2 == 0 else "distributed"
            sync = paths[kind]
            t0 = time.perf_counter()
            sync.write(v)
            sync.load(v)
            total = time.perf_counter() - t0
            m = sync.metrics()
            out[kind].append(
                {
                    "s": total,
                    "bytes": m["weights/sync_bytes"],
                    "assemble": m["weights/sync_assemble_s"],
                    "wire": m["weights/sync_wire_s"],
                    "pause": m["weights/sync_pause_s"],
                }
            )
            sync.keep({v})
        out["zero_copy"] = e_dist.sync_zero_copy  # the worker took the received bytes as weights
        # one more version per path, verified (engine.verify_weights=every): served == sent
        for kind, engine in (("disk", e_disk), ("distributed", e_dist)):
            settings = SyncSettings(mode=kind, verify="every", group=group)
            check = WeightSync(settings, engine, trainer, root / name / kind, log=print)
            v = 3 + 2 * versions + (kind == "distributed")
            check.write(v)
            check.load(v)  # raises on a mismatch
            out["verified"] = check.metrics()["weights/verify_s"] > 0
    trainer.close()
    return out


def summary(r: dict) -> dict:
    med = {
        k: {f: statistics.median(x[f] for x in r[k]) for f in r[k][0]}
        for k in ("disk", "distributed")
    }
    nbytes = med["distributed"]["bytes"]
    return {
        "config": r["config"],
        "params": r["params"],
        "bytes": nbytes,
        "disk_s": med["disk"]["s"],
        "dist_s": med["distributed"]["s"],
        "ratio": med["disk"]["s"] / med["distributed"]["s"],
        "disk_gbs": nbytes / med["disk"]["s"] / 1e9,
        "dist_gbs": nbytes / med["distributed"]["s"] / 1e9,
        "disk_split": med["disk"],
        "dist_split": med["distributed"],
        "zero_copy": r["zero_copy"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | parameters | bytes (fp32) | disk s | broadcast s | ratio | disk GB/s | "
        "broadcast GB/s | disk: write / load | broadcast: capture / wire | engine receive |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        d, b = s["disk_split"], s["dist_split"]
        lines.append(
            f"| {s['config']} | {s['params'] / 1e6:.1f} M | {s['bytes'] / 1e6:.0f} MB | "
            f"{s['disk_s']:.3f} | {s['dist_s']:.3f} | **{s['ratio']:.1f}×** | "
            f"{s['disk_gbs']:.2f} | {s['dist_gbs']:.2f} | {d['assemble']:.3f} / {d['wire']:.3f} | "
            f"{b['assemble']:.3f} / {b['wire']:.3f} | "
            f"{'no copy' if s['zero_copy'] else 'copy'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--versions", type=int, default=3, help="timed versions per path")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--write", action="store_true", help="append the table to bench/README.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sat-bench-ws-") as tmp:
        for name in args.configs.split(","):
            r = run(name, args.versions, args.bucket_mb, Path(tmp))
            assert r["verified"], f"{name}: the engine does not serve the trainer's weights"
            rows.append(summary(r))
            print(table(rows[-1:]), flush=True)
    text = table(rows)
    print(text)
    if args.write:
        stamp = time.strftime("%Y-%m-%d")
        with README.open("a") as f:
            f.write(
                f"\n### {stamp}: `python bench/weight_sync.py --versions {args.versions}`\n\n"
                f"{text}\n"
            )


if __name__ == "__main__":
    main()
