"""GPU check of the SGLang engine against a transformers recompute (one GPU, under 5 minutes).

Run with the Python of the SGLang environment (it has CUDA torch and transformers), with the
repository on PYTHONPATH; ``scripts/gpu_check_sglang.sh`` does both::

    scripts/gpu_check_sglang.sh path/to/tiny_ckpt /opt/sglang-env/bin/python

What it checks, printing one table row each (exit code 1 if any fails):
1. the server starts (``--enable-return-routed-experts --weight-version 0``) and answers;
2. SGLang's token log-probs equal a transformers recompute of ``log_softmax(logits / T)`` at the
   sampled tokens (bf16 tolerance: mean |diff| < 0.03, max |diff| < 0.3; temperature 1, no
   top-p/top-k so the sampled and the scored distribution are the same);
3. routed experts have shape ``[prompt_len + completion_len - 1, num_layers, top_k]`` and match
   the HF routers' top-k sets wherever the choice is not a near-tie (router-logit gap < 0.1;
   the agreement fraction is printed for information);
4. ``/update_weights_from_disk`` with a perturbed copy of the checkpoint (lm_head x 1.5): later
   samples report version 1 and match the recompute under the new weights, not the old ones.

``--launch-prefix`` replaces the interpreter (e.g. a container command). On a machine without
CUDA the transformers side runs on CPU; with the test stand-in as the launch prefix this exercises
the script's plumbing only (the numbers then fail by design).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from sat_cli.engines.base import SamplingParams
from sat_cli.engines.sglang import SGLangEngine, read_moe_dims
from sat_cli.engines.sglang.runtime import SGLangRuntime
from sat_cli.engines.sglang.settings import SGLangEngineSettings

DEFAULT_SERVER_ARGS = (
    "--attention-backend triton --sampling-backend pytorch --disable-cuda-graph "
    "--mem-fraction-static 0.3"
)


def hf_score(model, prompt: list[int], response: list[int], temperature: float):
    """Token log-probs of ``response`` under ``model`` (temperature-scaled, float32 softmax)
    and the router logits of every MoE layer for every fed token, ``[P + C - 1, L, E]``."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    router_logits: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        # transformers 5 Qwen3-MoE gate returns (logits, scores, indices); older: logits.
        logits = output[0] if isinstance(output, tuple) else output
        router_logits.append(logits.float().reshape(-1, logits.shape[-1]))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits[0].float()  # [P + C - 1, V]
    finally:
        for h in handles:
            h.remove()
    p = len(prompt)
    logp = torch.log_softmax(logits[p - 1 :] / temperature, dim=-1)  # [C, V]
    token_logp = logp.gather(1, torch.tensor(response, device=device)[:, None])[:, 0]
    return token_logp.cpu().double().numpy(), torch.stack(router_logits, dim=1).cpu()


