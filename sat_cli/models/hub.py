"""Hugging Face hub ids → local snapshot folders (`sat model fetch`, and ``model.path`` at start).

Every process of a run reads the model from a folder: the Megatron worker reads
``*.safetensors`` itself, SGLang and the local engine and trainer load the same folder. So a
``model.path`` that is a hub id (``org/name``) is resolved once, before anything starts, to its
snapshot in the Hugging Face cache (``$HF_HOME/hub/models--org--name/snapshots/<commit>/``, the
commit named by ``refs/<revision>``; ``model.revision`` or ``main``), and that folder is what
every process gets. Missing from the cache: downloaded there (huggingface_hub's
``snapshot_download``: progress bar, resumable), unless ``HF_HUB_OFFLINE`` is set or the
download fails (an offline node): then the run is refused in one line naming
``sat model fetch <id>``. The run records the hub id and the resolved commit (MLflow tags
``model.hub_id``, ``model.revision``: :func:`source_tags`).

`sat model fetch <id> [--revision R] [--to DIR]` downloads into the cache (where runs find it)
or, with ``--to``, into ``DIR`` itself (then ``model.path=DIR``), pinned to the commit ``R``
resolves to and recorded for the reader in ``DIR/sat_model_source.json`` (written, never read
back by `sat`). docs/cluster.md: the shared-filesystem layout.

Torch-free; huggingface_hub is imported inside the functions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.util.options import env

SOURCE_FILE = "sat_model_source.json"  # `sat model fetch --to DIR`: what DIR holds


@dataclass(frozen=True)
class Snapshot:
    hub_id: str
    revision: str  # the commit
    path: str


def is_hub_id(p: str) -> bool:
    """``org/name`` that is not a path here (absolute, ``./``-relative, ``~`` or existing)."""
    return p.count("/") == 1 and not p.startswith((".", "/", "~")) and not Path(p).exists()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (huggingface_hub's own reading of it)."""
    return str(env("HF_HUB_OFFLINE", "")).strip().lower() in ("1", "true", "yes", "on")


def fetch_command(hub_id: str, revision: str | None) -> str:
    return f"sat model fetch {hub_id}" + (f" --revision {revision}" if revision else "")


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached(hub_id: str, revision: str | None = None) -> Snapshot | None:
    """The snapshot of ``hub_id`` at ``revision`` (default ``main``) in the cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(hub_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        return None
    return Snapshot(hub_id, Path(path).name, str(path))


def fetch(hub_id: str, revision: str | None = None, to: str | None = None) -> Snapshot:
    """Download ``hub_id`` (resumable; a progress bar): into the cache, or into ``to`` pinned to
    the commit ``revision`` resolves to (recorded in ``to/sat_model_source.json``)."""
    from huggingface_hub import HfApi, snapshot_download

    if to is None:
        path = snapshot_download(hub_id, revision=revision)
        return Snapshot(hub_id, Path(path).name, str(path))
    sha = HfApi().model_info(hub_id, revision=revision).sha
    path = snapshot_download(hub_id, revision=sha, local_dir=to)
    record = {"hub_id": hub_id, "revision": sha, "requested": revision or "main"}
    tmp = Path(to) / (SOURCE_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, Path(to) / SOURCE_FILE)
    return Snapshot(hub_id, sha, str(path))


def resolve(hub_id: str, revision: str | None = None, log=print) -> Snapshot:
    """The local snapshot of ``hub_id`` (module docstring); ``UserError`` in one line naming
    `sat model fetch` when it is not in the cache and cannot be downloaded here."""
    snap = cached(hub_id, revision)
    if snap is not None:
        return snap
    at = f"@{revision}" if revision else ""
    missing = f"model.path={hub_id}{at} is not in the Hugging Face cache ({cache_dir()})"
    fix = (
        f"fetch it first with `{fetch_command(hub_id, revision)}` on a machine with the "
        "network, into the same HF_HOME (docs/cluster.md)"
    )
    if offline():
        raise UserError(f"{missing} and HF_HUB_OFFLINE is set: {fix}")
    log(f"model {hub_id}{at}: not in the cache, downloading it into {cache_dir()}")
    try:
        return fetch(hub_id, revision)
    except (OSError, ValueError) as exc:  # no network, an unknown repo or revision, a full disk
        reason = " ".join(str(exc).split())[:300]
        raise UserError(f"{missing} and could not be downloaded ({reason}): {fix}") from None


def source_tags(path: str) -> dict[str, str]:
    """``{model.hub_id, model.revision}`` of a snapshot folder of the cache
    (``…/models--org--name/snapshots/<commit>``); ``{}`` for any other folder."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name != "snapshots" or not repo.startswith("models--"):
        return {}
    return {"model.hub_id": repo[len("models--") :].replace("--", "/"), "model.revision": p.name}
