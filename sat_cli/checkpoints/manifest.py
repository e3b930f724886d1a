"""Checkpoint manifests: what a complete checkpoint holds, written last, verified on resume.

``write_manifest(folder)`` records every file of a checkpoint folder (relative path, size,
SHA-256) in ``manifest.json``; :func:`sat_cli.checkpoints.state.save_checkpoint` writes it after the
trainer state and the loop state, inside the temporary folder, just before the rename, so a
checkpoint with a manifest is one that was completely written.

``select_checkpoint(ckpt_root)`` is what ``resume`` uses: the newest checkpoint that passes
:func:`verify_checkpoint` — every file of the manifest present with its size and hash, the
manifest, the loop state and the trainer state of the shape of their schemas
(``sat_cli.records``: a ``step`` that is ``null`` or a list instead of an object is named), the
loop state's ``step`` the folder's, the trainer's state, optimizer and model present (the layout
both trainers write), the model complete and finite
(:func:`sat_cli.models.weights_check.check_hf_dir`), and the optimizer's tensors what the
trainer's ``load`` needs (:func:`trainer_problem`: for the local trainer one AdamW moment per
parameter, of its shape; with LoRA ``trainer/adapter/`` in place of the model, one moment per
adapter tensor named in ``lora_params``). No file is opened that is not a regular file (a FIFO would block). A damaged newer checkpoint is reported (one
line each) and skipped; when none is usable, ``UserError`` (exit 2) lists each one's problem.
Checkpoints written before manifests existed (no ``manifest.json``) are accepted when the other
checks pass. Hashing reads every byte once (about 1 s per GB).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.util.fsio import write_text_fsync

STATE_FILE = "loop_state.json"  # a checkpoint's loop state (sat_cli.checkpoints.state)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    out = []
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / STATE_FILE).is_file() and (p / "trainer").is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


MANIFEST = "manifest.json"
FORMAT = 1
# trainer.lora: trainer/adapter/ holds the adapter in place of trainer/model/ (the files of
# sat_cli.weightsync.adapters, named here: checkpoints/ does not import weightsync/)
ADAPTER = "adapter"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path) -> None:
    """Write ``folder/manifest.json`` (sizes and hashes of every other file), fsynced."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(folder).as_posix()] = {
                "size": p.stat().st_size,
                "sha256": _sha256(p),
            }
    data = json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True)
    write_text_fsync(folder / MANIFEST, data)


def verify_checkpoint(ckpt: Path) -> str | None:
    """None if ``ckpt`` is a complete, undamaged checkpoint, else a one-line reason. Every
    state file is checked against its schema (``sat_cli.records``) and the optimizer's tensors
    against the model's parameters, so a damaged checkpoint is found here, before a run uses it
    (and before its folder is written)."""
    from sat_cli.records import LOOP_STATE, RecordError, read_json
    from sat_cli.records import MANIFEST as MANIFEST_SCHEMA

    man = ckpt / MANIFEST
    if man.exists() or man.is_symlink():
        try:
            files = read_json(man, MANIFEST_SCHEMA)["files"]
        except RecordError as exc:
            return str(exc)
        for rel, rec in files.items():
            p = ckpt / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute() or not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != rec["size"]:
                return f"{rel} has {p.stat().st_size} bytes, the manifest says {rec['size']}"
            if _sha256(p) != rec["sha256"]:
                return f"{rel} does not match its SHA-256 in {MANIFEST}"
    try:
        state = read_json(ckpt / STATE_FILE, LOOP_STATE)
    except RecordError as exc:
        return str(exc)
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    if m and state["step"] != int(m.group(1)):
        return f"{STATE_FILE} does not describe {ckpt.name} (step {state['step']})"
    trainer = ckpt / "trainer"
    adapter = (trainer / ADAPTER).is_dir()  # trainer.lora: the adapter in place of the model
    for need, found in (
        ("trainer/trainer_state.json", (trainer / "trainer_state.json").is_file()),
        ("trainer/optimizer*.safetensors", any(trainer.glob("optimizer*.safetensors"))),
        ("trainer/model/", adapter or (trainer / "model").is_dir()),
        *((f"trainer/{ADAPTER}/{f}", (trainer / ADAPTER / f).is_file()) for f in ADAPTER_FILES),
    ):
        if not found and (adapter or ADAPTER not in need):
            return f"{need} is missing"
    if adapter:
        return trainer_problem(trainer)
    from sat_cli.models.weights_check import check_hf_dir

    try:
        check_hf_dir(trainer / "model", "trainer/model", values=True)
    except UserError as exc:
        return str(exc).split(": ", 1)[-1][:300]
    return trainer_problem(trainer)


