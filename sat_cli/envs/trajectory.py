"""The multi-turn driver (issue 43): an environment and a rollout engine, token in, token out.

``run_trajectory(engine, env, tokenizer, row, sampling, settings) -> Sample`` runs one
trajectory; ``run_trajectories(engine, envs, tokenizer, rows, sampling, settings)`` runs many
in lockstep, one engine request per turn for all the trajectories still running. Per turn:

1. the engine gets the trajectory so far as token ids (the first prompt, then every turn and
   every observation as appended) and returns the turn's ids, log-probs and versions;
2. the model's text of the turn (``decode``, special tokens skipped) goes to ``env.step``;
3. unless the trajectory ended, the observation is tokenised once (``render.py``: the chat
   template's piece after a model turn) and appended, log-prob 0.0, mask 0.

The returned ``Sample`` (``sat_cli.samples``) is one trainer sequence: ``prompt_ids`` the first
prompt, ``response_ids`` exactly the concatenation of the turns' ids and the observations' ids,
``loss_mask`` 1 on model tokens and 0 on environment tokens, ``turn_ids`` the turn of each token
(an observation: the turn it answers), ``token_versions`` each token's weight version when
they are not all one (an observation: its turn's last version), ``weight_version`` the first
token's. ``meta``: ``reward`` (the sum of the steps' rewards), ``turns``, ``requeues``,
``info`` (the last step's) and ``steps`` (per turn a ``TurnStep``: the environment's ``reward`` and
``observation`` messages: the samples table's reward parts and tool results). ``finish_reason``: ``stop`` when the environment ended the
trajectory, ``length`` when the token budget (``max_tokens``: prompt, turns and observations),
``max_turns`` or a turn cut at ``max_new_tokens`` ended it first (the environment still grades
that turn), ``abort`` when the engine aborted a turn or ``partial="abort"`` gave up.

Partial trajectories (``settings.partial``): when the weights change while a trajectory runs
(in-flight updates, bounded lag), ``resume`` keeps it: its tokens carry the versions that made
them. ``abort`` drops it and runs it again from a fresh ``env.reset`` (at most
``MAX_REQUEUES`` times; then it ends ``abort`` and the loop drops its group).

R3 (``routed_experts``, ``[prompt_len + response_len - 1, L, K]`` as a single-turn sample's):
row ``s`` is the routing of position ``s`` in the first request that fed it to the engine (a
turn's request re-feeds the trajectory so far; its new rows are the previous turn's last token,
the observation and its own tokens), so each row is what the engine routed when the tokens
after it were sampled. Without routes from every turn the sample has none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sat_cli.envs.base import MAX_TOKENS, MAX_TURNS, Environment
from sat_cli.envs.render import renderer_for
from sat_cli.samples import Sample, SamplingParams
from sat_cli.validate import check_int

PARTIAL_MODES = ("resume", "abort")
MAX_REQUEUES = 2


@dataclass(frozen=True)
class TrajectorySettings:
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 4096  # tokens per trajectory: prompt, turns and observations
    partial: str = "resume"  # a trajectory the weights changed under: resume | abort

    def __post_init__(self):
        for name, hi in (("max_turns", MAX_TURNS), ("max_tokens", MAX_TOKENS)):
            check_int(f"env.{name}", getattr(self, name), 1, hi)
        if self.partial not in PARTIAL_MODES:
            raise ValueError(
                f"env.partial={self.partial!r} must be one of {', '.join(PARTIAL_MODES)}"
            )


@dataclass(frozen=True)
class TurnVersions:
    """A lag profile's weight version of every generation call (``loop/lag_profile.py``):
    ``of(i, turn)`` is the version trajectory ``i``'s call of ``turn`` is generated from;
    ``load(version)`` puts those weights in the engine before the call."""

    of: Callable[[int, int], int]
    load: Callable[[int], Any]


@dataclass(frozen=True)
class TurnStep:
    """What the environment answered to one model turn (``Sample.meta["steps"]``)."""

    reward: float
    observation: list  # the messages it appended (a tool's result: role ``tool``)


@dataclass
class _Run:
    """One trajectory being built."""

    env: Any
    row: dict
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kept: list | None = None  # per token kept sets, while every turn has them
    topk: list | None = None  # per turn (ids, logp) [R, K], while every turn has them
    routes: list | None = None  # per turn its new rows of routed experts, while every turn has them
    turn: int = 0
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)  # per turn: the environment's reward, observation
    finish: str | None = None
    requeues: int = 0

    def start(self, renderer) -> None:
        self.prompt = list(renderer.prompt_ids(self.env.reset(self.row)))
        self.ids, self.logp, self.mask, self.turns, self.versions = [], [], [], [], []
        self.kept, self.topk, self.turn, self.reward, self.info = [], [], 0, 0.0, {}
        self.routes, self.steps = [], []

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def add_turn(self, s: Sample) -> None:
        n = s.response_len
        self._add_routes(s.routed_experts, self.length + n - 1)
        self.ids += list(s.response_ids)
        self.logp += [float(x) for x in s.rollout_logp]
        self.mask += [1] * n
        self.turns += [self.turn] * n
        self.versions += list(s.token_versions or [s.weight_version] * n)
        self.kept = None if self.kept is None or s.sampling_mask is None else self.kept
        if self.kept is not None:
            self.kept += [np.asarray(k, np.int32) for k in s.sampling_mask]
        has_topk = s.topk_ids is not None and s.topk_logp is not None
        self.topk = self.topk if self.topk is not None and has_topk else None
        if self.topk is not None:
            self.topk.append((np.asarray(s.topk_ids), np.asarray(s.topk_logp), n))

    def _add_routes(self, routes, rows: int) -> None:
        """The rows of this turn's routes not held yet (``rows``: the request's row count)."""
        if self.routes is None or routes is None or len(routes) != rows:
            self.routes = None
            return
        held = sum(len(r) for r in self.routes)
        self.routes.append(np.asarray(routes, np.int32)[held:])

    def add_observation(self, ids: list[int]) -> None:
        n = len(ids)
        self.ids += list(ids)
        self.logp += [0.0] * n
        self.mask += [0] * n
        self.turns += [self.turn - 1] * n  # the turn it answers (counted already)
        self.versions += [self.versions[-1] if self.versions else 0] * n
        if self.kept is not None:
            self.kept += [np.zeros(0, np.int32)] * n
        if self.topk is not None:
            self.topk.append((None, None, n))

    def sample(self) -> Sample:
        first = next((v for v, m in zip(self.versions, self.mask, strict=True) if m), 0)
        mixed = len({v for v, m in zip(self.versions, self.mask, strict=True) if m}) > 1
        out = Sample(
            prompt_ids=self.prompt,
            response_ids=self.ids,
            rollout_logp=self.logp,
            finish_reason=self.finish or "length",
            weight_version=first,
            token_versions=list(self.versions) if mixed else None,
            loss_mask=self.mask,
            turn_ids=self.turns,
            sampling_mask=self.kept if self.kept else None,
            meta={"reward": self.reward, "turns": self.turn, "requeues": self.requeues},
        )
        out.meta["info"] = self.info
        out.meta["steps"] = self.steps
        if self.routes:
            out.routed_experts = np.concatenate(self.routes)
        if self.topk:
            out.topk_ids, out.topk_logp = _stack_topk(self.topk)
        return out


def _stack_topk(parts) -> tuple[np.ndarray, np.ndarray]:
    """The turns' top-k ``[R, K]`` stacked, observation rows ``-1`` / ``0`` (the widest K)."""
    k = max((ids.shape[1] for ids, _, _ in parts if ids is not None), default=1)
    n = sum(r for _, _, r in parts)
    ids, lp, at = np.full((n, k), -1, np.int32), np.zeros((n, k), np.float32), 0
    for i, p, r in parts:
        if i is not None:
            ids[at : at + r, : i.shape[1]], lp[at : at + r, : p.shape[1]] = i, p
        at += r
    return ids, lp


