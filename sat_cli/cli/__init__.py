"""The `sat` command line: parse → compose config → build objects → call. Nothing else.

Heavy libraries (torch, transformers, mlflow, hydra) are imported inside the commands so that
`sat --help` stays instant. Exit codes (docs/reliability.md): 0 done; 1 a runtime fault (dead
engine or trainer, failed checkpoint write, non-finite loss, incomplete evaluation); 2 the
user's input (overrides, files, paths, run names, an unreachable tracking store at start), one
``sat: error:`` paragraph and no traceback; 130 Ctrl-C; 143 SIGTERM; 129 SIGHUP. An ``OSError``
that reaches the top is one line too: exit 1 when the disk refused a write (full, quota, I/O
error) or memory ran out (``MemoryError``, ``ulimit -v``), 2 for a path that cannot be used.
"""

from __future__ import annotations

import sys

import typer

from sat_cli import __version__
from sat_cli.cli.cluster import mlflow_server_cmd, sweep_cmd, worker_cmd
from sat_cli.cli.guard import SatGroup, arg, exit_with, fail, guard, opt
from sat_cli.cli.model import model_app
from sat_cli.util.options import COUNT, HOST, LINE, OVERRIDE, PATH, PORT, URI, Num
from sat_cli.util.procs import exit_process  # no teardown of torch at exit (1-1.5 s of CPU)

app = typer.Typer(
    name="sat",
    cls=SatGroup,
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


def _load(overrides: list[str], command: str):
    from sat_cli.config import ConfigError, load

    try:
        return load(overrides, command)
    except ConfigError as exc:
        fail(str(exc))


def _pin_numerics(obj) -> None:
    """``run.portable_numerics=true``: pin torch's CPU code paths in the environment before torch
    is imported; every process of the run inherits them (sat_cli/numerics.py)."""
    if not obj.run.portable_numerics:
        return
    from sat_cli.numerics import PortableError, pin

    try:
        pin(obj.trainer.num_threads)
    except PortableError as exc:
        fail(str(exc))


@app.command("config")
def config_cmd(overrides: list[str] = arg(OVERRIDE, None, help=_OVERRIDES_HELP)) -> None:
    """Print the composed, validated config (what a run would use)."""
    from sat_cli.config import to_yaml

    cfg, _ = _load(overrides or [], "config")
    typer.echo(to_yaml(cfg), nl=False)


_GPUS = opt(Num(int, 1, 1024), None, "--gpus-per-node", help="check the plan on nodes of N GPUs")


@app.command("plan", context_settings=_EXTRA)
def plan_cmd(
    overrides: list[str] = arg(OVERRIDE, None, help=_OVERRIDES_HELP), gpus_per_node: int = _GPUS
) -> None:
    """Print the layout a `sat train` would start (processes, parallel sizes, each process's
    GPUs) and the trainer's per-GPU memory estimate; starts nothing. Impossible layouts exit 2."""
    _, obj = _load(overrides or [], "plan")
    from sat_cli.commands.plan import plan_text

    guard(lambda: typer.echo(plan_text(obj, gpus_per_node), nl=False))


@app.command("train", context_settings=_EXTRA)
def train_cmd(
    overrides: list[str] = arg(OVERRIDE, None, help=_OVERRIDES_HELP),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the layout and memory estimate (as `sat plan`) and exit"
    ),
    gpus_per_node: int = _GPUS,
) -> None:
    """Run one asynchronous RL training run (embedded CPU default with no overrides)."""
    cfg, obj = _load(overrides or [], "plan" if dry_run else "train")
    from sat_cli.commands.plan import check_implemented, plan_text

    if dry_run:
        return guard(lambda: typer.echo(plan_text(obj, gpus_per_node), nl=False))
    guard(lambda: check_implemented(obj))  # before any process starts or model loads
    _pin_numerics(obj)
    from sat_cli.commands.train import train

    guard(lambda: train(cfg, obj, overrides or []))


@app.command("pretrain", context_settings=_EXTRA)
def pretrain_cmd(
    overrides: list[str] = arg(OVERRIDE, None, help=_OVERRIDES_HELP),
    use_shipped: bool = typer.Option(
        False,
        "--use-shipped",
        help="use the shipped warm start when it matches, as `sat train` does (default: train)",
    ),
) -> None:
    """Build and warm-start the tiny model on the task (cached; `sat train` runs it when needed)."""
    cfg, obj = _load(overrides or [], "pretrain")
    _pin_numerics(obj)
    from sat_cli.commands.train import pretrain

    guard(lambda: pretrain(obj, use_shipped=use_shipped))


@app.command("eval", context_settings=_EXTRA)
def eval_cmd(
    benchmark: str = arg(
        LINE, ..., help="toy | aime24 | aime25 | math500 | gsm8k | jsonl | an environment"
    ),
    overrides: list[str] = arg(OVERRIDE, None, help=_OVERRIDES_HELP),
) -> None:
    """avg@k / pass@k of a model or checkpoint on a benchmark (e.g. `sat eval aime24 model.path=…`)
    or on an environment's held-out rows (e.g. `sat eval guess model.path=…`)."""
    from sat_cli.config import group_options
    from sat_cli.envs.registry import ENVIRONMENTS

    if "=" in benchmark:
        fail(
            f"the first argument is the benchmark, got {benchmark!r}; "
            f"choose one of: {', '.join([*group_options('eval'), *ENVIRONMENTS.names()])}"
        )
    chosen = [f"eval={benchmark}"]
    if benchmark in ENVIRONMENTS:  # the env section's settings; eval's n, temperature, limit
        own_env = any(o.startswith("env=") for o in overrides or [])
        chosen = [f"eval.name={benchmark}", f"eval.benchmark={benchmark}"]
        chosen += [] if own_env else [f"env={benchmark}"]
    cfg, obj = _load([*chosen, *(overrides or [])], "eval")
    _pin_numerics(obj)
    from sat_cli.commands.eval_env import run_any_eval as evaluate

    guard(lambda: evaluate(cfg, obj))