def trainer_problem(trainer: Path) -> str | None:
    """None if ``trainer/trainer_state.json`` has its schema and the optimizer files hold what
    the trainer's ``load`` needs (the local trainer: one AdamW state per parameter, of the
    parameter's shape), else a one-line reason."""
    from sat_cli.records import TRAINER_STATE, RecordError, read_json
    from sat_cli.util.fsio import NotRegularFile

    try:
        meta = read_json(trainer / "trainer_state.json", TRAINER_STATE)
    except RecordError as exc:
        return f"trainer/{exc}"
    headers: dict[str, tuple[int, ...]] = {}
    for f in sorted(trainer.glob("optimizer*.safetensors")):
        try:
            part = _shapes(f)
        except NotRegularFile as exc:
            return f"trainer/{f.name} {exc.strerror}"
        except Exception as exc:  # SafetensorError, OSError: damaged, not a bug
            return f"trainer/{f.name} is not a readable safetensors file ({str(exc)[:120]})"
        if "rng/torch" not in part:
            return f"trainer/{f.name} has no random-number state (rng/torch)"
        headers.update(part)
    if meta.get("backend") == "megatron":
        return None  # parameter names of the worker's model: checked by the worker
    from sat_cli.models.weights_check import param_shapes

    try:
        if (trainer / ADAPTER).is_dir():
            shapes = _adapter_shapes(trainer, meta)
            if isinstance(shapes, str):
                return shapes
        else:
            shapes = param_shapes(trainer / "model")
    except NotRegularFile as exc:
        return f"trainer/{ADAPTER}: {exc.strerror}"
    except (OSError, ValueError, UserError):
        return None  # the model check above names a model folder that cannot be read
    except Exception as exc:  # SafetensorError: damaged, not a bug
        return f"trainer/{ADAPTER} is not a readable adapter ({str(exc)[:120]})"
    grouped = sorted(i for g in meta["param_groups"] for i in g["params"])
    if grouped != list(range(len(shapes))):
        return (
            f"trainer/trainer_state.json: the optimizer's parameter groups hold {len(grouped)} "
            f"parameters, the model has {len(shapes)}"
        )
    for name, shape in sorted(headers.items()):
        if not name.startswith("state/"):
            continue
        idx, _, key = name[len("state/") :].rpartition("/")
        if not idx.isdigit() or int(idx) >= len(shapes):
            return f"trainer/optimizer.safetensors: {name!r} names no parameter of the model"
        want = shapes[int(idx)] if key in ("exp_avg", "exp_avg_sq") else None
        if want is not None and shape != want:
            return (
                f"trainer/optimizer.safetensors: {name!r} has shape {list(shape)} but the "
                f"parameter has {list(want)}"
            )
    return None


def _adapter_shapes(trainer: Path, meta: dict) -> list[tuple[int, ...]] | str:
    """The shapes of a LoRA checkpoint's trainable parameters in the optimizer's order (its
    ``lora_params`` names in the adapter file), or a one-line reason."""
    names = meta.get("lora_params")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return "trainer/trainer_state.json: a LoRA checkpoint needs lora_params (names)"
    header = _shapes(trainer / ADAPTER / ADAPTER_FILES[0])
    missing = [n for n in names if n not in header]
    if missing or len(names) != len(header):
        return f"trainer/{ADAPTER}: its tensors are not the optimizer's parameters {missing[:2]}"
    return [header[n] for n in names]


