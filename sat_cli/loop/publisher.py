"""Weight versions on disk: publish each version once, keep exactly the ones still needed.

The trainer holds weight version ``t`` before step ``t``. A version is published to
``<run>/weights/v<t>`` (an atomic HF checkpoint the engine loads) when a batch will be generated
from it or an evaluation needs it. After every step :meth:`WeightPublisher.prune` deletes the
versions nothing can ask for any more; kept are:

* version 0 (a restarted engine holds the initial weights);
* the versions of batches requested and not consumed, and those the engine may still load
  (the loop passes ``RolloutThread.in_use()`` with them: the newest published version, which
  late binding and in-flight hand-overs bind when they run, and any version being loaded);
* the versions the next two batches can be generated from (:func:`future_versions`);
* every version from the last checkpoint's ``min_needed`` on, so that a resume from that
  checkpoint finds the weights its pending batches were requested with;
* in bounded mode, every version since the oldest pending request (late binding: a batch starts
  from the newest version published when its generation starts);
* with a lag profile, the last ``max_lag + 1`` versions (a later batch may draw any of them).
"""

from __future__ import annotations

from sat_cli.checkpoints.state import latest_checkpoint, prune_weights
from sat_cli.errors import RunFailed, as_os_error
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.settings import LoopSettings


class WeightsWriteError(RunFailed):
    """Publishing weights failed (a full disk, an I/O error): exit 1, checkpoints untouched."""


def future_versions(lag: LagPolicy, version: int) -> set[int]:
    """Weight versions the next batches (requested at trainer ``version``) can be generated from
    (a lag profile: any of the last ``max_lag + 1``; fixed mode: the last ``n + 1``, since batch
    ``k`` needs ``k - n`` and batches up to ``version + n`` can still be requested from versions
    that exist now)."""
    if lag.profile is not None:
        return set(range(max(0, version - lag.profile.max_lag), version + 1))
    if lag.mode == "fixed":
        return set(range(max(0, version - lag.n), version + 1))
    return {lag.version_for(k, version) for k in (version, version + 1)} | {version}


def min_needed(lag: LagPolicy, version: int, pending: list) -> int:
    """The oldest version a resume from a checkpoint at ``version`` can need."""
    need = set(future_versions(lag, version)) | {int(v) for _, v in pending}
    return min(need)


class WeightPublisher:
    """Publishes the trainer's weights by version and prunes the ones no longer needed.

    ``published`` is the sorted list of versions on disk (it is part of the loop state, so a
    resumed run knows what it has); :meth:`publish` is idempotent per version.
    """

    def __init__(
        self, s: LoopSettings, trainer, published: list[int], *, on_publish=None, sync=None
    ):
        """``s``: the loop's settings (the run folder: ``weights/`` and ``checkpoints/``, the lag
        policy); ``trainer`` writes the weights; ``published``: the versions on disk."""
        self.trainer, self.lag = trainer, s.lag
        self.weights_dir, self.ckpt_root = s.run_dir / "weights", s.run_dir / "checkpoints"
        self.published = published
        self.on_publish = on_publish  # called with each new version (the rollout thread's hook)
        self.sync = sync  # a loop.weightsync.WeightSync: captures instead of writing (distributed)

    def write(self, version: int) -> None:
        """Write ``v<version>`` whatever ``published`` says (the initial version 0)."""
        try:
            if self.sync is not None:
                self.sync.write(version)
            else:
                self.trainer.publish_weights(self.weights_dir, version)
        except Exception as exc:
            os_exc = as_os_error(exc)
            if os_exc is None:
                raise
            last = latest_checkpoint(self.ckpt_root)
            raise WeightsWriteError(
                f"cannot publish weights v{version} to {self.weights_dir}: "
                f"{os_exc.strerror or os_exc} ({type(exc).__name__}). "
                + (
                    f"The last complete checkpoint is {last}; continue with resume=auto once the "
                    "disk problem is fixed."
                    if last is not None
                    else "No checkpoint was written yet."
                )
            ) from exc

    def publish(self, version: int) -> None:
        if version not in self.published:
            self.write(version)
            self.published.append(version)
            if self.on_publish is not None:
                self.on_publish(version)

    def keep(self, version: int, pending_versions: set[int], since: int) -> set[int]:
        """The versions still needed after step ``version`` (see the module docstring)."""
        keep = set(pending_versions) | future_versions(self.lag, version) | {0}
        if self.lag.mode == "bounded" and pending_versions:
            # late binding: a pending batch may start from any version since its request
            since = min(since, *pending_versions)
        return keep | {v for v in self.published if v >= since}

    def prune(self, version: int, pending_versions: set[int], since: int) -> list[int]:
        keep = self.keep(version, pending_versions, since)
        prune_weights(self.weights_dir, keep)
        if self.sync is not None:
            self.sync.keep(keep)
        self.published = sorted(v for v in self.published if v in keep)
        return self.published
