"""The one prepared GPU check (``scripts/gpu_check.sh OUT``): every GPU path of `sat` in one call of
at most 10 minutes on one GPU machine, one JSON summary (``OUT/summary.json``) and a log per step
(``OUT/logs/``).

Steps (each a subprocess with its own time limit inside the call's budget; a step that fails or
runs out of time is recorded and the next one runs):

- ``plan``: the device plans of the GPU layouts (paper preset on one 8-GPU node, 2 × 8, one GPU
  local/local and SGLang + local colocated) against this machine's GPU count (CPU-only);
- ``losses``: ``scripts/gpu_check_losses.py --device cuda``: GRPO, SAT-GRPO, GSPO, SAT-GSPO on the
  GPU (float32 from bf16 log-probs, the trainers' path; all-bf16 reported) against float64 on the
  CPU, values and gradients;
- ``nccl``: ``scripts/gpu_check_nccl.py``: whether two processes on one GPU can form an NCCL group
  (what ``engine.weight_sync=distributed`` with ``engine.colocate=true`` needs on one GPU);
  reported;
- ``local``: ``scripts/gpu_check_local.py --device cuda``: engine/trainer parity fp32 and bf16,
  bf16 training on the tiny model and random weights of Qwen3-0.6B's shape, generation and
  training tokens/s measured separately on one GPU, ``sat train`` on the GPU;
- ``sglang``: ``scripts/gpu_check_sglang.py``: a real SGLang server on GPU 0, log-probs and routes
  against transformers, an update from disk (skipped, saying why, where the SGLang Python cannot
  import sglang: a bare GPU image has none, and SGLang's environment is far over what a call can
  carry);
- ``megatron``: ``scripts/gpu_check_megatron.py --models tiny --steps 2``: megatron-core bf16
  steps against the local trainer, one step through torchrun;
- ``weight_sync``: ``scripts/gpu_check_weight_sync.py``: an NCCL broadcast to the SGLang server,
  verified against its checksums and a disk load (skipped as ``sglang`` is);
- ``placement``: ``sat train engine=sglang trainer.device=cuda`` for a few steps (without SGLang:
  ``engine=local engine.device=cuda`` in bf16 with ``engine.verify_weights=every``, its weights
  over NCCL (``engine.weight_sync=distributed``) where engine and trainer have GPUs of their
  own, through the disk on one GPU); while it runs,
  ``nvidia-smi --query-compute-apps`` says which GPU each process of the run computes on
  (SGLang's schedulers are children of the server process), compared with the device plan
  (2+ GPUs: engine GPU 0, trainer GPU 1; one GPU: both on GPU 0 with engine.colocate=true).

``--cpu-dry-run`` runs the CPU-only parts here (the ``plan`` step, the nvidia-smi parser on a
fixed sample, the summary) and records every GPU step as skipped: tests/test_gpu_checks.py.
Rows: every ``| check | model | metric | value | bound | verdict |`` table row a step printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 570.0  # the call's limit (gpu_check.sh: timeout 590)
STEP_LIMIT_S = {
    "losses": 60,
    "nccl": 100,
    "local": 230,
    "megatron": 110,
    "placement": 100,
    "sglang": 120,
    "weight_sync": 90,
}
GPU_STEPS = tuple(STEP_LIMIT_S)  # in this order: the SGLang-free ones first
ROW = re.compile(r"^\|([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\|\s*(PASS|FAIL|-)\s*\|$")
LAYOUTS = {  # name: (overrides, GPUs per node)
    "paper 1x8": (["experiment=paper_qwen3_30b_a3b"], 8),
    "paper 2x8": (["experiment=paper_qwen3_30b_a3b", "trainer.nnodes=2"], 8),
    "local+local 1 GPU": (["engine.device=cuda", "trainer.device=cuda", "engine.colocate=true"], 1),
    "sglang+local 1 GPU": (["engine=sglang", "trainer.device=cuda", "engine.colocate=true"], 1),
}
# nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader and --query-gpu=index,uuid
SAMPLE_APPS = "4242, GPU-aaaa\n4243, GPU-bbbb\n"
SAMPLE_GPUS = "0, GPU-aaaa\n1, GPU-bbbb\n"


def gpu_of_pids(apps_csv: str, gpus_csv: str) -> dict[int, int]:
    """{pid: GPU index} from nvidia-smi's compute-apps and GPU queries (CSV, no header)."""
    index = {}
    for line in gpus_csv.strip().splitlines():
        i, uuid = (x.strip() for x in line.split(",")[:2])
        index[uuid] = int(i)
    out = {}
    for line in apps_csv.strip().splitlines():
        pid, uuid = (x.strip() for x in line.split(",")[:2])
        out[int(pid)] = index[uuid]
    return out


