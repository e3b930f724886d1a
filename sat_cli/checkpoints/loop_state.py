"""The training loop's state, typed: what ``sat_cli.loop.train.TrainLoop`` carries from step to
step and writes to ``checkpoints/step_N/loop_state.json`` (schema: ``sat_cli.records.LOOP_STATE``).

:meth:`LoopState.to_json` writes the JSON of the loop before this class existed, key for key and
type for type (a counter that was an int stays an int), and :meth:`LoopState.from_json` reads
it, so checkpoints written before and after load alike (``tests/test_loop_state.py`` resumes a
checkpoint written by the earlier loop).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sat_cli import metric_names as M


@dataclass
class EvalRecord:
    """The best and the last headline score of the in-training evaluations, with their steps."""

    best: float | None = None
    best_step: int | None = None
    last: float | None = None
    last_step: int | None = None
    key: str | None = None  # the headline's metric name, e.g. eval/toy/avg@8

    def record(self, key: str, value: float, step: int) -> None:
        self.key, self.last, self.last_step = key, value, step
        if self.best is None or value > self.best:
            self.best, self.best_step = value, step


# the running SAT fractions: (the step's metric, its counter)
_SAT_SIDES = (
    (M.SAT_ACTIVE, "sat_active_steps"),
    (M.SAT_ACTIVE_LOW, "sat_active_low_steps"),
    (M.SAT_ACTIVE_HIGH, "sat_active_high_steps"),
)


@dataclass
class Counters:
    """Steps and groups counted over the run (kept across resumes)."""

    skipped_steps: int = 0  # no sample survived scoring: no update
    dropped_groups: int = 0  # aborted, or zero-advantage with algo.drop_zero_adv_groups
    sat_active_steps: float = 0  # sums of the steps' sat/active (a fraction per step)
    sat_steps: int = 0  # steps that reported sat/active
    nonfinite_steps: int = 0
    stale_dropped: int = 0  # bounded mode: groups over the lag bound
    sat_active_low_steps: float | None = None  # per side, once a trainer reported it
    sat_active_high_steps: float | None = None

    def add_sat(self, tm: dict[str, float]) -> dict[str, float]:
        """Count a step's ``sat/active*`` (``tm``: the trainer's metrics); the running
        fractions of steps where SAT can act, either side and per side (``…_frac``). A step's
        ``sat/active`` is 0/1 with one ``q``, a fraction with several minibatches or
        per-micro-batch ``q``: the counters add it as it is."""
        self.sat_steps += 1
        out = {}
        for key, name in _SAT_SIDES:
            if key in tm:
                total = (getattr(self, name) or 0) + float(tm[key])
                setattr(self, name, total)
                out[key + "_frac"] = total / self.sat_steps
        return out

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Counters:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class LoopState:
    """The loop's state between steps (see the module docstring)."""

    step: int = 0  # the next step to run; the trainer holds this weight version
    pending: list[list[int]] = field(default_factory=list)  # [[batch, version]]: requested
    published: list[int] = field(default_factory=lambda: [0])  # weight versions on disk
    engine_version: int = 0  # the version the engine holds
    eval: EvalRecord = field(default_factory=EvalRecord)
    counters: Counters = field(default_factory=Counters)
    finished: bool = False
    mlflow_run_id: str | None = None
    min_needed: int | None = None  # the oldest version a resume can need (set by checkpoints)
    lag_profile_counts: list[int] | None = None  # a lag profile's realised lags, by lag

    def count_lags(self, lags: list[int]) -> list[int]:
        """Add a batch's sample lags to the realised histogram (a lag profile); returns it."""
        counts = self.lag_profile_counts
        if counts is None:
            counts = self.lag_profile_counts = []
        for lag in lags:
            counts.extend([0] * (lag + 1 - len(counts)))
            counts[lag] += 1
        return counts

    def to_json(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "pending": self.pending,
            "published": self.published,
            "engine_version": self.engine_version,
            "eval": asdict(self.eval),
            "counters": self.counters.to_json(),
            "finished": self.finished,
            "mlflow_run_id": self.mlflow_run_id,
        }
        if self.min_needed is not None:
            out["min_needed"] = self.min_needed
        if self.lag_profile_counts is not None:
            out["lag_profile_counts"] = self.lag_profile_counts
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoopState:
        """The state of a checkpoint's JSON (checked against ``LOOP_STATE`` by its reader);
        fields it lacks keep their defaults, fields this version does not know are ignored."""
        st = cls()
        for f in fields(cls):
            if f.name in d:
                setattr(st, f.name, d[f.name])
        st.eval = EvalRecord(**{k: v for k, v in (d.get("eval") or {}).items() if k in _EVAL})
        st.counters = Counters.from_json(d.get("counters") or {})
        return st


_EVAL = {f.name for f in fields(EvalRecord)}
