"""Compare your default run with the README's numbers, step by step (issue 58, item 3).

    sat train                                   # or: sat train run.portable_numerics=true
    python scripts/compare_reference.py         # the latest finished run in runs/mlflow.db
    python scripts/compare_reference.py --run NAME --tracking-uri sqlite:///PATH/mlflow.db

It reads the run's held-out avg@8 at every evaluation step and puts it beside the values
measured on each CPU kind (``docs/results/reference_evals.json``) in the same numeric mode
(``run.portable_numerics``), marking ``=`` where they are equal to the last bit. It then says
which kinds your run reproduces (equal at every step both have) and, for the others, the first
step that differs. A run with other settings than the default (other overrides, another seed)
cannot be compared: the script names the settings that differ and exits 1. Exit status: 0 when
the run reproduces at least one kind, 1 when it reproduces none (a CPU kind not recorded yet:
its values are worth adding) or is not a default run, 2 when the store or the run cannot be read.
Run it with the project's interpreter (``.venv/bin/python``); paths are the caller's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REFERENCE = ROOT / "docs" / "results" / "reference_evals.json"
DEFAULT_URI = "sqlite:///runs/mlflow.db"
MAX_BYTES = 1 << 20
# params that name, place or track a run without changing its numbers
PLACEMENT = ("run.name", "run.experiment", "run.dir", "resume", "run.portable_numerics")


class Refused(Exception):
    pass


def load_reference(path: Path = REFERENCE) -> dict:
    from sat_cli.util.fsio import read_regular_bytes

    try:
        if path.stat().st_size > MAX_BYTES:
            raise Refused(f"{path}: larger than 1 MiB")
        ref = json.loads(read_regular_bytes(path))
    except (OSError, ValueError) as exc:
        raise Refused(f"cannot read the reference values {path}: {exc}") from None
    for mode in ("portable", "default"):
        for kind in ref.get(mode, []):
            kind["evals"] = {int(s): float(v) for s, v in kind["evals"].items()}
    return ref


def differing_settings(params: dict[str, str]) -> list[str]:
    """The config params of a run that differ from the default run's (``sat train`` with no
    overrides), the seed included; placement, tracking and the machine record excluded, and
    options the run did not record (added to `sat` after it ran)."""
    from omegaconf import OmegaConf

    from sat_cli.config import load
    from sat_cli.report.cells import compared
    from sat_cli.tracking.params import flatten_config

    # load, not compose: a run records the values the schema derives (null = automatic, e.g.
    # engine.dtype and trainer.dtype by device), and so must the default it is compared with
    default = flatten_config(OmegaConf.to_container(load([])[0], resolve=True))
    keys = sorted(k for k in set(default) | set(params) if k == "seed" or compared(k))
    return [
        f"{k}={params[k]} (default {default[k]})"
        for k in keys
        if k in default and k in params and k not in PLACEMENT and params[k] != default[k]
    ]


def compare(evals: dict[int, float], kinds: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """``(table lines, kinds reproduced, one line per kind that differs)``."""
    steps = sorted(evals)
    head = "| step | this run | " + " | ".join(k["kind"] for k in kinds) + " |"
    lines = [head, "|" + "---|" * (len(kinds) + 2)]
    for s in steps:
        cells = []
        for k in kinds:
            v = k["evals"].get(s)
            cells.append("—" if v is None else ("=" if v == evals[s] else repr(v)))
        lines.append(f"| {s} | {evals[s]!r} | " + " | ".join(cells) + " |")
    same, differ = [], []
    for k in kinds:
        shared = [s for s in steps if s in k["evals"]]
        first = next((s for s in shared if k["evals"][s] != evals[s]), None)
        if not shared:
            continue
        if first is None:
            same.append(f"{k['kind']} ({len(shared)} steps)")
        else:
            differ.append(
                f"{k['kind']}: first differs at step {first} "
                f"({evals[first]!r} here, {k['evals'][first]!r} there)"
            )
    return lines, same, differ


def find_run(client, name: str | None):
    exp = client.get_experiment_by_name("sat")
    if exp is None:
        raise Refused("the store has no experiment 'sat': run `sat train` first")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    for r in runs:
        if (name is None and r.info.status == "FINISHED") or r.info.run_name == name:
            return r
    raise Refused(f"no run named {name!r}" if name else "no finished run in experiment 'sat'")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", default=DEFAULT_URI)
    ap.add_argument("--run", default=None, help="run name (default: the latest finished run)")
    args = ap.parse_args(argv)
    try:
        ref = load_reference()
        if args.tracking_uri.startswith("sqlite:///"):
            db = Path(args.tracking_uri[len("sqlite:///") :])
            if not db.is_file():
                raise Refused(
                    f"{db}: no such store (run `sat train` first, or pass --tracking-uri)"
                )
        from mlflow import MlflowClient

        from sat_cli.metric_names import avg_key
        from sat_cli.tracking.params import mlflow_key

        client = MlflowClient(tracking_uri=args.tracking_uri)
        run = find_run(client, args.run)
        params = run.data.params
        mode = "portable" if params.get("run.portable_numerics") == "true" else "default"
        key = mlflow_key(avg_key("toy", 8))
        evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
    except Refused as exc:
        print(f"compare_reference: {exc}", file=sys.stderr)
        return 2
    name = run.info.run_name
    other = differing_settings(params)
    if other:
        print(
            f"{name} is not the default run, so the reference values do not apply: "
            + "; ".join(other)
        )
        return 1
    if not evals:
        print(f"{name} logged no {avg_key('toy', 8)}")
        return 1
    lines, same, differ = compare(evals, ref[mode])
    print(f"{name} ({mode} numerics) against the values measured per CPU kind:\n")
    print("\n".join(lines) + "\n")
    if same:
        print("reproduces, to the last bit: " + "; ".join(same))
    for line in differ:
        print("differs from " + line)
    if not same:
        print(
            "reproduces none of the recorded kinds: a CPU kind not recorded yet "
            "(docs/results/reference_evals.json lists those measured)"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
