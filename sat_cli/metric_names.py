"""Every metric and histogram name `sat` logs, defined once.

Producers (the loss library, the shared trainer step, the loop, the tracker, `sat sweep`) and
consumers (``sat report``, the progress line, the tests) import these constants instead of
spelling the names, so a rename is one edit and a typo is a NameError, not a silently empty
plot. No other module spells a ``<group>/…`` string, f-strings included
(``tests/test_metric_names.py``); evaluation keys come from ``avg_key`` / ``pass_key`` /
``overlong_key`` / ``reward_error_key``. Torch-free: ``sat report`` imports it.

Groups (``<group>/<name>``): ``loss/`` the policy loss and optimizer step, ``sat/`` SAT's
interval, ``staleness/`` the mismatch between the trained and the behaviour policy,
``rollout/`` the batch, ``reward/`` the reward's components and failures, ``weights/`` the
weight sync, ``clip/`` the clip schedule, ``perf/`` timings, ``r3/`` the routing-replay audit,
``a3po/`` and ``vcpo/`` those algorithms' own, ``sweep/`` a sweep's parent run,
``tracking/`` the tracker's own counts, ``eval/<task>/`` and ``final/<task>/`` the held-out
evaluation (``avg@k`` / ``pass@k``, stored by MLflow as ``avg_at_k`` / ``pass_at_k``:
``sat_cli.tracking.mlflow_key``).
"""

from __future__ import annotations

# --- loss/ (rl/losses.py, rl/registry.py, trainers/step.py) -----------------------------------
LOSS_POLICY = "loss/policy"
CLIPFRAC = "loss/clipfrac"
CLIPFRAC_LOW = "loss/clipfrac_low"
CLIPFRAC_HIGH = "loss/clipfrac_high"
KL_K3 = "loss/kl_k3"
KL_REF = "loss/kl_ref"
ENTROPY = "loss/entropy"
GRAD_NORM = "loss/grad_norm"
LOSS_TOTAL = "loss/total"
TOKEN_WEIGHT_MEAN = "loss/token_weight_mean"
TOKEN_WEIGHT_ZERO_FRAC = "loss/token_weight_zero_frac"
NONFINITE_SKIPPED = "loss/nonfinite_skipped"  # 1 for a minibatch whose update was skipped
NONFINITE_STEPS = "loss/nonfinite_steps"  # the loop's running count
LR_SCALE = "opt/lr_scale"  # a loss asks the trainer to scale this step's learning rate
# the sequence trust region (rl/seq_trust.py) and score centering (rl/score_centering.py)
STR_DROP_FRAC = "loss/str_drop_frac"  # responses dropped (mean Bernoulli KL > str_delta)
STR_SEQ_KL_MEAN = "loss/str_seq_kl_mean"  # mean over responses of their mean token KL(mu||pi)
CENTERING_TERM = "loss/centering_term"  # the aggregated A * C added to the loss
CENTERING_SAMPLER_HEAD = "loss/centering_sampler_head_mass"  # mean sum_H q
CENTERING_POLICY_HEAD = "loss/centering_policy_head_mass"  # mean sum_H p
CENTERING_ALPHA_MEAN = "loss/centering_alpha_mean"  # mean tail coefficient alpha

# --- sat/ (rl/sat.py via rl/losses.py; the loop's running fractions) ---------------------------
SAT_Q = "sat/q"
SAT_GATE_RATE = "sat/gate_rate"
SAT_EPS_LOW_EFF = "sat/eps_low_eff_mean"
SAT_EPS_HIGH_EFF = "sat/eps_high_eff_mean"
SAT_C_MIN = "sat/c_min"
SAT_BAND = "sat/clipfrac_sat_band"
SAT_BAND_LOW = "sat/clipfrac_sat_band_low"
SAT_BAND_HIGH = "sat/clipfrac_sat_band_high"
SAT_ACTIVE = "sat/active"
SAT_ACTIVE_LOW = "sat/active_low"
SAT_ACTIVE_HIGH = "sat/active_high"
FRAC_SUFFIX = "_frac"  # the loop's running fraction of a sat/active* flag: sat/active_frac

