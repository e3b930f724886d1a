"""A format warm start of the embedded model for an environment (``parser=compact``).

The embedded checkpoint (``sat_cli/assets/tiny_moe_warm``) knows ``a+b=`` → ``\\boxed{sum}``
only; it never writes a tool call or a second turn, so RL on an environment would see no
reward. ``env_warm_start(env, cache_dir)`` continues it with teacher-forced cross-entropy on the
model tokens of the environment teacher's trajectories (its class's ``teacher``; the loss mask of
``plain.teacher_example``), batch 64, AdamW lr 1e-3, betas (0.9, 0.98), grad clip 1.0, fresh
training rows each step (``rows("train", …)`` from seed 10^9 on, far from an RL run's), and stops
as soon as the held-out success of one sampled trajectory per row (temperature 1,
``play``, ``heldout_size`` rows) reaches ``target`` (checked every ``eval_every`` steps):
low enough that RL has room to improve. The teacher of ``guess`` guesses at random, so its warm
start teaches the format and not the search: its success stays near that of random guessing.

The build is deterministic for its settings (same torch and thread count); the folder
``<cache_dir>/<env>_warm-<hash12>`` (HF files and ``warmstart.json``: steps, success, seconds,
key) is reused when its key matches. Run it on its own::

    python -m sat_cli.models.env_warmstart calculator --cache-dir runs/cache
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sat_cli.envs import registry
from sat_cli.envs.base import EnvSettings
from sat_cli.envs.plain import teacher_example, text_ids
from sat_cli.validate import check_int

SFT_SEED0 = 1_000_000_000
FORMAT_VERSION = 2  # the trajectories' rendering (plain.py)


def _print(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class EnvWarmStart:
    max_turns: int = 4
    seed: int = 0
    batch_size: int = 64
    lr: float = 1e-3
    eval_every: int = 10
    heldout_size: int = 100
    target: float | None = 0.2  # None: train exactly max_steps
    max_steps: int = 400

    def __post_init__(self):
        ints = {
            "max_turns": (1, 64),
            "batch_size": (1, 4096),
            "max_steps": (1, 10**5),
            "eval_every": (1, 10**5),
            "heldout_size": (1, 10**5),
            "seed": (0, 2**63 - 1),
        }
        for name, (lo, hi) in ints.items():
            check_int(f"warm start {name}", getattr(self, name), lo, hi)
        if not 0 < self.lr <= 1 or not (self.target is None or 0 <= self.target <= 1):
            raise ValueError("warm start lr must be in (0, 1] and target None or in [0, 1]")


def defaults(env: str) -> EnvWarmStart:
    """The warm start of ``env``: its class's ``warm_start`` fields (``ValueError``: none)."""
    envs = registry.ENVIRONMENTS
    fields = getattr(envs.find(env), "warm_start", None)
    if fields is None:
        have = [n for n in envs.names() if getattr(envs.get(n), "warm_start", None) is not None]
        raise ValueError(f"no warm start for environment {env!r}; valid: {', '.join(have)}")
    return EnvWarmStart(**fields)


def rows_of(env: str):
    """The rows of ``env``: its class's ``rows(split, n, start)``."""
    return registry.ENVIRONMENTS.get(env).rows


def settings_for(ws: EnvWarmStart) -> EnvSettings:
    return EnvSettings(max_turns=ws.max_turns, max_tokens=512, parser="compact")


