"""The recorded rollout stream of a run: ``<run>/replay/`` (format ``sat-replay``, version 1).

``manifest.json``: ``format``, ``version``, ``steps`` (batches ``0..steps-1`` recorded),
``prompts_per_step``, ``group_size``, ``header`` (what a replay must match: the run's resolved
config and overrides, written by the command) and ``files``: ``{name: {"sha256", "bytes"}}``.
One ``step_NNNNNN.safetensors`` per batch (numpy arrays, no pickle), the samples in the order
the engine returned them (prompt-major, then the group), ``S`` samples:

* ``prompt_ids``/``response_ids`` (int64, concatenated) with ``prompt_off``/``response_off``
  (int64 ``[S+1]``); ``rollout_logp`` (float64, per response token: the behaviour log-probs as
  sampled); ``token_versions`` (int64, per response token) with ``has_token_versions``
  (uint8 ``[S]``: the engine reported per-token versions); ``weight_version`` (int64 ``[S]``);
  ``finish`` (uint8 ``[S]``: stop 0, length 1, abort 2);
* ``routes`` (int32 ``[rows, layers, top_k]``, R3's routed experts, concatenated) with
  ``route_off`` and ``has_routes`` when any sample carries them;
* ``rewards`` (float64 ``[S]``; NaN for a group dropped before scoring);
* when the run asked for them (``algo.replay_sampling_mask``, ``algo.score_centering_topk``):
  ``mask_ids`` (int32, every token's kept set, concatenated) with ``mask_len`` (int32, per
  response token) and ``has_mask`` (uint8 ``[S]``); ``topk_ids`` / ``topk_logp`` (int32 /
  float32 ``[response tokens, K]``) with ``has_topk`` (uint8 ``[S]``);
* multi-turn samples (``env=<name>``): ``loss_mask`` (uint8, per response token: 1 the
  model's, 0 the environment's) and ``turn_ids`` (int64, per response token) with
  ``has_turns`` (uint8 ``[S]``);
* metadata ``step`` and ``rows`` (the prompt rows, JSON: the data order).

Without those settings no kept set or top-k is stored (the behaviour log-probs already have
temperature and filters applied), and the file is what it was before they existed. Every file is written atomically (temp file, fsync,
rename) before the manifest names it; :func:`open_recording` checks the manifest, every
file's size and SHA-256 and its arrays before anything else happens
(:class:`RecordingError`, exit 2).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from sat_cli.errors import UserError

FORMAT, VERSION = "sat-replay", 1
FINISH = ("stop", "length", "abort")
_INT_KEYS = ("prompt_ids", "response_ids", "token_versions")


class RecordingError(UserError):
    """A recording that is missing, damaged or does not fit the replay (exit 2)."""


def step_name(t: int) -> str:
    return f"step_{t:06d}.safetensors"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_step(t: int, groups: list[list[Any]], rows: list[dict], rewards: list) -> bytes:
    """One batch as safetensors bytes; ``rewards``: per group a list, or None (not scored)."""
    from safetensors.numpy import save

    samples = [smp for g in groups for smp in g]
    flat_r = [
        float(r) for g, rs in zip(groups, rewards, strict=True) for r in (rs or [math.nan] * len(g))
    ]

    def offsets(lens: list[int]) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)

    def ints(seqs) -> np.ndarray:
        return np.array([x for s in seqs for x in s], dtype=np.int64)

    arrays = {
        "prompt_ids": ints(s.prompt_ids for s in samples),
        "prompt_off": offsets([len(s.prompt_ids) for s in samples]),
        "response_ids": ints(s.response_ids for s in samples),
        "response_off": offsets([s.response_len for s in samples]),
        "rollout_logp": np.array([x for s in samples for x in s.rollout_logp], dtype=np.float64),
        "token_versions": ints(
            s.token_versions or [s.weight_version] * s.response_len for s in samples
        ),
        "has_token_versions": np.array([s.token_versions is not None for s in samples], np.uint8),
        "weight_version": np.array([s.weight_version for s in samples], dtype=np.int64),
        "finish": np.array([FINISH.index(s.finish_reason) for s in samples], dtype=np.uint8),
        "rewards": np.array(flat_r, dtype=np.float64),
    }
    routed = [s.routed_experts for s in samples]
    if any(r is not None for r in routed):
        shape = next(r for r in routed if r is not None).shape[1:]
        parts = [
            np.asarray(r, np.int32) if r is not None else np.zeros((0, *shape), np.int32)
            for r in routed
        ]
        arrays["routes"] = np.concatenate(parts).astype(np.int32)
        arrays["route_off"] = offsets([len(p) for p in parts])
        arrays["has_routes"] = np.array([r is not None for r in routed], np.uint8)
    arrays.update(_sampler_arrays(samples))
    arrays.update(_turn_arrays(samples))
    meta = {
        "step": str(t),
        "rows": json.dumps(rows),
        "group_size": str(len(groups[0]) if groups else 0),
    }
    return save(arrays, metadata=meta)


def decode_step(data: bytes, where: str) -> tuple[list[list[Any]], list[dict], list]:
    """``(groups, rows, rewards per group or None)`` from :func:`encode_step`'s bytes."""
    from safetensors.numpy import load

    from sat_cli.samples import Sample

    try:
        (hlen,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + hlen]).get("__metadata__") or {}
        a = load(data)
        rows, g = json.loads(meta["rows"]), int(meta["group_size"])
        po, ro = a["prompt_off"], a["response_off"]
        n = len(a["weight_version"])
        if len(po) != n + 1 or len(ro) != n + 1 or (g and n % g) or n != len(rows) * g:
            raise ValueError(f"{n} samples do not make {len(rows)} groups of {g}")
        if ro[-1] != len(a["response_ids"]) or ro[-1] != len(a["rollout_logp"]):
            raise ValueError("the response arrays do not match their offsets")
        if "loss_mask" in a and not len(a["loss_mask"]) == len(a["turn_ids"]) == ro[-1]:
            raise ValueError("loss_mask / turn_ids do not have one entry per response token")
        if "mask_len" in a:  # offsets of each response token's kept set in mask_ids
            if len(a["mask_len"]) != len(a["response_ids"]):
                raise ValueError("mask_len does not have one entry per response token")
            a["mask_off"] = np.concatenate([[0], np.cumsum(a["mask_len"], dtype=np.int64)])
        samples = []
        for i in range(n):
            rs, re_ = int(ro[i]), int(ro[i + 1])
            routes = None
            if "routes" in a and a["has_routes"][i]:
                routes = a["routes"][int(a["route_off"][i]) : int(a["route_off"][i + 1])]
            tv = (
                [int(x) for x in a["token_versions"][rs:re_]]
                if a["has_token_versions"][i]
                else None
            )
            samples.append(
                Sample(
                    **_sampler_fields(a, i, rs, re_),
                    **_turn_fields(a, i, rs, re_),
                    prompt_ids=[int(x) for x in a["prompt_ids"][int(po[i]) : int(po[i + 1])]],
                    response_ids=[int(x) for x in a["response_ids"][rs:re_]],
                    rollout_logp=[float(x) for x in a["rollout_logp"][rs:re_]],
                    finish_reason=FINISH[int(a["finish"][i])],
                    weight_version=int(a["weight_version"][i]),
                    routed_experts=routes,
                    token_versions=tv,
                )
            )
    except (
        KeyError,
        ValueError,
        IndexError,
        TypeError,
        AttributeError,
        struct.error,
        RecursionError,
        OverflowError,
    ) as exc:
        raise RecordingError(f"{where} is damaged: {str(exc)[:200]}") from None
    except Exception as exc:  # safetensors' own SafetensorError (a forged header)
        if type(exc).__name__ != "SafetensorError":
            raise
        raise RecordingError(f"{where} is damaged: {str(exc)[:200]}") from None
    groups = [samples[i * g : (i + 1) * g] for i in range(len(rows))]
    flat = [float(x) for x in a["rewards"]]
    rewards = [
        None if all(math.isnan(r) for r in flat[i * g : (i + 1) * g]) else flat[i * g : (i + 1) * g]
        for i in range(len(rows))
    ]
    return groups, rows, rewards