def _turn_seed(seed: int | None, j: int) -> int | None:
    """Request ``j``'s seed: ``seed`` itself for the first (a one-turn trajectory samples as a
    single-turn request), then a stable hash of ``(seed, j)``."""
    if seed is None or j == 0:
        return seed
    h = hashlib.sha256(f"{seed}:turn:{j}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _version_seed(seed: int | None, v: int) -> int | None:
    """The seed of a round's call from version ``v`` (a lag profile: one call per version)."""
    if seed is None:
        return None
    h = hashlib.sha256(f"{seed}:version:{v}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def run_trajectory(
    engine, env: Environment, tokenizer, row: dict, sampling: SamplingParams, settings=None
) -> Sample:
    """One trajectory of ``env`` on ``row`` (module docstring)."""
    return run_trajectories(engine, [env], tokenizer, [row], sampling, settings)[0]


def run_trajectories(
    engine,
    envs: list[Environment],
    tokenizer,
    rows: list[dict],
    sampling: SamplingParams,
    settings: TrajectorySettings | None = None,
    versions: TurnVersions | None = None,
) -> list[Sample]:
    """Trajectory ``i`` of ``envs[i]`` on ``rows[i]``, all in lockstep (module docstring);
    ``versions`` (a lag profile): each turn's call from the version drawn for it, the calls of
    a round grouped by version, oldest first."""
    s = settings or TrajectorySettings()
    if len(envs) != len(rows):
        raise ValueError(f"{len(envs)} environments for {len(rows)} rows")
    renderer = renderer_for(tokenizer)
    stop_ids = set(sampling.stop_token_ids) | {tokenizer.eos_token_id}
    runs = [_Run(env, row) for env, row in zip(envs, rows, strict=True)]
    for r in runs:
        r.start(renderer)
    index = {id(r): i for i, r in enumerate(runs)}
    active = [r for r in runs if not _out_of_budget(r, s)]
    j = 0
    while active:
        calls: dict[tuple[int, int], list[_Run]] = {}  # (version or -1, token budget)
        for r in active:
            v = -1 if versions is None else versions.of(index[id(r)], r.turn)
            budget = min(sampling.max_new_tokens, s.max_tokens - r.length)
            calls.setdefault((v, budget), []).append(r)
        for (v, budget), group in sorted(calls.items()):
            seed = _turn_seed(sampling.seed, j)
            if versions is not None:
                versions.load(v)
                seed = _version_seed(seed, v)
            turn = replace(sampling, max_new_tokens=budget, seed=seed)
            out = engine.generate([r.prompt + r.ids for r in group], 1, turn)
            for r, (smp,) in zip(group, out, strict=True):
                _step(r, smp, renderer, tokenizer, stop_ids, s)
        j += 1
        active = [r for r in runs if r.finish is None]
    return [r.sample() for r in runs]


def _out_of_budget(r: _Run, s: TrajectorySettings) -> bool:
    if r.length < s.max_tokens:
        return False
    r.finish = "length"
    return True


def _step(r: _Run, smp: Sample, renderer, tokenizer, stop_ids, s: TrajectorySettings) -> None:
    """Append one model turn, let the environment answer, append its observation."""
    r.add_turn(smp)
    if smp.finish_reason == "abort":
        r.finish = "abort"
        return
    if s.partial == "abort" and len(set(r.versions)) > 1:  # the weights changed under it
        if r.requeues >= MAX_REQUEUES:
            r.finish = "abort"
            return
        r.requeues += 1
        r.start(renderer)
        return
    text = tokenizer.decode(smp.response_ids, skip_special_tokens=True)
    from sat_cli.envs.results import check_step

    step = check_step(r.env.step(text), r.env)  # a plug-in's result: usable, or one line
    r.reward += float(step.reward)
    r.info = dict(step.info)
    r.steps.append(TurnStep(float(step.reward), list(step.observation)))
    r.turn += 1
    if step.done:
        r.finish = "stop"
        return
    if smp.finish_reason != "stop" or r.turn >= s.max_turns:
        r.finish = "length"  # a turn cut at max_new_tokens, or out of turns
        return
    obs = renderer.observation_ids(step.observation, stop_ids)
    if r.length + len(obs) >= s.max_tokens:
        r.finish = "length"  # no room for the observation and a next turn
        return
    r.add_observation(obs)


def tool_totals(samples: list[Sample]) -> tuple[int, int] | None:
    """``(tool calls, failed calls)`` over the trajectories' last-step infos
    (``tool_calls_total`` / ``tool_errors_total``; 0 for an environment without tools), or None
    when no sample carries an info (a replayed batch keeps no meta: nothing was called)."""
    infos = [s.meta["info"] for s in samples if isinstance(s.meta.get("info"), dict)]
    if not infos:
        return None
    calls = sum(int(i.get("tool_calls_total", 0)) for i in infos)
    return calls, sum(int(i.get("tool_errors_total", 0)) for i in infos)
