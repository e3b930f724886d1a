"""The torchrun worker process of the megatron trainer.

Started by ``MegatronTrainer`` as::

    python -m torch.distributed.run --nproc_per_node 1 --nnodes 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT -m sat_cli.trainers.megatron.worker \\
        --config WORK/worker_config.json --reply-fifo WORK/reply.fifo

``worker_config.json`` holds ``model_path``, the parallel sizes (``tp``, ``pp``, ``ep``,
``cp``) and the ``MegatronActor`` keyword arguments (``actor``). The worker initialises
torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel state, builds the actor,
reports ``ready`` and then serves the JSON-lines protocol of ``protocol.py``: commands on stdin,
replies on the FIFO, tensors in safetensors files. A failing command is answered with
``ok: false`` and the traceback, and the worker keeps serving. It exits on ``close``, on EOF of
stdin (the client is gone) and when its parent (torchrun) dies, so it never outlives the run.

Scope: world size 1. Larger sizes are rejected at start-up with a clear message: they need
data-parallel sharding of the batch, gradient reduction over EP ranks and a TP-sharded
converter, which are not implemented.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from . import protocol


def _watch_parent(parent: int) -> None:
    """Exit hard when torchrun (our parent) is gone: no orphan worker."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


class _Replies:
    def __init__(self, fifo: str):
        # The client holds the FIFO open for reading before it starts torchrun, so this open
        # does not block.
        self.f = open(fifo, "wb", buffering=0)  # noqa: SIM115

    def send(self, msg: dict) -> None:
        self.f.write(protocol.encode(msg))


def _serve(actor, replies: _Replies, stdin) -> int:
    for raw in stdin:
        line = raw.strip()
        if not line:
            continue
        msg_id = None
        try:
            msg = protocol.decode(line)
            msg_id = msg.get("id")
            cmd = msg.get("cmd")
            reply: dict = {}
            if cmd == "step":
                batch = protocol.read_batch(msg["batch"])
                reply = {"metrics": actor.step(batch), "step_count": actor.step_count}
            elif cmd == "logprobs":
                batch = protocol.read_batch(msg["batch"])
                protocol.write_tensors({"logprobs": actor.logprobs(batch)}, msg["out"])
                reply = {"out": msg["out"]}
            elif cmd == "publish":
                reply = {"path": str(actor.export_hf(msg["dir"]))}
            elif cmd == "save":
                actor.save(msg["dir"])
                reply = {"step_count": actor.step_count}
            elif cmd == "load":
                actor.load(msg["dir"])
                reply = {"step_count": actor.step_count}
            elif cmd == "ping":
                reply = {}
            elif cmd == "close":
                replies.send({"id": msg_id, "ok": True})
                return 0
            else:
                raise ValueError(f"unknown command {cmd!r}")
            replies.send({"id": msg_id, "ok": True, **reply})
        except Exception as exc:  # reported to the client, which raises it there
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            replies.send(
                {
                    "id": msg_id,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
    return 0  # EOF: the client closed our stdin


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="worker_config.json written by the client")
    ap.add_argument("--reply-fifo", required=True, help="named pipe for JSON-lines replies")
    args = ap.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cfg = json.loads(Path(args.config).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    replies = _Replies(args.reply_fifo) if rank == 0 else None
    try:
        if world != 1 or any(int(cfg.get(k, 1)) != 1 for k in ("tp", "pp", "ep", "cp")):
            raise NotImplementedError(
                f"megatron trainer runs with world size 1 only (got WORLD_SIZE={world}, "
                f"tp={cfg.get('tp')}, pp={cfg.get('pp')}, ep={cfg.get('ep')}, cp={cfg.get('cp')});"
                " see docs/megatron.md"
            )
        from . import runtime

        runtime.init_distributed(tp=1, pp=1, ep=1, cp=1)
        from .actor import MegatronActor

        actor = MegatronActor(cfg["model_path"], **cfg.get("actor", {}))
    except Exception as exc:
        traceback.print_exc()
        if replies is not None:
            replies.send(
                {
                    "event": "ready",
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
        return 1
    replies.send({"event": "ready", "ok": True, "step_count": 0, "pid": os.getpid()})
    print(f"megatron worker ready (pid {os.getpid()})", file=sys.stderr, flush=True)
    code = _serve(actor, replies, sys.stdin.buffer)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
