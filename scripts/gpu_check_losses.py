"""GPU check of the policy losses: GRPO, SAT-GRPO, GSPO and SAT-GSPO computed on the device, in
float32 and in bfloat16, against a float64 reference on the CPU (``registry.compute``, the one
entry point the trainers use).

    python scripts/gpu_check_losses.py --device cuda   # on the GPU machine (scripts/gpu_check.sh)
    python scripts/gpu_check_losses.py --device cpu    # the same rows on the CPU (tests)

Inputs (seeded, ``[B, T] = [64, 384]`` with ragged masks): log-probs of a bf16 policy and its
stale behaviour policy (a per-token mismatch of a few percent, a heavy tail of larger ones, so
SAT's high-mismatch tail and the clip are both active) and group-normalised advantages. They are
rounded to bf16 first, so every row and its reference see the same numbers; the reference is the
float64 loss and the gradient d loss / d logp on the CPU.

Rows (``| check | model | metric | value | bound | verdict |``, read by scripts/gpu_check.py):

- ``loss fp32 <algo>``: relative |Δ loss| of the device's float32 computation (gated ≤ 1e-5) and
  the relative max |Δ grad| (gated ≤ 1e-4, relative to max |grad|);
  this is the trainers' own path: a bf16 model's log-probs reach the loss as float32
  (``trainers/logprobs.py`` and the Megatron pipeline upcast them);
- ``loss bf16 <algo>``: the whole loss in bfloat16 on the device, reported, not gated: no
  trainer computes it so, and for GSPO it cannot be right (its radii 3e-4 / 4e-4 are below
  bf16's spacing at 1, 2^-8 below and 2^-7 above, so the sequence ratio's clip is decided on
  rounding noise); this row shows why the upcast matters;
- the clipped fraction of each row beside the reference's (reported).

Exit status 0 iff every gated row passes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sat_cli.metric_names import CLIPFRAC  # noqa: E402
from sat_cli.rl import registry  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.rl.loss_io import LossInputs  # noqa: E402

SHAPE = (64, 384)
ALGOS = {
    "grpo": LossConfig(algo="grpo"),
    "sat-grpo": LossConfig(algo="grpo", adaptive=True),
    "gspo": LossConfig(algo="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"),
    "sat-gspo": LossConfig(
        algo="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean", adaptive=True
    ),
}
ROWS: list[tuple[str, str, str, float, str, str]] = []


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16-rounded ``logp``, ``rollout_logp``, ``advantages`` and ``mask`` on the CPU, float64."""
    g = torch.Generator().manual_seed(seed)
    b, t = SHAPE
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3.0
    drift = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.03
    tail = torch.rand(b, t, generator=g, dtype=torch.float64) < 0.05
    drift = torch.where(tail, drift * 10.0, drift)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    rewards = torch.randint(0, 2, (b // 8, 8), generator=g).to(torch.float64)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)

    def bf16(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(torch.float64)

    return {
        "logp": bf16(logp),
        "rollout_logp": bf16(logp + drift),
        "advantages": bf16(adv.reshape(-1)),
        "mask": mask,
    }


def loss_and_grad(cfg: LossConfig, x: dict, device: str, dtype: torch.dtype):
    """``(loss, d loss / d logp, clipped fraction)`` computed on ``device`` in ``dtype``."""
    logp = x["logp"].to(device=device, dtype=dtype).requires_grad_(True)
    out = registry.compute(
        cfg,
        LossInputs(
            logp=logp,
            rollout_logp=x["rollout_logp"].to(device=device, dtype=dtype),
            advantages=x["advantages"].to(device=device, dtype=dtype),
            mask=x["mask"].to(device=device, dtype=dtype),
        ),
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    loss = out.loss.detach().to("cpu", torch.float64)
    return float(loss), grad.detach().to("cpu", torch.float64), out.metrics.get(CLIPFRAC)


def row(check: str, model: str, metric: str, value: float, bound: str, ok: bool | None) -> None:
    ROWS.append(
        (check, model, metric, value, bound, "-" if ok is None else "PASS" if ok else "FAIL")
    )


def check(name: str, cfg: LossConfig, x: dict, device: str) -> None:
    ref_loss, ref_grad, ref_clip = loss_and_grad(cfg, x, "cpu", torch.float64)
    scale = max(abs(ref_loss), 1e-12)
    gscale = max(float(ref_grad.abs().max()), 1e-30)
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gated = label == "fp32"
        loss, grad, clip = loss_and_grad(cfg, x, device, dtype)
        rel = abs(loss - ref_loss) / scale
        g = float((grad - ref_grad).abs().max()) / gscale
        for metric, value, tol in (
            ("rel abs dloss vs float64", rel, 1e-5),
            ("rel max abs dgrad", g, 1e-4),
        ):
            bound, ok = (f"≤ {tol:g}", value <= tol) if gated else ("-", None)
            row(f"loss {label}", name, metric, value, bound, ok)
        if clip is not None and ref_clip is not None:
            row(f"loss {label}", name, f"clip frac (ref {ref_clip:.4f})", clip, "-", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    x = inputs()
    for name, cfg in ALGOS.items():
        check(name, cfg, x, args.device)
    failed = [r for r in ROWS if r[5] == "FAIL"]
    print(f"torch {torch.__version__}, device {args.device}")
    print("\n| check | model | metric | value | bound | verdict |")
    print("|---|---|---|---|---|---|")
    for check_, model, metric, value, bound, verdict in ROWS:
        shown = f"{value:.4g}" if math.isfinite(value) else str(value)
        print(f"| {check_} | {model} | {metric} | {shown} | {bound} | {verdict} |")
    print(f"\n{len(ROWS)} rows, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
