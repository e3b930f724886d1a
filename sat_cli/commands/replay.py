"""`sat replay RUN [overrides]`: train a fresh copy of RUN's start checkpoint on RUN's recorded
rollout stream (``sat train … replay.record=true``; :mod:`sat_cli.replay.store`), in the same
order, with the same evaluation schedule, and another algorithm or clip (docs/replay.md).

The config is RUN's own: the overrides its recording names, then the replay's, which may only
change what does not change the data (``algo``, ``clip``, their fields, ``run.name``,
``tracking.*``, a smaller ``max_steps``). The composed config must then agree with the recorded
one on everything that makes the data (model, task, lag, engine, seed, r3, trainer kind); the
recording is checked whole (manifest, sizes, SHA-256, arrays). All of it happens before a
run folder is created: bad input exits 2 and writes nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.records import Int, ListOf, Obj, Str, read_checked
from sat_cli.replay import REPLAY_OF, REPLAY_OF_ID

# what `sat replay` reads of the manifest before the recording is checked whole
MANIFEST_HEADER = Obj(
    {
        "header": Obj({"config": Obj({}), "overrides": ListOf(Str())}, ("config", "overrides")),
        "steps": Int(0),
    },
    required=("header",),
)

# what a replay may override: it changes the loss, not the stream
# (seed, run.experiment and resume are what a sweep sets; the seed must be the recorded one)
ALLOWED = (
    "algo",
    "clip",
    "run.name",
    "tracking",
    "max_steps",
    "trainer.num_threads",
    "seed",
    "run.experiment",
    "resume",
)
# sections of the recorded config a replay must match: they make the data
DATA_KEYS = ("model", "task", "lag", "engine", "seed", "r3", "data", "eval")
DROPPED = ("run.name", "resume", "replay.record")  # taken from the recording, then replaced


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def masked_keys(recorded: list[str]) -> list[str]:
    """The keys of the recorded overrides whose value the recording masked (a secret: a
    recording keeps none; the replay is given each again)."""
    from sat_cli.tracking.params import REDACTED

    return [_key(ov) for ov in recorded if REDACTED in ov.partition("=")[2]]


def replay_overrides(recorded: list[str], given: list[str], name: str, tags=()) -> list[str]:
    """The overrides of the replay: the recording's (less its run name and its masked secrets),
    then the given ones (each masked secret given again), then ``tags`` (the MLflow tags naming
    the recorded run)."""
    secrets = masked_keys(recorded)
    for ov in given:
        key = _key(ov)
        if "=" not in ov or not (
            key in secrets or any(key == a or key.startswith(a + ".") for a in ALLOWED)
        ):
            raise UserError(
                f"sat replay: {ov!r} would change the recorded data; a replay takes only "
                f"{', '.join(a + '…' for a in ALLOWED)} (the rest comes from the recording)"
            )
    missing = [k for k in secrets if not any(_key(ov) == k for ov in given)]
    if missing:
        raise UserError(
            f"sat replay: the recording keeps no secrets; give {', '.join(missing)} again "
            f"(sat replay RUN {' '.join(k + '=…' for k in missing)})"
        )
    kept = [ov for ov in recorded if not any(_key(ov) == d for d in (*DROPPED, *secrets))]
    named = [] if any(_key(ov) == "run.name" for ov in given) else [f"run.name={name}"]
    return [*kept, *given, "replay.record=false", *named, *tags]


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [prefix]


def check_match(recorded: dict, composed: dict, steps: int, recorded_steps: int) -> None:
    """Refuse a replay whose data-making settings differ from the recording's (both masked as
    a recording stores its config: secrets are given again, not compared)."""
    from sat_cli.tracking.params import redact_config

    recorded, masked = redact_config(recorded), redact_config(composed)
    diff = [d for k in DATA_KEYS for d in _differences(recorded.get(k), masked.get(k), k)]
    rt, ct = recorded.get("trainer", {}), composed.get("trainer", {})
    diff += [f"trainer.{k}" for k in ("name", "lr", "dtype") if rt.get(k) != ct.get(k)]
    if diff:
        raise UserError(
            f"sat replay: this config cannot match the recording: {', '.join(diff[:6])}"
            f"{' …' if len(diff) > 6 else ''} differ from the recorded run's (a recording "
            "replays only on the model, task, lag, engine and seed it was made with)"
        )
    if steps > recorded_steps:
        raise UserError(
            f"sat replay: max_steps={steps} is above the recording's {recorded_steps} steps"
        )
    _check_sampler_records(recorded.get("algo", {}), composed.get("algo", {}), composed["task"])


def _check_sampler_records(recorded: dict, composed: dict, task: dict) -> None:
    """Refuse a replay that needs kept sets or a sampler top-k the recording does not hold
    (they are recorded only when the recorded run asked for them)."""
    filtering = task.get("top_p", 1.0) < 1 or task.get("top_k", -1) >= 1
    if (
        filtering
        and composed.get("replay_sampling_mask")
        and not recorded.get("replay_sampling_mask")
    ):
        raise UserError(
            "sat replay: algo.replay_sampling_mask=true needs each token's kept set, which the "
            "recording lacks (recorded with algo.replay_sampling_mask=false)"
        )
    want, have = composed.get("score_centering_topk", 0), recorded.get("score_centering_topk", 0)
    if want > have:
        raise UserError(
            f"sat replay: algo.score_centering_topk={want} needs the sampler's top-{want}; the "
            f"recording holds its top-{have} (algo.score_centering_topk={have} when recorded)"
        )


def prepare(run: str, given: list[str]):
    """``(cfg, obj, recording)`` for ``sat replay RUN given…``; reads only."""

    from omegaconf import OmegaConf

    from sat_cli.config import ConfigError, load
    from sat_cli.replay.store import RecordingError, open_recording

    run_dir = Path(run)
    if not run_dir.is_dir():
        raise UserError(f"sat replay: {run} is not a run folder")
    mpath = run_dir / "replay" / "manifest.json"
    if not mpath.is_file():
        raise RecordingError(
            f"{run_dir} has no recording ({mpath} is missing): record a run with "
            "`sat train … replay.record=true`"
        )
    manifest = read_checked(mpath, MANIFEST_HEADER, what=str(mpath), error=RecordingError)
    header = manifest["header"]
    recorded, overrides = header["config"], list(header["overrides"])
    # the default name, filled in once algo and clip are known
    name = f"{run_dir.name}-replay-{{algo}}-{{clip}}-{time.strftime('%Y%m%d-%H%M%S')}"
    from sat_cli.config.quoting import hydra_quote

    tags = [
        f"++tracking.tags.{REPLAY_OF}={hydra_quote(run_dir.name)}",
        f"++tracking.tags.{REPLAY_OF_ID}={hydra_quote(header.get('mlflow_run_id') or '')}",
    ]
    try:
        cfg, obj = load(replay_overrides(overrides, given, "replay-tmp", tags), "train")
        if not any(_key(ov) == "run.name" for ov in given):
            name = name.format(algo=obj.algo.name, clip=obj.clip.name)
            cfg, obj = load(replay_overrides(overrides, given, name, tags), "train")
    except ConfigError as exc:
        raise UserError(f"sat replay: {exc}") from None
    composed = OmegaConf.to_container(cfg, resolve=True)
    check_match(recorded, composed, obj.max_steps, manifest.get("steps", 0))
    recording = open_recording(run_dir, obj.max_steps)  # every file the replay reads, checked
    return cfg, obj, recording


def replay(run: str, given: list[str]) -> dict:
    """`sat replay`: check, then run the training command's path with the recorded stream."""
    from sat_cli.commands.train import train

    cfg, obj, recording = prepare(run, given)
    if obj.run.portable_numerics:  # the recording's numerics pins, set as `sat train` sets them
        from sat_cli.numerics import PortableError, pin

        try:
            pin(obj.trainer.num_threads)
        except PortableError as exc:
            raise UserError(str(exc)) from None
    print(f"replaying {recording.steps} recorded steps of {run} (max_steps={obj.max_steps})")
    return train(cfg, obj, given, replay=recording)