def _sampler_arrays(samples) -> dict[str, np.ndarray]:
    """The kept sets and sampler top-k of :func:`encode_step` (none when no sample has them)."""
    out: dict[str, np.ndarray] = {}
    if any(s.sampling_mask is not None for s in samples):
        rows = [ids for s in samples for ids in (s.sampling_mask or [[]] * s.response_len)]
        out["mask_len"] = np.array([len(r) for r in rows], dtype=np.int32)
        out["mask_ids"] = np.concatenate([np.asarray(r, np.int32) for r in rows] or [[]])
        out["mask_ids"] = out["mask_ids"].astype(np.int32)
        out["has_mask"] = np.array([s.sampling_mask is not None for s in samples], np.uint8)
    if any(s.topk_ids is not None for s in samples):
        k = max(np.asarray(s.topk_ids).shape[1] for s in samples if s.topk_ids is not None)
        ids = np.full((sum(s.response_len for s in samples), k), -1, dtype=np.int32)
        lp = np.zeros(ids.shape, dtype=np.float32)
        t = 0
        for s in samples:
            if s.topk_ids is not None:
                w = np.asarray(s.topk_ids).shape[1]
                ids[t : t + s.response_len, :w] = s.topk_ids
                lp[t : t + s.response_len, :w] = s.topk_logp
            t += s.response_len
        out["topk_ids"], out["topk_logp"] = ids, lp
        out["has_topk"] = np.array([s.topk_ids is not None for s in samples], np.uint8)
    return out


