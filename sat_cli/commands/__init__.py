"""The commands behind `sat train`, `sat pretrain`, `sat eval`, `sat plan`, `sat ui` and
`sat mlflow-server` (the sweep and report commands live in ``sat_cli.sweep`` and
``sat_cli.report``)."""