app.command("sweep", context_settings=_EXTRA)(sweep_cmd)


@app.command("report")
def report_cmd(
    target: str = arg(
        LINE, ..., help="a sweep id, an MLflow experiment name, or a collapse-study .csv"
    ),
    out: str = opt(PATH, None, "--out", help="output folder (default: runs/reports/<target>)"),
    tracking_uri: str = opt(URI, None, "--tracking-uri", help="default: sqlite:///runs/mlflow.db"),
    pair: list[str] = opt(
        LINE,
        None,
        "--pair",
        help="a paired comparison 'A@LAG:B@LAG' (A minus B, same seeds); repeat",
    ),
    last_k: int = opt(COUNT, 3, "--last-k", help="evaluations averaged for 'mean last K'"),
    epoch_steps: int = opt(COUNT, 16, "--epoch-steps", help="steps of the last-epoch d̄π"),
    collapse_below: float = opt(
        Num(float, -1e9, 1e9),
        None,
        "--collapse-below",
        help="collapse threshold (default: half the step-0 score)",
    ),
    collapse: bool = typer.Option(
        False, "--collapse", help="also the collapse study's collapse.csv / collapse.md"
    ),
) -> None:
    """The paper-style table with 95 % t-intervals over seeds, endpoints, paired differences
    (paired t, Wilcoxon), the regime section and plots, from MLflow."""
    from sat_cli.report import run_report

    guard(
        lambda: run_report(
            target,
            out=out,
            tracking_uri=tracking_uri,
            pairs=pair or [],
            last_k=last_k,
            epoch_steps=epoch_steps,
            collapse_below=collapse_below,
            collapse=collapse,
        )
    )


@app.command("replay", context_settings=_EXTRA)
def replay_cmd(
    run: str = arg(PATH, ..., help="a run folder recorded with replay.record=true"),
    overrides: list[str] = arg(OVERRIDE, None, help="algo=… clip=… (docs/replay.md)"),
) -> None:
    """Train a fresh copy of RUN's start checkpoint on RUN's recorded rollout stream, in the same
    order, with another algorithm or clip (docs/replay.md)."""
    from sat_cli.commands.replay import replay

    guard(lambda: replay(run, overrides or []))


@app.command("calibrate-control")
def calibrate_control_cmd(
    run: str = arg(PATH, ..., help="a run folder recorded with replay.record=true"),
    iters: int = opt(COUNT, 6, "--iters", help="replays of the control in the search"),
    steps: int = opt(COUNT, None, "--steps", help="replay only the first N recorded steps"),
) -> None:
    """The dose-matched control: replay RUN with SAT and with PPO at scaled radii, and pick the
    scale whose clipped fraction matches SAT's clipped + banded one (docs/replay.md)."""
    from sat_cli.commands.calibrate import calibrate_control

    guard(lambda: calibrate_control(run, iters, steps))


@app.command("ui")
def ui_cmd(
    port: int = opt(PORT, 5000, "--port", help="port on 127.0.0.1 (1-65535; must be free)"),
    host: str = opt(HOST, "127.0.0.1", "--host", help="bind address (default loopback only)"),
    run_dir: str = opt(PATH, "runs", "--run-dir", help="run.dir holding mlflow.db"),
    telemetry: bool = typer.Option(
        False, "--telemetry", help="let MLflow send its usage telemetry (off by default)"
    ),
) -> None:
    """Start the MLflow UI for the local store, bound to 127.0.0.1, and print experiment URLs."""
    from sat_cli.commands.ui import run_ui

    exit_with(lambda env: run_ui(run_dir, host=host, port=port, telemetry=telemetry, env=env))


app.command("worker")(worker_cmd)
app.command("mlflow-server")(mlflow_server_cmd)
app.add_typer(model_app, name="model")


@app.command("version")
def version_cmd() -> None:
    """Print the version of sat."""
    typer.echo(f"sat {__version__}")


def safe_streams() -> None:
    """An output that cannot encode what sat prints (``LC_ALL=C`` with ``PYTHONUTF8=0``,
    ``PYTHONIOENCODING=ascii``: "d̄π", "±", "→") gets backslash escapes instead of a
    ``UnicodeEncodeError`` at the first progress line."""
    for stream in (sys.stdout, sys.stderr):
        try:
            "d̄π ± → ✓".encode(stream.encoding or "ascii")
        except (UnicodeEncodeError, LookupError):
            stream.reconfigure(errors="backslashreplace")
        except AttributeError:  # replaced by a test harness: not a text stream of ours
            pass


def main() -> None:
    safe_streams()
    try:
        app()
    except (SystemExit, KeyboardInterrupt) as exc:  # Terminated, HungUp: 143, 129
        exit_process(getattr(exc, "code", 130))
    except MemoryError:  # while importing the libraries, before a command handles it
        sys.stderr.write("sat: error: out of memory while starting (see ulimit -v)\n")
        sys.exit(1)