def ancestors(pid: int) -> list[int]:
    """``pid`` and its parents (from /proc), nearest first."""
    chain = []
    while pid > 1 and len(chain) < 64:
        chain.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return chain


def roles_on_gpus(pids: dict[str, int], seen: dict[int, int]) -> dict[str, list[int]]:
    """{role: sorted GPU indices} of the processes under each role's pid (pids.json)."""
    by_pid = {pid: role for role, pid in pids.items() if pid}
    out: dict[str, set[int]] = {role: set() for role in pids}
    for pid, gpu in seen.items():
        role = next((by_pid[p] for p in ancestors(pid) if p in by_pid), None)
        if role is not None:
            out[role].add(gpu)
    return {role: sorted(g) for role, g in out.items()}


def step_plan(gpus: int) -> dict:
    """The device plans of LAYOUTS, checked against ``gpus`` per node where it is > 0."""
    sys.path.insert(0, str(ROOT))
    from sat_cli.config import load
    from sat_cli.config.devices import device_plan
    from sat_cli.devices import DevicePlanError

    out = {}
    for name, (overrides, per_node) in LAYOUTS.items():
        _, obj = load(overrides)
        plan = device_plan(obj)
        procs = {p.name: [p.node, list(p.gpus)] for p in plan.procs}
        fits = None
        if gpus:
            try:
                plan.check(gpus, "this machine")
                fits = True
            except DevicePlanError:
                fits = False
        plan.check(per_node, "its layout")  # the layout's own node size always holds it
        out[name] = {"procs": procs, "needed": plan.needed(), "fits_this_machine": fits}
    return out


def run_step(name: str, cmd: list[str], logs: Path, limit: float, env=None) -> dict:
    log = logs / f"{name}.log"
    t0 = time.monotonic()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=limit,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})},
            ).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    rows = [
        {
            "check": m[1].strip(),
            "model": m[2].strip(),
            "metric": m[3].strip(),
            "value": m[4].strip(),
            "bound": m[5].strip(),
            "verdict": m[6],
        }
        for m in (ROW.match(ln.strip()) for ln in log.read_text(errors="replace").splitlines())
        if m and m[1].strip() != "check"
    ]
    failed = rc != 0 or any(r["verdict"] == "FAIL" for r in rows)
    return {
        "status": "FAIL" if failed else "PASS",
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "log": str(log),
        "rows": rows,
    }


def _pythonpath() -> str:
    """The project root ahead of what the caller's PYTHONPATH holds (gpu_check.sh puts the
    offline wheels of ``make gpu-bundle`` there: the steps need them too)."""
    rest = os.environ.get("PYTHONPATH", "")
    return str(ROOT) + (os.pathsep + rest if rest else "")