def load_hf(path: str, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.to(device).eval()


def perturbed_copy(src: str, dst: Path) -> None:
    """A copy of checkpoint ``src`` with ``lm_head.weight`` scaled by 1.5 (safetensors only)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.5
            save_file(tensors, f, metadata={"format": "pt"})
            return
    raise SystemExit(f"no lm_head.weight in {src}/*.safetensors (tied embeddings?)")


def compare(model, samples, temperature, top_k):
    """Log-prob differences, and how SGLang's routed experts compare with HF's routers.

    A routing disagreement is acceptable only as a near-tie: ``gap`` is the HF router-logit sum
    of HF's top-k set minus that of SGLang's set (0 when they agree); bf16 noise makes small
    gaps, a wrong layout or layer order makes large ones.
    """
    diffs, agree, total, max_gap, shapes_ok = [], 0, 0, 0.0, True
    for group in samples:
        for s in group:
            ref_logp, router = hf_score(model, s.prompt_ids, s.response_ids, temperature)
            diffs.extend(abs(a - b) for a, b in zip(s.rollout_logp, ref_logp, strict=True))
            expected = (router.shape[0], router.shape[1], top_k)
            if s.routed_experts is None or s.routed_experts.shape != expected:
                shapes_ok = False
                continue
            got = torch.from_numpy(s.routed_experts).long()  # [T, L, K]
            best = router.topk(top_k, dim=-1)
            gap = best.values.sum(-1) - router.gather(-1, got).sum(-1)  # [T, L]
            same = got.sort(-1).values == best.indices.sort(-1).values
            agree += int(same.all(-1).sum())
            total += got.shape[0] * got.shape[1]
            max_gap = max(max_gap, float(gap.max()))
    diffs_t = torch.tensor(diffs, dtype=torch.float64)
    return {
        "mean": float(diffs_t.mean()),
        "max": float(diffs_t.max()),
        "shapes_ok": shapes_ok,
        "agree": agree / max(total, 1),
        "max_gap": max_gap,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "ckpt", help="HF checkpoint directory (config.json, safetensors, tokenizer)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter of the SGLang env")
    parser.add_argument("--launch-prefix", default=None, help="full launch prefix (shell words)")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    args = parser.parse_args()

    t_start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = read_moe_dims(args.ckpt)
    vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="sat-gpu-check-"))
    log_dir = Path(args.log_dir) if args.log_dir else work / "logs"
    rows: list[tuple[str, str, str, bool]] = []

    settings = SGLangEngineSettings(
        launch_prefix=shlex.split(args.launch_prefix) if args.launch_prefix else [],
        device="cuda",
        dtype="bfloat16",
        extra_args=shlex.split(args.server_args),
        startup_timeout_s=args.startup_timeout,
        deterministic=False,
        request_timeout_s=120.0,
        concurrency=8,
    )
    runtime = SGLangRuntime(args.ckpt, r3=True, python=args.python, log_dir=log_dir)
    engine = SGLangEngine.launch(settings, runtime)
    try:
        rows.append(
            ("server ready", f"{time.monotonic() - t_start:.0f} s", "healthy", engine.health())
        )
        rng = random.Random(0)
        # Token ids 3..vocab-1 avoid the tiny model's pad/eos/unk (ids 0..2).
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
            for _ in range(args.prompts)
        ]
        sampling = SamplingParams(
            temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens
        )

        t0 = time.monotonic()
        samples = engine.generate(prompts, args.n, sampling)
        gen_s = time.monotonic() - t0
        n_tokens = sum(s.response_len for g in samples for s in g)
        rows.append(("generate", f"{n_tokens} tokens in {gen_s:.1f} s", "-", n_tokens > 0))

        model = load_hf(args.ckpt, device)
        c = compare(model, samples, 1.0, dims.top_k)
        rows.append(("logp |sglang - hf| mean", f"{c['mean']:.4f}", "< 0.03", c["mean"] < 0.03))
        rows.append(("logp |sglang - hf| max", f"{c['max']:.4f}", "< 0.3", c["max"] < 0.3))
        shape = samples[0][0].routed_experts.shape
        rows.append(
            ("routed experts shape", f"{shape} [P+C-1, L, K]", "all samples", c["shapes_ok"])
        )
        rows.append(("routed experts = hf top-k", f"{c['agree']:.3f}", "(info)", True))
        rows.append(
            ("router gap where they differ", f"{c['max_gap']:.4f}", "< 0.1", c["max_gap"] < 0.1)
        )

        new_ckpt = work / "v1"
        perturbed_copy(args.ckpt, new_ckpt)
        t0 = time.monotonic()
        engine.update_weights(str(new_ckpt), 1)
        rows.append(("update_weights_from_disk", f"{time.monotonic() - t0:.1f} s", "success", True))
        samples = engine.generate(prompts, 1, sampling)
        versions = sorted({s.weight_version for g in samples for s in g})
        rows.append(("weight_version after update", str(versions), "[1]", versions == [1]))
        old_mean = compare(model, samples, 1.0, dims.top_k)["mean"]
        del model
        new_model = load_hf(str(new_ckpt), device)
        new_mean = compare(new_model, samples, 1.0, dims.top_k)["mean"]
        rows.append(("v1 logp vs new weights mean", f"{new_mean:.4f}", "< 0.03", new_mean < 0.03))
        rows.append(
            ("v1 logp vs old weights mean", f"{old_mean:.4f}", "> 3x new", old_mean > 3 * new_mean)
        )
    finally:
        engine.close()

    rows.append(
        (
            "total wall time",
            f"{time.monotonic() - t_start:.0f} s",
            "< 300 s",
            time.monotonic() - t_start < 300,
        )
    )
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'value':<28} {'wanted':<12} ok")
    for name, value, wanted, ok in rows:
        print(f"{name:<{width}}  {value:<28} {wanted:<12} {'PASS' if ok else 'FAIL'}")
    print(f"server log: {log_dir}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
