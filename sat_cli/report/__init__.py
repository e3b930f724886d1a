"""`sat report`: a sweep's tables, seed statistics, paired comparisons, regime section and plots
from MLflow (``run.py`` loads and writes; ``select``, ``tables``, ``pairs``, ``stats``,
``regime``, ``hist`` and ``plots`` do one part each; see ``run.py``'s docstring)."""

from sat_cli.report.methods import derive_method
from sat_cli.report.run import build_report, run_report

__all__ = ["build_report", "derive_method", "run_report"]
