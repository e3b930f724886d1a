"""The `sat` commands that place runs on other machines: `sat sweep` (with its SLURM and Ray
executor options), `sat worker` (one more node of a Megatron job) and `sat mlflow-server` (one
tracking server for every node). Registered on the app by :mod:`sat_cli.cli`."""

from __future__ import annotations

import typer

from sat_cli.cli.guard import arg, exit_with, fail, guard, opt
from sat_cli.util.options import COUNT, HOST, LINE, OVERRIDE, PATH, PORT, SECONDS, URI, Num, Text

# a registered executor's name (sat_cli/sweep/registry.py): `sat sweep` refuses an unknown one,
# listing the registered ones (a plugin may register its own before the command runs)
EXECUTORS = Text("name")


def sweep_cmd(
    sweep_file: str = arg(
        PATH, None, help="a sweep YAML (sweeps/smoke.yaml) or a sweep's name (smoke; --list)"
    ),
    overrides: list[str] = arg(OVERRIDE, None, help="overrides applied to every run"),
    jobs: int = opt(
        Num(int, 1, 4096),
        None,
        "--jobs",
        "-j",
        help="runs at once (local default 1; a cluster: all)",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and exit"),
    list_: bool = typer.Option(False, "--list", help="list the project's sweep files and exit"),
    executor: str = opt(
        EXECUTORS, "local", "--executor", help="local | slurm (submitit) | ray: where the runs go"
    ),
    slurm_cluster: str = opt(
        Text("choice", ("slurm", "local")),
        None,
        "--slurm-cluster",
        help="slurm (default) | local: submitit's local executor",
    ),
    slurm_partition: str = opt(Text("name"), None, "--slurm-partition", help="SLURM partition"),
    slurm_time: int = opt(
        Num(int, 1, 525_600, unit="min"), None, "--slurm-time", help="time limit per run, minutes"
    ),
    slurm_gpus: int = opt(Num(int, 0, 1024), None, "--slurm-gpus", help="GPUs per run (one node)"),
    slurm_cpus: int = opt(Num(int, 1, 4096), None, "--slurm-cpus", help="CPUs per run"),
    slurm_mem_gb: float = opt(
        Num(float, 0, 1e5, unit="GB", lo_open=True),
        None,
        "--slurm-mem-gb",
        help="memory per run, GB",
    ),
    slurm_option: list[str] = opt(
        Text("keyvalue"),
        None,
        "--slurm-option",
        help="an extra #SBATCH option KEY=VALUE (e.g. account=x); repeat",
    ),
    slurm_setup: list[str] = opt(
        LINE,
        None,
        "--slurm-setup",
        help="a shell line run before each job (module load ...); repeat",
    ),
    ray_address: str = opt(Text("line"), None, "--ray-address", help="HOST:PORT of the Ray head"),
    ray_cpus: float = opt(Num(float, 0, 4096), None, "--ray-cpus", help="CPUs per run"),
    ray_gpus: float = opt(Num(float, 0, 1024), None, "--ray-gpus", help="GPUs per run"),
    ray_resource: list[str] = opt(
        Text("keyvalue"),
        None,
        "--ray-resource",
        help="a custom Ray resource per run NAME=AMOUNT; repeat",
    ),
) -> None:
    """Run a grid of `sat train` runs, resumable, grouped under one MLflow parent run; locally,
    on SLURM (submitit) or on a Ray cluster (docs/cluster.md)."""
    from sat_cli.sweep import run_sweep
    from sat_cli.sweep.spec import sweep_listing

    if list_:
        typer.echo(sweep_listing(), nl=False)
        return
    if sweep_file is None:
        fail("give a sweep file: a path, or the name of one of `sat sweep --list`")
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
    guard(lambda: run_sweep(sweep_file, overrides or [], jobs=jobs, dry_run=dry_run, executor=opts))


def worker_cmd(
    join: str = opt(
        Text("endpoint"), ..., "--join", help="HOST:PORT of the job's rendezvous (node 0)"
    ),
    config: str = opt(
        PATH,
        ...,
        "--config",
        help="the job's worker_config.json (RUN/megatron/, shared filesystem)",
    ),
    node_rank: int = opt(COUNT, 1, "--node-rank", help="this node's rank, 1 .. nnodes - 1"),
    nproc_per_node: int = opt(
        Num(int, 1, 1024),
        None,
        "--nproc-per-node",
        help="processes on this node (default: the job's)",
    ),
    wait: float = opt(SECONDS, 60.0, "--wait", help="seconds to wait for the rendezvous"),
) -> None:
    """Join this machine as one more node to a running `sat train trainer=megatron
    trainer.nnodes=N` job (docs/megatron.md, Multi-node)."""
    from sat_cli.commands.worker import join as join_job

    code: list[int] = []
    guard(
        lambda: code.append(
            join_job(join, config, node_rank=node_rank, nproc_per_node=nproc_per_node, wait=wait)
        )
    )
    if code and code[0]:
        fail(f"the worker ranks of node {node_rank} exited with code {code[0]}", 1)


def mlflow_server_cmd(
    backend_store_uri: str = opt(
        URI,
        ...,
        "--backend-store-uri",
        help="postgresql://USER[:PASSWORD]@HOST:5432/DB (the store)",
    ),
    artifacts_destination: str = opt(
        URI, ..., "--artifacts-destination", help="where artifacts go: a shared path (or s3://…)"
    ),
    host: str = opt(
        HOST, "127.0.0.1", "--host", help="bind address (a cluster: the head's address)"
    ),
    port: int = opt(PORT, 5000, "--port", help="port (1-65535; must be free)"),
    workers: int = opt(Num(int, 1, 256), 2, "--workers", help="server worker processes"),
    db_timeout: float = opt(SECONDS, 10.0, "--db-timeout", help="seconds to reach the database"),
    telemetry: bool = typer.Option(
        False, "--telemetry", help="let MLflow send its usage telemetry (off by default)"
    ),
    allowed_hosts: str = opt(
        LINE,
        None,
        "--allowed-hosts",
        help="Host headers served besides localhost and private IPs: NAME[:PORT],… (* wildcards)",
    ),
) -> None:
    """One MLflow tracking server for every node (PostgreSQL store, shared artifacts); prints
    the tracking URI for `tracking=mlflow_server tracking.uri=…` (docs/cluster.md)."""
    from sat_cli.commands.mlflow_server import run_server

    exit_with(
        lambda env: run_server(
            backend_store_uri,
            artifacts_destination,
            host=host,
            port=port,
            workers=workers,
            telemetry=telemetry,
            db_timeout_s=db_timeout,
            env=env,
            allowed_hosts=allowed_hosts,
        )
    )