# --- staleness/ ---------------------------------------------------------------------------------
DPI = "staleness/abs_logratio_mean"  # the paper's d̄π, against the loss's ratio denominator
DPI_MU = "staleness/abs_logratio_mean_mu"  # the same against the behaviour policy mu
MISMATCH = "staleness/mismatch_abs_logratio_mean"  # |log pi_old - log mu| (recompute pass)
ESS = "staleness/ess"
SAT_Q_SHADOW = "staleness/q_shadow"  # without SAT: the q SAT would compute on the batch
ABS_LOGRATIO_PCT = "staleness/abs_logratio_{}"  # .format("p50" | "p90" | "p99")
VERSION_LAG_MEAN = "staleness/version_lag_mean"  # per sample: its oldest (first) token's lag
VERSION_LAG_MAX = "staleness/version_lag_max"
TOKEN_LAG_MEAN = "staleness/token_version_lag_mean"  # per token (in-flight updates mix them)
MIXED_VERSION_FRAC = "staleness/mixed_version_frac"  # responses whose tokens span versions
# the three-log-prob ledger (algo.ledger; rl/ledger.py): delta = log pi - log mu = m + s with
# m = log pi_old(version) - log mu (engine mismatch), s = log pi - log pi_old (staleness)
LEDGER_DPI = "staleness/ledger_abs_logratio_mean"  # mean |delta| = mismatch + staleness part
LEDGER_MISMATCH_PART = "staleness/ledger_mismatch_part"  # mean sign(delta) * m
LEDGER_STALENESS_PART = "staleness/ledger_staleness_part"  # mean sign(delta) * s
LEDGER_MISMATCH_ABS = "staleness/ledger_mismatch_abs_mean"  # mean |m|
LEDGER_STALENESS_ABS = "staleness/ledger_staleness_abs_mean"  # mean |s|
LEDGER_HELD_FRAC = "staleness/ledger_held_frac"  # tokens whose version's weights were held

# --- rollout/ (loop/steps.py) ------------------------------------------------------------------
BATCH_INDEX = "rollout/batch_index"
PROMPT_DIGEST = "rollout/prompt_digest"
REWARD_MEAN = "rollout/reward_mean"
RESPONSE_LEN_MEAN = "rollout/response_len_mean"
TRUNCATED_FRAC = "rollout/truncated_frac"
TOKENS_PER_S = "rollout/tokens_per_s"
STALE_DROPPED = "rollout/stale_dropped"  # bounded mode: groups older than lag.n (running count)

# --- reward/ (loop/steps.py; sat_cli/rewards) ---------------------------------------------------
REWARD = "reward"
REWARD_ERROR_FRAC = "reward/error_frac"  # samples of the step whose reward raised, timed out, NaN


ARTIFACT_SAMPLES = "samples"  # folder of the samples tables (prompts, responses, rewards)


def samples_artifact(kind: str, step: int) -> str:
    """``samples/<kind>_step_<step>.json``: a samples table (``kind``: ``train``, ``eval``,
    ``final``) in ``mlflow.log_table``'s JSON layout."""
    return f"{ARTIFACT_SAMPLES}/{kind}_step_{step:06d}.json"


def reward_key(component: str) -> str:
    """``reward/<component>``: the step's mean of one component of a dict-valued reward."""
    return f"{REWARD}/{component}"


# --- weights/ (loop/weightsync.py: one weight version brought to the engine) --------------------
SYNC_S = "weights/sync_s"  # pause + wire + assemble
SYNC_PAUSE_S = "weights/sync_pause_s"  # group set-up, begin/end, pauses
SYNC_WIRE_S = "weights/sync_wire_s"  # broadcast and load, or the disk load
SYNC_ASSEMBLE_S = "weights/sync_assemble_s"  # capture and flattening, or the disk write
SYNC_BYTES = "weights/sync_bytes"
VERIFY_S = "weights/verify_s"  # checksums compared (engine.verify_weights)
SYNC_FALLBACK = "weights/sync_fallback"  # running count of versions resent from disk

# --- clip/ (the loop's schedule) --------------------------------------------------------------
EPS_LOW = "clip/eps_low"
EPS_HIGH = "clip/eps_high"

