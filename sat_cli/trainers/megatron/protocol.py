"""The channel between ``MegatronTrainer`` (client) and the torchrun worker (no pickle anywhere).

Transport
- **Commands**: JSON lines on the worker's stdin. ``torchrun`` passes its stdin to the workers;
  only rank 0 reads it and broadcasts each line to the other ranks (a byte tensor over a gloo
  group); every rank runs the command, rank 0 answers. EOF on stdin (the client is gone) makes the worker exit, so a dead client leaves no
  worker behind.
- **Replies**: JSON lines written by rank 0 to a named pipe (FIFO) in the run-local work
  directory (``--reply-fifo``). stdout/stderr of torchrun and the workers go to the log file, so
  stray prints of libraries never corrupt the protocol.
- **Tensors**: batches and results are safetensors files in the work directory; messages carry
  their paths.

Messages (one JSON object per line)
- worker → client, once after start: ``{"event": "ready", "ok": true, "step_count": 0,
  "pids": [pid of rank 0, …], "sender_port": port or null}`` or ``{"event": "ready", "ok":
  false, "error": …}`` (``sender_port``: rank 0's weight sender, ``sat_cli.weightsync.service``,
  when the config has ``sender``)
- client → worker: ``{"id": n, "cmd": c, ...}`` with ``c`` one of
  - ``"step"``, ``"batch": path`` [, ``"diag": path``] → ``{"metrics": {name: float},
    "step_count": n}``; with ``diag``, rank 0 also writes the loss's per-token diagnostics
    (``PolicyTrainer.step``'s ``diag`` tensors) to that path
  - ``"logprobs"``, ``"batch": path, "out": path`` → ``{"out": path}`` (tensor ``logprobs``
    ``[B, S]`` float32, aligned like ``TrainBatch.rollout_logp``; column 0 is 0, padding
    positions hold values that nothing scores, as in the local trainer)
  - ``"publish"``, ``"dir": path, "version": v`` → ``{"path": path}`` (HF checkpoint)
  - ``"capture"``, ``"version": v`` → ``{"bytes": n}`` (every rank gathers; rank 0's weight
    sender holds version ``v`` in memory: the distributed weight sync, no file)
  - ``"save"`` / ``"load"``, ``"dir": path`` → ``{"step_count": n}``
  - ``"set_clip_radii"``, ``"eps_low": x, "eps_high": y`` → ``{}`` (a clip schedule)
  - ``"skip_step"`` → ``{"step_count": n}`` (a loop step without samples)
  - ``"ping"`` → ``{}``; ``"close"`` → ``{}`` and the worker exits 0
- every reply: ``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": text,
  "traceback": text}``.

Batch files hold the non-``None`` fields of ``TrainBatch`` under their field names.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROTOCOL_VERSION = 1


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError(f"protocol message is not a JSON object: {line!r}")
    return msg


def write_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Atomic safetensors write (temp name + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    return path


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def write_batch(batch, path: str | os.PathLike) -> Path:
    """Write a ``TrainBatch`` (its non-None tensor fields) as safetensors."""
    tensors = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is not None:
            tensors[f.name] = value
    return write_tensors(tensors, path)


def read_batch(path: str | os.PathLike):
    """Read a batch file back into a ``TrainBatch``."""
    from sat_cli.trainers.batch import TrainBatch

    tensors = read_tensors(path)
    known = {f.name for f in fields(TrainBatch)}
    unknown = set(tensors) - known
    if unknown:
        raise ValueError(f"batch file {path} has unknown fields {sorted(unknown)}")
    return TrainBatch(**tensors)
