"""The commands behind `sat train`, `sat pretrain` and `sat eval` (the sweep, report and UI
commands live in ``sat_cli.sweep``, ``sat_cli.report`` and ``sat_cli.ui``)."""
