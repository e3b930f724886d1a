"""The commands behind `sat train`, `sat pretrain`, `sat eval`, `sat plan` and `sat ui` (the sweep
and report commands live in ``sat_cli.sweep`` and ``sat_cli.report``)."""
