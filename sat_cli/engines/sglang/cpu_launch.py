"""Run an SGLang module on the CPU, with four workarounds applied in every process it starts.

Run by SGLang's own interpreter, never imported by ``sat`` (the SGLang environment has no
``sat_cli``; this file needs only the standard library, torch and sglang)::

    .venv-sglang/bin/python sat_cli/engines/sglang/cpu_launch.py -m sglang.launch_server \
        --model-path M --device cpu --dtype bfloat16 --attention-backend torch_native ...
    .venv-sglang/bin/python sat_cli/engines/sglang/cpu_launch.py -m sglang_router.launch_router ...

SGLang starts its scheduler and detokenizer with multiprocessing ``spawn``; a spawned child
imports the parent's main module again (this file, as ``__mp_main__``), so the patches below run
in every SGLang process. The module is run with ``runpy.run_module(alter_sys=False)`` so that
this file stays the main module. Installed packages are never edited.

The patches, for SGLang 0.5.23 with PyPI's torchvision 0.28.0 on torch 2.13.0+cpu (see
``../shared/sglang-cpu/README.md`` beside the project for how each was found):

- ``torchvision``: PyPI's torchvision is a CUDA build; on CPU torch its ``_C`` extension does not
  load, and ``torchvision/_meta_registrations.py`` then fails at import (``operator
  torchvision::nms does not exist``) in its two unguarded ``register_fake`` decorators. SGLang
  imports ``torchvision.transforms`` unconditionally. The patch skips fake-kernel registration
  for torchvision operators that do not exist, during that one import.
- ``state_capturer``: ``--enable-return-routed-experts`` allocates the routed-experts host buffer
  with ``pin_memory=True`` on every device, which asserts "Torch not compiled with CUDA enabled"
  on a CPU build. The patch pins only when the device is not the CPU.
- ``amx_pack``: AMX pre-packing (``srt/layers/amx_utils.py``) accepts 2-D weights with fewer than
  16 output rows (the 8-expert router gate) and stores them transposed, so a later
  ``/update_weights_from_disk`` kills the server with a shape assertion. The patch packs only
  when the output size is a multiple of 16 (the gate then stays a plain matrix).
- ``checksum_loaded``: on AMX CPUs SGLang re-lays linear and expert weights out for its AMX
  kernels after every load (``_amx_process_weight_after_loading``), and ``/weights_checker``
  ``checksum`` then hashes the packed bytes, which no trainer can compute, so
  ``engine.verify_weights`` could never match. The patch hashes each weight as it was loaded,
  just before it is packed (at the first load and after every update: SGLang packs again after
  ``/update_weights_from_disk`` and ``/end_weight_update``), and ``checksum`` reports that hash
  for a packed weight while it still holds exactly the bytes packed from it (the packed bytes
  are a fixed function of it); a weight changed since reports the hash of what it holds. SGLang's
  layers import the packing function by name (``quantization/unquant.py``), so the patch
  replaces it in every loaded module, not only in ``amx_utils``. Without AMX nothing is packed
  and nothing changes.

- ``lora_pin`` (only with ``--enable-lora``): SGLang's LoRA layers and backends allocate their
  batch-info and offset tensors with ``pin_memory=True`` and call ``.pin_memory()`` on CPU
  tensors unconditionally (``srt/lora/layers.py``, ``backend/torch_backend.py``,
  ``backend/chunked_backend.py``); without an accelerator torch refuses both ("pin_memory=True
  requires a CUDA or other accelerator backend"), so the server dies at start-up in
  ``LoRAManager.init_lora_modules`` and, past that, in its warm-up's ``prepare_lora_batch``. The
  patch gives those modules a ``torch`` whose factory functions drop ``pin_memory``, and makes
  ``Tensor.pin_memory`` return the tensor itself for a CPU tensor when no accelerator exists
  (where it could only raise). Pinning is a transfer optimisation; the values are unchanged.

``SAT_SGLANG_CPU_SKIP=name[,name]`` leaves patches out (tests show each one is needed).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0]; its sibling modules (client.py, server.py,
# ...) must not shadow top-level modules for SGLang, so the folder is taken off the path first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import runpy  # noqa: E402

PATCHES = ("torchvision", "state_capturer", "amx_pack", "checksum_loaded", "lora_pin")
# patches needed only when the server is started with a flag (its processes share its argv)
ONLY_WITH = {"lora_pin": "--enable-lora"}


def patch_torchvision() -> None:
    """Import torchvision with fake-kernel registration skipped for missing torchvision ops."""
    import torch.library

    original = torch.library.register_fake

    def guarded(op, func=None, /, *args, **kwargs):
        if func is not None:
            return original(op, func, *args, **kwargs)
        register = original(op, *args, **kwargs)

        def decorator(fn):
            try:
                return register(fn)
            except RuntimeError as exc:
                missing = isinstance(op, str) and op.startswith("torchvision::")
                if missing and "does not exist" in str(exc):
                    return fn
                raise

        return decorator

    torch.library.register_fake = guarded
    try:
        import torchvision.transforms  # noqa: F401
    finally:
        torch.library.register_fake = original


class _NoPinOnCpu:
    """``ALLOC_MEMORY_FUNCS`` with ``pin_memory`` forced off for the CPU device."""

    def __init__(self, funcs) -> None:
        self._funcs = funcs

    def __getitem__(self, device):
        alloc = self._funcs[device]
        if device != "cpu":
            return alloc

        def alloc_unpinned(*args, **kwargs):
            kwargs["pin_memory"] = False
            return alloc(*args, **kwargs)

        return alloc_unpinned


def patch_state_capturer() -> None:
    from sglang.srt.state_capturer import base

    if not isinstance(base.ALLOC_MEMORY_FUNCS, _NoPinOnCpu):
        base.ALLOC_MEMORY_FUNCS = _NoPinOnCpu(base.ALLOC_MEMORY_FUNCS)


# torch's factory functions SGLang's LoRA modules call with pin_memory=True
_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor"})
# the modules that do it (SGLang 0.5.23); the others are GPU-only backends
LORA_MODULES = (
    "sglang.srt.lora.layers",
    "sglang.srt.lora.backend.torch_backend",
    "sglang.srt.lora.backend.chunked_backend",
)


class _UnpinnedTorch:
    """``torch`` as SGLang's LoRA modules see it: ``pin_memory`` dropped from the factories."""

    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        if name not in _FACTORIES:
            return value

        def unpinned(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return value(*args, **kwargs)

        return unpinned


def patch_lora_pin() -> None:
    import importlib

    import torch

    if torch.accelerator.is_available():
        return  # pinned memory exists: nothing to work around
    for name in LORA_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _UnpinnedTorch):
            module.torch = _UnpinnedTorch(torch)
    pin = torch.Tensor.pin_memory
    if getattr(pin, "_sat_unpinned", False):
        return

    def pin_memory(self, *args, **kwargs):
        if self.device.type == "cpu":  # no accelerator: pinning could only raise
            return self
        return pin(self, *args, **kwargs)

    pin_memory._sat_unpinned = True
    torch.Tensor.pin_memory = pin_memory


