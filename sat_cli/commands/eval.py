"""`sat eval <benchmark>`: avg@k / pass@k of a model or a training checkpoint.

The model is ``ckpt=<run>/checkpoints/step_N`` (its ``trainer/model`` HF folder), else
``model.path`` (an HF directory or hub id), else the warm-started tiny model. Results go to
``<run.dir>/eval/<benchmark>-<time>/`` (per-problem JSON/CSV, summary) and to an MLflow run in
the experiment ``eval`` with the per-problem table as an artifact. An interrupted or failed
evaluation writes what it finished and says INCOMPLETE; it never reports a partial score as
complete (exit 1; Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, the MLflow run marked KILLED).
Every input (model folder, checkpoint, data file, tokenizer, prompt lengths, the output folder)
is checked before anything is written or started. Results that cannot be written (a full disk)
end the command with exit 1 and the MLflow run FAILED.

The benchmark files come from ``data.dir`` / ``$SAT_DATA_DIR`` when they hold a copy, else from
the evaluation sets shipped in the package (:func:`sat_cli.tasks.data.benchmark_file`); the file
used is printed and logged as the param ``eval.data_file``. ``eval.max_new_tokens`` is capped at
the model's context (``max_position_embeddings``): the benchmark configs ask 32768 tokens for
real reasoning models, which would be meaningless (and hours of CPU) for the 512-position tiny
default model if it ever failed to stop.
"""

from __future__ import annotations

import time
from pathlib import Path

from sat_cli.errors import RunFailed, UserError


def _model_dir(obj) -> str:
    from sat_cli.build import check_hf_dir, model_path

    if obj.ckpt:
        ck = Path(obj.ckpt)
        if not ck.is_dir():
            raise UserError(f"ckpt={obj.ckpt!r} is not a directory")
        if (ck / "manifest.json").is_file():  # a training checkpoint: its files must match
            from sat_cli.checkpoints.manifest import verify_checkpoint

            reason = verify_checkpoint(ck)
            if reason is not None:
                raise UserError(f"ckpt={obj.ckpt!r} is damaged: {reason}")
        for cand in (ck / "trainer" / "model", ck / "model", ck):
            if (cand / "config.json").is_file():
                check_hf_dir(cand, "ckpt", values=True)  # no NaN/inf weight either
                return str(cand)
        raise UserError(
            f"ckpt={obj.ckpt!r} is not a training checkpoint (no trainer/model/config.json)"
        )
    return model_path(obj)


def _own_folder(base: Path) -> Path:
    """Create ``base`` (or ``base-2``, ``base-3``, …) exclusively: two evaluations started in
    the same second never write into one folder."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        out = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            out.mkdir()
        except FileExistsError:
            continue
        return out
    raise UserError(f"cannot create an evaluation folder next to {base}: 999 exist")


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
    from sat_cli.build import _hf_config

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

    from sat_cli.build import build_engine, build_evaluator, build_task, eval_problems
    from sat_cli.commands import preflight
    from sat_cli.commands.common import check_devices, loading, run_environment, write_pids
    from sat_cli.errors import os_error
    from sat_cli.evaluation import format_table, write_results
    from sat_cli.tracking import Tracker, flatten_config
    from sat_cli.tracking.final_status import apply_pending, end_run
    from sat_cli.util.signals import BY_NAME, orderly_stop

    # every input is checked before anything is written or started; the data first (cheap:
    # no torch import, no model read), then the model
    e = obj.eval
    preflight.check_address_space("eval")  # ulimit -v too low: one clear line, nothing written
    check_devices(obj, trainer=False)
    task = build_task(obj) if e.benchmark == "toy" else None
    spec = eval_problems(obj, task)
    data_file = _data_file(obj)
    path = _model_dir(obj)
    tokenizer = preflight.load_tokenizer(path)
    overlong = preflight.check_eval_lengths(spec[0], spec[2], tokenizer, path)
    out = Path(obj.run.dir) / "eval" / f"{e.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    preflight.check_output_dir(out, "evaluation folder")
    out = _own_folder(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    params.update(run_environment(obj))
    params["eval.model_path"] = path
    if data_file is not None:
        params["eval.data_file"] = data_file
    cap = _cap_to_context(e, path)
    if cap is not None:
        params["eval.max_new_tokens_capped"] = str(cap)
    with orderly_stop():
        from sat_cli.commands.launch import build_launcher

        placer = build_launcher(obj, print, logs, trainer_nodes=False)  # servers on Ray
        try:
            engine = loading(path, lambda: build_engine(obj, path, logs, r3=False, placer=placer))
        except BaseException:
            if placer is not None:
                placer.close()
            raise
        write_pids(logs, engine)
        params.update({f"env.engine.{k}": v for k, v in getattr(engine, "numerics", {}).items()})
        holder: dict = {}
        try:
            run = build_evaluator(
                obj, engine, tokenizer, task, keep=holder, spec=spec, overlong=overlong
            )
            data = f", data {data_file}" if data_file else ""
            print(f"eval {e.name}: {e.n} samples per problem, model {path}{data}", flush=True)
            m = run()
        finally:
            engine.close()
            if placer is not None:
                placer.close()
    res = holder["result"]
    # evaluate() turns Ctrl-C / SIGTERM / SIGHUP into an incomplete result: keep it, then exit
    # 130 / 143 / 129
    stop = BY_NAME.get((res.error or "").split(":", 1)[0])
    interrupted: KeyboardInterrupt | None = stop() if stop is not None else None
    try:
        paths = write_results(res, out)
    except OSError as exc:
        paths, write_error = {}, os_error(exc, f"cannot write the evaluation results to {out}")
    else:
        write_error = None
    print(format_table(res))
    print(f"results: {out}")
    tr = Tracker(
        uri,
        "eval",
        out.name,
        params=params,
        tags={"benchmark": e.benchmark, "complete": res.complete},
    )
    apply_pending(Path(obj.run.dir), tr)
    status = "FAILED"
    try:
        tr.log_metrics(m if res.complete else {}, step=0)
        for p in paths.values():
            tr.log_artifact(str(p))
        if interrupted:
            status = "KILLED"
        elif res.complete and write_error is None:
            status = "FINISHED"
    finally:
        end_run(tr, status, Path(obj.run.dir))
    if write_error is not None:
        raise write_error
    if interrupted is not None:
        print(f"evaluation INCOMPLETE (interrupted); partial results in {out}", flush=True)
        raise interrupted
    if not res.complete:
        raise RunFailed(f"evaluation INCOMPLETE ({res.error}); partial results in {out}")