# --- histograms (loop/steps.log_histograms) ----------------------------------------------------
HIST_VERSION_LAG = "staleness/version_lag"  # per sample
HIST_TOKEN_VERSION_LAG = "staleness/token_version_lag"  # per token
HIST_ABS_LOGRATIO = "staleness/abs_logratio"
HIST_SAT_ABS_LOGRATIO = "sat/abs_logratio"
HIST_CONTRACTION = "sat/contraction"
HIST_LEDGER_MISMATCH = "staleness/ledger_mismatch"  # per token m (algo.ledger)
HIST_LEDGER_STALENESS = "staleness/ledger_staleness"  # per token s (algo.ledger)

# --- eval/ and final/ ---------------------------------------------------------------------------
EVAL = "eval"
FINAL = "final"


def eval_prefix(task: str, final: bool = False) -> str:
    """``eval/<task>/`` (periodic held-out evaluation) or ``final/<task>/`` (the final one)."""
    return f"{FINAL if final else EVAL}/{task}/"


def env_eval_key(env: str, what: str) -> str:
    """``eval/<env>/<what>`` of ``sat eval <env>`` (success, turns_mean, pass@k, …)."""
    return f"{eval_prefix(env)}{what}"


def avg_key(task: str, n: int, final: bool = False) -> str:
    """The logged name of avg@n (MLflow stores it as ``…/avg_at_<n>``)."""
    return f"{eval_prefix(task, final)}avg@{n}"


# every loss/ sat/ staleness/ name a trainer step with SAT on a token-ratio algorithm reports
STEP_NAMES = (
    LOSS_POLICY,
    CLIPFRAC,
    CLIPFRAC_LOW,
    CLIPFRAC_HIGH,
    KL_K3,
    ENTROPY,
    GRAD_NORM,
    LOSS_TOTAL,
    SAT_Q,
    SAT_GATE_RATE,
    SAT_EPS_LOW_EFF,
    SAT_EPS_HIGH_EFF,
    SAT_C_MIN,
    SAT_BAND,
    SAT_BAND_LOW,
    SAT_BAND_HIGH,
    SAT_ACTIVE,
    SAT_ACTIVE_LOW,
    SAT_ACTIVE_HIGH,
    DPI,
    DPI_MU,
    ESS,
)

# --- per turn of multi-turn trajectories (loop/multiturn.py; env != none), .format(k), k from 0 -
TURN_TOKENS = "staleness/turn_{}/tokens"  # the model's tokens of turn k in the batch
TURN_TOKEN_LAG_MEAN = "staleness/turn_{}/token_version_lag_mean"  # their mean version lag
TURN_DPI_MU = "staleness/turn_{}/abs_logratio_mean_mu"  # their d̄π against mu (histogram steps)
HIST_TURN_TOKEN_VERSION_LAG = "staleness/turn_{}/token_version_lag"  # per token of turn k
TURNS_MEAN = "rollout/turns_mean"  # model turns per trajectory
ENV_TOKEN_FRAC = "rollout/env_token_frac"  # response tokens that are the environment's

# --- env/ (loop/multiturn.py; env != none: the step's tool calls, from the environments' infos) -
ENV_TOOL_CALLS = "env/tool_calls"  # tool calls of the step's trajectories
ENV_TOOL_ERROR_FRAC = "env/tool_error_frac"  # of those, the ones that failed (crash, hang, flood)

# --- lag profiles (loop/train.py, loop/lag_profile.py) ------------------------------------------
LAG_PROFILE_TV = "staleness/lag_profile_tv"  # TV(realised lags so far, the profile's target)
HIST_LAG_PROFILE = "staleness/lag_profile"  # the realised lags so far, one bin per lag

