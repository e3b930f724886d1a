"""`sat eval <benchmark>`: avg@k / pass@k of a model or a training checkpoint.

The model is ``ckpt=<run>/checkpoints/step_N`` (its ``trainer/model`` HF folder), else
``model.path`` (an HF directory or hub id), else the warm-started tiny model. Results go to
``<run.dir>/eval/<benchmark>-<time>/`` (per-problem JSON/CSV, summary) and to an MLflow run in
the experiment ``eval`` with the per-problem table as an artifact. An interrupted or failed
evaluation writes what it finished and says INCOMPLETE; it never reports a partial score as
complete (exit 1; Ctrl-C exits 130 and SIGTERM 143, the MLflow run marked KILLED). Every input
(model folder, checkpoint, data file) is checked before anything is written or started.

The benchmark files come from ``data.dir`` / ``$SAT_DATA_DIR`` when they hold a copy, else from
the evaluation sets shipped in the package (:func:`sat_cli.tasks.data.benchmark_file`); the file
used is printed and logged as the param ``eval.data_file``. ``eval.max_new_tokens`` is capped at
the model's context (``max_position_embeddings``): the benchmark configs ask 32768 tokens for
real reasoning models, which would be meaningless (and hours of CPU) for the 512-position tiny
default model if it ever failed to stop.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from sat_cli.errors import RunFailed, UserError


def _model_dir(obj) -> str:
    from sat_cli.loop.run import check_hf_dir, model_path

    if obj.ckpt:
        ck = Path(obj.ckpt)
        if not ck.is_dir():
            raise UserError(f"ckpt={obj.ckpt!r} is not a directory")
        for cand in (ck / "trainer" / "model", ck / "model", ck):
            if (cand / "config.json").is_file():
                check_hf_dir(cand, "ckpt")
                return str(cand)
        raise UserError(
            f"ckpt={obj.ckpt!r} is not a training checkpoint (no trainer/model/config.json)"
        )
    return model_path(obj)


def _data_file(obj) -> str | None:
    """The JSONL file a benchmark name resolves to (data directory, else the shipped copy)."""
    from sat_cli.tasks.datafiles import BENCHMARK_FILES, benchmark_file

    e = obj.eval
    if e.benchmark == "jsonl":
        return e.path
    if e.benchmark in BENCHMARK_FILES:
        return str(benchmark_file(e.benchmark, obj.data.dir))
    return None


def _cap_to_context(e, path: str) -> int | None:
    """Lower ``eval.max_new_tokens`` to the model's ``max_position_embeddings``; the cap or None."""
    from sat_cli.loop.run import _hf_config

    try:
        ctx = int(_hf_config(path).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return None
    if ctx <= 0 or e.max_new_tokens <= ctx:
        return None
    print(
        f"eval.max_new_tokens={e.max_new_tokens} exceeds the model's context "
        f"(max_position_embeddings={ctx}): capped at {ctx}",
        flush=True,
    )
    e.max_new_tokens = ctx
    return ctx


def run_eval_command(cfg, obj) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from sat_cli.evaluation import format_table, write_results
    from sat_cli.loop.run import (
        Terminated,
        _loading,
        _on_sigterm,
        build_engine,
        build_evaluator,
        build_task,
        eval_problems,
        write_pids,
    )
    from sat_cli.tracking import Tracker, flatten_config

    # every input is checked before anything is written or started
    path = _model_dir(obj)
    e = obj.eval
    task = build_task(obj) if e.benchmark == "toy" else None
    spec = eval_problems(obj, task)
    data_file = _data_file(obj)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the tokenizer of {path}: {str(exc)[:300]}") from None
    out = Path(obj.run.dir) / "eval" / f"{e.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    params["eval.model_path"] = path
    if data_file is not None:
        params["eval.data_file"] = data_file
    cap = _cap_to_context(e, path)
    if cap is not None:
        params["eval.max_new_tokens_capped"] = str(cap)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        engine = _loading(path, lambda: build_engine(obj, path, logs, r3=False))
        write_pids(logs, engine)
        holder: dict = {}
        try:
            run = build_evaluator(obj, engine, tokenizer, task, keep=holder, spec=spec)
            data = f", data {data_file}" if data_file else ""
            print(f"eval {e.name}: {e.n} samples per problem, model {path}{data}", flush=True)
            m = run()
        finally:
            engine.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    res = holder["result"]
    # evaluate() turns Ctrl-C / SIGTERM into an incomplete result: keep it, then exit 130 / 143
    interrupted: KeyboardInterrupt | None = None
    if res.error and res.error.startswith("Terminated"):
        interrupted = Terminated()
    elif res.error and res.error.startswith("KeyboardInterrupt"):
        interrupted = KeyboardInterrupt()
    paths = write_results(res, out)
    print(format_table(res))
    print(f"results: {out}")
    tr = Tracker(
        uri,
        "eval",
        out.name,
        params=params,
        tags={"benchmark": e.benchmark, "complete": res.complete},
    )
    try:
        tr.log_metrics(m if res.complete else {}, step=0)
        for p in paths.values():
            tr.log_artifact(str(p))
    finally:
        tr.end("KILLED" if interrupted else ("FINISHED" if res.complete else "FAILED"))
    if interrupted is not None:
        print(f"evaluation INCOMPLETE (interrupted); partial results in {out}", flush=True)
        raise interrupted
    if not res.complete:
        raise RunFailed(f"evaluation INCOMPLETE ({res.error}); partial results in {out}")
