"""The local engine's LoRA adapters, one per weight version (``trainer.lora``).

The worker's model is the base it started on; the trainer publishes every later version as an
adapter folder (``sat_cli.weightsync.adapters``). :class:`EngineAdapters` holds the adapters
of the newest ``keep`` versions at once on the base's target layers
(``sat_cli.models.lora.AdapterSlots``) and drops older ones; a version asked for again after it
was dropped is read from disk again (an adapter load, never a full reload).

* **On arrival** every adapter is checked (``weightsync.adapters.read_adapter``: its version,
  tensor names and every checksum against what the trainer wrote), then the worker scores the
  trainer's probe sequence with it (``weightsync.adapter_probe``: the log-probs must be the
  trainer's at that version); a damaged one is refused and nothing the engine holds changes.
* **Per request**: a request names its version's adapter (``generate``'s ``adapter``), which is
  made active for that request only; the samples are stamped with the adapter's own version,
  so a version stamp is the adapter that produced it. A lag profile's mixed-version batch is
  one request that names an adapter per prompt (``adapters``): each row of the batch's
  forwards takes its own version's adapter, and each sample is stamped with it. A request naming an adapter the engine
  does not hold fails (no silent fallback to the base or another version).
* **Served checksums** (``engine.verify_weights``) are those of the tensors the engine holds
  for the active version, in the engine's dtype and the adapter file's names.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from sat_cli.models.lora import LORA_A, LORA_B, activate, activate_rows, add_slots


class AdapterMissing(RuntimeError):
    """A request named an adapter version the engine does not hold."""


class EngineAdapters:
    """The adapters a worker holds (module docstring); ``keep`` 0: every version."""

    def __init__(self, keep: int, dtype: torch.dtype, device: torch.device):
        self.keep, self.dtype, self.device = int(keep), dtype, device
        self.held: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.slots: dict = {}
        self.active: int | None = None
        self.loads = 0  # adapters read from disk (each verified)

    def load(self, model, path: str, version: int) -> bool:
        """Hold ``version``'s adapter (read and checked from ``path`` unless held already);
        True when it was read. ``AdapterDamaged``: refused, nothing changed."""
        from sat_cli.weightsync.adapters import read_adapter

        version = int(version)
        if version in self.held:
            self.held.move_to_end(version)
            return False
        config, tensors = read_adapter(path, version)
        layers = sorted({n.removesuffix("." + LORA_A) for n in tensors if n.endswith(LORA_A)})
        if {f"{p}.{k}" for p in layers for k in (LORA_A, LORA_B)} != set(tensors):
            raise ValueError(f"adapter {path}: every layer needs both {LORA_A} and {LORA_B}")
        self.slots = add_slots(model, layers)
        scaling = float(config["alpha"]) / int(config["rank"])
        own = {n: t.to(self.device, self.dtype) for n, t in tensors.items()}
        for p in layers:
            self.slots[p].held[version] = (own[f"{p}.{LORA_A}"], own[f"{p}.{LORA_B}"], scaling)
        self.held[version] = own
        if "probe" in config:
            self._probe(model, config, version)
        self.loads += 1
        self._evict(version)
        return True

    def _probe(self, model, config: dict, version: int) -> None:
        """Score the trainer's probe with ``version``'s adapter; a mismatch drops it again
        (``AdapterDamaged``), the active adapter unchanged."""
        from sat_cli.weightsync.adapter_probe import check_probe, model_logprobs

        before = self.active
        activate(self.slots, version)
        try:
            served = model_logprobs(model, config["probe"]["ids"])
            check_probe(config, served, str(self.dtype).removeprefix("torch."), "the local engine")
        except Exception:
            self._drop(version)
            raise
        finally:
            activate(self.slots, before)

    def _evict(self, new: int) -> None:
        """Drop the oldest versions beyond ``keep``, never the new one or the active one."""
        while self.keep and len(self.held) > self.keep:
            old = [v for v in self.held if v not in (new, self.active)]
            if not old:
                return
            self._drop(min(old))

    def _drop(self, version: int) -> None:
        del self.held[version]
        for s in self.slots.values():
            s.held.pop(version, None)

    def activate(self, version: int | None) -> None:
        """The adapter of ``version`` applies to the next forwards (None: the base alone)."""
        if version is not None and int(version) not in self.held:
            raise AdapterMissing(
                f"the request names adapter v{version}, which the engine does not hold "
                f"(it holds {sorted(self.held)})"
            )
        self.active = None if version is None else int(version)
        activate(self.slots, self.active)

    def activate_rows(self, versions: list[int], base_version: int) -> None:
        """Row ``i`` of the next forwards takes ``versions[i]``'s adapter (one request for a
        lag profile's mixed-version batch); ``base_version``: the version the base alone is
        (the engine's start), served where no adapter of it is held."""
        missing = sorted({int(v) for v in versions if v not in self.held and v != base_version})
        if missing:
            raise AdapterMissing(
                f"the request names adapters {missing}, which the engine does not hold "
                f"(it holds {sorted(self.held)})"
            )
        activate_rows(self.slots, [int(v) if v in self.held else None for v in versions])

    def checksums(self) -> dict[str, str]:
        """The served checksums of the active adapter (module docstring)."""
        from sat_cli.weightsync.buckets import tensor_hash

        if self.active is None:
            return {}
        return {n: tensor_hash(t) for n, t in self.held[self.active].items()}

    def versions(self) -> list[int]:
        return sorted(self.held)
