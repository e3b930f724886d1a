"""A LoRA adapter on disk, the unit of adapter-only weight sync (``trainer.lora``).

A published version ``weights/v<N>`` of a LoRA run is an adapter folder, not an HF checkpoint:

* ``adapter_model.safetensors``: ``<module path>.lora_A.weight`` ``[r, in]`` and
  ``.lora_B.weight`` ``[out, r]`` of every adapted layer (``sat_cli.models.lora``);
* ``adapter_config.json``: ``format`` (``sat-lora/1``), ``version`` (the weight version it
  is), ``rank``, ``alpha``, ``target_modules`` and ``checksums``: every tensor's checksum as
  the trainer sent it (the weight sync's hash, ``weightsync.layouts``); ``probe``: the trainer's
  log-probs of a fixed sequence at this version (``weightsync.adapter_probe``); and PEFT's keys
  ``peft_type`` (``LORA``), ``r``, ``lora_alpha``, so that SGLang's ``/load_lora_adapter``
  reads the folder as it is (its loader needs no ``base_model.model.`` prefix on the names).

The base weights reach the engine once (the model it starts on); every later version moves
only its adapter. :func:`read_adapter` checks an adapter on arrival: the config's shape, the
tensors' names against the checksums, every checksum, and the version it claims; a damaged or
mislabelled adapter is :class:`AdapterDamaged` (a ``WeightsMismatch``: the loop's weight sync
tries the disk once more, then the run fails closed).
"""

from __future__ import annotations

import json
from pathlib import Path

from sat_cli.errors import WeightsMismatch
from sat_cli.records import Int, ListOf, MapOf, Num, Obj, RecordError, Str, read_json

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FORMAT = "sat-lora/1"
CONFIG_SCHEMA = Obj(
    {
        "format": Str(choices=(FORMAT,)),
        "version": Int(0),
        "rank": Int(1),
        "alpha": Num(0),
        "target_modules": ListOf(Str()),
        "checksums": MapOf(Str()),
        "probe": Obj({"ids": ListOf(Int(0)), "logprobs": ListOf(Num())}, ("ids", "logprobs")),
    },
    required=("format", "version", "rank", "alpha", "checksums"),
)


class AdapterDamaged(WeightsMismatch):
    """An adapter whose files are not what the trainer wrote (or not the version asked for)."""


def is_adapter(path) -> bool:
    """Whether ``path`` is an adapter folder (rather than an HF checkpoint)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_checksums(tensors: dict, dtype: str | None = None) -> dict[str, str]:
    from sat_cli.weightsync.layouts import expected_checksums

    return expected_checksums(tensors.items(), "hf", dtype)


def write_adapter(
    path, tensors: dict, *, version: int, rank: int, alpha: float, targets, probe=None
) -> Path:
    """Write an adapter folder at ``path`` atomically (a staged sibling renamed into place);
    ``probe``: ``{"ids", "logprobs"}`` (``weightsync.adapter_probe``), or None."""
    from safetensors.torch import save_file

    from sat_cli.util.fsio import staged_dir

    path = Path(path)
    config = {
        "format": FORMAT,
        "version": int(version),
        "rank": int(rank),
        "alpha": float(alpha),
        "target_modules": [str(t) for t in targets],
        "checksums": adapter_checksums(tensors),
        # what PEFT (and SGLang's LoRA loader) reads
        "peft_type": "LORA",
        "r": int(rank),
        "lora_alpha": float(alpha),
    }
    if probe is not None:
        config["probe"] = {"ids": [int(i) for i in probe["ids"]], "logprobs": probe["logprobs"]}
    with staged_dir(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_FILE))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return path


def read_adapter(path, version: int | None = None) -> tuple[dict, dict]:
    """``(config, {name: tensor})`` of the adapter at ``path``, checked (module docstring);
    ``version``: the weight version it must be. :class:`AdapterDamaged` otherwise."""
    from safetensors.torch import load_file

    from sat_cli.util.fsio import check_regular

    path = Path(path)
    try:
        config = read_json(path / ADAPTER_CONFIG, CONFIG_SCHEMA)
        check_regular(path / ADAPTER_FILE)
        tensors = load_file(str(path / ADAPTER_FILE))
    except (RecordError, OSError) as exc:
        raise AdapterDamaged(f"adapter {path} is unreadable: {str(exc)[:200]}") from None
    except Exception as exc:  # SafetensorError: damaged bytes, not a bug
        raise AdapterDamaged(
            f"adapter {path}: {ADAPTER_FILE} is damaged ({str(exc)[:120]})"
        ) from None
    if version is not None and config["version"] != int(version):
        raise AdapterDamaged(
            f"adapter {path} is weight version {config['version']}, not v{int(version)}"
        )
    sent = config["checksums"]
    if set(sent) != set(tensors):
        raise AdapterDamaged(
            f"adapter {path}: its tensors {sorted(set(tensors) ^ set(sent))[:3]} are not the "
            "ones the trainer wrote"
        )
    got = adapter_checksums(tensors)
    bad = sorted(n for n in sent if got[n] != sent[n])
    if bad:
        raise AdapterDamaged(
            f"adapter v{config['version']} at {path} is damaged: {len(bad)} of {len(sent)} "
            f"tensors differ from what the trainer sent (e.g. {bad[0]}: {got[bad[0]]}, sent "
            f"{sent[bad[0]]})"
        )
    return config, tensors


def adapter_bytes(path) -> int:
    """Bytes of an adapter folder's tensor file (what one version's sync moves)."""
    return (Path(path) / ADAPTER_FILE).stat().st_size
