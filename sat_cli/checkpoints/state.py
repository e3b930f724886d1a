"""Run directory, atomic writes and checkpoints of the training loop.

A checkpoint ``checkpoints/step_N/`` holds the trainer state (``trainer/``: weights, optimizer,
RNG, as safetensors + JSON) and ``loop_state.json``: the next step, the data cursor, the batches
requested but not yet consumed (with the weight version each was requested with, so resume
regenerates exactly the same samples), the engine's weight version, eval best/last, counters and
the MLflow run id. It is written to a temporary folder and renamed into place, so a crash never
leaves a half checkpoint under a final name; ``latest_checkpoint`` only returns complete ones.
``manifest.json`` (sizes and SHA-256 of every file, written last) lets ``resume`` verify a
checkpoint and fall back to the previous one when it is damaged (``sat_cli.checkpoints.manifest``).
A write that fails (disk full, a file where a folder must go, an I/O error) removes its temporary
folder and raises :class:`CheckpointWriteError` (a ``RunFailed``: exit code 1) naming the last
complete checkpoint, which is left untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from sat_cli.checkpoints.loop_state import LoopState
from sat_cli.checkpoints.manifest import (  # noqa: F401 - STATE_FILE, list_checkpoints re-exported
    STATE_FILE,
    list_checkpoints,
    write_manifest,
)
from sat_cli.errors import RunFailed, as_os_error
from sat_cli.util.fsio import atomic_write_json, atomic_write_text  # noqa: F401 - re-exported


class CheckpointError(Exception):
    """A checkpoint or run directory is unusable (missing files, wrong format)."""


class CheckpointWriteError(RunFailed):
    """Writing a checkpoint failed (I/O); the previous complete checkpoint is still in place."""


def save_checkpoint(ckpt_root: Path, step: int, trainer, loop_state: dict) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically: trainer state + loop state."""
    final = ckpt_root / f"step_{step}"
    tmp = None
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=ckpt_root))
        trainer.save(tmp / "trainer")
        atomic_write_json(tmp / STATE_FILE, loop_state)
        write_manifest(tmp)  # last: a checkpoint with a manifest was written completely
        if final.exists() or final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as exc:
        if as_os_error(exc) is None:  # not an I/O failure: a bug, shown as such
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        exc = as_os_error(exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        last = None
        try:
            last = latest_checkpoint(ckpt_root)
        except OSError:
            pass
        raise CheckpointWriteError(
            f"cannot write checkpoint {final}: {type(exc).__name__}: {exc.strerror or exc}. "
            + (
                f"The last complete checkpoint is {last}; continue with resume=auto "
                "once the disk problem is fixed."
                if last is not None
                else "No complete checkpoint exists yet."
            )
        ) from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    ckpts = list_checkpoints(ckpt_root)
    return ckpts[-1][1] if ckpts else None


def prune_checkpoints(ckpt_root: Path, keep: int) -> None:
    for _, p in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    if ckpt_root.is_dir():  # leftovers of interrupted writes
        for p in ckpt_root.glob(".step_*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def read_loop_state(ckpt: Path) -> dict:
    """The checkpoint's loop state, checked against its schema (``sat_cli.records``) and against
    the folder name (``step_N`` holds step N); ``CheckpointError`` (exit 2) otherwise."""
    from sat_cli.records import LOOP_STATE, RecordError, read_json

    try:
        state = read_json(ckpt / STATE_FILE, LOOP_STATE)
    except RecordError as exc:
        raise CheckpointError(f"cannot use {ckpt / STATE_FILE}: {exc}") from None
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    if m and state["step"] != int(m.group(1)):
        raise CheckpointError(
            f"cannot use {ckpt / STATE_FILE}: it says step {state['step']}, not {m.group(1)}"
        )
    return state


def load_loop_state(ckpt: Path) -> LoopState:
    """:func:`read_loop_state` as the typed ``LoopState`` the training loop carries."""
    return LoopState.from_json(read_loop_state(ckpt))


def prune_weights(weights_root: Path, keep_versions: set[int]) -> None:
    """Delete published weight versions not in ``keep_versions`` (and stale temp folders)."""
    if not weights_root.is_dir():
        return
    for p in weights_root.iterdir():
        m = re.fullmatch(r"v(\d+)", p.name)
        if (m and int(m.group(1)) not in keep_versions) or p.name.startswith("."):
            shutil.rmtree(p, ignore_errors=True)
