"""Benchmark of the evaluation path: grader cost per answer, and evaluate() problems/s.

Grader figures (ms per answer, median of ``--repeat`` passes after one warm-up pass):

* ``math500 gold, grade()``: every MATH-500 gold answer boxed in a response and graded against
  itself with the public ``grade`` (most settle on the string fast path);
* ``math500 gold, math-verify only``: the same pairs through math-verify alone (fast path
  bypassed), i.e. the cost of a correct answer written differently from the gold;
* ``math500 shuffled, grade()``: each problem graded against another problem's answer (wrong
  answers; non-integers reach math-verify);
* ``math500 shuffled, grade_many(workers=W)``: the same through the process pool, including the
  pool start-up;
* ``toy \\boxed{579}``: the toy task's format, right and wrong answers.

Driver figure: with ``--engine module:function`` (a factory returning ``(engine, tokenizer)``,
e.g. the tiny model on the local engine), ``evaluate()`` runs on ``--benchmark`` and the script
prints problems/s and avg@n. Run from the repository root::

    .venv/bin/python bench/eval_throughput.py [--data-dir DIR] [--repeat 3] [--workers 2]
    .venv/bin/python bench/eval_throughput.py --engine mypkg.mod:make_engine --benchmark aime24 --n 4
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _timed(fn: Callable[[], object], count: int, repeat: int) -> tuple[float, object]:
    """(median ms per item over ``repeat`` passes after one warm-up pass, last result)."""
    result = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3 / count)
    return statistics.median(times), result


def bench_grader(data_dir: Path, repeat: int, workers: int) -> list[dict]:
    from sat_cli.tasks import reward as R
    from sat_cli.tasks.data import load_benchmark

    rows = load_benchmark("math500", data_dir=data_dir)
    golds = [r["answer"] for r in rows]
    boxed = [f"Reasoning ... so the answer is \\boxed{{{g}}}." for g in golds]
    order = list(range(len(golds)))
    random.Random(0).shuffle(order)
    shuffled = [""] * len(golds)
    for j, i in enumerate(order):
        shuffled[i] = f"\\boxed{{{golds[order[(j + 1) % len(order)]]}}}"

    out = []

    def add(name: str, ms: float, correct: int, total: int) -> None:
        out.append({"case": name, "ms_per_answer": ms, "correct": correct, "total": total})
        print(f"{name:45s} {ms:8.3f} ms/answer   {correct}/{total} correct", flush=True)

    ms, res = _timed(
        lambda: [R.grade(b, g) for b, g in zip(boxed, golds, strict=True)], len(golds), repeat
    )
    add("math500 gold, grade()", ms, sum(res), len(golds))

    def mv_only() -> list[bool]:
        R._parse_cached.cache_clear()  # measure parsing too, not a cache hit
        return [R._verify_with_alarm(g, g, R.DEFAULT_TIMEOUT_S) for g in golds]

    ms, res = _timed(mv_only, len(golds), repeat)
    add("math500 gold, math-verify only", ms, sum(res), len(golds))

    def wrong() -> list[bool]:
        R._parse_cached.cache_clear()
        return [R.grade(s, g) for s, g in zip(shuffled, golds, strict=True)]

    ms, res = _timed(wrong, len(golds), repeat)
    add("math500 shuffled, grade()", ms, sum(res), len(golds))

    t0 = time.perf_counter()
    res = R.grade_many(shuffled, golds, workers=workers)
    ms = (time.perf_counter() - t0) * 1e3 / len(golds)
    add(f"math500 shuffled, grade_many(workers={workers})", ms, sum(res), len(golds))

    rng = random.Random(1)
    pairs = [(rng.randrange(10**6), rng.randrange(10**6)) for _ in range(2000)]
    toy_right = [(f"\\boxed{{{a + b}}}", str(a + b)) for a, b in pairs]
    toy_wrong = [(f"\\boxed{{{a + b + 1}}}", str(a + b)) for a, b in pairs]
    for name, cases in (
        ("toy \\boxed{579}, right", toy_right),
        ("toy \\boxed{579}, wrong", toy_wrong),
    ):
        ms, res = _timed(lambda c=cases: [R.grade(r, g) for r, g in c], len(cases), repeat)
        add(name, ms, sum(res), len(cases))
    return out


def bench_driver(
    engine,
    tokenizer,
    problems: list[dict],
    *,
    n: int,
    template: str,
    max_new_tokens: int,
    batch_size: int,
) -> dict:
    """evaluate() on a real engine: problems/s and the scores (the integrator's tiny-model hook)."""
    from sat_cli.engines.base import SamplingParams
    from sat_cli.evaluation import evaluate, format_table

    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens)
    res = evaluate(
        engine,
        tokenizer,
        problems,
        n=n,
        sampling=sampling,
        template=template,
        batch_size=batch_size,
    )
    print(format_table(res))
    return {
        "problems": res.num_finished,
        "n": n,
        "problems_per_s": res.problems_per_s,
        "wall_s": res.wall_s,
        f"avg@{n}": res.avg_at_k,
        "complete": res.complete,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_dir = os.environ.get("SAT_DATA_DIR") or str(REPO.parent / "shared" / "data")
    ap.add_argument("--data-dir", default=default_dir)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--engine", help="module:function returning (engine, tokenizer)")
    ap.add_argument("--benchmark", default="aime24")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--template", default="boxed")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--skip-grader", action="store_true")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.json:  # checked before the work (sat_cli.util.script_args)
        from sat_cli.util.script_args import output_file

        args.json = str(output_file("bench/eval_throughput.py", args.json, "--json"))

    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
    }
    if not args.skip_grader:
        report["grader"] = bench_grader(Path(args.data_dir), args.repeat, args.workers)
    if args.engine:
        from sat_cli.tasks.data import load_benchmark

        module, _, func = args.engine.partition(":")
        engine, tokenizer = getattr(importlib.import_module(module), func)()
        try:
            problems = load_benchmark(args.benchmark, data_dir=args.data_dir, limit=args.limit)
            report["driver"] = bench_driver(
                engine,
                tokenizer,
                problems,
                n=args.n,
                template=args.template,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
            )
            print(json.dumps(report["driver"]))
        finally:
            engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":  # required: grade_many starts a spawn process pool
    main()
