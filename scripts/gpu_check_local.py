"""GPU check of the single-GPU path: ``engine=local`` and ``trainer=local`` on CUDA, no SGLang, no
Megatron (``engine.device=cuda trainer.device=cuda``, bf16 where asked), on one GPU.

    scripts/gpu_check_local.sh [--model-path DIR]      # on the GPU machine (bounded, one call)
    python scripts/gpu_check_local.py --device cpu     # CPU smoke of this script (tiny model)

Models: the tiny Qwen3-MoE (docs/stack.md) and, on the GPU, a randomly initialised dense model of
Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads, vocabulary 151,936: ~0.6 B parameters).
With ``--model-path`` a real checkpoint (e.g. Qwen3-0.6B-Base in a local folder) is trained too.
Checks, each a row of the table:

- ``parity fp32``: the engine (``LocalEngine``, its own process, float32) samples; the trainer
  (``LocalTrainer``, float32) recomputes the same tokens' log-probs on the same device: max
  ``|Δ log-prob|`` (TF32 off);
- ``parity bf16``: engine in bf16 weights, trainer under bf16 autocast (fp32 weights): mean
  ``|Δ log-prob|`` gated, max reported;
- ``train bf16``: ``--steps`` SAT-GRPO steps of the bf16 trainer on the engine's samples (fixed
  advantages): every loss and gradient norm finite, the weights moved, weights and AdamW states
  still fp32; seconds per step and (GPU) peak memory of the trainer process reported;
- ``sat train``: the command line end to end on the device, engine and trainer in bf16, the
  embedded default (tiny model, toy addition) with ``tracking=none``: exit 0, and on the GPU
  held-out avg@8 at step 50 at least 10 points above step 0 (the CPU default gains 22);
  the CPU smoke runs 3 steps and checks the exit code and that every eval was printed;
- ``sat train real`` (with ``--model-path``): ``model=qwen3_0_6b model.path=DIR`` on the toy task,
  a few steps: exit 0 and the evals printed (values reported, not gated).

Exit status 0 iff every gated row passes; rows with ``-`` as bound are reported only.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("parity", "train", "real-batch", "sat-train")  # --only
sys.path.insert(0, str(ROOT))

from sat_cli.engines.base import SamplingParams  # noqa: E402
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings  # noqa: E402
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.samples import Sample  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.local import LocalTrainer  # noqa: E402

# Qwen3-0.6B's shape (its config.json), randomly initialised; tied embeddings
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)

ROWS: list[tuple[str, str, str, float, float | None, float | None]] = []


def row(check: str, model: str, metric: str, value: float, lo=None, hi=None) -> None:
    """A table row; gated when ``lo`` or ``hi`` is given (``lo <= value <= hi``)."""
    ROWS.append((check, model, metric, float(value), lo, hi))
    print(
        f"  {check:<16} {model:<9} {metric:<34} {value:10.4g} {_verdict(value, lo, hi)}", flush=True
    )


def _verdict(value, lo, hi) -> str:
    if lo is None and hi is None:
        return "-"
    ok = math.isfinite(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    return "PASS" if ok else "FAIL"


def _bound(lo, hi) -> str:
    if lo is None and hi is None:
        return "-"
    if lo is None:
        return f"<= {hi:g}"
    return f">= {lo:g}" if hi is None else f"[{lo:g}, {hi:g}]"


def save_qwen3_shape(path: Path) -> Path:
    """A random model of Qwen3-0.6B's shape with the char tokenizer (eos 1, pad 0)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**QWEN3_0_6B, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
    return save_hf(model, build_char_tokenizer(), path)