def _sampler_fields(a: dict, i: int, rs: int, re_: int) -> dict:
    """Sample ``i``'s kept sets and top-k (response tokens ``rs:re_``) from the step's arrays."""
    out: dict = {}
    if "mask_len" in a and a["has_mask"][i]:
        off = a["mask_off"]
        out["sampling_mask"] = [a["mask_ids"][off[t] : off[t + 1]] for t in range(rs, re_)]
    if "topk_ids" in a and a["has_topk"][i]:
        out["topk_ids"], out["topk_logp"] = a["topk_ids"][rs:re_], a["topk_logp"][rs:re_]
    return out


def _turn_arrays(samples) -> dict[str, np.ndarray]:
    """Multi-turn samples' ``loss_mask`` (uint8) and ``turn_ids`` (int64) per response token,
    with ``has_turns`` (uint8 ``[S]``); none when no sample is multi-turn."""
    if all(s.loss_mask is None for s in samples):
        return {}
    return {
        "loss_mask": np.array(
            [m for s in samples for m in (s.loss_mask or [1] * s.response_len)], np.uint8
        ),
        "turn_ids": np.array(
            [k for s in samples for k in (s.turn_ids or [0] * s.response_len)], np.int64
        ),
        "has_turns": np.array([s.loss_mask is not None for s in samples], np.uint8),
    }


def _turn_fields(a: dict, i: int, rs: int, re_: int) -> dict:
    """Sample ``i``'s ``loss_mask`` and ``turn_ids`` (response tokens ``rs:re_``), if recorded."""
    if "loss_mask" not in a or not a["has_turns"][i]:
        return {}
    return {
        "loss_mask": [int(x) for x in a["loss_mask"][rs:re_]],
        "turn_ids": [int(x) for x in a["turn_ids"][rs:re_]],
    }