def _shapes(f: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of one safetensors file, from its header (a regular file only)."""
    from safetensors import safe_open

    from sat_cli.util.fsio import check_regular

    check_regular(f)
    with safe_open(str(f), framework="pt") as sf:
        return {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}


def select_checkpoint(ckpt_root: Path, log=print) -> tuple[Path | None, list[Path]]:
    """(newest usable checkpoint or None when there is none at all, damaged newer ones).

    Raises ``UserError`` when checkpoints exist but none is usable."""

    damaged: list[tuple[Path, str]] = []
    for _, ckpt in reversed(list_checkpoints(ckpt_root)):
        reason = verify_checkpoint(ckpt)
        if reason is None:
            for bad, why in damaged:
                log(f"WARNING: checkpoint {bad} is damaged ({why}); using {ckpt.name} instead")
            return ckpt, [bad for bad, _ in damaged]
        damaged.append((ckpt, reason))
    if damaged:
        raise UserError(
            f"no usable checkpoint under {ckpt_root}: "
            + "; ".join(f"{p.name}: {why}" for p, why in damaged)
            + ". Nothing was changed; remove the damaged checkpoint(s) to start over, or "
            "choose another run.name"
        )
    return None, []


# config.json keys that decide which weights (names and shapes) a model has
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


def _same_model(ckpt_model: Path, model_path: str) -> str | None:
    """None if the checkpoint's model has the architecture of ``model_path``, else the keys."""
    from sat_cli.models.hf_config import config_if_usable

    a, b = config_if_usable(ckpt_model, "checkpoint"), config_if_usable(model_path)
    if a is None or b is None:
        return None  # a hub id or a trainer without an HF model folder: the loader decides
    keys = [k for k in _ARCH_KEYS if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:4]) or None


# what a trainer state written before these keys existed means by their absence
_STATE_DEFAULTS = {
    "backend": "local",
    "world_size": 1,
    "tp": 1,
    "ep": 1,
    "pp": 1,
    "dtype": "float32",
}


def _same_trainer(ckpt: Path, trainer: dict) -> str | None:
    """None if the checkpoint's trainer state was written by the trainer ``trainer`` describes
    (its settings' ``checkpoint_kind()``: ``backend``, then the keys that trainer's checkpoints
    must match, e.g. megatron's ``world_size``, ``tp``, ``ep``, ``pp``, ``dtype``); another
    backend is named alone."""
    meta = json.loads((ckpt / "trainer" / "trainer_state.json").read_text())  # checked above
    have = {k: meta.get(k, _STATE_DEFAULTS.get(k)) for k in ("backend", *trainer)}
    if trainer.get("backend", have["backend"]) != have["backend"]:
        have = {"backend": have["backend"]}
    diff = [k for k in have if trainer.get(k, have[k]) != have[k]]
    if not diff:
        return None
    return ", ".join(f"{k}: {have[k]!r} in the checkpoint, {trainer.get(k)!r} now" for k in diff)


def resume_checkpoint(
    run_dir: Path, resuming: bool, model_path: str, log=print, trainer: dict | None = None
) -> Path | None:
    """The checkpoint a run continues from, chosen under the run's lock: the newest verified one.

    Damaged newer checkpoints are renamed ``damaged_step_N`` (kept for inspection, never chosen
    again). Refusals (``UserError``) change nothing: no checkpoint at all although the run was
    to be resumed, none usable, a checkpoint of another model (e.g. another ``model.*``) or of
    another trainer or trainer layout (``trainer``: what :func:`_same_trainer` compares), or a
    run that gained checkpoints since the command started without ``resume``."""

    root = run_dir / "checkpoints"
    if not resuming:
        if list_checkpoints(root):
            raise UserError(
                f"run {run_dir} already has checkpoints; continue it with resume=auto "
                "or choose another run.name"
            )
        return None
    ckpt, damaged = select_checkpoint(root, log)
    if ckpt is None:
        raise UserError(f"no complete checkpoint under {root} to resume from")
    diff = _same_model(ckpt / "trainer" / "model", model_path)
    if diff:
        raise UserError(
            f"checkpoint {ckpt} holds another model than the one configured ({diff}); resume "
            "with the settings the run was started with (its config.yaml)"
        )
    diff = _same_trainer(ckpt, trainer) if trainer else None
    if diff:
        raise UserError(
            f"checkpoint {ckpt} was written by another trainer than the one configured ({diff}); "
            "resume with the trainer settings the run was started with (its config.yaml)"
        )
    for bad in damaged:
        target = bad.with_name(f"damaged_{bad.name}")
        if target.exists():
            target = bad.with_name(f"damaged_{bad.name}_{int(time.time())}")
        bad.rename(target)
        log(f"moved the damaged checkpoint {bad.name} to {target.name}")
    return ckpt
