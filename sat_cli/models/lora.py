"""LoRA on an HF causal LM, without PEFT: the trainer's adapters and the engine's adapter slots.

A target linear layer ``y = W x (+ b)`` becomes ``y = W x (+ b) + (alpha / r) B A dropout(x)``
with ``A`` ``[r, in]`` (Kaiming-uniform, as PEFT initialises it) and ``B`` ``[out, r]`` (zeros),
so a fresh adapter leaves the model unchanged. The base weights are frozen.

* :func:`apply_lora` wraps the trainer's model: every ``nn.Linear`` whose attribute name is in
  ``target_modules`` becomes a :class:`LoraLinear` (trainable ``lora_A``, ``lora_B``);
  :func:`adapter_tensors` names them as in a PEFT adapter file, without PEFT's
  ``base_model.model.`` prefix: ``<module path>.lora_A.weight`` / ``.lora_B.weight``.
* :class:`AdapterSlots` is the engine's side: the named adapters of several weight versions
  held at once on the same base layer (:func:`add_slots`), one of them active per request
  (:func:`activate`); nothing of the base is copied or reloaded when the adapter changes.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"


class LoraTargetError(ValueError):
    """No linear layer of the model has a name of ``trainer.lora.target_modules``."""


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus one trainable low-rank adapter (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.rank, self.scaling = int(rank), float(alpha) / int(rank)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.dropout(x) @ self.lora_A.t().to(x.dtype)
        return self.base(x) + (delta @ self.lora_B.t().to(x.dtype)) * self.scaling


def _targets(model: nn.Module, target_modules) -> list[tuple[nn.Module, str, str]]:
    """``(parent, attribute, module path)`` of every ``nn.Linear`` named in ``target_modules``."""
    names = set(target_modules)
    out = []
    for path, module in model.named_modules():
        for attr, child in module.named_children():
            if attr in names and isinstance(child, nn.Linear):
                out.append((module, attr, f"{path}.{attr}" if path else attr))
    return out


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules) -> int:
    """Freeze ``model`` and wrap its target layers with :class:`LoraLinear` (in module order,
    so the adapters' initial values follow torch's RNG as seeded); returns how many."""
    model.requires_grad_(False)
    found = _targets(model, target_modules)
    if not found:
        kinds = sorted(
            {a for m in model.modules() for a, c in m.named_children() if isinstance(c, nn.Linear)}
        )
        raise LoraTargetError(
            f"trainer.lora.target_modules={list(target_modules)} names no linear layer of the "
            f"model; its linear layers are named {kinds[:12]}"
        )
    for parent, attr, _ in found:
        setattr(parent, attr, LoraLinear(getattr(parent, attr), rank, alpha, dropout))
    return len(found)


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{<module path>.lora_A.weight: A, ....lora_B.weight: B}`` (detached, on the CPU)."""
    out = {}
    for path, m in lora_layers(model).items():
        out[f"{path}.{LORA_A}"] = m.lora_A.detach().cpu().contiguous()
        out[f"{path}.{LORA_B}"] = m.lora_B.detach().cpu().contiguous()
    return out


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy an adapter (:func:`adapter_tensors`' names) into the model's :class:`LoraLinear`s;
    every adapter of the model must be given, of its shape."""
    layers = lora_layers(model)
    want = {f"{p}.{k}" for p in layers for k in (LORA_A, LORA_B)}
    if set(tensors) != want:
        raise ValueError(
            f"the adapter holds {len(tensors)} tensors, the model's LoRA layers {len(want)} "
            f"(e.g. missing {sorted(want - set(tensors))[:2]}, extra {sorted(set(tensors) - want)[:2]})"
        )
    with torch.no_grad():
        for path, m in layers.items():
            for key, p in ((LORA_A, m.lora_A), (LORA_B, m.lora_B)):
                t = tensors[f"{path}.{key}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{path}.{key} has shape {list(t.shape)}, the model {list(p.shape)}"
                    )
                p.copy_(t)


def merged_weight(layer: LoraLinear) -> torch.Tensor:
    """``W + (alpha / r) B A`` of one layer (float64: the reference the tests compare with)."""
    w = layer.base.weight.detach().double()
    return w + layer.scaling * (layer.lora_B.detach().double() @ layer.lora_A.detach().double())


@contextlib.contextmanager
def merged_linears(model: nn.Module):
    """Within the block every :class:`LoraLinear` of ``model`` is a plain ``nn.Linear`` of
    weight ``W + (alpha / r) B A`` (summed in float64, cast to ``W``'s dtype; the bias kept),
    so ``model.state_dict()`` and ``save_pretrained`` give an HF checkpoint of the merged
    model (``trainer.lora.sync=merged``); the adapters are back afterwards, nothing changed."""
    swapped = []
    for path, layer in lora_layers(model).items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = layer.base
        plain = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(merged_weight(layer).to(base.weight.dtype), requires_grad=False)
        plain.bias = base.bias
        setattr(parent, attr, plain)
        swapped.append((parent, attr, layer))
    try:
        yield model
    finally:
        for parent, attr, layer in swapped:
            setattr(parent, attr, layer)


# --- the engine's side: several versions' adapters on one base ----------------------------------
class AdapterSlots(nn.Module):
    """A frozen ``nn.Linear`` plus the adapters of several weight versions; ``active`` (a
    version, or None: the base alone) is the one the forward applies."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.active: int | None = None
        # per-row adapters of one batch: [(version or None, row indices)], None: ``active``
        self.rows: list[tuple[int | None, torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.rows is not None:  # x: [rows, ...]; each row group its own version's adapter
            out = y.clone()
            for version, idx in self.rows:
                if version is not None:
                    a, b, scaling = self.held[version]
                    out[idx] += ((x[idx] @ a.t()) @ b.t()) * scaling
            return out
        if self.active is None:
            return y
        a, b, scaling = self.held[self.active]
        return y + ((x @ a.t()) @ b.t()) * scaling


def add_slots(model: nn.Module, paths) -> dict[str, AdapterSlots]:
    """Wrap the layers at ``paths`` (module paths) in :class:`AdapterSlots` (those wrapped
    already stay); returns every slot of the model by path. ``KeyError``: a path that is not a
    linear layer of the model."""
    for path in paths:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        child = getattr(parent, attr, None)
        if isinstance(child, AdapterSlots):
            continue
        if not isinstance(child, nn.Linear):
            raise KeyError(f"{path} is not a linear layer of the engine's model")
        setattr(parent, attr, AdapterSlots(child))
    return {p: m for p, m in model.named_modules() if isinstance(m, AdapterSlots)}


def activate(slots: dict[str, AdapterSlots], version: int | None) -> None:
    for s in slots.values():
        s.active = version if version is not None and version in s.held else None
        s.rows = None


def activate_rows(slots: dict[str, AdapterSlots], versions: list[int | None]) -> None:
    """Row ``i`` of the next forwards takes ``versions[i]``'s adapter (None: the base alone)."""
    groups: dict = {}
    for i, v in enumerate(versions):
        groups.setdefault(v, []).append(i)
    on: dict = {}  # the row indices on each layer's device
    for s in slots.values():
        dev = s.base.weight.device
        if dev not in on:
            on[dev] = [
                (v, torch.tensor(ix, dtype=torch.long, device=dev)) for v, ix in groups.items()
            ]
        s.rows = [(v if v in s.held else None, ix) for v, ix in on[dev]]