def sample_batch(engine, n_prompts: int, n: int, max_new: int, seed: int):
    """The engine's samples of ``n_prompts`` random char-token prompts, collated with fixed
    advantages (+1 / -1 alternating within each group)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 100, (int(torch.randint(6, 24, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_prompts)
    ]
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    groups = engine.generate(prompts, n=n, sampling=sp)
    samples = [s for grp in groups for s in grp]
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))])
    return collate(samples, adv, pad_id=0)


def check_parity(name: str, ckpt: Path, dev: str, dtype: str, shape) -> None:
    with LocalEngine(
        LocalEngineSettings(dtype=dtype), LocalEngineRuntime(str(ckpt), device=dev, seed=0)
    ) as engine:
        batch = sample_batch(engine, *shape, seed=1)
    trainer = LocalTrainer(str(ckpt), device=dev, dtype=dtype, lr=1e-5, loss=LossConfig())
    lp = trainer.logprobs(batch)
    m = batch.loss_mask.bool()
    d = (lp - batch.rollout_logp)[m].abs()
    tag = "fp32" if dtype == "float32" else "bf16"
    if dtype == "float32":
        row(f"parity {tag}", name, "max abs dlogp engine-trainer", d.max().item(), hi=1e-3)
    else:
        row(f"parity {tag}", name, "mean abs dlogp engine-trainer", d.mean().item(), hi=2e-2)
        row(f"parity {tag}", name, "max abs dlogp engine-trainer", d.max().item())
    row(f"parity {tag}", name, "tokens compared", float(m.sum()))
    del trainer
    _free(dev)


def check_training(name: str, ckpt: Path, dev: str, steps: int, shape) -> None:
    with LocalEngine(
        LocalEngineSettings(dtype="bfloat16"), LocalEngineRuntime(str(ckpt), device=dev, seed=0)
    ) as engine:
        sample_batch(engine, *shape, seed=9)  # warm-up: the tokens/s below exclude the first call
        t0 = time.perf_counter()
        batches = [sample_batch(engine, *shape, seed=10 + i) for i in range(steps)]
        gen_s = time.perf_counter() - t0
    generated = sum(float(b.loss_mask.sum()) for b in batches)  # response tokens sampled
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = LocalTrainer(
        str(ckpt), device=dev, dtype="bfloat16", lr=1e-5, loss=LossConfig(adaptive=True)
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    nonfinite, times = 0, []
    for b in batches:
        t0 = time.perf_counter()
        m = trainer.step(b)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        nonfinite += sum(not math.isfinite(m[k]) for k in ("loss/total", "loss/grad_norm"))
    moved = max(
        (p.detach() - before[k]).abs().max().item() for k, p in trainer.model.named_parameters()
    )
    fp32 = all(p.dtype == torch.float32 for p in trainer.model.parameters()) and all(
        t.dtype == torch.float32
        for st in trainer.opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    row("train bf16", name, "non-finite loss or grad norm", nonfinite, hi=0)
    row("train bf16", name, "max abs dweight", moved, lo=1e-12)
    row("train bf16", name, "weights and Adam fp32 (1 = yes)", float(fp32), lo=1)
    # one GPU's throughput, generation and training apart (bench/README.md when run on a GPU)
    row("train bf16", name, "generation tokens/s (engine, bf16)", generated / gen_s)
    tokens = sum(float(b.loss_mask.sum()) for b in batches[1:])
    row(
        "train bf16",
        name,
        "training tokens/s (after the first)",
        tokens / max(sum(times[1:]), 1e-9),
    )
    row("train bf16", name, "s per step (after the first)", sum(times[1:]) / max(len(times) - 1, 1))
    if dev == "cuda":
        row(
            "train bf16",
            name,
            "trainer peak GPU memory GiB",
            torch.cuda.max_memory_allocated() / 2**30,
        )
    del trainer, before
    _free(dev)


def check_real_batch(name: str, ckpt: Path, dev: str, rows: int, prompt: int, response: int):
    """One bf16 trainer step at a real batch (``rows`` responses of ``response`` tokens after
    ``prompt``-token prompts, synthetic ids and log-probs): its seconds and peak memory, beside
    ``sat plan``'s figure for the local trainer (weights, gradients and AdamW only). An
    out-of-memory error is a reported row (the measured fact), not a crash of the check."""
    trainer = LocalTrainer(
        str(ckpt), device=dev, dtype="bfloat16", lr=1e-5, loss=LossConfig(adaptive=True)
    )
    hi = min(int(trainer.model.config.vocab_size), 1000)
    g = torch.Generator().manual_seed(11)
    samples = [
        Sample(
            prompt_ids=torch.randint(3, hi, (prompt,), generator=g).tolist(),
            response_ids=torch.randint(3, hi, (response,), generator=g).tolist(),
            rollout_logp=(-torch.rand(response, generator=g) * 4).tolist(),
            finish_reason="length",
            weight_version=0,
        )
        for _ in range(rows)
    ]
    batch = collate(samples, [1.0 if i % 2 == 0 else -1.0 for i in range(rows)], pad_id=0)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    label = f"train bf16 {rows}x{prompt + response}"
    row(label, name, "sat plan's trainer figure GiB (16 B/param)", n_params * 16 / 2**30)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        m = trainer.step(batch)
        if dev == "cuda":
            torch.cuda.synchronize()
        row(label, name, "s per step", time.perf_counter() - t0)
        row(label, name, "non-finite loss", float(not math.isfinite(m["loss/total"])), hi=0)
    except torch.OutOfMemoryError:
        row(label, name, "out of memory (1 = yes)", 1.0)
    if dev == "cuda":
        row(label, name, "trainer peak GPU memory GiB", torch.cuda.max_memory_allocated() / 2**30)
    del trainer, batch
    _free(dev)


def _free(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.empty_cache()


def sat_train(args: list[str], cwd: Path, timeout: float) -> tuple[int, str, float]:
    """`sat train <args>` as a real subprocess: (exit code, output, seconds)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "sat_cli.cli", "train", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=env,
        )
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = 124, f"timed out after {timeout:.0f} s: {exc.stdout or ''}"
    return code, text, time.perf_counter() - t0


def evals(text: str) -> dict[int, float]:
    """``{step: avg@k}`` from the progress lines ``eval @ step N: avg@k X``."""
    return {int(s): float(v) for s, v in re.findall(r"eval @ step (\d+): avg@\d+ ([0-9.]+)", text)}


