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
from typing import NoReturn

import typer

from sat_cli import __version__
from sat_cli.util.procs import exit_process  # no teardown of torch at exit (1-1.5 s of CPU)

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
    try:
        typer.echo(f"sat: error: {message}", err=True)
    except OSError:  # no terminal any more (SIGHUP)
        pass
    raise typer.Exit(code)


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
def config_cmd(overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP)) -> None:
    """Print the composed, validated config (what a run would use)."""
    from sat_cli.config import to_yaml

    cfg, _ = _load(overrides or [], "config")
    typer.echo(to_yaml(cfg), nl=False)


_GPUS = typer.Option(None, "--gpus-per-node", min=1, help="check the plan on nodes of N GPUs")


@app.command("plan", context_settings=_EXTRA)
def plan_cmd(
    overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP), gpus_per_node: int = _GPUS
) -> None:
    """Print the layout a `sat train` would start (processes, parallel sizes, each process's
    GPUs) and the trainer's per-GPU memory estimate; starts nothing. Impossible layouts exit 2."""
    _, obj = _load(overrides or [], "plan")
    from sat_cli.commands.plan import plan_text

    _guard(lambda: typer.echo(plan_text(obj, gpus_per_node), nl=False))


@app.command("train", context_settings=_EXTRA)
def train_cmd(
    overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the layout and memory estimate (as `sat plan`) and exit"
    ),
    gpus_per_node: int = _GPUS,
) -> None:
    """Run one asynchronous RL training run (embedded CPU default with no overrides)."""
    cfg, obj = _load(overrides or [], "plan" if dry_run else "train")
    from sat_cli.commands.plan import check_implemented, plan_text

    if dry_run:
        return _guard(lambda: typer.echo(plan_text(obj, gpus_per_node), nl=False))
    _guard(lambda: check_implemented(obj))  # before any process starts or model loads
    _pin_numerics(obj)
    from sat_cli.commands.train import train

    _guard(lambda: train(cfg, obj, overrides or []))


