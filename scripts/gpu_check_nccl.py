"""GPU probe: can two processes on ONE GPU form an NCCL group and broadcast? (The weight sync
``engine.weight_sync=distributed`` with ``engine.colocate=true`` on a one-GPU machine would need
it.) Two ranks, both on ``cuda:0``, ``init_process_group("nccl")`` and one broadcast of 1 MB,
each under a 60 s deadline; a row per outcome (reported, not gated: the answer decides what
``sat`` accepts at compose time).

    python scripts/gpu_check_nccl.py      # on a GPU machine (scripts/gpu_check.sh)
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    try:
        dist.init_process_group(
            "nccl", rank=rank, world_size=2, timeout=timedelta(seconds=60), device_id=0
        )
        x = torch.full((1 << 18,), float(rank + 1), device="cuda:0")
        dist.broadcast(x, src=0)
        torch.cuda.synchronize()
        result.put((rank, "ok", float(x[0])))
        dist.destroy_process_group()
    except Exception as exc:  # the probe's answer: which error NCCL gives
        result.put((rank, "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = {}
    for _ in procs:
        try:
            rank, status, value = result.get(timeout=90)
        except Exception:
            break
        outcomes[rank] = (status, value)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ok = all(outcomes.get(r, ("missing",))[0] == "ok" for r in range(2))
    for r in range(2):
        print(f"nccl probe rank {r}: {outcomes.get(r, ('no answer in 90 s', ''))}", flush=True)
    print("\n| check | model | metric | value | bound | verdict |")
    print("|---|---|---|---|---|---|")
    print(f"| nccl one GPU | - | two ranks on cuda:0 broadcast (1 = worked) | {int(ok)} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
