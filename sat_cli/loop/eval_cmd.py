"""`sat eval <benchmark>`: avg@k / pass@k of a model or a training checkpoint.

The model is ``ckpt=<run>/checkpoints/step_N`` (its ``trainer/model`` HF folder), else
``model.path`` (an HF directory or hub id), else the warm-started tiny model. Results go to
``<run.dir>/eval/<benchmark>-<time>/`` (per-problem JSON/CSV, summary) and to an MLflow run in
the experiment ``eval`` with the per-problem table as an artifact. An interrupted or failed
evaluation writes what it finished and says INCOMPLETE; it never reports a partial score as
complete (exit 1).
"""

from __future__ import annotations

import time
from pathlib import Path

from sat_cli.errors import RunFailed, UserError


def _model_dir(obj) -> str:
    from sat_cli.loop.run import model_path

    if obj.ckpt:
        ck = Path(obj.ckpt)
        for cand in (ck / "trainer" / "model", ck / "model", ck):
            if (cand / "config.json").is_file():
                if not any(cand.glob("*.safetensors")):
                    raise UserError(f"ckpt={obj.ckpt!r}: no .safetensors weights in {cand}")
                return str(cand)
        raise UserError(
            f"ckpt={obj.ckpt!r} is not a training checkpoint (no trainer/model/config.json)"
        )
    return model_path(obj)


def run_eval_command(cfg, obj) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from sat_cli.evaluation import format_table, write_results
    from sat_cli.loop.run import build_engine, build_evaluator, build_task
    from sat_cli.tracking import Tracker, flatten_config

    path = _model_dir(obj)
    e = obj.eval
    out = Path(obj.run.dir) / "eval" / f"{e.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = build_task(obj) if e.benchmark == "toy" else None
    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    params["eval.model_path"] = path
    engine = build_engine(obj, path, logs, r3=False)
    holder: dict = {}
    try:
        run = build_evaluator(obj, engine, tokenizer, task, keep=holder)
        print(f"eval {e.name}: {e.n} samples per problem, model {path}", flush=True)
        m = run()
    finally:
        engine.close()
    res = holder["result"]
    paths = write_results(res, out)
    print(format_table(res))
    print(f"results: {out}")
    with Tracker(
        uri,
        "eval",
        out.name,
        params=params,
        tags={"benchmark": e.benchmark, "complete": res.complete},
    ) as tr:
        tr.log_metrics(m if res.complete else {}, step=0)
        for p in paths.values():
            tr.log_artifact(str(p))
    if not res.complete:
        raise RunFailed(f"evaluation INCOMPLETE ({res.error}); partial results in {out}")
