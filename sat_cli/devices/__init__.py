"""The device plan of a run: which GPUs every process gets, per node (``plan.py``), and the
environment and arguments that carry it to each process (``apply.py``). Torch-free; plain
values in (``EngineSpec``, ``TrainerSpec``), so config registries and tests call it alike."""

from sat_cli.devices.plan import (
    COLOCATE_MEM_FRACTION,
    DevicePlan,
    DevicePlanError,
    EngineSpec,
    Proc,
    TrainerSpec,
    make_plan,
)

__all__ = [
    "COLOCATE_MEM_FRACTION",
    "DevicePlan",
    "DevicePlanError",
    "EngineSpec",
    "Proc",
    "TrainerSpec",
    "make_plan",
]