def dim_is_supported(weight) -> bool:
    """AMX gemm needs OC % 16 == 0 and IC % 32 == 0 (SGLang also accepted OC < 16)."""
    out_features = weight.size(1) if weight.ndim == 3 else weight.size(0)
    in_features = weight.size(2) if weight.ndim == 3 else weight.size(1)
    return out_features % 16 == 0 and in_features % 32 == 0


def patch_amx_pack() -> None:
    from sglang.srt.layers import amx_utils

    amx_utils.dim_is_supported = dim_is_supported


def patch_checksum_loaded() -> None:
    from sglang.srt.layers import amx_utils
    from sglang.srt.utils import weight_checker

    pack = amx_utils._amx_process_weight_after_loading
    hash_tensor = weight_checker._hash_tensor

    def pack_recording(module, weight_names, *args, **kwargs):
        before = {name: getattr(module, name) for name in weight_names}
        hashes = {name: hash_tensor(t.data) for name, t in before.items()}
        out = pack(module, weight_names, *args, **kwargs)
        for name in weight_names:
            after = getattr(module, name)
            if after is not before[name]:  # packed: a new parameter (it shares the old __dict__)
                after.__dict__["_sat_loaded_hash"] = (hash_tensor(after.data), hashes[name])
        return out

    _rebind(pack, pack_recording)
    compute = weight_checker.WeightChecker._compute_checksum

    def checksum(self, skip_tensor_list=None, *, role):
        out = compute(self, skip_tensor_list, role=role)
        packed = {n: t.__dict__.get("_sat_loaded_hash") for n, t in self._model_state()}
        sums = {n: _as_loaded(h, packed.get(n)) for n, h in out["checksums"].items()}
        return {**out, "checksums": sums, "per_gpu_checksum": weight_checker.overall_checksum(sums)}

    weight_checker.WeightChecker._compute_checksum = checksum


def _rebind(original, replacement) -> None:
    """Replace ``original`` in every loaded module that holds it: SGLang's layers import
    ``_amx_process_weight_after_loading`` by name (``quantization/unquant.py``, imported with
    ``weight_checker``), so patching ``amx_utils`` alone would leave their copy in use; modules
    imported later take the patched one from ``amx_utils``."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        for name, value in list(names.items()) if isinstance(names, dict) else ():
            if value is original:
                setattr(module, name, replacement)


def _as_loaded(served: str, record) -> str:
    """The checksum to report for a tensor whose bytes hash to ``served``: the loaded weight's
    hash if the tensor still holds exactly the bytes packed from it (``record`` = (packed
    hash, loaded hash)), else ``served`` (a tensor changed since, in place or unpacked, reports
    what it holds, so a corrupted weight never passes for the loaded one)."""
    if record is None:
        return served
    packed_hash, loaded_hash = record
    return loaded_hash if served == packed_hash else served


def apply(skip: set[str] = frozenset()) -> list[str]:
    """Apply every patch not in ``skip`` (torchvision first: SGLang imports it); return names."""
    unknown = set(skip) - set(PATCHES)
    if unknown:
        raise SystemExit(f"SAT_SGLANG_CPU_SKIP: unknown patch {sorted(unknown)}; know {PATCHES}")
    done = []
    for name in PATCHES:
        flag = ONLY_WITH.get(name)
        if name not in skip and (flag is None or flag in sys.argv):
            globals()[f"patch_{name}"]()
            done.append(name)
    return done


def _skip_from_env() -> set[str]:
    raw = os.environ.get("SAT_SGLANG_CPU_SKIP", "")
    return {s.strip() for s in raw.split(",") if s.strip()}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: cpu_launch.py -m <module> [args...]")
    module = argv[1]
    sys.argv = [sys.argv[0], *argv[2:]]  # what the module parses (and spawned children inherit)
    runpy.run_module(module, run_name="__main__", alter_sys=False)


if __name__ in ("__main__", "__mp_main__"):
    applied = apply(_skip_from_env())
    if __name__ == "__main__":
        print(f"sat cpu_launch: patches applied: {', '.join(applied) or 'none'}", file=sys.stderr)
        main(sys.argv[1:])