@app.command("pretrain", context_settings=_EXTRA)
def pretrain_cmd(
    overrides: list[str] = typer.Argument(None, help=_OVERRIDES_HELP),
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

    _guard(lambda: pretrain(obj, use_shipped=use_shipped))


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
    cfg, obj = _load([f"eval={benchmark}", *(overrides or [])], "eval")
    _pin_numerics(obj)
    from sat_cli.commands.eval import run_eval_command as evaluate

    _guard(lambda: evaluate(cfg, obj))


@app.command("sweep", context_settings=_EXTRA)
def sweep_cmd(
    sweep_file: str = typer.Argument(..., help="a sweep YAML, e.g. sweeps/smoke.yaml"),
    overrides: list[str] = typer.Argument(None, help="overrides applied to every run"),
    jobs: int = typer.Option(
        None, "--jobs", "-j", min=1, help="runs at once (local default 1; a cluster: all)"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and exit"),
    executor: str = typer.Option(
        "local", "--executor", help="local | slurm (submitit) | ray: where the runs go"
    ),
    slurm_cluster: str = typer.Option(
        None, "--slurm-cluster", help="slurm (default) | local: submitit's local executor"
    ),
    slurm_partition: str = typer.Option(None, "--slurm-partition", help="SLURM partition"),
    slurm_time: int = typer.Option(None, "--slurm-time", help="time limit per run, minutes"),
    slurm_gpus: int = typer.Option(None, "--slurm-gpus", help="GPUs per run (one node)"),
    slurm_cpus: int = typer.Option(None, "--slurm-cpus", help="CPUs per run"),
    slurm_mem_gb: float = typer.Option(None, "--slurm-mem-gb", help="memory per run, GB"),
    slurm_option: list[str] = typer.Option(
        None, "--slurm-option", help="an extra #SBATCH option KEY=VALUE (e.g. account=x); repeat"
    ),
    slurm_setup: list[str] = typer.Option(
        None, "--slurm-setup", help="a shell line run before each job (module load ...); repeat"
    ),
    ray_address: str = typer.Option(None, "--ray-address", help="HOST:PORT of the Ray head"),
    ray_cpus: float = typer.Option(None, "--ray-cpus", help="CPUs per run"),
    ray_gpus: float = typer.Option(None, "--ray-gpus", help="GPUs per run"),
    ray_resource: list[str] = typer.Option(
        None, "--ray-resource", help="a custom Ray resource per run NAME=AMOUNT; repeat"
    ),
) -> None:
    """Run a grid of `sat train` runs, resumable, grouped under one MLflow parent run; locally,
    on SLURM (submitit) or on a Ray cluster (docs/cluster.md)."""
    from sat_cli.sweep import run_sweep
    from sat_cli.sweep.executor import ExecutorOptions

    opts = ExecutorOptions(
        name=executor,
        slurm_cluster=slurm_cluster,
        slurm_partition=slurm_partition,
        slurm_time=slurm_time,
        slurm_gpus=slurm_gpus,
        slurm_cpus=slurm_cpus,
        slurm_mem_gb=slurm_mem_gb,
        slurm_options=list(slurm_option or []),
        slurm_setup=list(slurm_setup or []),
        ray_address=ray_address,
        ray_cpus=ray_cpus,
        ray_gpus=ray_gpus,
        ray_resources=list(ray_resource or []),
    )
    _guard(
        lambda: run_sweep(sweep_file, overrides or [], jobs=jobs, dry_run=dry_run, executor=opts)
    )


@app.command("report")
def report_cmd(
    target: str = typer.Argument(
        ..., help="a sweep id, an MLflow experiment name, or a collapse-study .csv"
    ),
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
    collapse: bool = typer.Option(
        False, "--collapse", help="also the collapse study's collapse.csv / collapse.md"
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
            collapse=collapse,
        )
    )


@app.command("replay", context_settings=_EXTRA)
def replay_cmd(
    run: str = typer.Argument(..., help="a run folder recorded with replay.record=true"),
    overrides: list[str] = typer.Argument(None, help="algo=… clip=… (docs/replay.md)"),
) -> None:
    """Train a fresh copy of RUN's start checkpoint on RUN's recorded rollout stream, in the same
    order, with another algorithm or clip (docs/replay.md)."""
    from sat_cli.commands.replay import replay

    _guard(lambda: replay(run, overrides or []))


@app.command("calibrate-control")
def calibrate_control_cmd(
    run: str = typer.Argument(..., help="a run folder recorded with replay.record=true"),
    iters: int = typer.Option(6, "--iters", help="replays of the control in the search"),
    steps: int = typer.Option(None, "--steps", help="replay only the first N recorded steps"),
) -> None:
    """The dose-matched control: replay RUN with SAT and with PPO at scaled radii, and pick the
    scale whose clipped fraction matches SAT's clipped + banded one (docs/replay.md)."""
    from sat_cli.commands.calibrate import calibrate_control

    _guard(lambda: calibrate_control(run, iters, steps))


@app.command("worker")
def worker_cmd(
    join: str = typer.Option(..., "--join", help="HOST:PORT of the job's rendezvous (node 0)"),
    config: str = typer.Option(
        ..., "--config", help="the job's worker_config.json (RUN/megatron/, shared filesystem)"
    ),
    node_rank: int = typer.Option(1, "--node-rank", help="this node's rank, 1 .. nnodes - 1"),
    nproc_per_node: int = typer.Option(
        None, "--nproc-per-node", help="processes on this node (default: the job's)"
    ),
    wait: float = typer.Option(60.0, "--wait", help="seconds to wait for the rendezvous"),
) -> None:
    """Join this machine as one more node to a running `sat train trainer=megatron
    trainer.nnodes=N` job (docs/megatron.md, Multi-node)."""
    from sat_cli.commands.worker import join as join_job

    code: list[int] = []
    _guard(
        lambda: code.append(
            join_job(join, config, node_rank=node_rank, nproc_per_node=nproc_per_node, wait=wait)
        )
    )
    if code and code[0]:
        fail(f"the worker ranks of node {node_rank} exited with code {code[0]}", 1)


@app.command("ui")
def ui_cmd(
    port: int = typer.Option(5000, help="port on 127.0.0.1 (1-65535; must be free)"),
    host: str = typer.Option("127.0.0.1", help="bind address (default loopback only)"),
    run_dir: str = typer.Option("runs", "--run-dir", help="run.dir holding mlflow.db"),
    telemetry: bool = typer.Option(
        False, "--telemetry", help="let MLflow send its usage telemetry (off by default)"
    ),
) -> None:
    """Start the MLflow UI for the local store, bound to 127.0.0.1, and print experiment URLs."""
    from sat_cli.commands.ui import run_ui

    _exit_with(lambda env: run_ui(run_dir, host=host, port=port, telemetry=telemetry, env=env))


@app.command("mlflow-server")
def mlflow_server_cmd(
    backend_store_uri: str = typer.Option(
        ..., "--backend-store-uri", help="postgresql://USER[:PASSWORD]@HOST:5432/DB (the store)"
    ),
    artifacts_destination: str = typer.Option(
        ..., "--artifacts-destination", help="where artifacts go: a shared path (or s3://…)"
    ),
    host: str = typer.Option("127.0.0.1", help="bind address (a cluster: the head's address)"),
    port: int = typer.Option(5000, help="port (1-65535; must be free)"),
    workers: int = typer.Option(2, help="server worker processes"),
    db_timeout: float = typer.Option(10.0, "--db-timeout", help="seconds to reach the database"),
    telemetry: bool = typer.Option(
        False, "--telemetry", help="let MLflow send its usage telemetry (off by default)"
    ),
) -> None:
    """One MLflow tracking server for every node (PostgreSQL store, shared artifacts); prints
    the tracking URI for `tracking=mlflow_server tracking.uri=…` (docs/cluster.md)."""
    from sat_cli.commands.mlflow_server import run_server

    _exit_with(lambda env: run_server(backend_store_uri, artifacts_destination, host=host,
                                      port=port, workers=workers, telemetry=telemetry,
                                      db_timeout_s=db_timeout, env=env))  # fmt: skip


def _exit_with(fn) -> NoReturn:
    """``_guard(fn(env))``, then exit with its code; ``env``: the environment before ``_guard``
    sets sat's own defaults (MLflow telemetry off in-process), for a server's subprocess."""
    import os

    env, code = dict(os.environ), [0]
    _guard(lambda: code.__setitem__(0, fn(env)))
    raise typer.Exit(code[0])


@app.command("version")
def version_cmd() -> None:
    """Print the version of sat."""
    typer.echo(f"sat {__version__}")


def _guard(fn) -> None:
    """Run a command body: user errors → message + exit 2; runtime faults (a dead or failing
    trainer or engine, a failed checkpoint write) → message + exit 1; Ctrl-C → exit 130. By
    exception type; the library modules that define them import no heavy library."""
    from sat_cli.util.quiet import quiet_libraries

    quiet_libraries()
    from sat_cli.checkpoints.state import CheckpointError
    from sat_cli.config import ConfigError
    from sat_cli.engines.base import EngineError
    from sat_cli.errors import RunFailed, UserError, as_failure, without_tracebacks
    from sat_cli.tasks.datafiles import DataError
    from sat_cli.tracking.store import TrackingError

    try:
        fn()
    except (UserError, ConfigError, DataError, TrackingError, CheckpointError) as exc:
        fail(str(exc), getattr(exc, "code", 2))
    except (RunFailed, EngineError) as exc:  # TrainerError (MegatronWorkerError, R3Error) included
        fail(without_tracebacks(str(exc)), getattr(exc, "code", 1))
    except Exception as exc:  # a path, disk or memory problem no layer below named (OSError,
        err = as_failure(exc)  # safetensors' "No space left on device", MemoryError): 1 line
        if err is None:
            raise
        fail(str(err), err.code)
    except KeyboardInterrupt as exc:
        code = getattr(exc, "code", 130)
        name = getattr(exc, "signame", None)
        try:
            typer.echo("sat: interrupted" + (f" ({name})" if name else ""), err=True)
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        raise typer.Exit(code) from None


def main() -> None:
    try:
        app()
    except (SystemExit, KeyboardInterrupt) as exc:  # Terminated, HungUp: 143, 129
        exit_process(getattr(exc, "code", 130))
    except MemoryError:  # while importing the libraries, before a command handles it
        sys.stderr.write("sat: error: out of memory while starting (see ulimit -v)\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
