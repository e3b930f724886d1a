"""Overhead of SAT over plain PPO/GSPO clipping: forward + backward of ``policy_loss``.

Times ``policy_loss(..., adaptive=True)`` against ``adaptive=False`` on one ``[B, T]`` fp32 CPU
batch (default 512 x 1024, ~75 % active tokens, heavy-tailed log-ratios, per-sequence
advantages of both signs), at token level (GRPO) and sequence level (GSPO). Runs alternate
PPO/SAT within one process (order flipped every round), and the reported figure is the median of
the per-round ratios ``t_SAT / t_PPO`` (wall clock; also CPU time of the process, which is less
sensitive to other load on a shared machine). Each run includes the metrics, as a trainer
would call it.

Run:  .venv/bin/python bench/loss_overhead.py [--batch 512 --seq 1024 --rounds 15]
Goal: median ratio <= 1.10. Results are recorded in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss


def make_batch(batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    denom = -3.0 * torch.rand(batch, seq, generator=g)  # [B, T]
    z = torch.randn(3, batch, seq, generator=g)
    d = 0.05 * z[0] / torch.sqrt((z[1] ** 2 + z[2] ** 2) / 2)  # Student-t (df 2) log-ratios
    logp = (denom + d).requires_grad_()  # [B, T]
    lens = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lens[:, None]  # [B, T]
    adv = torch.randn(batch, generator=g)  # [B]
    return logp, denom, adv, mask


def one_run(logp, denom, adv, mask, level: str, adaptive: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one forward + backward."""
    t0, c0 = time.perf_counter(), time.process_time()
    loss, _ = policy_loss(logp, denom, adv, mask, LossConfig(adaptive=adaptive), level=level)
    loss.backward()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    logp.grad = None
    return dt, dc


def bench_level(batch, level: str, rounds: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        one_run(*batch, level, False)
        one_run(*batch, level, True)
    t_ppo, t_sat, ratios, cpu_ratios = [], [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            a = one_run(*batch, level, False)
            b = one_run(*batch, level, True)
        else:
            b = one_run(*batch, level, True)
            a = one_run(*batch, level, False)
        t_ppo.append(a[0])
        t_sat.append(b[0])
        ratios.append(b[0] / a[0])
        cpu_ratios.append(b[1] / a[1])
    return {
        "level": level,
        "ppo_ms": 1e3 * statistics.median(t_ppo),
        "sat_ms": 1e3 * statistics.median(t_sat),
        "median_ratio": statistics.median(ratios),
        "q1_ratio": statistics.quantiles(ratios, n=4)[0],
        "q3_ratio": statistics.quantiles(ratios, n=4)[2],
        "median_cpu_ratio": statistics.median(cpu_ratios),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", type=str, default="", help="also write the results to this file")
    args = ap.parse_args()
    if args.json:  # checked before the work (sat_cli.util.script_args)
        from sat_cli.util.script_args import output_file

        args.json = str(output_file("bench/loss_overhead.py", args.json, "--json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = make_batch(args.batch, args.seq)
    rows = [bench_level(batch, level, args.rounds) for level in ("token", "sequence")]
    print(
        f"policy_loss fwd+bwd, [{args.batch}, {args.seq}] fp32 CPU, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {args.rounds} alternating rounds"
    )
    print(
        f"{'level':<10} {'PPO ms':>8} {'SAT ms':>8} {'SAT/PPO wall':>13} {'IQR':>13}"
        f" {'SAT/PPO CPU':>12}"
    )
    for r in rows:
        iqr = f"{r['q1_ratio']:.3f}-{r['q3_ratio']:.3f}"
        print(
            f"{r['level']:<10} {r['ppo_ms']:>8.1f} {r['sat_ms']:>8.1f} "
            f"{r['median_ratio']:>13.3f} {iqr:>13} {r['median_cpu_ratio']:>12.3f}"
        )
    ok = all(r["median_ratio"] <= 1.10 for r in rows)
    print(f"goal median ratio <= 1.10: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
