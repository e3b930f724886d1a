"""Supervised warm start on a user's file task (``task.path``): `sat pretrain`, then `sat train`.

The tiny model's own warm start (:mod:`sat_cli.models.warmstart`) knows ``a+b=`` only, so RL on
a task of yours starts from a score near 0 and sees no reward to learn from. This continues a
base checkpoint with teacher-forced cross-entropy on the task's training rows, each the prompt
(the task's template) followed by ``\\boxed{<answer>}`` and EOS, loss on the target only
(:mod:`sat_cli.tasks.sft_data`): batches of ``model.warm_start.batch_size`` rows in a seeded
order (epochs reshuffled), AdamW at ``model.warm_start.lr``, betas (0.9, 0.98), grad clip 1.0.

* **Base**: the toy warm start (``model=tiny_moe`` without ``model.path``: the shipped one for
  the default architecture), or ``model.path`` (any HF folder; a hub id in the local cache).
* **What it learns from**: the rows the RL run trains on (the held-out split or
  ``task.heldout_path`` are never seen), less a validation slice of them (``heldout_frac`` of
  them by a hash of the problem text, at most ``model.warm_start.eval_size``), which is not
  trained on either.
* **When it stops**: every ``eval_every`` steps (and before the first, for the log), one sample
  per validation row (temperature 1, ``task.max_new_tokens``) is graded by the math grader;
  training stops once the share correct reaches ``model.warm_start.target_accuracy`` (default
  0.2: RL has room to improve), and fails (exit 1, nothing cached) if ``max_steps`` pass first.
* **Refused before training** (exit 2): a row whose prompt or answer holds a character the
  tokenizer has no token for, naming the row and the character; a training row longer than
  the model's context (``max_position_embeddings``).
* **Cache**: ``<run.dir>/cache/<model.name>_task-<hash12>`` (HF files and ``warmstart.json``),
  keyed by SHA-256 of the base (the toy warm start's key; an HF folder's ``config.json``,
  tokenizer files, and each weight file's name, size and mtime), the data (the SHA-256 of the
  training file's bytes and of ``task.heldout_path``'s, the column roles ``task.fields``, the
  template, the split settings), the SFT settings and torch's version: a changed file never
  reuses a stale warm start.

`sat train` with ``model=tiny_moe`` (no ``model.path``) on a file task resolves the same
folder, building it when absent; with ``model.path``, pass the folder `sat pretrain` prints.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.sft_data import check_charset, data_digest, sft_example

FORMAT_VERSION = 1
SEED = 0  # the data order and the validation samples


@dataclass(frozen=True)
class TaskSft:
    """The supervised run's settings (part of the cache key)."""

    batch_size: int
    lr: float
    eval_every: int
    target_accuracy: float
    max_steps: int
    eval_size: int
    max_new_tokens: int
    seed: int = SEED


