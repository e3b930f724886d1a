"""The torchrun worker process of the megatron trainer.

Started by ``MegatronTrainer`` as::

    python -m torch.distributed.run --nproc_per_node 1 --nnodes 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT -m sat_cli.trainers.megatron.worker \\
        --config WORK/worker_config.json --reply-fifo WORK/reply.fifo

``worker_config.json`` holds ``model_path``, the parallel sizes (``tp``, ``pp``, ``ep``,
``cp``) and the ``MegatronActor`` keyword arguments (``actor``; its ``loss`` is a
``LossConfig.to_dict()``, turned back into a ``LossConfig`` by the actor). The worker initialises
torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel state, builds the actor,
reports ``ready`` and then serves the JSON-lines protocol of ``protocol.py``: commands on stdin,
replies on the FIFO, tensors in safetensors files. A failing command is answered with
``ok: false`` and the traceback, and the worker keeps serving. It exits on ``close``, on EOF of
stdin (the client is gone) and when its parent (torchrun) dies, so it never outlives the run.

Several ranks: rank 0 reads stdin and broadcasts each command line (a byte tensor over a gloo
group, so it also works beside NCCL); every rank runs the command (the actor's collectives
need all of them) and rank 0 replies. Supported layouts (``check_layout``): ``world = dp x tp
x pp`` with tensor parallelism ``tp`` (sequence parallel, megatron-core's parallel layers),
pipeline stages ``pp`` (``pipeline.py``) and expert parallelism ``ep`` dividing the ranks of a
stage; ``cp`` must be 1 (rejected at start-up with a clear message). Each rank logs its peak
RSS after the model load. A command that fails on some ranks only (not a validation error,
which all ranks raise alike) can leave the others waiting in a collective; the client then
sees no reply but a live worker, as with any hung step.
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


class _Commands:
    """Command lines: rank 0 reads stdin, the others receive rank 0's lines by broadcast."""

    def __init__(self, stdin, rank: int, world: int):
        self.stdin, self.rank, self.world = stdin, rank, world
        self.group = None
        if world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")

    def __iter__(self):
        while True:
            line = self._next()
            if line is None:
                return
            yield line

    def _next(self) -> bytes | None:
        if self.world == 1:
            raw = self.stdin.readline()
            return raw if raw else None
        import torch
        import torch.distributed as dist

        raw = self.stdin.readline() if self.rank == 0 else b""
        size = torch.tensor([len(raw) if raw else -1], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if int(size) < 0:
            return None  # EOF on rank 0: every rank stops
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0 else None
        if self.rank != 0:
            buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return bytes(buf.tolist()) if self.rank != 0 else raw


def _serve(actor, replies: _Replies | None, commands, sender=None) -> int:
    if replies is None:  # ranks > 0 run the commands but do not answer
        replies = _NoReplies()
    for raw in commands:
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
                diag = {} if msg.get("diag") else None
                reply = {"metrics": actor.step(batch, diag), "step_count": actor.step_count}
                if diag is not None and actor.rank == 0:  # every rank has the same loss
                    protocol.write_tensors(diag, msg["diag"])
            elif cmd == "logprobs":
                batch = protocol.read_batch(msg["batch"])
                logprobs = actor.logprobs(batch)  # every rank computes (collectives)
                if actor.rank == 0:
                    protocol.write_tensors({"logprobs": logprobs}, msg["out"])
                reply = {"out": msg["out"]}
            elif cmd == "publish":
                reply = {"path": str(actor.export_hf(msg["dir"]))}
            elif cmd == "capture":  # distributed weight sync: gathered, held on rank 0
                state = actor.hf_state()  # a collective: every rank
                held = sender.capture(msg["version"], state) if sender is not None else 0
                reply = {"bytes": held}
            elif cmd == "save":
                actor.save(msg["dir"])
                reply = {"step_count": actor.step_count}
            elif cmd == "load":
                actor.load(msg["dir"])
                reply = {"step_count": actor.step_count}
            elif cmd == "set_clip_radii":
                actor.set_clip_radii(msg["eps_low"], msg["eps_high"])
            elif cmd == "skip_step":
                actor.skip_step()
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


class _NoReplies:
    def send(self, msg: dict) -> None:
        pass


def _all_pids(commands: _Commands) -> list[int]:
    """Process ids of all ranks, in rank order (over the gloo group: CPU tensors)."""
    if commands.world == 1:
        return [os.getpid()]
    import torch
    import torch.distributed as dist

    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(commands.world)]
    dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64), group=commands.group)
    return [int(p) for p in pids]


