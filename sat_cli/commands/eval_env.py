"""`sat eval <env>`: held-out evaluation of a registered environment (``calculator``, ``guess``,
or one of the user's) through the multi-turn driver (``sat_cli.evaluation.envs``).

``eval.limit`` held-out rows (``<Env>.rows("heldout", …)``; 100 when unset), ``eval.n``
trajectories per row at ``eval.temperature``, ``eval.max_new_tokens`` per turn, the ``env``
section's ``max_turns``, ``max_tokens`` and ``parser``. Prints and writes (``summary.json``,
``rows.json`` in ``<run.dir>/eval/<env>-<time>/``) the success rate (avg@n), pass@k, mean turns
and the success within ``k`` turns, and logs them to an MLflow run in the experiment ``eval``
(``eval/<env>/…``), with the inputs, the interruption and failure handling of ``sat eval``
(``commands/eval.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

from sat_cli.commands.eval import Evaluator, model_dir
from sat_cli.errors import UserError

DEFAULT_ROWS = 100


def is_env_benchmark(name: str) -> bool:
    from sat_cli.envs.registry import ENVIRONMENTS

    return name in ENVIRONMENTS


class EnvEvaluator(Evaluator):
    """``Evaluator`` with an environment's held-out rows and trajectories in place of problems."""

    def __init__(self, cfg, obj, log=print):  # noqa: D107 — the parent's checks, per environment
        from omegaconf import OmegaConf

        from sat_cli.build.components import run_environment
        from sat_cli.commands import preflight
        from sat_cli.commands.common import check_devices
        from sat_cli.envs.base import EnvSettings
        from sat_cli.envs.registry import ENVIRONMENTS
        from sat_cli.envs.trajectory import TrajectorySettings
        from sat_cli.tracking import flatten_config

        self.obj, self.log, e = obj, log, obj.eval
        preflight.check_address_space("eval")
        check_devices(obj, trainer=False)
        env = getattr(obj, "env", None)
        if env is None or env.name != e.benchmark:
            raise UserError(f"sat eval {e.benchmark} needs env={e.benchmark} (the env section)")
        self.settings = EnvSettings(env.max_turns, env.max_tokens, env.parser, env.sandbox)
        self.trajectory = TrajectorySettings(env.max_turns, env.max_tokens)
        self.rows = ENVIRONMENTS.get(e.benchmark).rows("heldout", e.limit or DEFAULT_ROWS)
        self.spec = ([], None, None)  # no problems: the parent's run() closes spec[1] if any
        self.data_file = None
        self.path = model_dir(obj)
        self.tokenizer = preflight.load_tokenizer(self.path)
        preflight.check_engine_architecture(obj.engine, self.path)
        preflight.check_env_context(env, self.path)  # a trajectory fits the model's positions
        self.base = Path(obj.run.dir) / "eval" / f"{e.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        preflight.check_output_dir(self.base, "evaluation folder")
        self.max_new_tokens = e.max_new_tokens
        params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
        params.update(run_environment(obj))
        params["eval.model_path"] = self.path
        params["eval.rows"] = str(len(self.rows))
        self.params = params
        self.out = None
        self.write_error = None

    def _evaluate(self, tracker):
        from sat_cli.build.components import build_engine
        from sat_cli.commands.common import loading, write_pids
        from sat_cli.engines.base import SamplingParams
        from sat_cli.evaluation.envs import evaluate_env

        obj, e = self.obj, self.obj.eval
        logs = self.out / "logs"
        engine = loading(self.path, lambda: build_engine(obj, self.path, logs, r3=False))
        try:
            write_pids(logs, engine)
            sampling = SamplingParams(
                temperature=e.temperature,
                top_p=e.top_p,
                top_k=e.top_k,
                max_new_tokens=self.max_new_tokens,
                stop_token_ids=(self.tokenizer.eos_token_id,),
                seed=obj.seed + 7919,
            )
            self.log(
                f"eval {e.name}: {len(self.rows)} held-out rows, {e.n} trajectories each, "
                f"model {self.path}"
            )
            return evaluate_env(
                engine,
                self.tokenizer,
                e.benchmark,
                self.settings,
                self.trajectory,
                self.rows,
                e.n,
                sampling,
                e.batch_size,
            )
        finally:
            engine.close()

    def _record(self, tracker, res) -> str:
        from sat_cli.errors import os_error
        from sat_cli.evaluation.envs import format_summary, metrics
        from sat_cli.util.fsio import atomic_write_json

        out, e = self.out, self.obj.eval
        head = {"name": e.name, "n": e.n, "complete": res.complete, "error": res.error}
        files = {"summary.json": {**head, **res.summary}, "rows.json": res.rows}
        from sat_cli.tracking.params import mask_known_in

        files["samples.json"] = mask_known_in(res.samples)  # one secret policy (samples tables)
        try:
            for fname, data in files.items():
                atomic_write_json(out / fname, data)
        except OSError as exc:
            self.write_error = os_error(exc, f"cannot write the evaluation results to {out}")
        if res.summary:
            self.log(format_summary(e.name, e.n, res.summary))
        self.log(f"results: {out}")
        tracker.set_tags({"complete": res.complete})
        tracker.log_metrics(metrics(res.summary, e.name) if res.complete else {}, step=0)
        if self.write_error is None:
            for fname in files:
                tracker.log_artifact(str(out / fname))
        if res.interrupted is not None:
            return "KILLED"
        return "FINISHED" if res.complete and self.write_error is None else "FAILED"


def run_any_eval(cfg, obj) -> None:
    """`sat eval NAME`: :class:`EnvEvaluator` for an environment's name, else ``Evaluator``."""
    cls = EnvEvaluator if is_env_benchmark(obj.eval.benchmark) else Evaluator
    from sat_cli.tracking.params import masked_print

    cls(cfg, obj, log=lambda s: masked_print(s, flush=True)).run()  # the secret policy
