"""Typed schema of every `sat` config: dataclasses registered in Hydra's ConfigStore.

YAML files under `conf/` only set values; the types, defaults and bounds live here, beside a
one-line description of each field. Bounds are checked in ``__post_init__``, which runs when the
composed config is turned into objects (``OmegaConf.to_object``) by :func:`sat_cli.config.load`,
so a typo or an out-of-range value fails at compose time, before any process starts. One rule
covers every number: NaN and infinity are refused in any field
(:func:`sat_cli.validate.check_finite`, a walk over the composed config).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sat_cli.cluster.settings import LauncherSettings  # where processes go
from sat_cli.config.additions import check_loss_additions  # STR, score centering
from sat_cli.config.budgets import check_budgets
from sat_cli.config.compat import check_compat  # rules across sections
from sat_cli.config.devices import check_device_plan  # GPU ids per process, Ray's requests
from sat_cli.config.dynamic import DynamicSamplingConfig  # DAPO's dynamic sampling
from sat_cli.config.env import EnvConfig, check_env  # multi-turn rollouts (env=none: off)
from sat_cli.config.options import components  # the registered options
from sat_cli.config.reward import RewardConfig  # which reward scores a response
from sat_cli.config.sat_scope import check_sat_scope
from sat_cli.config.task import TaskConfig, check_sampling  # the task section
from sat_cli.engines.settings import EngineSettings  # each engine's own: engines/<name>/
from sat_cli.rl.names import (  # the loss choices, defined once (torch-free)
    ALGOS,
    ANCHORS,
    BEHAV_MODES,
    CORRECTIONS,
    DENOMINATORS,
    LOSS_AGGS,
    Q_SCOPES,
)
from sat_cli.trainers.settings import (  # each trainer's own: trainers/
    TrainerSettings,
    check_token_budgets,
)
from sat_cli.validate import ConfigError, check_choice, check_range

SCHEDULES = ("constant", "linear", "cosine")
LAG_MODES = ("interval", "fixed", "bounded")
TRACKING_BACKENDS = ("mlflow", "none")
NAME_MAX = 255  # bytes of one path component on common file systems (ext4, xfs, tmpfs)
# The engine and evaluation seeds are derived from the run seed by adding offsets and must fit
# torch's and the servers' int64 seeds; 2**62 leaves room for every offset.
MAX_SEED = 2**62 - 1


@dataclass
class WarmStartConfig:
    """Supervised warm start of the tiny model (run once, cached by a hash of its config)."""

    max_steps: int = 3000  # upper bound on SFT steps
    batch_size: int = 128
    lr: float = 3e-3
    eval_every: int = 25  # evaluate sampled held-out accuracy this often
    target_accuracy: float = 0.2  # stop once sampled (T=1) held-out accuracy reaches this
    eval_size: int = 200  # held-out problems for the sampled accuracy

    def __post_init__(self) -> None:
        check_range("model.warm_start.max_steps", self.max_steps, 1)
        check_range("model.warm_start.batch_size", self.batch_size, 1)
        check_range("model.warm_start.lr", self.lr, 0, lo_open=True)
        check_range("model.warm_start.eval_every", self.eval_every, 1)
        check_range("model.warm_start.target_accuracy", self.target_accuracy, 0, 1)
        check_range("model.warm_start.eval_size", self.eval_size, 1)


@dataclass
class ModelConfig:
    name: str = "tiny_moe"
    kind: str = "tiny"  # tiny: built and warm-started here; hf: an HF directory or hub id
    path: str | None = None  # HF checkpoint dir or hub id; tiny: None = warm-start cache
    # a hub id's branch, tag or commit (null: main); resolved to a snapshot of the HF cache
    # before the run starts (sat_cli/models/hub.py; `sat model fetch` downloads it)
    revision: str | None = None
    num_layers: int = 4
    hidden_size: int = 128
    num_experts: int = 8
    top_k: int = 2
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        check_choice("model.kind", self.kind, ("tiny", "hf"))
        if self.kind == "hf" and not self.path:
            raise ConfigError(f"model.path must be set for model={self.name} (an HF dir or hub id)")
        if self.revision is not None and not re.fullmatch(r"[\w.\-/]{1,200}", self.revision):
            raise ConfigError(
                f"model.revision={self.revision!r} is not a branch, tag or commit name"
            )
        for k in ("num_layers", "hidden_size", "num_experts", "top_k"):
            check_range(f"model.{k}", getattr(self, k), 1)
        if self.top_k > self.num_experts:
            raise ConfigError("model.top_k must be <= model.num_experts")


@dataclass
class AlgoConfig:
    name: str = "grpo"  # policy-loss family, see sat_cli/rl/registry.py
    correction: str = "none"  # mismatch correction: none | tis | mis | icepop
    eps_low: float = 0.2  # nominal PPO clip radii (the clip schedule scales them over steps)
    eps_high: float = 0.2
    dual_clip_c: float | None = None  # > 1 to cap the loss of A<0 tokens
    loss_agg: str = "token-mean"
    adv_std_norm: bool = True  # false: Dr.GRPO (no std division)
    drop_zero_adv_groups: bool = False
    ratio_denominator: str = "rollout"  # rollout (paper) | recompute
    num_minibatches: int = 1  # optimizer steps per rollout batch (paper: 1)
    kl_coef: float = 0.0  # low_var_kl (k3) against the reference policy
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    dppo_delta: float = 1e-3
    m2po_tau: float = 0.04
    behav_cap: float | None = None  # decoupled_ppo, a3po: cap on the behaviour weight pi_prox/mu
    behav_mode: str = "clip"  # clip: min(w, cap) | mask: w = 0 above cap
    vcpo_is_cap: float = 8.0  # vcpo: truncation C of the sequence IS weight min(w, C)
    vcpo_ess_base: float = 1.0  # vcpo: step scale sqrt(min(1, ESS/B / vcpo_ess_base))
    vcpo_opob: bool = True  # vcpo: the off-policy optimal baseline (false: GRPO's group mean)
    # score on the engine's top-p/top-k kept set: log p = z[y] - logsumexp(z[kept]), z = logits/T
    replay_sampling_mask: bool = False  # (no filter: a no-op; docs/algorithms.md §1)
    score_centering_topk: int = 0  # K of the sampler's top-k the engine records (0 = off)
    str_delta: float | None = None  # STR: drop responses with mean Bernoulli KL(mu||pi) > this
    score_centering: bool = False  # + A * sum_H sg(c_v) log p_v (needs score_centering_topk)
    ledger: bool = False  # log d̄pi split into engine mismatch and staleness (trainer=local)
    # DAPO's dynamic sampling: zero-variance groups dropped, the batch refilled (config/dynamic.py)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        check_choice("algo.name", self.name, ALGOS)
        check_choice("algo.correction", self.correction, CORRECTIONS)
        check_range("algo.eps_low", self.eps_low, 0, 1, lo_open=True, hi_open=True)
        check_range("algo.eps_high", self.eps_high, 0, 1, lo_open=True, hi_open=True)
        if self.dual_clip_c is not None:
            check_range("algo.dual_clip_c", self.dual_clip_c, 1, lo_open=True)
        check_choice("algo.loss_agg", self.loss_agg, LOSS_AGGS)
        check_choice("algo.ratio_denominator", self.ratio_denominator, DENOMINATORS)
        check_range("algo.num_minibatches", self.num_minibatches, 1)
        check_range("algo.kl_coef", self.kl_coef, 0)
        check_range("algo.tis_cap", self.tis_cap, 0, lo_open=True)
        if not 0 < self.icepop_low < self.icepop_high:
            raise ConfigError("need 0 < algo.icepop_low < algo.icepop_high")
        check_range("algo.dppo_delta", self.dppo_delta, 0, lo_open=True)
        check_range("algo.m2po_tau", self.m2po_tau, 0, lo_open=True)
        if self.behav_cap is not None:
            check_range("algo.behav_cap", self.behav_cap, 0, lo_open=True)
        check_choice("algo.behav_mode", self.behav_mode, BEHAV_MODES)
        check_range("algo.vcpo_is_cap", self.vcpo_is_cap, 0, lo_open=True)
        check_range("algo.vcpo_ess_base", self.vcpo_ess_base, 0, 1, lo_open=True)
        check_range("algo.score_centering_topk", self.score_centering_topk, 0)
        check_loss_additions(self)  # str_delta, score_centering (config/additions.py)
        if self.name == "vcpo" and self.loss_agg != "seq-mean-token-mean":
            raise ConfigError(
                "algo=vcpo aggregates seq-mean-token-mean (its optimal baseline is per response); "
                f"got algo.loss_agg={self.loss_agg}"
            )


@dataclass
class ClipConfig:
    name: str = "sat"
    adaptive: bool = True  # SAT: staleness-adaptive interval (ALGORITHMS.md §4)
    quantile: float = 0.9  # alpha of the batch reference q
    exponent: float = 2.0  # Hill kernel exponent p
    anchor: str = (
        "q"  # q (paper) | min_q_eps (beyond the paper: bites when the whole batch is stale)
    )
    schedule: str = "constant"  # schedule of the nominal radii over steps
    final_scale: float = 1.0  # radii at max_steps = eps * final_scale (linear/cosine)
    # the algorithm's own radii times this factor, applied once when the config is composed
    # (clip=ppo_tight: 0.75, the "smaller step" control); 1 = the algorithm's radii
    radius_scale: float = 1.0
    # scope of SAT's order statistic q: batch = over the whole optimizer minibatch (default);
    # micro_batch = per block of micro_batch_size rows, the paper's per-micro-batch-per-rank scope
    q_scope: str = "batch"
    micro_batch_size: int = 1  # rows (responses) per micro-batch on one rank, for q_scope

    def __post_init__(self) -> None:
        check_range("clip.quantile", self.quantile, 0, 1, lo_open=True, hi_open=True)
        check_choice("clip.q_scope", self.q_scope, Q_SCOPES)
        check_range("clip.micro_batch_size", self.micro_batch_size, 1)
        check_range("clip.exponent", self.exponent, 0, lo_open=True)
        check_choice("clip.anchor", self.anchor, ANCHORS)
        check_choice("clip.schedule", self.schedule, SCHEDULES)
        check_range("clip.final_scale", self.final_scale, 0, 1, lo_open=True)
        check_range("clip.radius_scale", self.radius_scale, 0, 1, lo_open=True)


@dataclass
class LagConfig:
    n: int = 1  # staleness bound / weight-push interval (ALGORITHMS.md §7); 0 = synchronous
    mode: str = "interval"  # interval (paper, slime) | fixed | bounded (AReaL-style)
    # bounded mode: the engine takes each new version at the next token boundary, so one
    # response can span versions (per-token versions); cache after a switch: recompute | keep
    inflight_updates: bool = False
    inflight_cache: str = "recompute"
    # each sample's lag drawn from a distribution (docs/lag-profiles.md): fixed:K | uniform:A-B |
    # geometric:P,max=M | empirical:FILE; replaces n and mode (the file is read by sat train)
    profile: str | None = None

    def __post_init__(self) -> None:
        check_range("lag.n", self.n, 0)
        if self.profile is not None and (self.mode == "bounded" or self.inflight_updates):
            raise ConfigError(
                f"lag.profile={self.profile!r} draws each sample's version in advance; it cannot "
                "be combined with lag.mode=bounded or lag.inflight_updates=true (timing decides "
                "their versions; per-token profiles are not implemented: docs/lag-profiles.md)"
            )
        if self.profile is not None:
            from sat_cli.loop.lag_profile import ProfileError, parse_profile

            try:
                parse_profile(self.profile)
            except ProfileError as exc:
                raise ConfigError(str(exc)) from None
        check_choice("lag.mode", self.mode, LAG_MODES)
        check_choice("lag.inflight_cache", self.inflight_cache, ("recompute", "keep"))
        if self.inflight_updates and (self.mode != "bounded" or self.n < 1):
            raise ConfigError(
                "lag.inflight_updates=true needs lag.mode=bounded and lag.n >= 1 (the other "
                f"modes fix each batch's version in advance); got lag.mode={self.mode}, "
                f"lag.n={self.n}"
            )


@dataclass
class EvalConfig:
    name: str = "toy"
    # toy | heldout (the training task's own held-out split; the default of a data task) | aime24 |
    # aime25 | math500 | gsm8k | jsonl
    benchmark: str = "toy"
    path: str | None = None  # eval=jsonl: the file
    every: int = 10  # in-training evaluation period in steps (0 = off)
    at_start: bool = True  # evaluate the initial model too
    n: int = 8  # samples per problem (avg@n, pass@k for k <= n)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    template: str = "plain"
    limit: int | None = None  # evaluate only the first N problems
    batch_size: int = 64  # prompts per engine request
    grader_timeout_s: float = 5.0  # math-verify time limit per answer (benchmarks, not toy)
    # one larger evaluation of the final weights after the last step, logged as final/<name>/*:
    final_n: int | None = None  # samples per problem (None: no final evaluation)
    final_limit: int | None = None  # problems (None: the whole held-out set / benchmark)

    def __post_init__(self) -> None:
        check_range("eval.every", self.every, 0)
        if self.final_n is not None:
            check_range("eval.final_n", self.final_n, 1)
        if self.final_limit is not None:
            check_range("eval.final_limit", self.final_limit, 1)
        check_range("eval.n", self.n, 1)
        check_sampling("eval", self)  # the rule of task.*'s
        if self.limit is not None:
            check_range("eval.limit", self.limit, 1)
        check_range("eval.batch_size", self.batch_size, 1)
        check_range("eval.grader_timeout_s", self.grader_timeout_s, 0, lo_open=True)
        from sat_cli.tasks.registry import eval_source

        if eval_source(self.benchmark).user_file and not self.path:
            raise ConfigError(f"eval={self.benchmark} needs eval.path=<file.jsonl>")


@dataclass
class TrackingConfig:
    backend: str = "mlflow"
    uri: str = "sqlite:///${run.dir}/mlflow.db"
    histogram_every: int = 10
    # a table of the step's prompts, responses, rewards and versions (samples/train_step_N.json)
    # every this many steps; 0 = only the evaluations' tables
    samples_every: int = 25
    # extra MLflow tags of the run (not params: they may change when a run is resumed). `sat
    # sweep` sets sweep_id, override_hash, method and parent_run_id (tags sat.sweep_id,
    # sat.override_hash, sat.method, mlflow.parentRunId); any other key becomes a tag as it is.
    tags: dict[str, str] = field(default_factory=dict)
    # store unreachable mid-run: metrics wait on disk (<run.dir>/.mlflow_pending/) and are
    # retried every retry_interval_s; past outage_timeout_s the run stops with a checkpoint
    outage_timeout_s: float = 1800.0
    retry_interval_s: float = 30.0

    def __post_init__(self) -> None:
        check_choice("tracking.backend", self.backend, TRACKING_BACKENDS)
        check_range("tracking.histogram_every", self.histogram_every, 1)
        check_range("tracking.samples_every", self.samples_every, 0)
        check_range("tracking.outage_timeout_s", self.outage_timeout_s, 0, lo_open=True)
        check_range("tracking.retry_interval_s", self.retry_interval_s, 0, lo_open=True)
        for key in self.tags:
            if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", str(key)):
                raise ConfigError(
                    f"tracking.tags: {key!r} is not a tag name (letters, digits, _ . -; at most "
                    "100 characters)"
                )


@dataclass
class RunConfig:
    name: str | None = None  # default: <algo>-<clip>-lag<n>-r3<bool>-s<seed>-<time>
    dir: str = "runs"
    experiment: str = "sat"
    # pin torch's CPU code paths (ATen AVX2, oneDNN AVX2, MKL's COMPATIBLE branch, fixed threads)
    # in every process, aiming at the same numbers for a seed on any x86-64 CPU (numerics.py)
    portable_numerics: bool = False

    def __post_init__(self) -> None:
        for key, value in (("run.name", self.name), ("run.experiment", self.experiment)):
            if value is None:
                continue
            if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
                raise ConfigError(
                    f"{key}={value!r} is not a safe name: no path separators, '.' or '..'"
                )
            if any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise ConfigError(f"{key}={value!r} has a control character (newline, tab, …)")
            if len(value.encode("utf-8", "surrogatepass")) > NAME_MAX:
                raise ConfigError(
                    f"{key} is {len(value.encode('utf-8', 'surrogatepass'))} bytes long; a folder "
                    f"name may have at most {NAME_MAX} bytes"
                )


@dataclass
class ReplayConfig:
    # store the rollout stream in <run>/replay for `sat replay` (docs/replay.md)
    record: bool = False


@dataclass
class CheckpointConfig:
    every: int = 25  # steps between checkpoints (0 = only at the end)
    keep: int = 2  # most recent checkpoints kept

    def __post_init__(self) -> None:
        check_range("checkpoint.every", self.every, 0)
        check_range("checkpoint.keep", self.keep, 1)


@dataclass
class DataConfig:
    dir: str | None = None  # benchmark data directory; falls back to $SAT_DATA_DIR


@dataclass
class SatConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    lag: LagConfig = field(default_factory=LagConfig)
    # engine, trainer, launcher: the chosen option's own settings class (a subclass; the
    # registries: engines/registry.py, trainers/registry.py, cluster/registry.py)
    engine: EngineSettings = field(default_factory=EngineSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    launcher: LauncherSettings = field(default_factory=LauncherSettings)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    r3: bool = False  # rollout routing replay (MoE): record routes at rollout, replay in training
    seed: int = 0
    max_steps: int = 250
    resume: str | None = None  # auto | force | <run dir>: continue from the last checkpoint
    ckpt: str | None = None  # sat eval: a training checkpoint dir to evaluate

    def __post_init__(self) -> None:
        check_range("max_steps", self.max_steps, 1)
        check_range("seed", self.seed, 0, MAX_SEED)
        if self.r3 and self.model.num_experts <= 1:
            raise ConfigError("r3=true needs a Mixture-of-Experts model")
        for component in components(self):  # each option's own rules (trainer=megatron: layout)
            component.check(self)
        check_device_plan(self)  # GPU ids per process, Ray's GPU requests (config/devices.py)
        check_compat(self)  # model × task × trainer × engine rules (sat_cli/config/compat.py)
        check_token_budgets(self.trainer, self.task.max_new_tokens)  # trainers/settings.py
        check_budgets(self)  # token and memory budgets across sections (config/budgets.py)
        t = self.trainer  # null lr_decay_steps: the run's optimizer steps (trainers/lr_schedule)
        if t.lr_decay_steps is None and t.lr_schedule != "constant":
            t.lr_decay_steps = self.max_steps * self.algo.num_minibatches
        check_sat_scope(self.algo.name, self.clip)  # SAT needs a clip and a q that can gate
        check_env(self)  # env=<name>: what multi-turn rollouts cannot be combined with yet
