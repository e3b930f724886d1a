"""The rewards ``reward=<name>`` can choose: name → :class:`~sat_cli.rewards.RewardEntry`
(``build``, ``check``, ``validate``, ``label``, ``processes``, ``grades_itself``) in a :class:`sat_cli.registry.Registry`. ``reward.name`` is checked against
it at compose time (``sat_cli.config.reward``: exit 2 listing the registered ones). A new reward:
its module with ``build`` (and what else it has of these), and one ``REWARDS.add`` line here."""

from __future__ import annotations

from sat_cli.registry import Registry
from sat_cli.rewards import RewardEntry, builtin, http, pool

REWARDS = Registry("reward", "reward")
REWARDS.add("math", RewardEntry(builtin.build_math, grades_itself=True))
REWARDS.add("exact", RewardEntry(builtin.build_exact))
REWARDS.add("regex", RewardEntry(builtin.build_regex, validate=builtin.validate_regex))
python = dict(validate=pool.validate, label=pool.label, processes=pool.processes)
REWARDS.add("python", RewardEntry(pool.build, pool.check, **python))
REWARDS.add("http", RewardEntry(http.build, http.check, validate=http.validate, label=http.label))
