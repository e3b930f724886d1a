"""`sat eval <benchmark>`: avg@k / pass@k of a model or a training checkpoint (:class:`Evaluator`).

The model is ``ckpt=<run>/checkpoints/step_N`` (its ``trainer/model`` HF folder), else
``model.path`` (an HF directory or hub id), else the warm-started tiny model. Results go to
``<run.dir>/eval/<benchmark>-<time>/`` (per-problem JSON/CSV, summary) and to an MLflow run in
the experiment ``eval`` with the per-problem table as an artifact. An interrupted or failed
evaluation writes what it finished and says INCOMPLETE; it never reports a partial score as
complete (exit 1; Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, the MLflow run marked KILLED).
The MLflow run is opened before the engine starts, so a crash at any point leaves it FAILED
(KILLED for a stop signal), never missing or RUNNING.
Every input (model folder, checkpoint, data file, tokenizer, prompt lengths, the output folder)
is checked before anything is written or started. Results that cannot be written (a full disk)
end the command with exit 1 and the MLflow run FAILED.

The benchmark files come from ``data.dir`` / ``$SAT_DATA_DIR`` when they hold a copy, else from
the evaluation sets shipped in the package (:func:`sat_cli.tasks.data.benchmark_file`); the file
used is printed and logged as the param ``eval.data_file``. ``eval.max_new_tokens`` is capped at
the model's context (``max_position_embeddings``; the config itself is left as it is, the cap is
the param ``eval.max_new_tokens_capped``): the benchmark configs ask 32768 tokens for
real reasoning models, which would be meaningless (and hours of CPU) for the 512-position tiny
default model if it ever failed to stop.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from sat_cli.errors import RunFailed, UserError

if TYPE_CHECKING:
    from sat_cli.evaluation import EvalResult


def model_dir(obj) -> str:
    from sat_cli.build.parts import check_hf_dir, model_path

    if obj.ckpt:
        ck = Path(obj.ckpt)
        if not ck.is_dir():
            raise UserError(f"ckpt={obj.ckpt!r} is not a directory")
        if (ck / "manifest.json").is_file():  # a training checkpoint: its files must match
            from sat_cli.checkpoints.manifest import verify_checkpoint

            reason = verify_checkpoint(ck)
            if reason is not None:
                raise UserError(f"ckpt={obj.ckpt!r} is damaged: {reason}")
        if adapter_dir(obj) is not None:  # trainer.lora: the configured base + its adapter
            return model_path(obj)
        for cand in (ck / "trainer" / "model", ck / "model", ck):
            if (cand / "config.json").is_file():
                check_hf_dir(cand, "ckpt", values=True)  # no NaN/inf weight either
                return str(cand)
        raise UserError(
            f"ckpt={obj.ckpt!r} is not a training checkpoint (no trainer/model/config.json)"
        )
    return model_path(obj)


def _version_schema():
    from sat_cli.records import Int, Obj

    return Obj({"version": Int(0)}, required=("version",))


def adapter_dir(obj) -> Path | None:
    """The adapter of a LoRA checkpoint ``ckpt=`` (``trainer/adapter/``, or an adapter folder
    itself: a published ``weights/v<N>``), else None. Its base is the configured model."""
    if not obj.ckpt:
        return None
    ck = Path(obj.ckpt)
    for cand in (ck / "trainer" / "adapter", ck):
        if (cand / "adapter_config.json").is_file():
            # LORA_EVAL: whether sat eval's engine loads adapters (engine=sglang's servers get
            # the LoRA flags of trainer.lora in sat train only)
            kind = type(obj.engine)
            if not getattr(kind, "LORA_EVAL", getattr(kind, "LORA_ADAPTERS", False)):
                raise UserError(
                    f"ckpt={obj.ckpt!r} is a LoRA adapter: engine={obj.engine.name} does not "
                    "load adapters; use engine=local"
                )
            return cand
    return None


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
    from sat_cli.tasks.registry import eval_source

    return eval_source(obj.eval.benchmark).data_file(obj.eval, obj.task, obj.data.dir)


def _max_new_tokens(e, path: str, log=print) -> int:
    """``eval.max_new_tokens``, capped at the model's ``max_position_embeddings`` (said once)."""
    from sat_cli.models.hf_config import read_hf_config

    try:
        ctx = int(read_hf_config(path).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return e.max_new_tokens
    if ctx <= 0 or e.max_new_tokens <= ctx:
        return e.max_new_tokens
    log(
        f"eval.max_new_tokens={e.max_new_tokens} exceeds the model's context "
        f"(max_position_embeddings={ctx}): capped at {ctx}"
    )
    return ctx


class Evaluator:
    """`sat eval` as an object.

    Construction checks every input (the data first: cheap, no torch import; then the model,
    its tokenizer, the prompt lengths and the output folder) and writes nothing. ``run()``
    creates the evaluation folder, opens the MLflow run (RUNNING, params recorded) before the
    engine starts, evaluates, writes the results and ends the run: FINISHED when complete,
    KILLED on Ctrl-C / SIGTERM / SIGHUP (the finished problems written, the exception raised
    again), FAILED on anything else (an engine crash, an incomplete evaluation, results that
    cannot be written). Returns the ``EvalResult`` of a complete evaluation.
    """

    def __init__(self, cfg, obj, log=print):
        from omegaconf import OmegaConf

        from sat_cli.build.components import run_environment
        from sat_cli.build.parts import build_task, eval_problems
        from sat_cli.commands import preflight
        from sat_cli.commands.common import check_devices
        from sat_cli.tasks.registry import eval_source
        from sat_cli.tracking import flatten_config

        self.obj, self.log, e = obj, log, obj.eval
        preflight.check_address_space("eval")  # ulimit -v too low: one clear line, nothing written
        check_devices(obj, trainer=False)
        self.task = build_task(obj) if eval_source(e.benchmark).own else None
        self.spec = eval_problems(obj, self.task)
        self.data_file = _data_file(obj)
        self.path = model_dir(obj)
        self.adapter = adapter_dir(obj)  # a LoRA checkpoint's adapter, loaded on the base
        self.tokenizer = preflight.load_tokenizer(self.path)
        preflight.check_chat_template({"eval.template": self.spec[2]}, self.tokenizer, self.path)
        preflight.check_engine_architecture(obj.engine, self.path)
        self.overlong = preflight.check_eval_lengths(
            self.spec[0], self.spec[2], self.tokenizer, self.path
        )
        self.base = Path(obj.run.dir) / "eval" / f"{e.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        preflight.check_output_dir(self.base, "evaluation folder")
        self.max_new_tokens = _max_new_tokens(e, self.path, log)
        params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
        params.update(run_environment(obj))
        params["eval.model_path"] = self.path
        if self.adapter is not None:
            params["eval.adapter"] = str(self.adapter)
        if self.data_file is not None:
            params["eval.data_file"] = self.data_file
        if self.max_new_tokens != e.max_new_tokens:
            params["eval.max_new_tokens_capped"] = str(self.max_new_tokens)
        self.params = params
        self.out: Path | None = None  # the evaluation folder, once run() made it
        self.write_error: Exception | None = None

    def run(self) -> EvalResult:
        from sat_cli.tracking import Tracker, TrackerSettings
        from sat_cli.tracking.final_status import apply_pending, end_run
        from sat_cli.util.signals import orderly_stop

        obj, run_root = self.obj, Path(self.obj.run.dir)
        self.out = out = _own_folder(self.base)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
        tags = {"benchmark": obj.eval.benchmark, "complete": False}
        with orderly_stop():  # SIGTERM / SIGHUP raise like Ctrl-C: the run ends KILLED
            tracker = Tracker(TrackerSettings(uri, "eval"), out.name, params=self.params, tags=tags)
            status = "FAILED"  # unless the evaluation gets to say otherwise
            try:
                apply_pending(run_root, tracker)
                res = self._evaluate(tracker)
                status = self._record(tracker, res)
            except KeyboardInterrupt:
                status = "KILLED"
                raise
            finally:
                getattr(self.spec[1], "close", lambda: None)()  # a reward plugin's workers
                end_run(tracker, status, run_root)
                from sat_cli.tracking.secret_logs import scrub_logs

                scrub_logs(out / "logs")  # the engine is closed: its logs, secrets masked
        return self._outcome(res)

    def _evaluate(self, tracker) -> EvalResult:
        """Start the engine, evaluate, stop the engine."""
        from sat_cli.build.components import build_engine, build_launcher
        from sat_cli.build.parts import eval_runner
        from sat_cli.commands.common import loading, write_pids

        obj, path, e = self.obj, self.path, self.obj.eval
        logs = self.out / "logs"
        placer = build_launcher(obj, self.log, logs, trainer_nodes=False)  # servers on Ray
        try:
            engine = loading(path, lambda: build_engine(obj, path, logs, r3=False, placer=placer))
        except BaseException:
            if placer is not None:
                placer.close()
            raise
        try:
            write_pids(logs, engine)
            if self.adapter is not None:
                self._load_adapter(engine)
            from sat_cli.tracking.environment import engine_params

            numerics = getattr(engine, "numerics", {})  # the engine worker's view (local engine)
            tracker.log_params(engine_params(numerics))
            run = eval_runner(
                obj,
                engine,
                self.tokenizer,
                self.task,
                spec=self.spec,
                overlong=self.overlong,
                max_new_tokens=self.max_new_tokens,
            )
            data = f", data {self.data_file}" if self.data_file else ""
            self.log(f"eval {e.name}: {e.n} samples per problem, model {path}{data}")
            return run()
        finally:
            engine.close()
            if placer is not None:
                placer.close()

    def _load_adapter(self, engine) -> None:
        """The checkpoint's adapter on the engine's base, checked on arrival (a damaged one is
        refused: ``UserError``, as a damaged checkpoint is)."""
        from sat_cli.errors import EngineError
        from sat_cli.records import RecordError, read_json

        try:
            version = int(
                read_json(self.adapter / "adapter_config.json", _version_schema())["version"]
            )
            engine.update_weights(str(self.adapter), version)
        except (RecordError, EngineError) as exc:
            why = str(exc).strip().splitlines()[-1][:300]
            raise UserError(f"ckpt={self.obj.ckpt!r}: its adapter was refused: {why}") from None
        self.log(f"eval: adapter {self.adapter} (weight version {version}) on the base {self.path}")

    def _record(self, tracker, res: EvalResult) -> str:
        """Write the results (also partial ones), log them; the run's final status."""
        from sat_cli.errors import os_error
        from sat_cli.evaluation import format_table, metrics, write_results

        out = self.out
        try:
            paths = write_results(res, out)
        except OSError as exc:
            paths = {}
            self.write_error = os_error(exc, f"cannot write the evaluation results to {out}")
        self.log(format_table(res))
        self.log(f"results: {out}")
        tracker.set_tags({"complete": res.complete})
        tracker.log_metrics(metrics(res) if res.complete else {}, step=0)
        for p in paths.values():
            tracker.log_artifact(str(p))
        if res.samples:  # what the model wrote: the first samples, with their rewards
            from sat_cli import metric_names as M
            from sat_cli.rewards.grading import samples_table

            tracker.log_dict(samples_table(res.samples), M.samples_artifact("eval", 0))
        if res.interrupted is not None:
            return "KILLED"
        ok = res.complete and res.reward_error_frac <= self.obj.reward.max_error_frac
        return "FINISHED" if ok and self.write_error is None else "FAILED"

    def _outcome(self, res: EvalResult) -> EvalResult:
        """``res`` when complete; else the reason it is not, raised (the run has ended)."""
        if self.write_error is not None:
            raise self.write_error
        if res.interrupted is not None:
            self.log(f"evaluation INCOMPLETE (interrupted); partial results in {self.out}")
            raise res.interrupted
        if not res.complete:
            raise RunFailed(f"evaluation INCOMPLETE ({res.error}); partial results in {self.out}")
        from sat_cli.evaluation.output import check_reward_errors

        check_reward_errors(res, self.obj.reward.max_error_frac)
        return res