class StreamWriter:
    """Writes a run's stream as it trains (``replay.record=true``): one file per step, then
    the manifest naming it (both atomic)."""

    def __init__(self, folder: Path, header: dict, prompts_per_step: int, group_size: int):
        from sat_cli.util.fsio import atomic_write_json

        self.folder, self._write_json = Path(folder), atomic_write_json
        self.manifest = {
            "format": FORMAT,
            "version": VERSION,
            "steps": 0,
            "prompts_per_step": prompts_per_step,
            "group_size": group_size,
            "header": header,
            "files": {},
        }
        old = self.folder / "manifest.json"
        if old.is_file():  # a resumed run: keep what was recorded before the interruption
            try:
                prev = json.loads(old.read_text())
                self.manifest["files"] = dict(prev.get("files", {}))
            except ValueError:
                pass
        self.bytes_written = 0

    def write(self, t: int, groups, rows, rewards) -> None:
        from sat_cli.util.fsio import atomic_write_bytes

        data = encode_step(t, groups, rows, rewards)
        name = step_name(t)
        atomic_write_bytes(self.folder / name, data)
        self.bytes_written += len(data)
        files = {k: v for k, v in self.manifest["files"].items() if k < name}
        files[name] = {"sha256": _sha256(data), "bytes": len(data)}
        self.manifest.update(files=files, steps=t + 1)
        self._write_json(self.folder / "manifest.json", self.manifest)


class Recording:
    """A verified recording: :meth:`batch` reads step ``t`` (its hash checked again)."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = folder, manifest
        self.steps = int(manifest["steps"])
        self.header = manifest.get("header") or {}
        # groups of one generation batch: a dynamic-sampling step records several in a row
        self.prompts_per_step = int(manifest.get("prompts_per_step") or 0)

    def batch(self, t: int) -> tuple[list[list[Any]], list[dict], list]:
        from sat_cli.util.fsio import read_regular_bytes

        name = step_name(t)
        path = self.folder / name
        data = read_regular_bytes(path)
        if _sha256(data) != self.manifest["files"][name]["sha256"]:
            raise RecordingError(f"{path} changed since it was checked (SHA-256 differs)")
        return decode_step(data, str(path))


def open_recording(run_dir: Path, steps_needed: int) -> Recording:
    """Check ``<run_dir>/replay`` completely (manifest, sizes, SHA-256, arrays of every step
    the replay needs) and return it; :class:`RecordingError` naming the file otherwise."""
    from sat_cli.util.fsio import read_regular_bytes
    from sat_cli.util.readers import read_json

    folder = Path(run_dir) / "replay"
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise RecordingError(
            f"{run_dir} has no recording ({mpath} is missing): record a run with "
            "`sat train … replay.record=true`"
        )
    manifest = read_json(mpath, what=str(mpath), error=RecordingError)
    try:
        ok = manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
        steps = int(manifest["steps"])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise RecordingError(f"{mpath} is not a sat-replay manifest ({exc})") from None
    if not ok:
        raise RecordingError(f"{mpath} is not a sat-replay manifest (format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise RecordingError(
            f"{mpath}: recording format version {manifest.get('version')!r}; this sat reads "
            f"version {VERSION}"
        )
    if steps < steps_needed:
        raise RecordingError(
            f"{folder} holds {steps} recorded steps; the replay needs {steps_needed} "
            f"(replay fewer with max_steps={steps})"
        )
    for t in range(steps_needed):
        name = step_name(t)
        path, entry = folder / name, manifest["files"].get(name)
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise RecordingError(f"{mpath} does not list {name}: the recording is incomplete")
        try:
            data = read_regular_bytes(path)
        except FileNotFoundError:
            raise RecordingError(f"{path} is missing: the recording is incomplete") from None
        if len(data) != entry.get("bytes"):
            raise RecordingError(
                f"{path} has {len(data)} bytes, the manifest says {entry.get('bytes')}: "
                "truncated or damaged"
            )
        if _sha256(data) != entry["sha256"]:
            raise RecordingError(f"{path}: SHA-256 differs from the manifest's: damaged")
        decode_step(data, str(path))
    return Recording(folder, manifest)