def sglang_missing(python: str) -> str | None:
    """Why ``python`` cannot run an SGLang server, or None when it imports sglang."""
    try:
        out = subprocess.run(
            [python, "-c", "import sglang"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return f"{python} cannot import sglang ({last})"
    return None


def step_placement(out: Path, gpus: int, limit: float, sglang_python: str | None) -> dict:
    """`sat train` on the GPU (SGLang + the local trainer, or without SGLang the local engine with
    its weights broadcast over NCCL and verified); nvidia-smi while it runs vs the plan."""
    run_dir = out / "placement_run"
    colocate = gpus < 2
    if sglang_python:
        engine = ["engine=sglang", f"engine.python={sglang_python}"]
    else:
        engine = [
            "engine.device=cuda",
            "engine.dtype=bfloat16",
            "trainer.dtype=bfloat16",
            "engine.verify_weights=every",
        ]
        engine += [] if colocate else ["engine.weight_sync=distributed"]
    args = [
        *engine,
        "trainer.device=cuda",
        "max_steps=3",
        "eval.every=0",
        "tracking=none",
        "checkpoint.every=0",
        f"run.dir={run_dir}",
    ]
    args += ["engine.colocate=true"] if colocate else []
    want = {"engine": [0], "orchestrator": [0 if colocate else 1]}
    log = out / "logs" / "placement.log"
    t0, seen_roles = time.monotonic(), {}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sat_cli.cli", "train", *args],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
        )
        try:
            while proc.poll() is None and time.monotonic() - t0 < limit:
                time.sleep(2)
                pids_file = next(run_dir.rglob("logs/pids.json"), None)
                if pids_file is None:
                    continue
                apps = _smi("--query-compute-apps=pid,gpu_uuid")
                seen = gpu_of_pids(apps, _smi("--query-gpu=index,uuid")) if apps.strip() else {}
                roles = roles_on_gpus(json.loads(pids_file.read_text()), seen)
                if all(roles.get(r) for r in want):
                    seen_roles = roles
        finally:
            if proc.poll() is None:
                proc.terminate()
            rc = proc.wait(timeout=30)
    ok = rc == 0 and all(seen_roles.get(r) == g for r, g in want.items())
    return {
        "status": "PASS" if ok else "FAIL",
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "log": str(log),
        "want": want,
        "seen": seen_roles,
        "colocate": colocate,
        "engine": "sglang" if sglang_python else "local",
    }


def _smi(query: str) -> str:
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30
    ).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for summary.json and logs/ (created)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the CPU-only parts, here")
    ap.add_argument("--sglang-python", default=os.environ.get("SAT_SGLANG_PYTHON", "python"))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds for all steps together, in [60, {BUDGET_S:g}] (default {BUDGET_S:g})",
    )
    ap.add_argument(
        "--steps",
        default=",".join(GPU_STEPS),
        help=f"the GPU steps to run, comma-separated, in their fixed order: {','.join(GPU_STEPS)}",
    )
    args = ap.parse_args()
    if not 60 <= args.budget_s <= BUDGET_S:
        ap.error(f"--budget-s must be in [60, {BUDGET_S:g}], got {args.budget_s:g}")
    chosen = [x.strip() for x in args.steps.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(GPU_STEPS))
    if unknown or not chosen:
        ap.error(f"--steps: unknown {unknown or 'none given'}; valid: {','.join(GPU_STEPS)}")
    sys.path.insert(0, str(ROOT))
    from sat_cli.util.script_args import output_dir

    out = output_dir("scripts/gpu_check.py", args.out, "OUT")  # one line, exit 2, if unusable
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    gpus = 0 if args.cpu_dry_run else len(_smi("--query-gpu=index,uuid").strip().splitlines())
    summary = {"gpus": gpus, "cpu_dry_run": args.cpu_dry_run, "steps": {}}
    steps = summary["steps"]
    steps["plan"] = {"status": "PASS", "layouts": step_plan(gpus)}
    steps["nvidia_smi_parser"] = {
        "status": "PASS" if gpu_of_pids(SAMPLE_APPS, SAMPLE_GPUS) == {4242: 0, 4243: 1} else "FAIL"
    }
    if args.cpu_dry_run:
        for name in GPU_STEPS:
            steps[name] = {"status": "SKIPPED", "why": "--cpu-dry-run: needs a GPU"}
    else:
        ckpt = Path(tempfile.mkdtemp(prefix="sat-gpu-check-")) / "tiny"
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from sat_cli.models.tiny_moe import "
                "build_char_tokenizer as t, build_tiny_moe as m, save_hf as s; "
                "s(m(seed=0), t(), sys.argv[1])",
                str(ckpt),
            ],
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
            timeout=120,
        )
        py, sg = sys.executable, args.sglang_python
        no_sglang = sglang_missing(sg)
        summary["sglang_python"] = {"python": sg, "missing": no_sglang}
        cmds = {
            "losses": [py, "scripts/gpu_check_losses.py", "--device", "cuda"],
            "nccl": [py, "scripts/gpu_check_nccl.py"],
            "local": [py, "scripts/gpu_check_local.py", "--device", "cuda", "--steps", "3"],
            "sglang": [
                sg,
                "scripts/gpu_check_sglang.py",
                str(ckpt),
                "--python",
                sg,
                "--log-dir",
                str(out / "logs" / "sglang"),
            ],
            "megatron": [
                py,
                "scripts/gpu_check_megatron.py",
                "--device",
                "cuda",
                "--models",
                "tiny",
                "--steps",
                "2",
            ],
            "weight_sync": [
                py,
                "scripts/gpu_check_weight_sync.py",
                str(ckpt),
                "--sglang-python",
                sg,
            ],
        }
        for name in GPU_STEPS:
            left = args.budget_s - (time.monotonic() - t0)
            if name not in chosen:
                steps[name] = {"status": "SKIPPED", "why": "not in --steps"}
                continue
            if left < 20:
                steps[name] = {"status": "SKIPPED", "why": f"the {args.budget_s:g} s were spent"}
                continue
            limit = min(STEP_LIMIT_S[name], left - 10)
            if name in ("sglang", "weight_sync") and no_sglang:
                steps[name] = {"status": "SKIPPED", "why": f"no SGLang environment: {no_sglang}"}
            elif name == "placement":
                steps[name] = step_placement(out, gpus, limit, None if no_sglang else sg)
            else:
                steps[name] = run_step(name, cmds[name], out / "logs", limit)
            print(
                f"gpu_check: {name}: {steps[name]['status']} ({steps[name].get('seconds')} s)",
                flush=True,
            )
        shutil.rmtree(ckpt.parent, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["status"] = "FAIL" if any(s["status"] == "FAIL" for s in steps.values()) else "PASS"
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "summary.json")
    print(f"gpu_check: {summary['status']}; {out / 'summary.json'}", flush=True)
    return 0 if summary["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
