"""Soak run of `sat train`: memory of the orchestrator and the engine process over many steps.

Run: .venv/bin/python bench/soak.py --steps 300 [--out soak.json]

Starts ``python -m sat_cli.cli train experiment=cpu_smoke`` (small batches, periodic
checkpoints and in-training evaluation, MLflow on a sqlite store in a temporary run dir) and
samples ``VmRSS`` / ``VmHWM`` of both processes from ``/proc/<pid>/status`` every second (the
pids come from the run's ``logs/pids.json``). Growth is the median RSS of the last 10 % of the
samples over the median of the samples at 25–35 % of the run (after warm-up: model loads,
first checkpoint, first evaluation, allocator arenas). The run passes when both processes grow
by at most ``--max-growth`` (default 10 %) and the run itself exits 0. Prints a table and writes
the samples and figures as JSON (``--out``). Exit code 0 = pass, 1 = fail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def status_kb(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (kB) of a process, {} once it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def growth(samples: list[int]) -> tuple[float, float, float]:
    """(baseline, final, relative growth) of an RSS series (see the module docstring)."""
    n = len(samples)
    base = samples[int(0.25 * n) : max(int(0.35 * n), int(0.25 * n) + 1)]
    tail = samples[int(0.9 * n) :] or samples[-1:]
    b, f = statistics.median(base), statistics.median(tail)
    return b, f, f / b - 1.0


def soak(
    steps: int,
    run_dir: Path,
    *,
    interval: float = 1.0,
    prompts: int = 2,
    samples: int = 2,
    checkpoint_every: int = 25,
    eval_every: int = 50,
    extra: list[str] | None = None,
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "sat_cli.cli",
        "train",
        "experiment=cpu_smoke",
        f"max_steps={steps}",
        f"task.prompts_per_step={prompts}",
        f"task.samples_per_prompt={samples}",
        f"checkpoint.every={checkpoint_every}",
        f"eval.every={eval_every}",
        "eval.n=1",
        "eval.limit=32",
        f"run.dir={run_dir}",
        "run.name=soak",
        *(extra or []),
    ]
    logs = run_dir / "sat" / "soak" / "logs"
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(run_dir / "soak.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        pids = {}
        series: dict[str, list[tuple[float, int]]] = {"orchestrator": [], "engine": []}
        hwm: dict[str, int] = {}
        while proc.poll() is None:
            if not pids and (logs / "pids.json").is_file():
                pids = json.loads((logs / "pids.json").read_text())
            for role, pid in pids.items():
                st = status_kb(int(pid)) if pid else {}
                if "VmRSS" in st:
                    series[role].append((round(time.monotonic() - t0, 2), st["VmRSS"]))
                    hwm[role] = max(hwm.get(role, 0), st.get("VmHWM", 0))
            time.sleep(interval)
        code = proc.wait()
    wall = time.monotonic() - t0
    report: dict = {
        "command": cmd,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "steps": steps,
        "interval_s": interval,
        "processes": {},
    }
    for role, pts in series.items():
        rss = [kb for _, kb in pts]
        if len(rss) < 3:
            report["processes"][role] = {"samples": len(rss)}
            continue
        b, f, g = growth(rss)
        report["processes"][role] = {
            "samples": len(rss),
            "peak_rss_mib": round(max(rss) / 1024, 1),
            "vm_hwm_mib": round(hwm.get(role, 0) / 1024, 1),
            "baseline_rss_mib": round(b / 1024, 1),
            "final_rss_mib": round(f / 1024, 1),
            "growth": round(g, 4),
            "series": pts,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--max-growth", type=float, default=0.10)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--run-dir", default=None, help="default: a temporary folder, removed")
    ap.add_argument("--out", default=None, help="JSON report (samples and figures)")
    args = ap.parse_args(argv)
    from sat_cli.util.script_args import output_dir, output_file

    if args.out:  # checked before the soak (sat_cli.util.script_args): not a traceback after it
        args.out = str(output_file("bench/soak.py", args.out, "--out"))

    tmp = None
    if args.run_dir:
        run_dir = output_dir("bench/soak.py", args.run_dir, "--run-dir")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="sat-soak-")
        run_dir = Path(tmp.name)
    try:
        rep = soak(
            args.steps,
            run_dir,
            interval=args.interval,
            prompts=args.prompts,
            samples=args.samples,
            checkpoint_every=args.checkpoint_every,
            eval_every=args.eval_every,
        )
        if rep["exit_code"] != 0:
            print((run_dir / "soak.out").read_text()[-3000:], file=sys.stderr)
    finally:
        if tmp is not None:
            tmp.cleanup()
    ok = rep["exit_code"] == 0
    print(f"sat train, {args.steps} steps: exit {rep['exit_code']}, {rep['wall_s']} s")
    print(
        f"{'process':<13}{'samples':>8}{'peak MiB':>10}{'HWM MiB':>9}{'base MiB':>10}"
        f"{'final MiB':>10}{'growth':>9}"
    )
    for role, p in rep["processes"].items():
        if "growth" not in p:
            print(f"{role:<13}{p['samples']:>8}  (too few samples)")
            ok = False
            continue
        ok &= p["growth"] <= args.max_growth
        print(
            f"{role:<13}{p['samples']:>8}{p['peak_rss_mib']:>10.1f}{p['vm_hwm_mib']:>9.1f}"
            f"{p['baseline_rss_mib']:>10.1f}{p['final_rss_mib']:>10.1f}{p['growth']:>+9.1%}"
        )
    rep["max_growth"] = args.max_growth
    rep["pass"] = ok
    print("PASS" if ok else f"FAIL (growth above {args.max_growth:.0%} or the run failed)")
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