def batch(env: str, ws: EnvWarmStart, tokenizer, step: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off model tokens)."""
    import torch

    rows = rows_of(env)("train", ws.batch_size, start=SFT_SEED0 + step * ws.batch_size * 2)
    rng = random.Random(f"{ws.seed}:{step}")
    ex = [teacher_example(env, r, settings_for(ws), tokenizer, rng)[:2] for r in rows]
    S = max(len(ids) for ids, _ in ex)
    ids = torch.full((len(ex), S), tokenizer.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(ex), S), dtype=torch.long)
    labels = torch.full((len(ex), S), -100, dtype=torch.long)
    for b, (seq, mask) in enumerate(ex):
        t = torch.tensor(seq)
        ids[b, : len(seq)], att[b, : len(seq)] = t, 1
        labels[b, : len(seq)] = torch.where(torch.tensor(mask) == 1, t, -100)
    return ids, att, labels


def play(
    model,
    tokenizer,
    env_name: str,
    rows: list[dict[str, Any]],
    settings: EnvSettings,
    *,
    seed: int,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
) -> list[dict[str, Any]]:
    """Play each row once with ``model`` (batched per turn, seeded): per row ``{"reward",
    "turns", "correct", "first_turn_correct", "text"}``. An in-process stand-in for the
    multi-turn driver (the same token sequence, no engine), for the warm start's own check;
    ``sat eval <env>`` measures with the driver."""
    import torch

    from sat_cli.models.sampling import sample_batch

    envs = [registry.make(env_name, settings) for _ in rows]
    seqs = [text_ids(tokenizer, e.reset(r)) for e, r in zip(envs, rows, strict=True)]
    out: list[dict[str, Any]] = [{"reward": 0.0, "turns": 0, "text": ""} for _ in rows]
    active = list(range(len(rows)))
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        while active:
            got = sample_batch(
                model,
                [seqs[i] for i in active],
                temperature=temperature,
                top_p=1.0,
                top_k=-1,
                max_new_tokens=max_new_tokens,
                stop_token_ids={eos},
                pad_id=tokenizer.pad_token_id,
                generator=gen,
            )
            still = []
            for i, g in zip(active, got, strict=True):
                ids = [int(t) for t in g["response_ids"]]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                obs, reward, done, info = envs[i].step(text)
                o = text_ids(tokenizer, obs)
                seqs[i] += ids + o
                rec = out[i]
                rec["turns"], rec["text"] = info["turn"], rec["text"] + text + "|"
                if info["turn"] == 1:
                    rec["first_turn_correct"] = bool(done and reward > 0)
                rec["reward"] += reward
                if done:
                    rec["correct"] = reward > 0
                elif len(seqs[i]) + max_new_tokens <= settings.max_tokens:
                    still.append(i)
                else:
                    rec["correct"] = False  # the token budget ends it
            active = still
    return out


def heldout_success(model, tokenizer, env: str, ws: EnvWarmStart, seed: int) -> dict:
    """Success, first-turn success and mean turns of one sampled trajectory per held-out row."""
    rows = rows_of(env)("heldout", ws.heldout_size)
    was = model.training
    model.eval()
    got = play(model, tokenizer, env, rows, settings_for(ws), seed=seed)
    model.train(was)
    n = len(got)
    return {
        "success": sum(g["correct"] for g in got) / n,
        "first_turn": sum(g.get("first_turn_correct", False) for g in got) / n,
        "turns": sum(g["turns"] for g in got) / n,
    }


def train(env: str, ws: EnvWarmStart, base: str | Path, log=None):
    """Continue ``base`` on ``env``'s teacher; returns ``(model, tokenizer, info)``."""
    import torch

    from sat_cli.models.tiny_moe import load_model, load_tokenizer

    log = log or _print

    torch.manual_seed(ws.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(base).train(), load_tokenizer(base)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.98), weight_decay=0.0)
    stats, step, reached = heldout_success(model, tokenizer, env, ws, ws.seed), 0, False
    for step in range(1, ws.max_steps + 1):
        ids, att, labels = batch(env, ws, tokenizer, step)
        out = model(input_ids=ids, attention_mask=att, use_cache=False)
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % ws.eval_every == 0 or step == ws.max_steps:
            stats = heldout_success(model, tokenizer, env, ws, ws.seed * 7919 + step)
            log(
                f"{env} warm start step {step:4d}  loss {float(loss.detach()):.4f}  held-out {stats}"
                f"  ({time.perf_counter() - t0:.1f} s)"
            )
            if ws.target is not None and stats["success"] >= ws.target:
                reached = True
                break
    info = {"steps": step, **stats, "seconds": round(time.perf_counter() - t0, 2)}
    return model.eval(), tokenizer, {**info, "reached": reached or ws.target is None}


def env_warm_start(env: str, cache_dir: str | Path, ws: EnvWarmStart | None = None, log=None):
    """The warm-start folder of ``env`` for ``ws``, trained from the shipped checkpoint and
    cached when absent."""
    import torch

    from sat_cli.models.tiny_moe import save_hf
    from sat_cli.models.warmstart import SHIPPED

    log = log or _print
    default = defaults(env)  # an environment without a warm start: ValueError, whatever ws
    ws = ws or default
    base_key = json.loads((SHIPPED / "warmstart.json").read_text())["key"]
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "env": env,
            "ws": asdict(ws),
            "base": base_key,
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
    )
    key = hashlib.sha256(blob.encode()).hexdigest()
    target = Path(cache_dir) / f"{env}_warm-{key[:12]}"
    meta = target / "warmstart.json"
    if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
        log(f"{env} warm start: cached {target}")
        return target
    model, tokenizer, info = train(env, ws, SHIPPED, log)
    if not info["reached"]:
        raise RuntimeError(
            f"{env} warm start did not reach held-out success {ws.target} in {ws.max_steps} "
            f"steps (last {info['success']:.3f})"
        )
    tmp = target.with_name(target.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp)
    (tmp / "warmstart.json").write_text(
        json.dumps({"key": key, "env": env, **asdict(ws), **info}, indent=1)
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log(f"{env} warm start: {info} -> {target}")
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("env", choices=sorted(registry.ENVIRONMENTS.names()))
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(env_warm_start(args.env, args.cache_dir), flush=True)


if __name__ == "__main__":
    main()
