"""``MegatronTrainer``: the orchestrator side of the megatron-core trainer (``trainer=megatron``).

It implements ``sat_cli.trainers.base.Trainer`` (``step``, ``logprobs``, ``publish_weights``,
``save``, ``load``, ``close``, ``step_count``) and the local trainer's loop hooks
(``set_clip_radii``, ``skip_step``) by launching the worker under torchrun as a
subprocess and driving it over the channel described in ``protocol.py``:

    [python, -m, torch.distributed.run, --nproc_per_node, N, --nnodes, M,
     --rdzv-backend, c10d, --rdzv-endpoint, HOST:PORT, --rdzv-id, ID, --max-restarts, 0,
     --monitor-interval, 0.1, --log-dir, WORK/torchelastic, -m, sat_cli.trainers.megatron.worker,
     --config, WORK/worker_config.json, --reply-fifo, WORK/reply.fifo]

(HOST:PORT is ``127.0.0.1:0`` on one node: the OS picks the port at torchrun's bind. With
``nnodes`` M > 1 the rendezvous is torchrun's static one, ``--node-rank 0 --master-addr HOST
--master-port PORT``, and the other nodes join with ``sat worker --join HOST:PORT --config
WORK/worker_config.json --node-rank k``: ``launch.py``).

- The transport is a channel (``channel.py``): :class:`LocalChannel` starts torchrun here. With
  ``launcher=ray`` a ``placer`` (``sat_cli.cluster.launcher.RayLauncher``) runs the same channel
  inside a Ray actor on trainer node 0 and starts ``sat worker --join`` on nodes 1..; its
  ``failure()`` (a lost node, a joined node that exited) is checked while waiting, and a
  failed reply or a dead torchrun is reported as the lost node when the monitor finds one.
- ``work_dir`` (run-local) holds the config, the reply FIFO and the batch/result safetensors
  files (deleted after use); ``logs_dir`` gets ``megatron_trainer.log`` (torchrun and worker
  stdout/stderr).
- Commands are JSON lines on torchrun's stdin (inherited by the worker); replies come back on
  the FIFO (``calls.WorkerCalls``). While waiting, the client polls torchrun and the worker process every 0.2 s: if
  either dies, the call raises ``MegatronWorkerError`` with the exit code and the tail of the log
  within about a second, and the remaining processes are ended (by pid). No call hangs on a
  dead worker; a healthy but slow step has no time limit.
- An error inside a command (a bad batch, missing R3 routes) comes back as ``ok: false`` and is
  raised here (``R3Error`` for routing errors, ``MegatronWorkerError`` otherwise); the worker
  keeps running.

A trainer is built from its settings (``MegatronTrainerSettings``: ``trainer.*`` of
``trainer=megatron``) and a ``MegatronRuntime`` (the model, folders, loss, step options from
outside ``trainer.*``, export dtype, weight-sync sender, launcher, environment). The step
keywords (``loss``, a ``sat_cli.rl.config.LossConfig``; ``lr``, ``betas``, ``weight_decay``,
``grad_clip``, ``temperature``, ``r3``, ``num_minibatches``, ``seed``, ...) plus ``dtype``,
``export_dtype``, ``recompute`` and ``optimizer_offload`` are forwarded to ``MegatronActor`` in
the worker, the loss settings as ``LossConfig.to_dict()`` under ``actor.loss`` in
``worker_config.json``. Parallel sizes (``tp``, ``pp``, ``ep``, ``cp``,
``nproc_per_node``, ``nnodes``) are passed through; the worker runs ``dp x tp x pp`` ranks
(``tp x pp`` must divide ``nproc_per_node x nnodes``) with expert parallelism ``ep`` inside,
and rejects ``cp`` > 1 at start-up with a clear message. Batch files must be readable by every
rank (one node, or a shared filesystem).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch

from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.megatron.trainer_runtime import MegatronRuntime
from sat_cli.trainers.step import StepSettings
from sat_cli.util.procs import free_port

from . import protocol
from .calls import MegatronWorkerError, WorkerCalls
from .channel import LocalChannel
from .launch import join_command, launch_env, torchrun_command

LOG_NAME = "megatron_trainer.log"


class MegatronTrainer(WorkerCalls):
    """Trainer backed by a megatron-core worker under torchrun (see module docstring)."""

    def __init__(self, settings, runtime: MegatronRuntime):
        """``settings``: ``trainer.*`` of ``trainer=megatron`` (``settings.MegatronTrainerSettings``:
        optimizer, layout, precision, rendezvous); ``runtime``: the model, the work and log folders, the loss and step
        options, the export dtype, the weight-sync sender, the launcher, node 0's environment."""
        s, rt = settings, runtime
        unknown = set(rt.options) - {f.name for f in fields(StepSettings)}
        if unknown:
            raise TypeError(
                f"MegatronTrainer got unknown trainer options {sorted(unknown)}; "
                f"valid: {sorted(f.name for f in fields(StepSettings))}"
            )
        if rt.options.get("replay_sampling_mask") or rt.options.get("score_centering_topk"):
            raise ValueError(
                "replay_sampling_mask and score_centering_topk are wired into the local "
                "trainer only (the kept sets and top-k would have to cross the pipeline and "
                "data-parallel gathers); use trainer=local"
            )
        if rt.options.get("ledger_keep"):
            raise ValueError(
                "the three-log-prob ledger (algo.ledger) is wired into the local trainer only "
                "(it keeps whole-model weight snapshots; Megatron's are sharded over ranks); use "
                "trainer=local"
            )
        from sat_cli.rl import registry

        actor = rt.actor_keywords(s)
        for k in ("replay_sampling_mask", "score_centering_topk"):
            actor.pop(k, None)
        loss: LossConfig = actor.pop("loss") or LossConfig()
        spec = registry.resolve(loss.algo, loss.correction, loss.ratio_denominator)
        if spec.needs:  # a3po, vcpo: their extra inputs are wired into the local trainer only
            raise ValueError(
                f"algo={spec.algo} needs {', '.join(spec.needs)}, which only trainer=local "
                "provides; use trainer=local"
            )
        self.step_count = 0
        self._msg_id = 0
        self._chan = None  # LocalChannel, or a RemoteChannel on the cluster (launcher=ray)
        self._placer = None
        self.weight_sender = None  # weight_sync: a RemoteSender of rank 0's WeightSender
        self._worker_pids: list[int] = []
        self._buf = b""
        self.work_dir = Path(rt.work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir = Path(rt.logs_dir).resolve() if rt.logs_dir else self.work_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.logs_dir / LOG_NAME
        (self.work_dir / "io").mkdir(exist_ok=True)

        placer, nnodes, nproc_per_node = rt.placer, s.nnodes, s.nproc_per_node
        rdzv_endpoint = f"{s.master_addr}:{s.master_port}" if s.master_port else None
        if placer is not None:  # node 0's address on the cluster (port 0 on one node)
            endpoint = placer.trainer_endpoint(rdzv_endpoint, nnodes)
        elif rdzv_endpoint:
            endpoint = rdzv_endpoint
        elif nnodes == 1:  # as `torchrun --standalone`: a port picked here could be taken
            # before torchrun binds it (any ephemeral bind), and torchrun then waits on the stranger
            endpoint = "127.0.0.1:0"
        else:  # the other nodes must know the port before node 0 binds it
            endpoint = f"127.0.0.1:{free_port()}"
        config = {
            "protocol": protocol.PROTOCOL_VERSION,
            "nnodes": nnodes,
            "nproc_per_node": nproc_per_node,
            "master": endpoint,
            "model_path": str(Path(rt.model_path).resolve()),
            "tp": s.tp,
            "pp": s.pp,
            "ep": s.ep,
            "cp": s.cp,
            "max_shard_size": s.max_shard_size,
            "actor": {**actor, "loss": loss.to_dict()},
        }
        if rt.weight_sync is not None:  # {dtype, device, bucket_bytes}: rank 0, on node 0
            config["sender"] = {**rt.weight_sync, "host": endpoint.rsplit(":", 1)[0]}
        config_path = self.work_dir / "worker_config.json"
        tmp_config = config_path.with_name(".worker_config.json.tmp")
        tmp_config.write_text(json.dumps(config, indent=1))
        os.replace(tmp_config, config_path)  # `sat worker --join` may be polling for it

        fifo = self.work_dir / "reply.fifo"
        self._placer, python = placer, rt.python
        if placer is not None and python is None:
            python = placer.trainer_python()  # node 0's interpreter (the cluster's environment)
        self.command = torchrun_command(
            python or sys.executable,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            endpoint=endpoint,
            node_rank=0,
            log_dir=self.work_dir / "torchelastic",
            config=config_path,
            fifo=fifo,
        )
        note = None
        if nnodes > 1 and placer is None:
            note = (
                f"megatron trainer: waiting for {nnodes - 1} more node(s); on node k = 1 .. "
                f"{nnodes - 1} run: {join_command(endpoint, config_path)} --node-rank k\n"
            )
            print(note, end="", file=sys.stderr, flush=True)
        channel_args = dict(
            log_path=self.log_path, fifo=fifo, cleanup=[self.work_dir / "torchelastic"], note=note
        )
        if placer is None:
            self._chan = LocalChannel(self.command, env=launch_env(rt.env), **channel_args)
        else:  # node 0 on the cluster; nodes 1.. join it with `sat worker --join`
            self._chan = placer.trainer_channel(self.command, rt.env or {}, **channel_args)
        try:
            if placer is not None and nnodes > 1:
                placer.join_trainer_nodes(endpoint, config_path, rt.startup_timeout_s)
            ready = self._read_reply(
                lambda m: m.get("event") == "ready", "start-up", rt.startup_timeout_s
            )
        except BaseException:
            self._teardown()
            raise
        if not ready.get("ok"):
            self._teardown()
            raise MegatronWorkerError(
                f"megatron worker failed to start: {ready.get('error')}\n"
                f"{ready.get('traceback', '')}(log: {self.log_path})"
            )
        self._worker_pids = [int(p) for p in ready.get("pids", [])]  # this node's ranks
        if ready.get("sender_port"):
            from sat_cli.weightsync.service import RemoteSender

            self.weight_sender = RemoteSender(config["sender"]["host"], ready["sender_port"])

    # --- Trainer interface -----------------------------------------------------------------------
    def step(self, batch: TrainBatch, diag: dict | None = None) -> dict[str, float]:
        """The worker's step; ``diag`` (a dict) receives the loss's per-token diagnostics
        (``PolicyTrainer.step``), shipped back as a safetensors file."""
        path = protocol.write_batch(batch, self._io_path("batch"))
        out = self._io_path("diag") if diag is not None else None
        try:
            fields = {} if out is None else {"diag": str(out)}
            reply = self._request("step", batch=str(path), **fields)
            if out is not None:
                diag.update(protocol.read_tensors(out))
        finally:
            path.unlink(missing_ok=True)
            if out is not None:
                out.unlink(missing_ok=True)
        self.step_count = int(reply["step_count"])
        return {k: float(v) for k, v in reply["metrics"].items()}

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        path = protocol.write_batch(batch, self._io_path("batch"))
        out = self._io_path("logprobs")
        try:
            self._request("logprobs", batch=str(path), out=str(out))
            return protocol.read_tensors(out)["logprobs"]
        finally:
            path.unlink(missing_ok=True)
            out.unlink(missing_ok=True)

    def set_clip_radii(self, eps_low: float, eps_high: float) -> None:
        """Change the clip radii for later steps (a clip schedule)."""
        self._request("set_clip_radii", eps_low=float(eps_low), eps_high=float(eps_high))

    def skip_step(self) -> None:
        """Count a step that had no samples (keeps ``step_count`` equal to the loop's step)."""
        self.step_count = int(self._request("skip_step")["step_count"])

    def ping(self, timeout: float = 30.0) -> None:
        """Round trip to the worker (raises ``MegatronWorkerError`` if it is gone)."""
        self._request("ping", timeout=timeout)

    def publish_weights(self, dir: str | os.PathLike, version: int) -> Path:
        target = Path(dir).resolve() / f"v{int(version)}"
        return Path(self._request("publish", dir=str(target), version=int(version))["path"])

    def capture_weights(self, version: int) -> int:
        """Hold the current weights as ``version`` in rank 0's sender (distributed sync): every
        rank gathers, ``megatron_to_hf`` names them as ``publish_weights`` does, no disk."""
        return int(self._request("capture", version=int(version))["bytes"])

    def save(self, dir: str | os.PathLike) -> None:
        self._request("save", dir=str(Path(dir).resolve()))

    def load(self, dir: str | os.PathLike) -> None:
        self.step_count = int(self._request("load", dir=str(Path(dir).resolve()))["step_count"])

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks (rank order)."""
        return list(self._worker_pids)

    @property
    def launcher_pid(self) -> int | None:
        return self._chan.launcher_pid if self._chan else None

    def close(self, timeout: float = 30.0) -> None:
        """Ask the worker to exit, then make sure torchrun and the worker are gone."""
        if self._chan is None:
            return
        if self._chan.exit_code() is None:
            try:
                self._request("close", timeout=timeout)
            except MegatronWorkerError:
                pass  # _teardown below ends whatever is left
        self._teardown()

    def _teardown(self) -> None:
        if self.weight_sender is not None:
            self.weight_sender.close()
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close(self._worker_pids)
        if self._placer is not None:
            self._placer.stop_trainer_nodes()

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_chan", None) is not None:
            self._teardown()
