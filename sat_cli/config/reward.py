"""The ``reward`` section (``conf/reward/*.yaml``): which reward scores a response
(:mod:`sat_cli.rewards`, one registry entry per name) and how failures of a user's reward are
handled."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields

from sat_cli.validate import ConfigError, check_choice, check_range

MAX_TIMEOUT_S = 3600.0
MAX_WORKERS = 64
MIN_MEMORY_MB, MAX_MEMORY_MB = 128, 1 << 20
# the settings only some rewards read: the others ignore them (math, exact and regex return
# one number: no components to weigh, nothing to call, batch or time)
USED_BY = {
    "fn": ("python",),
    "pattern": ("regex",),
    "url": ("http",),
    "batched": ("python", "http"),
    "weights": ("python", "http"),
    "timeout_s": ("python", "http"),
    "workers": ("python", "http"),
    "deadline_s": ("http",),
    "memory_mb": ("python",),
}


@dataclass
class RewardConfig:
    # math: the task's own grader (the toy task's exact sum; math-verify for data tasks);
    # exact: the final answer equals the row's answer; regex: the last match of pattern does;
    # python: a function of yours (fn); http: a reward server (url)
    name: str = "math"
    fn: str | None = None  # python: pkg.module:function or path/to/file.py:function
    batched: bool = False  # python/http: one call per batch with lists, returning a list
    pattern: str | None = None  # regex: group 1 of its last match (else the match) is the answer
    url: str | None = None  # http: the endpoint taking a JSON POST
    # a reward returning {name: value}: each component is logged as reward/<name>; the reward is
    # sum(weights[k] * value[k]) over the weights' keys (empty: the sum of the components)
    weights: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 10.0  # one call of your function (python) or one request (http)
    deadline_s: float = 60.0  # http: a request is retried until this many seconds have passed
    on_error: float = 0.0  # the reward of a sample whose reward raised, timed out or was NaN
    max_error_frac: float = 0.5  # a step with more failed rewards than this ends the run FAILED
    workers: int = 2  # python: processes that run your function (http: threads)
    # python: each worker's address space in MiB (RLIMIT_AS; more is a MemoryError, counted as
    # that sample's error)
    memory_mb: int = 16384
    # an evaluation counts a sample correct when its reward is at least this (math: its grader)
    pass_threshold: float = 1.0

    def __post_init__(self) -> None:
        from sat_cli.rewards import reserved_components
        from sat_cli.rewards.registry import REWARDS

        check_choice("reward.name", self.name, tuple(REWARDS.names()))
        check_range("reward.timeout_s", self.timeout_s, 0, MAX_TIMEOUT_S, lo_open=True)
        check_range("reward.deadline_s", self.deadline_s, self.timeout_s, MAX_TIMEOUT_S)
        check_range("reward.on_error", self.on_error, -1e6, 1e6)
        check_range("reward.max_error_frac", self.max_error_frac, 0, 1)
        check_range("reward.workers", self.workers, 1, MAX_WORKERS)
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int):
            raise ConfigError(f"reward.memory_mb={self.memory_mb!r} must be an integer")
        check_range("reward.memory_mb", self.memory_mb, MIN_MEMORY_MB, MAX_MEMORY_MB)
        check_range("reward.pass_threshold", self.pass_threshold, -1e6, 1e6)
        for key, weight in self.weights.items():
            if not re.fullmatch(r"[a-z0-9_]{1,64}", str(key)):
                raise ConfigError(
                    f"reward.weights: {key!r} is not a component name (a-z, 0-9, _; at most 64)"
                )
            check_range(f"reward.weights.{key}", weight, -1e6, 1e6)
            if key in reserved_components():
                raise ConfigError(
                    f"reward.weights: {key!r} is a built-in metric's name (reward/{key}); "
                    "name the component otherwise"
                )
        for f in fields(self):
            users = USED_BY.get(f.name, (self.name,))
            default = f.default if f.default_factory is MISSING else f.default_factory()
            if self.name not in users and getattr(self, f.name) != default:
                raise ConfigError(
                    f"reward.{f.name} is a setting of reward={' or reward='.join(users)}; "
                    f"with reward={self.name} it would be ignored"
                )
        REWARDS.get(self.name).validate(self)  # the chosen reward's own rules
