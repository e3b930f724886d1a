"""Supervised warm start of the tiny Qwen3-MoE on the toy task, cached by a config hash.

RL from a random 1 M-parameter model never sees a reward, so the embedded default starts from a
briefly supervised checkpoint: ``ensure_warm_start(cache_dir, ...)`` returns an HF checkpoint
folder, building it when absent. Training: teacher-forced cross-entropy on the response tokens
``\\boxed{<sum>}<eos>`` of fresh training problems (batch 128, AdamW lr 3e-3, betas (0.9, 0.98),
grad clip 1.0); every ``eval_every`` steps the held-out *sampled* accuracy (temperature 1.0,
full distribution) is measured and training stops as soon as it reaches ``target_accuracy``
(default 0.2), so RL starts in the 20-40 % band and has room to improve. The accuracy stays near
0 for about 350 steps, then jumps: the default build stops at step 425 with sampled accuracy
0.205 (greedy 0.36), after ~100 s of CPU time on one thread (6.5 min wall on a 2-core machine
shared with other jobs).

The cache key is a SHA-256 of the model config, the task (digits, seed, held-out size) and the
SFT settings; the folder ``<cache_dir>/tiny_moe_warm-<hash12>`` holds the HF files plus
``warmstart.json`` (steps, accuracy, seconds, key). A shipped copy in ``sat_cli/assets/
tiny_moe_warm`` is used instead of training when its ``warmstart.json`` carries the same key.
The build is deterministic for a seed (same torch version and thread count): initial weights
from ``seed``, the data from the task's cursor stream, the evaluation sampler's own generator.

Run it on its own: ``python -m sat_cli.models.warmstart --cache-dir runs/cache``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sat_cli.models.tiny_moe import (
    TINY_MOE_CONFIG,
    build_char_tokenizer,
    build_tiny_moe,
    save_hf,
)
from sat_cli.tasks.toy import ToyTask

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "tiny_moe_warm"
SFT_CURSOR0 = 1_000_000_000  # SFT draws problems far from the RL run's cursor (which starts at 0)
FORMAT_VERSION = 1


def _print(msg: str) -> None:
    print(msg, flush=True)


def warm_start_key(model_overrides: dict, task: dict, sft: dict) -> str:
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "model": {**TINY_MOE_CONFIG, **model_overrides},
            "task": task,
            "sft": sft,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _sft_batch(task: ToyTask, tokenizer, cursor: int, batch_size: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the response)."""
    eos = tokenizer.eos_token_id
    examples = []
    for it in task.sample_prompts(batch_size, cursor):
        p = tokenizer(it["prompt"])["input_ids"]
        r = tokenizer(task.target(it["answer"]))["input_ids"] + [eos]
        examples.append((p + r, [-100] * len(p) + r))
    return pad_batch(examples, tokenizer.pad_token_id)


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id, else its EOS (Llama's tokenizers have no pad token)."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """``(input_ids, attention_mask, labels)`` of ``(ids, labels)`` pairs, right-padded (labels
    ``-100`` on the padding)."""
    S = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), S), pad_id, dtype=torch.long)  # [B, S]
    att = torch.zeros((len(examples), S), dtype=torch.long)  # [B, S]
    labels = torch.full((len(examples), S), -100, dtype=torch.long)  # [B, S]
    for b, (seq, lab) in enumerate(examples):
        ids[b, : len(seq)] = torch.tensor(seq)
        att[b, : len(seq)] = 1
        labels[b, : len(seq)] = torch.tensor(lab)
    return ids, att, labels


def sft_step(model, opt, ids, att, labels) -> float:
    """One teacher-forced cross-entropy step (mean over the labelled tokens, grad clip 1.0);
    returns the loss."""
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False)
    logits = out.logits[:, :-1].float()  # [B, S-1, V]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def sample_texts(
    model, tokenizer, prompts: list[str], max_new: int, seed: int, temperature: float = 1.0
) -> list[str]:
    """One sampled response per prompt (full distribution at ``temperature``, seeded), decoded
    without special tokens; the model is in eval mode meanwhile."""
    from sat_cli.models.sampling import sample_batch

    was_training = model.training
    model.eval()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    outs = sample_batch(
        model,
        ids,
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new,
        stop_token_ids={tokenizer.eos_token_id},
        pad_id=pad_id(tokenizer),
        generator=gen,
    )
    model.train(was_training)
    return [tokenizer.decode(o["response_ids"], skip_special_tokens=True) for o in outs]


def sampled_accuracy(model, tokenizer, task: ToyTask, seed: int, temperature: float = 1.0) -> float:
    """Held-out accuracy of one sample per problem (temperature ``temperature``, seeded)."""
    items = task.heldout()
    max_new = len(task.target("9" * (task.digits + 1))) + 1
    texts = sample_texts(
        model, tokenizer, [it["prompt"] for it in items], max_new, seed, temperature
    )
    hits = [task.reward(t, it["answer"]) for t, it in zip(texts, items, strict=True)]
    return sum(hits) / len(hits)


@dataclass(frozen=True)
class WarmStartSettings:
    """What a warm start trains (the cache key is made of these): the toy task (``digits``,
    ``task_seed``, ``heldout_size``), the supervised run (``seed``, ``batch_size``, ``lr``,
    ``eval_every``, ``target_accuracy``, ``max_steps``) and the model's ``model_overrides`` of
    ``TINY_MOE_CONFIG``."""

    digits: int = 3
    task_seed: int = 0
    heldout_size: int = 200
    seed: int = 0
    batch_size: int = 128
    lr: float = 3e-3
    eval_every: int = 25
    target_accuracy: float = 0.2
    max_steps: int = 3000
    model_overrides: dict = field(default_factory=dict)


def train_warm_start(
    ws: WarmStartSettings | None = None,
    *,
    num_threads: int | None = None,
    log: Callable[[str], None] | None = _print,
):
    """Train from scratch; returns ``(model, tokenizer, info)`` with info ``{steps, accuracy,
    seconds, reached}``. ``target_accuracy > 1`` trains exactly ``max_steps`` steps."""
    ws = ws or WarmStartSettings()
    if num_threads:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    task = ToyTask(digits=ws.digits, seed=ws.task_seed, heldout_size=ws.heldout_size)
    tokenizer = build_char_tokenizer()
    model = build_tiny_moe(ws.seed, **ws.model_overrides).train()
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.98), weight_decay=0.0)
    acc, step, reached = 0.0, 0, False
    loss_v = float("nan")
    for step in range(1, ws.max_steps + 1):
        ids, att, labels = _sft_batch(
            task, tokenizer, SFT_CURSOR0 + (step - 1) * ws.batch_size, ws.batch_size
        )
        loss_v = sft_step(model, opt, ids, att, labels)
        if step % ws.eval_every == 0 or step == ws.max_steps:
            acc = sampled_accuracy(model, tokenizer, task, seed=ws.seed * 7919 + step)
            if log:
                log(
                    f"warm start step {step:4d}  loss {loss_v:.4f}  held-out sampled acc {acc:.3f}"
                    f"  ({time.perf_counter() - t0:.1f} s)"
                )
            if acc >= ws.target_accuracy:
                reached = True
                break
    info = {
        "steps": step,
        "accuracy": acc,
        "loss": loss_v,
        "seconds": round(time.perf_counter() - t0, 2),
        "reached": reached,
    }
    return model.eval(), tokenizer, info


def _key_parts(ws: WarmStartSettings) -> tuple[dict, dict, dict]:
    """The model overrides, task and SFT settings the cache key of ``ws`` is made of."""
    overrides = dict(ws.model_overrides)
    task_cfg = {
        "name": "toy_add",
        "digits": ws.digits,
        "seed": ws.task_seed,
        "heldout_size": ws.heldout_size,
    }
    sft_cfg = {
        "seed": ws.seed,
        "batch_size": ws.batch_size,
        "lr": ws.lr,
        "eval_every": ws.eval_every,
        "target_accuracy": ws.target_accuracy,
        "max_steps": ws.max_steps,
        "torch": torch.__version__.split("+")[0],
    }
    return overrides, task_cfg, sft_cfg


def toy_warm_start_key(ws: WarmStartSettings | None = None) -> str:
    """The cache key of the toy warm start for ``ws`` (the shipped copy's for the defaults)."""
    return warm_start_key(*_key_parts(ws or WarmStartSettings()))


def ensure_warm_start(
    cache_dir: str | Path,
    ws: WarmStartSettings | None = None,
    *,
    use_shipped: bool = True,
    num_threads: int | None = None,
    log: Callable[[str], None] | None = _print,
) -> Path:
    """The warm-start checkpoint folder for these settings, trained and cached when absent."""
    ws = ws or WarmStartSettings()
    overrides, task_cfg, sft_cfg = _key_parts(ws)
    key = warm_start_key(overrides, task_cfg, sft_cfg)
    target = Path(cache_dir) / f"tiny_moe_warm-{key[:12]}"
    if is_complete(target, key):
        if log:
            log(f"warm start: cached {target}")
        return target
    if use_shipped and is_complete(SHIPPED, key):
        if log:
            log(f"warm start: using the shipped checkpoint ({SHIPPED.name})")
        return SHIPPED
    if log:
        log(
            f"warm start: training the tiny model on {ws.digits}-digit addition (target acc "
            f"{ws.target_accuracy})"
        )
    model, tokenizer, info = train_warm_start(ws, num_threads=num_threads, log=log)
    if not info["reached"]:
        raise RuntimeError(
            f"warm start did not reach held-out accuracy {ws.target_accuracy} in {ws.max_steps} steps "
            f"(last {info['accuracy']:.3f}); raise max_steps or lower target_accuracy"
        )
    tmp = target.with_name(target.name + ".building")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_hf(model, tokenizer, tmp)
    meta = {"key": key, "model": overrides, "task": task_cfg, "sft": sft_cfg, **info}
    (tmp / "warmstart.json").write_text(json.dumps(meta, indent=1))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    if log:
        log(
            f"warm start: done in {info['seconds']:.1f} s, {info['steps']} steps, held-out sampled "
            f"accuracy {info['accuracy']:.3f} -> {target}"
        )
    return target


def is_complete(path: Path, key: str) -> bool:
    meta = path / "warmstart.json"
    weights = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards
    if not (meta.is_file() and any((path / w).is_file() for w in weights)):
        return False
    try:  # a damaged record (cut short, not an object) means an incomplete cache: rebuilt
        rec = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(rec, dict) and rec.get("key") == key


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--target-accuracy", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--no-shipped", action="store_true", help="train even if a shipped copy matches"
    )
    args = ap.parse_args(argv)
    path = ensure_warm_start(
        args.cache_dir,
        WarmStartSettings(seed=args.seed, digits=args.digits, target_accuracy=args.target_accuracy),
        use_shipped=not args.no_shipped,
        num_threads=args.threads,
    )
    print(path)


if __name__ == "__main__":
    main()
