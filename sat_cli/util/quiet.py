"""Library log levels for a console command (``sat_cli.cli``): no INFO noise from MLflow."""

from __future__ import annotations


def quiet_libraries() -> None:
    """MLflow/alembic INFO lines (database migrations, telemetry) are noise on a console."""
    import logging
    import os

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("mlflow", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # logs a full traceback for every failed sqlite write (locked, disk full) before raising it;
    # the tracker reports the raised error once, in one line, and carries on
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