# --- dynamic/ (loop/dynamic.py, algo.dynamic_sampling: DAPO's zero-variance filter and refill) ---
DYN_GEN_BATCHES = "dynamic/gen_batches"  # generation batches the step drew (1 = no refill)
DYN_GROUPS_DROPPED = "dynamic/groups_dropped"  # groups the zero-variance filter dropped
DYN_GROUPS_SURPLUS = "dynamic/groups_surplus"  # kept groups past prompts_per_step: not trained
DYN_GROUPS_SHORT = "dynamic/groups_short"  # prompts_per_step - trained groups (> 0: bound hit)
DYN_KEPT_FRAC = "dynamic/kept_frac"  # trained groups / generated groups
DYN_EXTRA_LAG = "dynamic/extra_lag"  # mean sample lag: trained - the first generation batch's
DYN_REFILL_S = "dynamic/refill_s"  # seconds the step waited for its refill batches
# the split of the step's generated samples: kept (trained) + dropped (not trained) = total;
# sums and counts, so that the parts add up exactly (the means beside them)
DYN_SPLIT = "dynamic/{}_{}"  # DYN_SPLIT.format(<quantity>, kept|dropped|total)
DYN_SPLIT_QUANTITIES = ("n_groups", "n_samples", "n_tokens", "version_lag_sum", "token_lag_sum")
DYN_SPLIT_MEANS = "dynamic/version_lag_mean_{}"  # kept | dropped
DYN_SPLIT_PARTS = ("kept", "dropped", "total")
# algo.ledger with dynamic sampling: the ledger's sums over the kept / dropped / all tokens
# (before the step's update; rl/ledger.py: |delta| = sign(delta) m + sign(delta) s per token)
DYN_LEDGER = "dynamic/ledger_{}_{}"  # DYN_LEDGER.format(<quantity>, kept|dropped|total)
DYN_LEDGER_QUANTITIES = ("n_tokens", "abs_logratio_sum", "mismatch_part_sum", "staleness_part_sum")
HIST_VERSION_LAG_SPLIT = "staleness/version_lag_{}"  # per sample: kept | dropped
HIST_TOKEN_VERSION_LAG_SPLIT = "staleness/token_version_lag_{}"  # per token: kept | dropped

# --- a3po/ and vcpo/ (rl/offpolicy.py: the custom algorithms' own metrics) ----------------------
A3PO_ALPHA_MEAN = "a3po/alpha_mean"
VCPO_ESS = "vcpo/ess"
VCPO_BASELINE_SHIFT = "vcpo/baseline_shift_abs_mean"

# --- perf/ (trainers/step.py, loop/steps.py, loop/train.py: seconds and counts of one step) -----
PERF_TRAIN_S = "perf/train_s"  # the trainer's step(), all minibatches
PERF_OPTIMIZER_STEPS = "perf/optimizer_steps"
PERF_GEN_S = "perf/gen_s"  # generation of this step's batch
PERF_WAIT_S = "perf/wait_s"  # the loop waiting for that batch
PERF_EVAL_S = "perf/eval_s"
PERF_STEP_S = "perf/step_s"
PERF_OVERLAP = "perf/overlap_efficiency"  # max(gen, train) / (step - eval), at most 1

# --- r3/ (trainers/step.py with trainer.r3_audit) -----------------------------------------------
R3_AUDIT_ROWS = "r3/audit_rows"
R3_AUDIT_MISMATCHED_ROWS = "r3/audit_mismatched_rows"

# --- sweep/ (sweep/run.py: the parent run of a sweep) -------------------------------------------
SWEEP_RUNS_FINISHED = "sweep/runs_finished"
SWEEP_RUNS_FAILED = "sweep/runs_failed"
SWEEP_WALL_S = "sweep/wall_s"
ARTIFACT_SWEEP_RUNS = "sweep/runs.json"  # the parent run's table of children (an artifact path)
ARTIFACT_SWEEP_FILE = "sweep/{name}"  # the parent run's copy of the sweep file, masked

# --- tracking/ (tracking/tracker.py: the tracker's own counts) ----------------------------------
TRACKING_NONFINITE = "tracking/nonfinite_metrics"  # values dropped because not finite
TRACKING_DROPPED_METRICS = "tracking/dropped_metrics"
TRACKING_DROPPED_ARTIFACTS = "tracking/dropped_artifacts"

# --- group prefixes -----------------------------------------------------------------------------
LOSS_GROUP = "loss/"  # the loop stops on a non-finite value of any loss/ metric


def pass_key(task: str, k: int, final: bool = False) -> str:
    """The logged name of pass@k (MLflow stores it as ``…/pass_at_<k>``)."""
    return f"{eval_prefix(task, final)}pass@{k}"


def reward_error_key(task: str, final: bool = False) -> str:
    """The fraction of an evaluation's graded samples whose reward failed (a reward plugin)."""
    return f"{eval_prefix(task, final)}reward_error_frac"


def overlong_key(task: str, final: bool = False) -> str:
    """Problems scored wrong because their prompt does not fit the model's context."""
    return f"{eval_prefix(task, final)}overlong"