def _say(line: str) -> None:
    """One line to the log in a single write: the ranks share the file, and ``print`` may
    split a line over writes, so lines of two ranks could interleave mid-line."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def check_layout(world: int, *, tp: int, pp: int, ep: int, cp: int) -> None:
    """Refuse, before anything is built, a layout the worker cannot run."""
    if cp != 1:
        raise NotImplementedError(
            f"megatron trainer supports data, tensor, pipeline and expert parallelism only: cp "
            f"must be 1 (got cp={cp}); see docs/megatron.md"
        )
    if world % (tp * pp):
        raise ValueError(f"tp={tp} x pp={pp} does not divide the world size {world}")
    if world // pp % ep:
        raise ValueError(f"ep={ep} does not divide the ranks of a pipeline stage ({world // pp})")


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _sender_service(cfg: dict, actor):
    """Rank 0's weight sender (the gathered versions) behind a socket for the driver."""
    from sat_cli.weightsync.sender import WeightSender
    from sat_cli.weightsync.service import SenderService

    s = cfg["sender"]
    tied = bool(actor.hf_config.get("tie_word_embeddings", False))
    sender = WeightSender(
        dtype=s["dtype"],
        device=s.get("device", "cpu"),
        bucket_bytes=int(s.get("bucket_bytes", 512 * 2**20)),
        tied=tied,
        source_dir=cfg["model_path"],
        max_shard_size=actor.max_shard_size,
    )
    return sender, SenderService(sender, s.get("host", "127.0.0.1"))


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
    sender = service = None
    try:
        tp, pp, ep, cp = (int(cfg.get(k, 1)) for k in ("tp", "pp", "ep", "cp"))
        check_layout(world, tp=tp, pp=pp, ep=ep, cp=cp)
        from . import runtime

        runtime.init_distributed(tp=tp, pp=pp, ep=ep, cp=1)
        commands = _Commands(sys.stdin.buffer, rank, world)
        from .actor import MegatronActor

        before = _peak_rss_mib()  # imports, process groups: the part the weights do not scale
        actor = MegatronActor(cfg["model_path"], **cfg.get("actor", {}))
        actor.max_shard_size = cfg.get("max_shard_size", "5GB")  # export_hf's shard cap
        pids = _all_pids(commands)
        if rank == 0 and cfg.get("sender"):  # engine.weight_sync=distributed (weightsync/)
            sender, service = _sender_service(cfg, actor)
        _say(
            f"megatron worker rank {rank}: peak RSS after model load {_peak_rss_mib():.0f} MiB, "
            f"before {before:.0f} MiB "
            f"(tp={tp}, pp={pp}, ep={ep}, world={world}; {actor.memory_options()})"
        )
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
    if replies is not None:
        # the client watches the processes of its own node (ranks 0 .. local world - 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replies.send(
            {
                "event": "ready",
                "ok": True,
                "step_count": 0,
                "pids": pids[:local],
                "sender_port": service.port if service else None,
            }
        )
    from sat_cli.tracking.environment import process_numerics

    numerics = " ".join(f"{k}={v}" for k, v in process_numerics().items())
    _say(f"megatron worker rank {rank}/{world} ready (pid {os.getpid()}; {numerics})")
    code = _serve(actor, replies, commands, sender)
    if service is not None:
        service.close()
        sender.close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
