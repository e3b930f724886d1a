"""Frozen stale-data replay (issue 33): a run's rollout stream recorded as it trains
(``sat train … replay.record=true``, :mod:`sat_cli.replay.store`) and trained on again by a
fresh copy of its start checkpoint with another algorithm or clip (``sat replay RUN …``,
``sat_cli.commands.replay``), so that corrections compare on identical data (docs/replay.md).
"""

# the MLflow tags of a replay's run: the recorded run's folder name and MLflow run id
REPLAY_OF, REPLAY_OF_ID = "replay_of", "replay_of_run_id"