def check_cli(dev: str, tmp: Path, smoke: bool) -> None:
    common = [
        f"engine.device={dev}",
        f"trainer.device={dev}",
        "engine.dtype=bfloat16",
        "trainer.dtype=bfloat16",
        "tracking=none",
        f"run.dir={tmp / 'runs'}",
    ]
    if dev == "cuda":  # engine and trainer share the one GPU (the device plan, docs/gpus.md)
        common.append("engine.colocate=true")
    args = (
        [*common, "experiment=cpu_smoke"]
        if smoke
        else [*common, "max_steps=50", "eval.every=25", "checkpoint.every=0"]
    )
    code, text, secs = sat_train(args, tmp, timeout=240)
    ev = evals(text)
    print("\n".join("    | " + ln for ln in text.strip().splitlines()[-12:]), flush=True)
    row("sat train", "tiny", "exit code", code, hi=0)
    row("sat train", "tiny", "wall s", secs)
    last = max(ev) if ev else None
    if smoke:
        row("sat train", "tiny", "evals printed (steps 0, 2, 3)", len(ev), lo=3)
    else:
        gain = ev[last] - ev[0] if ev and 0 in ev else float("nan")
        row("sat train", "tiny", f"avg@8 step {last} - step 0 (points)", gain, lo=10)


def check_real(path: str, tmp: Path) -> None:
    args = [
        "model=qwen3_0_6b",
        f"model.path={path}",
        "engine.device=cuda",
        "trainer.device=cuda",
        "engine.colocate=true",
        "engine.dtype=bfloat16",
        "trainer.dtype=bfloat16",
        "tracking=none",
        "trainer.lr=1e-6",
        "max_steps=10",
        "eval.every=10",
        "eval.limit=64",
        "eval.n=4",
        "checkpoint.every=0",
        f"run.dir={tmp / 'runs_real'}",
    ]
    code, text, secs = sat_train(args, tmp, timeout=240)
    print("\n".join("    | " + ln for ln in text.strip().splitlines()[-12:]), flush=True)
    ev = evals(text)
    row("sat train real", "qwen3", "exit code", code, hi=0)
    row("sat train real", "qwen3", "wall s (10 steps, 2 evals)", secs)
    for step, v in sorted(ev.items()):
        row("sat train real", "qwen3", f"avg@4 at step {step}", v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model-path", default=None, help="a real HF checkpoint folder (GPU only)")
    ap.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"the parts to run, comma-separated: {','.join(PARTS)} (default: all)",
    )
    args = ap.parse_args()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only or only - set(PARTS):
        ap.error(f"--only: unknown {sorted(only - set(PARTS)) or 'none given'}; valid: {PARTS}")
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke of this script", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    on_gpu = dev == "cuda"
    t_start = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if on_gpu else "none"
    print(f"torch {torch.__version__}, device {dev} ({gpu})", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_local_") as tmp_name:
        tmp = Path(tmp_name)
        models = {"tiny": save_hf(build_tiny_moe(seed=0), build_char_tokenizer(), tmp / "tiny")}
        if on_gpu and only & {"parity", "train", "real-batch"}:
            models["qwen3-0.6b"] = save_qwen3_shape(tmp / "qwen3")
        for name, ckpt in models.items():
            shape = (16, 4, 64) if on_gpu else (4, 2, 12)  # prompts, samples each, new tokens
            for dtype in ("float32", "bfloat16") if "parity" in only else ():
                _guarded(f"parity {dtype}", name, check_parity, name, ckpt, dev, dtype, shape)
            if "train" in only:
                _guarded("train bf16", name, check_training, name, ckpt, dev, args.steps, shape)
        if on_gpu and "real-batch" in only:  # 16 responses of 1,536 tokens after 512-token prompts
            big = models["qwen3-0.6b"]
            _guarded(
                "train bf16 real batch",
                "qwen3-0.6b",
                check_real_batch,
                "qwen3-0.6b",
                big,
                dev,
                16,
                512,
                1536,
            )
        if "sat-train" in only:
            _guarded("sat train", "tiny", check_cli, dev, tmp, not on_gpu)
        if args.model_path and on_gpu:
            _guarded("sat train real", "qwen3", check_real, args.model_path, tmp)
    failed = [r for r in ROWS if _verdict(r[3], r[4], r[5]) == "FAIL"]
    print("\n| check | model | metric | value | bound | ok |")
    print("|---|---|---|---|---|---|")
    for check, model, metric, value, lo, hi in ROWS:
        verdict = _verdict(value, lo, hi)
        print(f"| {check} | {model} | {metric} | {value:.4g} | {_bound(lo, hi)} | {verdict} |")
    print(f"\n{len(ROWS)} rows, {len(failed)} failed, {time.perf_counter() - t_start:.0f} s")
    return 1 if failed else 0


def _guarded(check: str, name: str, fn, *args) -> None:
    """A check that raises is a failed row (with its traceback), and the others still run."""
    import traceback

    try:
        fn(*args)
    except Exception:
        traceback.print_exc()
        row(check, name, "raised (see traceback)", 1.0, hi=0)


if __name__ == "__main__":
    sys.exit(main())
