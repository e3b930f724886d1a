"""The device plan: the GPU ids every process of a run gets on its node, computed once from plain
settings (``EngineSpec``, ``TrainerSpec``: each option's ``gpu_layout()``; whether the launcher
places processes in bundles) and obeyed everywhere.

**Processes.** SGLang servers (``engine=sglang engine.device=cuda``; tp × dp GPUs each; ep
shares them), the local engine (``engine.device=cuda``: one GPU), the local trainer
(``trainer.device=cuda``: one GPU) and the Megatron ranks (``trainer=megatron``: one GPU per rank,
``trainer.nproc_per_node`` on each of ``trainer.nnodes`` nodes; gloo on the CPU where no GPU is
visible). CPU processes get no GPU.

**Ids** (``launcher=local``): node 0 takes the engine first, from GPU 0 (``engine.gpu_groups``
when given, one group per server), then the trainer on the next free ids; nodes 1.. hold the
other Megatron nodes from GPU 0. A process started here sees its GPUs through
``CUDA_VISIBLE_DEVICES`` (SGLang servers, torchrun: its ranks call ``set_device(LOCAL_RANK)``,
the i-th of those); the local engine's worker and the local trainer name theirs as
``cuda:K``. Ids index the GPUs this process sees (``apply.visible_devices`` maps them through an
inherited ``CUDA_VISIBLE_DEVICES``). With ``launcher=ray`` each process gets a bundle of its
GPU count and Ray picks the ids (the bundle's actor and its children see them as 0..n-1).

**Disjoint unless asked.** The engine and the trainer never share a GPU unless
``engine.colocate=true``: then the trainer starts at the engine's first GPU, SGLang takes
``engine.mem_fraction_static`` of each shared GPU (``COLOCATE_MEM_FRACTION`` when unset) and the
trainer the rest; the local engine's memory is not capped (HF ``generate`` allocates as it goes).
:meth:`DevicePlan.check` refuses a layout that needs more GPUs than a node has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sat_cli.errors import UserError

COLOCATE_MEM_FRACTION = 0.4  # SGLang's mem_fraction_static on a GPU shared with the trainer
ROLES = ("engine", "trainer")


class DevicePlanError(UserError):
    """A layout the nodes cannot hold, or engine and trainer on one GPU unasked (exit 2)."""


@dataclass(frozen=True)
class EngineSpec:
    name: str = "local"
    device: str = "cpu"
    dtype: str = "float32"
    servers: int = 1  # processes (SGLang servers) this run launches (0: started elsewhere)
    tp: int = 1
    dp: int = 1
    ep: int = 1
    gpu_groups: tuple[str, ...] = ()
    mem_fraction: float | None = None  # engine.mem_fraction_static
    colocate: bool = False
    label: str = "engine {i}"  # a process's name; {i}: its index
    detail: str = ""
    placed: bool = False  # a launcher that places processes (launcher=ray) places these
    own_visible: bool = False  # its processes see their GPUs through CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class TrainerSpec:
    name: str = "local"
    device: str = "cpu"  # megatron: cuda (a GPU per rank) unless its Ray bundles ask for none
    dtype: str = "float32"
    nnodes: int = 1
    nproc_per_node: int = 1
    # torchrun ranks, a GPU each, nproc_per_node on each of nnodes nodes (placed in bundles by
    # launcher=ray; node 0 sees its GPUs through CUDA_VISIBLE_DEVICES, the others join with `sat
    # worker --join`); False: one process, the orchestrator itself
    torchrun: bool = False
    label: str = "trainer"  # a process's name; {node}: its node


@dataclass(frozen=True)
class Proc:
    """One process of the run and its GPUs (ids on its node; bundle-relative under Ray)."""

    name: str  # "sglang server 0", "megatron node 0", "local engine", "local trainer"
    role: str  # engine | trainer
    node: int | None  # None: wherever Ray places its bundle
    gpus: tuple[int, ...]
    dtype: str
    detail: str = ""
    mem_fraction: float | None = None  # share of each of its GPUs; None: not capped
    own_visible: bool = False  # sees its GPUs through CUDA_VISIBLE_DEVICES (SGLang, torchrun)

    @property
    def device(self) -> str:
        """The torch device the process computes on: ``cpu``, ``cuda:K`` (local engine and
        trainer) or ``cuda`` (its ranks' ``cuda:0..n-1`` of its own CUDA_VISIBLE_DEVICES)."""
        if not self.gpus:
            return "cpu"
        one = len(self.gpus) == 1 and not self.own_visible and self.node is not None
        return f"cuda:{self.gpus[0]}" if one else "cuda"


def _ids(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


@dataclass(frozen=True)
class DevicePlan:
    procs: tuple[Proc, ...]
    placed: bool = False  # a launcher places the processes in bundles (launcher=ray)
    colocate: bool = False

    def find(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def of(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def needed(self) -> dict[int, int]:
        """GPUs each node must have (launcher=local): the highest id used + 1."""
        out: dict[int, int] = {}
        for p in self.procs:
            if p.node is not None and p.gpus:
                out[p.node] = max(out.get(p.node, 0), max(p.gpus) + 1)
        return out

    def bundle_gpus(self, role: str) -> int:
        """GPUs per Ray bundle of ``role`` (0 when its processes run on the CPU)."""
        return max((len(p.gpus) for p in self.of(role)), default=0)

    def total(self) -> tuple[int, int]:
        """(rollout GPUs, training GPUs), a shared GPU counted on both sides."""
        return tuple(sum(len(p.gpus) for p in self.of(r)) for r in ROLES)

    def check(self, gpus_per_node: int, where: str) -> None:
        """Refuse (``DevicePlanError``) a layout that needs more GPUs than a node has."""
        if self.placed:
            for p in self.procs:
                if len(p.gpus) > gpus_per_node:
                    raise DevicePlanError(
                        f"the {p.name} bundle asks for {len(p.gpus)} GPUs but a node has "
                        f"{gpus_per_node} ({where}): one bundle must fit one node ({p.detail})"
                    )
            return
        for node, need in sorted(self.needed().items()):
            if need <= gpus_per_node:
                continue
            users = "; ".join(
                f"{p.name} {_ids(p.gpus)}" for p in self.procs if p.node == node and p.gpus
            )
            hint = (
                "use fewer GPUs (engine.tp, engine.dp, engine.num_servers, trainer.nproc_per_node)"
            )
            # colocated, node 0 would need the larger side only (servers are disjoint)
            sides = [sum(len(p.gpus) for p in self.of(r) if p.node == node) for r in ROLES]
            if not self.colocate and all(sides) and max(sides) <= gpus_per_node:
                hint += ", or share the engine's GPUs with the trainer: engine.colocate=true"
            raise DevicePlanError(
                f"the device plan needs {need} GPUs on node {node} ({users}) but the node has "
                f"{gpus_per_node} ({where}): {hint}"
            )

    def lines(self) -> list[str]:
        """The plan as `sat plan` prints it (one line per process)."""
        out = []
        for p in self.procs:
            where = "Ray bundle" if p.node is None else f"node {p.node}"
            if not p.gpus:
                gpus = "CPU"
            elif p.node is None:
                gpus = f"{len(p.gpus)} GPU(s)"
            else:
                gpus = f"GPU {_ids(p.gpus)}"
            env = ""
            if p.own_visible and p.gpus:
                env = (
                    "CUDA_VISIBLE_DEVICES from Ray; "
                    if p.node is None
                    else (f"CUDA_VISIBLE_DEVICES={_ids(p.gpus)}; ")
                )
            mem = ""
            if p.gpus and self.colocate:
                mem = (
                    "; memory not capped"
                    if p.mem_fraction is None
                    else f"; {p.mem_fraction:g} of each GPU's memory"
                )
            out.append(
                f"  {where:<10} {p.name:<17} {gpus:<16} {p.device}, {p.dtype}; {env}{p.detail}{mem}"
            )
        return out


def _groups(e: EngineSpec) -> list[tuple[int, ...]]:
    per = e.tp * e.dp
    groups = []
    for i, text in enumerate(e.gpu_groups):
        try:
            ids = tuple(int(x) for x in str(text).split(","))
        except ValueError:
            ids = ()
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise DevicePlanError(
                f"engine.gpu_groups[{i}]={text!r} is not a list of distinct GPU ids like '0,1'"
            )
        if len(ids) != per:
            raise DevicePlanError(
                f"engine.gpu_groups[{i}]={text!r} has {len(ids)} GPU(s) but each server uses "
                f"engine.tp × engine.dp = {per}"
            )
        groups.append(ids)
    return groups


def _next_free(used: set[int], count: int) -> tuple[int, ...]:
    out, gpu = [], 0
    while len(out) < count:
        if gpu not in used:
            out.append(gpu)
        gpu += 1
    return tuple(out)


def _engine_procs(e: EngineSpec, bundles: bool) -> list[Proc]:
    placed = bundles and e.placed
    per = e.tp * e.dp if e.device == "cuda" else 0
    groups = _groups(e) if e.gpu_groups and not placed else []
    procs, used = [], set()
    for i in range(e.servers):
        if groups:
            gpus = groups[i]
            clash = used & set(gpus)
            if clash:
                raise DevicePlanError(
                    f"engine.gpu_groups: GPU {_ids(tuple(sorted(clash)))} is in two groups; "
                    "each SGLang server needs its own GPUs"
                )
        else:
            gpus = _next_free(used, per)
        used |= set(gpus)
        procs.append(
            Proc(
                e.label.format(i=i),
                "engine",
                None if placed else 0,
                gpus,
                e.dtype,
                e.detail,
                e.mem_fraction,
                own_visible=e.own_visible,
            )
        )
    return procs


def _trainer_procs(
    t: TrainerSpec, engine_ids: set[int], colocate: bool, bundles: bool
) -> list[Proc]:
    placed = bundles and t.torchrun
    count = t.nproc_per_node if t.device == "cuda" else 0
    procs = []
    for node in range(t.nnodes):
        if placed:
            gpus = tuple(range(count))
        elif node == 0:
            gpus = tuple(range(count)) if colocate else _next_free(engine_ids, count)
        else:
            gpus = tuple(range(count))
        detail = "in the orchestrator process"
        if t.torchrun:
            first = node * t.nproc_per_node
            detail = f"ranks {first}-{first + t.nproc_per_node - 1} under torchrun"
            detail += ", set_device(LOCAL_RANK)" if count else ", gloo"
            if node and not placed:  # `sat worker --join` on that node: its GPUs from 0, no env
                detail += " (sat worker --join)"
        procs.append(
            Proc(
                t.label.format(node=node),
                "trainer",
                None if placed else node,
                gpus,
                t.dtype,
                detail,
                own_visible=t.torchrun and (placed or node == 0),
            )
        )
    return procs


def make_plan(engine: EngineSpec, trainer: TrainerSpec, placed: bool = False) -> DevicePlan:
    """The plan of a run (module docstring; ``placed``: the launcher places processes in
    bundles, launcher=ray); ``DevicePlanError`` for engine and trainer on one GPU without
    ``colocate`` or ``colocate`` where nothing can be shared."""
    engine_procs = _engine_procs(engine, placed)
    engine_ids = {g for p in engine_procs if p.node == 0 for g in p.gpus}
    if engine.colocate:
        on_cpu = [
            who
            for who, spec in (("engine", engine), ("trainer", trainer))
            if spec.device != "cuda" or (who == "engine" and not engine_ids and not placed)
        ]
        if placed or on_cpu:
            why = (
                "with launcher=ray each process gets the GPUs of its own bundle"
                if placed
                else f"the {' and the '.join(on_cpu)} get(s) no GPU in this run (on the CPU or elsewhere)"
            )
            raise DevicePlanError(
                f"engine.colocate=true shares GPUs between the engine and the trainer, but {why}; "
                "drop engine.colocate"
            )
        frac = engine.mem_fraction if engine.mem_fraction is not None else COLOCATE_MEM_FRACTION
        engine_procs = [
            replace(p, mem_fraction=frac if p.own_visible else None) for p in engine_procs
        ]
    trainer_procs = _trainer_procs(trainer, engine_ids, engine.colocate, placed)
    if engine.colocate:
        rest = round(1 - max(p.mem_fraction or 0 for p in engine_procs), 4)
        trainer_procs = [replace(p, mem_fraction=rest if rest < 1 else None) for p in trainer_procs]
    return DevicePlan(tuple(engine_procs + trainer_procs), placed, engine.colocate)
