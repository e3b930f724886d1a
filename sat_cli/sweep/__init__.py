"""`sat sweep`: a grid of `sat train` runs, resumable, grouped under one MLflow parent run.

A sweep file (YAML; format in docs/sweeps.md) names a grid::

    name: smoke                          # MLflow experiment and folder <run.dir>/<name>/
    base: [experiment=cpu_smoke]         # overrides of every run
    axes: {lag: "1,8"}                   # Hydra sweep strings, expanded as a Cartesian product
    methods:                             # ordered named variants (the rows of `sat report`)
      GRPO: [algo=grpo, clip=ppo]
      SAT-GRPO: [algo=grpo, clip=sat]
    seeds: [0]

Each run is ``base + method + axis point + CLI overrides`` (a later override of the same key
replaces an earlier one) ``+ seed=S run.name=<method>-<axes>-s<S> run.experiment=<name>
resume=auto``. Its *override hash* is the SHA-256 of the sorted override list; the *sweep id*
is ``<name>-<10 hex of the SHA-256 of every run's override list>``. Axes are expanded with
Hydra's ``OverridesParser`` and ``sweep_string_iterator`` (``1,8``, ``choice(…)``,
``range(…)``), as Hydra's basic sweeper does, but no multirun launcher is involved: each run is
a ``sat train`` subprocess (``python -m sat_cli.cli train …``, an argument list), ``--jobs`` of
them at once, each in its own process group, its output in
``<run.dir>/<name>/<run>/logs/sweep_child.log``.

Every run is composed and validated with :func:`sat_cli.config.load` before anything starts; a
bad sweep file or a run that does not compose raises :class:`UserError` (exit 2) naming the
run and the problem.

State: ``<run.dir>/<name>/sweep_state.json`` (atomic writes) records each run's overrides,
hash, status, attempts and exit code, and the parent MLflow run of each sweep id. Re-running a
sweep skips finished runs (their latest checkpoint's ``loop_state.json`` says
``"finished": true``), resumes interrupted ones from their last checkpoint (``resume=auto``
with a fixed ``run.name`` continues the same MLflow run) and reruns failed ones. A run folder
started with other overrides is refused rather than resumed with a changed config
(``<run>/sweep_run.json`` holds the hash it was started with). A lock file keeps two sweeps of
one name from running in the same folder at once.

MLflow: a parent run ``sweep-<name>`` in experiment ``<name>`` with tags ``sat.sweep_id``,
``sat.sweep_role=parent``, the method order, axes and seeds, and artifacts ``sweep/runs.json``
(every run's name, method, axis point, seed, overrides, hash) and the sweep file. Children get
the overrides ``++tracking.tags.{sweep_id,override_hash,method,parent_run_id}=…``, which
``sat train`` logs as tags (``mlflow.parentRunId`` nests them); no environment variable carries
configuration.

Ctrl-C (or SIGTERM, or SIGHUP): SIGINT to each child's process group, a grace period
(``SAT_SWEEP_GRACE_S``, default 30 s; a second Ctrl-C cuts it short), then SIGKILL; the parent
run ends KILLED and the command exits 130. Runs that failed make the command exit 1 after the
others are done.
"""

from sat_cli.sweep.children import (
    Child,
    SweepInterrupted,
    stop_children,
    tag_overrides,
)
from sat_cli.sweep.plan import Plan, format_plan, validate
from sat_cli.sweep.run import CHILD_LOG, DEFAULT_GRACE_S, run_sweep
from sat_cli.sweep.spec import (
    REQUIRED_KEYS,
    RESERVED,
    SWEEP_KEYS,
    Sweep,
    SweepRun,
    load_sweep,
    override_hash,
    slug,
)
from sat_cli.sweep.state import RUN_RECORD, STATE_FILE, checkpoint_status, read_state, run_status

__all__ = [
    "CHILD_LOG",
    "DEFAULT_GRACE_S",
    "Plan",
    "REQUIRED_KEYS",
    "RESERVED",
    "RUN_RECORD",
    "STATE_FILE",
    "SWEEP_KEYS",
    "Sweep",
    "SweepInterrupted",
    "SweepRun",
    "Child",
    "checkpoint_status",
    "format_plan",
    "load_sweep",
    "override_hash",
    "read_state",
    "run_status",
    "run_sweep",
    "slug",
    "stop_children",
    "tag_overrides",
    "validate",
]
