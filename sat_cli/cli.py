"""The `sat` command line: parse → compose config → build objects → call. Nothing else.

Heavy libraries (torch, transformers, mlflow, hydra) are imported inside the commands so that
`sat --help` stays instant. Exit codes (docs/reliability.md): 0 done; 1 a runtime fault (dead
engine or trainer, failed checkpoint write, non-finite loss, incomplete evaluation); 2 the
user's input (overrides, files, paths, run names, an unreachable tracking store at start), one
``sat: error:`` paragraph and no traceback; 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

from sat_cli import __version__

app = typer.Typer(
    name="sat",
    help=(
        "sat — asynchronous RL experiments with staleness-adaptive trust regions (SAT).\n\n"
        "Overrides use Hydra syntax, e.g. `sat train algo=gspo lag=8 r3=true`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_OVERRIDES_HELP = "Hydra overrides, e.g. algo=gspo lag=8 r3=true clip=ppo trainer.lr=1e-4"
_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"sat: error: {message}", err=True)
    raise typer.Exit(code)


def _load(overrides: list[str]):
    from sat_cli.config import ConfigError, load

    try:
        return load(overrides)
    except ConfigError as exc:
        fail(str(exc))


@app.command("config")
def config_cmd(overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP)) -> None:
    """Print the composed, validated config (what a run would use)."""
    from sat_cli.config import to_yaml

    cfg, _ = _load(overrides or [])
    typer.echo(to_yaml(cfg), nl=False)


@app.command("train", context_settings=_EXTRA)
def train_cmd(overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP)) -> None:
    """Run one asynchronous RL training run (embedded CPU default with no overrides)."""
    cfg, obj = _load(overrides or [])
    from sat_cli.loop.run import train

    _guard(lambda: train(cfg, obj, overrides or []))


@app.command("pretrain", context_settings=_EXTRA)
def pretrain_cmd(overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP)) -> None:
    """Build and warm-start the tiny model on the task (cached; `sat train` runs it when needed)."""
    cfg, obj = _load(overrides or [])
    from sat_cli.loop.run import pretrain

    _guard(lambda: pretrain(obj))


@app.command("eval", context_settings=_EXTRA)
def eval_cmd(
    benchmark: str = typer.Argument(..., help="toy | aime24 | aime25 | math500 | gsm8k | jsonl"),
    overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP),
) -> None:
    """avg@k / pass@k of a model or checkpoint on a benchmark (e.g. `sat eval aime24 model.path=…`)."""
    from sat_cli.config import group_options

    if "=" in benchmark:
        fail(
            f"the first argument is the benchmark, got {benchmark!r}; "
            f"choose one of: {', '.join(group_options('eval'))}"
        )
    cfg, obj = _load([f"eval={benchmark}", *(overrides or [])])
    from sat_cli.loop.run import evaluate

    _guard(lambda: evaluate(cfg, obj))


@app.command("sweep", context_settings=_EXTRA)
def sweep_cmd(
    sweep_file: str = typer.Argument(..., help="a sweep YAML, e.g. sweeps/smoke.yaml"),
    overrides: list[str] = typer.Argument(None, help="overrides applied to every run"),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="runs at once"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and exit"),
) -> None:
    """Run a grid of `sat train` runs, resumable, grouped under one MLflow parent run."""
    from sat_cli.sweep import run_sweep

    _guard(lambda: run_sweep(sweep_file, overrides or [], jobs=jobs, dry_run=dry_run))


@app.command("report")
def report_cmd(
    target: str = typer.Argument(..., help="a sweep id or an MLflow experiment name"),
    out: str = typer.Option(None, "--out", help="output folder (default: runs/reports/<target>)"),
    tracking_uri: str = typer.Option(
        None, "--tracking-uri", help="default: sqlite:///runs/mlflow.db"
    ),
    pair: list[str] = typer.Option(
        None, "--pair", help="a paired comparison 'A@LAG:B@LAG' (A minus B, same seeds); repeat"
    ),
    last_k: int = typer.Option(3, "--last-k", help="evaluations averaged for 'mean last K'"),
    epoch_steps: int = typer.Option(16, "--epoch-steps", help="steps of the last-epoch d̄π"),
    collapse_below: float = typer.Option(
        None, "--collapse-below", help="collapse threshold (default: half the step-0 score)"
    ),
) -> None:
    """The paper-style table with 95 % t-intervals over seeds, endpoints, paired differences
    (paired t, Wilcoxon), the regime section and plots, from MLflow."""
    from sat_cli.report import run_report

    _guard(
        lambda: run_report(
            target,
            out=out,
            tracking_uri=tracking_uri,
            pairs=pair or [],
            last_k=last_k,
            epoch_steps=epoch_steps,
            collapse_below=collapse_below,
        )
    )


@app.command("ui")
def ui_cmd(
    port: int = typer.Option(5000, help="port on 127.0.0.1"),
    host: str = typer.Option("127.0.0.1", help="bind address (default loopback only)"),
    run_dir: str = typer.Option("runs", "--run-dir", help="run.dir holding mlflow.db"),
) -> None:
    """Start the MLflow UI for the local store, bound to 127.0.0.1."""
    import subprocess
    from pathlib import Path

    from sat_cli.tracking import ui_command

    db = Path(run_dir) / "mlflow.db"
    if not db.exists():
        fail(f"no MLflow store at {db}: run `sat train` first or pass --run-dir")
    cmd = ui_command(f"sqlite:///{db}", host=host, port=port)
    typer.echo(f"MLflow UI on http://{host}:{port}  (Ctrl-C to stop)")
    try:
        raise typer.Exit(subprocess.call(cmd))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("version")
def version_cmd() -> None:
    """Print the version of sat."""
    typer.echo(f"sat {__version__}")


def _quiet_libraries() -> None:
    """MLflow/alembic INFO lines (database migrations, telemetry) are noise on a console."""
    import logging
    import os

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("mlflow", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _guard(fn) -> None:
    """Run a command body: user errors → message + exit 2; Ctrl-C → exit 130."""
    _quiet_libraries()
    from sat_cli.config import ConfigError
    from sat_cli.errors import RunFailed, UserError

    try:
        fn()
    except (UserError, ConfigError, RunFailed) as exc:
        fail(str(exc), getattr(exc, "code", 2))
    except Exception as exc:
        # Library errors that are the user's input or an expected runtime fault, by class name
        # so that this module does not import the heavy modules that define them.
        name = type(exc).__name__
        if name in ("DataError", "TrackingError", "CheckpointError"):
            fail(str(exc), 2)
        if name in ("EngineError", "TrainerError"):
            fail(str(exc), 1)
        raise
    except KeyboardInterrupt as exc:
        code = getattr(exc, "code", 130)
        typer.echo("sat: interrupted" + (" (SIGTERM)" if code == 143 else ""), err=True)
        raise typer.Exit(code) from None


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