def _base_identity(base: Path) -> dict:
    """What names a base checkpoint in the key: a warm start's own key, else the HF folder's
    config and tokenizer bytes and each other file's name, size and mtime (weights are not
    read: a 60 GB checkpoint would take minutes); a hub id is its name."""
    meta = base / "warmstart.json"
    if meta.is_file():
        try:
            return {"warm_start": json.loads(meta.read_text())["key"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged record: identify the folder by its files
    if not base.is_dir():
        return {"hub_id": str(base)}
    files = {}
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        if f.suffix in (".json", ".jinja", ".txt", ".model"):
            files[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
        else:
            st = f.stat()
            files[f.name] = [st.st_size, st.st_mtime_ns]
    return {"folder": files}


def task_key(base: dict, task_cfg: dict, sft: TaskSft, torch_version: str) -> str:
    blob = {"format": FORMAT_VERSION, "base": base, "task": task_cfg, "sft": asdict(sft)}
    blob["torch"] = torch_version
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def task_config(t) -> dict:
    """The data part of the key, from a ``TaskConfig``."""
    return {
        "data_sha256": data_digest(t.path),
        "heldout_sha256": data_digest(t.heldout_path) if t.heldout_path else None,
        "fields": {k: getattr(t.fields, k) for k in ("prompt", "answer", "system", "id")},
        "template": t.template,
        "system_prompt": t.system_prompt,
        "heldout_frac": t.heldout_frac,
        "kind": t.kind,
    }


def sft_split(obj, tokenizer):
    """``(task, train_rows, val_rows)``: the RL run's training rows less a validation slice.
    Every row (held-out ones too) is checked against the tokenizer's characters first."""
    from sat_cli.tasks.dataset import DatasetTask, split_heldout
    from sat_cli.tasks.prompts import ChatTemplateMissing
    from sat_cli.tasks.registry import TASK_SOURCES, eval_source

    heldout = eval_source(obj.eval.benchmark).splits_task
    task = DatasetTask.from_config(
        obj.task, TASK_SOURCES.get(obj.task.kind), data_dir=obj.data.dir, seed=SEED, heldout=heldout
    )
    task.tokenizer = tokenizer
    try:
        check_charset(tokenizer, task.rows, task.render, str(obj.task.path))
        if heldout:
            where = obj.task.heldout_path or f"{obj.task.path} (held-out rows)"
            check_charset(tokenizer, task.heldout(), task.render, str(where))
    except ChatTemplateMissing as exc:
        raise UserError(str(exc)) from None
    rows, val = split_heldout(task.rows, obj.task.heldout_frac, str(obj.task.path))
    return task, rows, val[: obj.model.warm_start.eval_size]


def train_on_task(base: Path, obj, sft: TaskSft, log=print):
    """Continue ``base`` on the task's rows; returns ``(model, tokenizer, info)``."""
    import torch

    from sat_cli.models.tiny_moe import load_model, load_tokenizer
    from sat_cli.models.warmstart import pad_batch, pad_id, sample_texts, sft_step
    from sat_cli.tasks.dataset import DatasetTask
    from sat_cli.tasks.reward import grade

    tokenizer = load_tokenizer(base)
    task, rows, val = sft_split(obj, tokenizer)
    train = DatasetTask(rows, template=task.template, seed=sft.seed)
    train.tokenizer, train.system_prompt = tokenizer, task.system_prompt
    val_prompts = [task.render(r) for r in val]
    log(f"task warm start: {len(rows)} training rows, {len(val)} validation rows, from {base}")

    def accuracy(step: int) -> float:
        texts = sample_texts(model, tokenizer, val_prompts, sft.max_new_tokens, sft.seed + step)
        return sum(grade(t, r["answer"]) for t, r in zip(texts, val, strict=True)) / len(val)

    torch.manual_seed(sft.seed)
    t0 = time.perf_counter()
    model = load_model(base).train()
    limit = getattr(model.config, "max_position_embeddings", None)
    for r in rows if limit else ():
        n = len(sft_example(tokenizer, train.render(r), r["answer"])[0])
        if n > limit:
            raise DataError(
                f"{obj.task.path}: row {r['id']!r}: its prompt and answer are {n} tokens, over "
                f"the model's context of {limit}; shorten or drop the row"
            )
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, betas=(0.9, 0.98), weight_decay=0.0)
    acc0 = acc = accuracy(0)
    log(f"task warm start: validation sampled accuracy before {acc0:.3f}")
    step, reached, loss = 0, False, float("nan")  # at least eval_every steps
    while not reached and step < sft.max_steps:
        step += 1
        items = train.sample_prompts(sft.batch_size, (step - 1) * sft.batch_size)
        examples = [sft_example(tokenizer, it["prompt"], it["answer"]) for it in items]
        loss = sft_step(model, opt, *pad_batch(examples, pad_id(tokenizer)))
        if step % sft.eval_every == 0 or step == sft.max_steps:
            acc = accuracy(step)
            reached = acc >= sft.target_accuracy
            log(
                f"task warm start step {step:4d}  loss {loss:.4f}  validation sampled acc "
                f"{acc:.3f}  ({time.perf_counter() - t0:.1f} s)"
            )
    info = {"steps": step, "accuracy_before": acc0, "accuracy": acc, "loss": loss}
    info.update(seconds=round(time.perf_counter() - t0, 2), reached=reached)
    info.update(train_rows=len(rows), validation_rows=len(val))
    return model.eval(), tokenizer, info


def ensure_task_warm_start(obj, base: str | Path, cache_dir: str | Path, log=print) -> Path:
    """The warm-start folder of ``obj``'s file task from ``base``, trained and cached when absent."""
    import torch

    from sat_cli.models.tiny_moe import save_hf
    from sat_cli.models.warmstart import is_complete

    ws, base = obj.model.warm_start, Path(base)
    sft = TaskSft(
        batch_size=ws.batch_size,
        lr=ws.lr,
        eval_every=ws.eval_every,
        target_accuracy=ws.target_accuracy,
        max_steps=ws.max_steps,
        eval_size=ws.eval_size,
        max_new_tokens=obj.task.max_new_tokens,
    )
    task_cfg = task_config(obj.task)
    key = task_key(_base_identity(base), task_cfg, sft, torch.__version__.split("+")[0])
    target = Path(cache_dir) / f"{obj.model.name}_task-{key[:12]}"
    if is_complete(target, key):
        log(f"task warm start: cached {target}")
        return target
    # one thread: the tiny model gains nothing from more, and two threads on a busy 2-core
    # machine took 7-14 s a step instead of 0.7 s (workers spinning); the numerics are then
    # those of one thread on any machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer, info = train_on_task(base, obj, sft, log)
    finally:
        torch.set_num_threads(threads)
    if not info["reached"]:
        raise UserError(
            f"the task warm start did not reach validation accuracy {sft.target_accuracy} in "
            f"{sft.max_steps} steps (last {info['accuracy']:.3f}); raise "
            "model.warm_start.max_steps or lower model.warm_start.target_accuracy",
            code=1,
        )
    save_hf(model, tokenizer, target)  # atomic: a staged sibling renamed over the target
    meta = {"key": key, "base": str(base), "task": task_cfg, "sft": asdict(sft), **info}
    tmp = target / "warmstart.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(target / "warmstart.json")
    log(
        f"task warm start: done in {info['seconds']:.1f} s, {info['steps']} steps, validation "
        f"sampled accuracy {info['accuracy_before']:.3f} -> {info['accuracy']:.3f} -> {target}"
    )
    return target


def tiny_task_warm_start(obj, cache_dir: str | Path, model_overrides: dict, log=print) -> Path:
    """``model=tiny_moe`` on a file task: the toy warm start of this architecture (the shipped
    one for the default; its SFT settings are the defaults, not ``model.warm_start``'s, which
    apply to the task's SFT), then :func:`ensure_task_warm_start` from it."""
    from sat_cli.models.warmstart import WarmStartSettings, ensure_warm_start

    toy = WarmStartSettings(model_overrides=model_overrides)
    base = ensure_warm_start(cache_dir, toy, use_shipped=True, log=log)
    return ensure_task_warm_start(obj, base, cache_dir, log=log)
