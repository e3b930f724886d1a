"""A test-only fake GPU layer: nodes of N GPUs, and the GPUs each process of a run would compute
on, derived from what the run really hands that process (its environment, its argument list, the
torch device it is given) by stand-ins of the ``torch.cuda`` calls the process makes.

- :class:`FakeCuda` is ``torch.cuda`` as a process with a given environment sees it: the
  physical GPUs of its ``CUDA_VISIBLE_DEVICES`` (all of the node's when unset), ``set_device`` /
  ``device`` calls recorded as physical ids.
- :func:`torchrun_gpus`: the Megatron worker's own line (``MEGATRON_SET_DEVICE``, read from
  ``sat_cli/trainers/megatron/runtime.py`` by ``test_stand_ins_match_the_sources``) run for
  ``LOCAL_RANK`` = 0 .. nproc-1 with :class:`FakeCuda` as ``torch.cuda``.
- :func:`sglang_gpus`: SGLang's scheduler placement (``data_parallel_controller.py`` and
  ``entrypoints/engine.py`` of SGLang 0.5: dp rank d, tp rank t computes on visible GPU
  ``base_gpu_id + d·tp·gpu_id_step + t·gpu_id_step``), read from the server's argument list.
- :func:`ray_assign`: Ray giving each actor of a placement group ``num_gpus`` GPUs of one node as
  its ``CUDA_VISIBLE_DEVICES`` (PACK fills a node first, SPREAD goes round the nodes).
"""

from __future__ import annotations

import os

MEGATRON_SET_DEVICE = 'torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))'


class FakeCuda:
    def __init__(self, node_gpus: int, env: dict[str, str] | None = None) -> None:
        value = (env or {}).get("CUDA_VISIBLE_DEVICES")
        if value is None:
            self.visible = list(range(node_gpus))
        else:
            self.visible = [int(x) for x in value.split(",") if x.strip()]
        for gpu in self.visible:
            assert 0 <= gpu < node_gpus, f"CUDA_VISIBLE_DEVICES={value}: no GPU {gpu} on the node"
        self.used: list[int] = []  # physical ids, in call order

    def device_count(self) -> int:
        return len(self.visible)

    def is_available(self) -> bool:
        return bool(self.visible)

    def set_device(self, index: int) -> None:
        self.used.append(self.visible[index])  # IndexError: an invalid device ordinal

    def device(self, name: str) -> int:
        """The physical GPU of a torch device string (``cuda`` is the current one, 0)."""
        index = int(name.split(":")[1]) if ":" in name else 0
        gpu = self.visible[index]
        self.used.append(gpu)
        return gpu


def torchrun_gpus(env: dict[str, str], nproc: int, node_gpus: int) -> list[int]:
    """The physical GPU of each local rank of a torchrun started with ``env``."""
    out = []
    for rank in range(nproc):
        cuda = FakeCuda(node_gpus, env)
        fake_torch = type("torch", (), {"cuda": cuda})
        fake_os = type("os", (), {"environ": {**env, "LOCAL_RANK": str(rank)}})
        exec(MEGATRON_SET_DEVICE, {"torch": fake_torch, "os": fake_os})
        out += cuda.used
    return out


def _flag(cmd: list[str], name: str, default: int) -> int:
    return int(cmd[cmd.index(name) + 1]) if name in cmd else default


def sglang_gpus(cmd: list[str], env: dict[str, str], node_gpus: int) -> list[int]:
    """The physical GPU of each scheduler (dp × tp ranks) of an SGLang server."""
    cuda = FakeCuda(node_gpus, env)
    tp, dp = _flag(cmd, "--tp-size", 1), _flag(cmd, "--dp-size", 1)
    base, step = _flag(cmd, "--base-gpu-id", 0), _flag(cmd, "--gpu-id-step", 1)
    for d in range(dp):
        for t in range(tp):
            cuda.set_device(base + d * tp * step + t * step)
    return cuda.used


def ray_assign(bundles: list[float], nodes: int, node_gpus: int, strategy: str) -> list[tuple]:
    """(node, CUDA_VISIBLE_DEVICES) Ray gives the actor of each bundle (``num_gpus``)."""
    free = [list(range(node_gpus)) for _ in range(nodes)]
    out, turn = [], 0
    for gpus in bundles:
        order = list(range(nodes))
        if "SPREAD" in strategy:
            order = order[turn:] + order[:turn]
            turn = (turn + 1) % nodes
        node = next((n for n in order if len(free[n]) >= int(gpus)), None)
        assert node is not None, f"Ray cannot place a bundle of {gpus} GPUs ({free} free)"
        ids, free[node] = free[node][: int(gpus)], free[node][int(gpus) :]
        out.append((node, ",".join(map(str, ids))))
    return out


def environ_with(env: dict[str, str]) -> dict[str, str]:
    """What a child started with ``env`` on top of this process's environment sees."""
    return {**os.environ, **env}
