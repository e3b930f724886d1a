"""Complete check of an HF weights folder before anything uses it.

``check_hf_dir(path, what)`` refuses (``WeightsError``, a ``UserError``: exit code 2) a folder
that is not a loadable safetensors HF checkpoint, without loading any weights:

* the folder exists and has a readable ``config.json`` (a JSON object);
* it holds ``*.safetensors`` weights (pickle-only folders — ``pytorch_model.bin``, ``*.pt`` — are
  refused, never unpickled), every file named by ``model.safetensors.index.json`` exists, and
  every header parses; no tensor name appears in two files;
* **the tensors are exactly the model's**: every tensor the architecture in ``config.json``
  expects is present, nothing unexpected is there, each has the expected shape, and its dtype
  is of the expected kind (floating point for floating parameters, the exact dtype otherwise).
  A floating tensor may be stored in any float width (F16/BF16/F32/F64): loading casts it to the
  run's dtype. Without this check transformers silently initialises missing weights at random,
  drops unexpected ones and casts integer tensors to float.

The expected tensors come from the model built on the ``meta`` device (nothing allocated) and
turned into the on-disk layout the way ``save_pretrained`` does it (``revert_weight_conversion``:
transformers 5 fuses the experts of an MoE layer in memory but stores them one by one). A folder
in the in-memory layout is accepted as well. Tied weights (``lm_head`` = ``embed_tokens`` when
``tie_word_embeddings``) need one of their names; the model class's
``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns are honoured. Models with a
``quantization_config`` have other tensors on disk (scales, packed weights): for them only the
header parse is checked and completeness is left to the loader.

The expected layout is cached per ``config.json`` text, so checking every checkpoint that the
engine or trainer loads mid-run (``sat_cli.models.tiny_moe.load_model``) costs only the header
reads after the first one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.models.hf_config import read_config_json
from sat_cli.util.fsio import NotRegularFile, check_regular

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
_SHOW = 4  # names listed per kind of problem


class WeightsError(UserError):
    """A weights folder that is not the model its config describes (exit code 2)."""


@dataclass(frozen=True)
class _Layout:
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, torch dtype name)
    groups: tuple[tuple[str, ...], ...]  # names of which at least one must be present
    ignore_missing: tuple[str, ...]
    ignore_unexpected: tuple[str, ...]


def _names(items: list[str]) -> str:
    shown = ", ".join(repr(k) for k in items[:_SHOW])
    return shown + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def _is_float(torch_dtype: str) -> bool:
    return torch_dtype in ("float16", "bfloat16", "float32", "float64") or "float8" in torch_dtype


_CACHE: dict[str, tuple[_Layout, ...]] = {}
_PARAMS: dict[str, tuple[tuple[int, ...], ...]] = {}  # parameter shapes in optimizer order
_SAFETENSORS_INT = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}


def _layouts(config_text: str, config_dir: str) -> tuple[_Layout, ...]:
    """(on-disk layout[, in-memory layout]) of the model a ``config.json`` describes."""
    if config_text in _CACHE:
        return _CACHE[config_text]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(config_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an unknown model_type, inconsistent sizes
        why = " ".join(str(exc).split())[:300]  # transformers' messages span lines
        raise WeightsError(
            f"{config_dir}: config.json does not describe a causal LM ({why})"
        ) from None
    _PARAMS[config_text] = tuple(tuple(p.shape) for p in model.parameters())
    live = model.state_dict(keep_vars=True)
    owner_of: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in live.items():
        owner = owner_of.setdefault(id(t), name)
        aliases.setdefault(owner, []).append(name)

    def spec(t) -> tuple[tuple[int, ...], str]:
        return tuple(t.shape), str(t.dtype).removeprefix("torch.")

    ign_missing = tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    ign_unexpected = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    memory = _Layout(
        {k: spec(v) for k, v in live.items()},
        tuple(tuple(v) for v in aliases.values()),
        ign_missing,
        ign_unexpected,
    )
    layouts = [memory]
    try:
        from transformers.core_model_loading import revert_weight_conversion

        disk = revert_weight_conversion(model, {k: live[k].detach() for k in aliases})
    except ImportError:  # transformers 4: the in-memory names are the on-disk names
        disk = None
    if disk is not None and set(disk) != set(aliases):
        tensors = {k: spec(v) for k, v in disk.items()}
        groups = []
        for k in disk:  # a tied weight may be stored under any of its names
            names = aliases.get(k, [k])
            groups.append(tuple(names))
            tensors.update({n: memory.tensors[n] for n in names[1:]})
        layouts.insert(0, _Layout(tensors, tuple(groups), ign_missing, ign_unexpected))
    _CACHE[config_text] = tuple(layouts)
    return _CACHE[config_text]


def _problems(
    layout: _Layout, found: dict[str, tuple[tuple[int, ...], str]]
) -> tuple[int, list[str]]:
    """(number of tensors at fault, one phrase per problem)."""

    def ignored(name: str, patterns: tuple[str, ...]) -> bool:
        return any(re.search(p, name) for p in patterns)

    missing = [
        g[0]
        for g in layout.groups
        if not any(k in found for k in g) and not ignored(g[0], layout.ignore_missing)
    ]
    unexpected = sorted(
        k for k in found if k not in layout.tensors and not ignored(k, layout.ignore_unexpected)
    )
    out = []
    bad = len(missing) + len(unexpected)
    if missing:
        out.append(f"{len(missing)} tensor(s) missing: {_names(sorted(missing))}")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    for k, (shape, dtype) in sorted(found.items()):
        want = layout.tensors.get(k)
        if want is None:
            continue
        if want[0] != shape:
            bad += 1
            out.append(
                f"tensor {k!r} has shape {list(shape)} but config.json implies {list(want[0])}"
            )
        elif _is_float(want[1]) != (dtype in _FLOAT_DTYPES) or (
            not _is_float(want[1]) and _SAFETENSORS_INT.get(dtype) != want[1]
        ):
            bad += 1
            out.append(f"tensor {k!r} is stored as {dtype} but the model needs {want[1]}")
    return bad, out


def read_headers(p: Path, what: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, safetensors dtype)}`` of every ``*.safetensors`` file in ``p``."""
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"{what}={str(p)!r}: {index.name} is unreadable: {exc}") from None
        absent = sorted(f for f in wanted if not (p / str(f)).is_file())
        if absent:
            raise WeightsError(
                f"{what}={str(p)!r}: {index.name} names weight file(s) that are missing: "
                f"{_names(absent)}"
            )
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            check_regular(f)  # a FIFO would block safe_open where Ctrl-C cannot reach
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    sl = sf.get_slice(key)
                    if key in found:
                        raise WeightsError(f"{what}={str(p)!r}: tensor {key!r} is in two files")
                    found[key] = (tuple(sl.get_shape()), sl.get_dtype())
        except WeightsError:
            raise
        except Exception as exc:  # SafetensorError, OSError: a damaged or non-safetensors file
            raise WeightsError(
                f"{what}={str(p)!r}: {f.name} is not a readable safetensors file "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
    return found


def _irregular(p: Path) -> list[str]:
    """Names of the files of ``p`` a loader may open that are not regular files (FIFOs, ...)."""
    out = []
    for f in sorted(p.iterdir()):
        try:
            if not f.is_dir():
                check_regular(f)
        except NotRegularFile:
            out.append(f.name)
        except OSError:  # a dangling link: the loader names it if it needs it
            pass
    return out


def check_hf_dir(path: str | os.PathLike, what: str, *, values: bool = False) -> None:
    """Refuse a folder that is not exactly the model its ``config.json`` describes; with
    ``values``, also one with a NaN or infinite weight (:func:`check_finite_values`)."""
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"{what}={str(path)!r} is not a directory")
    odd = _irregular(p)
    if odd:
        raise WeightsError(
            f"{what}={str(path)!r}: {_names(odd)} is not a regular file (a FIFO, a device or a "
            "socket); sat reads model files only from regular files"
        )
    if not (p / "config.json").is_file():
        raise WeightsError(f"{what}={str(path)!r} has no config.json: not an HF checkpoint")
    if not any(p.glob("*.safetensors")):
        pickles = sorted(f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise WeightsError(
                f"{what}={str(path)!r} holds only pickle weights ({', '.join(pickles[:3])}); "
                "sat loads weights from .safetensors only (pickle files can run code when "
                "loaded). Convert them with safetensors first."
            )
        raise WeightsError(f"{what}={str(path)!r} has no .safetensors weights")
    config = read_config_json(p, what)  # bounded, its sizes checked: ModelConfigError
    text = (p / "config.json").read_text()
    found = read_headers(p, what)
    if not config.get("quantization_config"):
        layouts = _layouts(text, str(p.resolve()))
        reports = [_problems(layout, found) for layout in layouts]
        if not any(n == 0 for n, _ in reports):
            best = min(reports, key=lambda r: r[0])[1]
            raise WeightsError(
                f"{what}={str(path)!r}: the weights do not belong to this config.json: "
                + "; ".join(best[:6])
                + (f"; and {len(best) - 6} more problems" if len(best) > 6 else "")
            )
    if values:
        check_finite_values(p, what)


def check_finite_values(path: str | os.PathLike, what: str) -> None:
    """Refuse weights with a NaN or infinite value (``WeightsError``): such a model samples
    garbage (an all-NaN model's log-probabilities are NaN, every token equally "likely") and
    its scores would be reported as if they meant something. Reads every floating tensor once,
    one at a time (about 1 s per GB)."""
    import torch
    from safetensors import safe_open

    bad: list[str] = []
    counts: dict[str, int] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        check_regular(f)
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if sf.get_slice(key).get_dtype() not in _FLOAT_DTYPES:
                    continue
                t = sf.get_tensor(key)
                n = int(t.numel() - torch.isfinite(t).sum())
                if n:
                    bad.append(key)
                    counts[key] = n
    if bad:
        first = bad[0]
        raise WeightsError(
            f"{what}={str(path)!r}: {len(bad)} tensor(s) hold NaN or infinite values "
            f"({_names(bad)}; {counts[first]} in {first!r}): these weights cannot be sampled "
            "from. Use an earlier checkpoint or the weights the model was trained from"
        )


def param_shapes(path: str | os.PathLike) -> tuple[tuple[int, ...], ...]:
    """Shapes of the model's parameters in ``model.parameters()`` order (the order of the
    local trainer's AdamW state), from the ``config.json`` of ``path`` (nothing loaded)."""
    p = Path(path)
    text = (p / "config.json").read_text()
    _layouts(text, str(p.resolve()))
    return _PARAMS[text]
