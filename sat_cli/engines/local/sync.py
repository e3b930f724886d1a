"""Distributed weight sync of the local engine: its worker joins a gloo group with the trainer.

The same path as SGLang's (``engine.weight_sync=distributed``), so the mode runs on every
machine. The client (:func:`run_sync`, called by ``LocalEngine.sync_weights`` on the
engine's request thread, so between generation requests like a disk update):

1. once: the sender listens, the worker is told to join as rank 1 (``join_group``) while the
   sender joins as rank 0 (both wait at most the sync timeout);
2. per version: the worker is sent every bucket's names, dtypes and shapes (``receive``) and
   receives the buckets, in order, into buffers it keeps, while the sender broadcasts them;
   when all arrived the model takes them and the version. All or nothing: a failed receive
   leaves the old weights and version.

Where every weight's bytes arrive in the model's own memory order (one weight within one
bucket, its parts — the per-expert tensors of a fused expert weight — in the order they lie in
it, the model's dtype; what the trainer's sender sends to this engine), the model's weights
become views of the received buffers (:func:`bind_views`): no copy. The buffers come in two
sets, and a version is received into the set the model does not use, so the old weights stay
whole until the new ones are complete. Otherwise each tensor is copied into the model (into
the fused experts where transformers holds them so).

A failure closes the group on both sides (the next sync joins a new one) and raises
``WeightSyncError``. ``checksums`` is the local engine's ``/weights_checker``: the tensor hash of
every weight in HF checkpoint names (experts split back per expert), in the engine's dtype.
"""

from __future__ import annotations

import itertools
import re
import time
import weakref

from sat_cli.engines.verification import Checksums
from sat_cli.errors import EngineError, WeightSyncError
from sat_cli.weightsync import buckets as B

_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")
_names = itertools.count()


# --- the worker's side ------------------------------------------------------------------------
def parts(model):
    """``(state-dict key, HF checkpoint name, view)`` of every weight: transformers 5 holds a
    layer's experts fused, ``gate_up_proj`` ``[E, 2I, H]`` (gate rows then up rows per expert)
    and ``down_proj`` ``[E, H, I]``; other names are the model's. Views of the model's tensors,
    in their memory order."""
    for name, t in model.state_dict().items():
        m = _FUSED.fullmatch(name)
        if m is None:
            yield name, name, t
        elif m[2] == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield name, f"{m[1]}.{e}.gate_proj.weight", t[e, :half]
                yield name, f"{m[1]}.{e}.up_proj.weight", t[e, half:]
        else:
            for e in range(t.shape[0]):
                yield name, f"{m[1]}.{e}.down_proj.weight", t[e]


def targets(model) -> dict:
    """HF checkpoint name → the model's own tensor (a view of its parameter) that holds it."""
    return {hf: view for _, hf, view in parts(model)}


def bind_views(model, flats: list, located: dict, own: set[int]) -> bool:
    """Make each of ``model``'s weights a view of received bytes, where they lie in the model's
    own memory order (module docstring): ``flats`` are the received buckets, ``located`` maps
    an HF name to ``(bucket, byte offset, TensorMeta)``, ``own`` holds the storage addresses of
    this engine's receive buffers. False, and nothing changed, when any weight does not lie so, or when two
    weights share memory (tied embeddings: rebinding one would leave the other behind)."""

    state = model.state_dict()
    views, start, storages = {}, {}, set()
    for key, hf, part in parts(model):
        base = state[key]
        if hf not in located or not base.is_contiguous():
            return False
        k, off, meta = located[hf]
        if meta.shape != tuple(part.shape) or meta.dtype != B.dtype_name(part):
            return False
        rel = part.data_ptr() - base.data_ptr()  # where this part lies in its weight
        first = start.setdefault(key, (k, off - rel))
        if first != (k, off - rel):
            return False
        if key not in views:
            st = base.untyped_storage().data_ptr()
            if st in storages and st not in own:
                return False  # two weights in one storage that is not ours
            storages.add(st)
            nbytes = base.numel() * base.element_size()
            lo = off - rel
            if lo < 0 or lo + nbytes > flats[k].numel() or lo % base.element_size():
                return False
            views[key] = flats[k][lo : lo + nbytes].view(base.dtype).view(base.shape)
    params = dict(model.named_parameters(remove_duplicate=False))
    if len({id(p) for p in params.values()}) != len(params) or set(views) != set(state):
        return False
    for key, view in views.items():
        if key in params:
            params[key].data = view
        else:  # a persistent buffer
            owner, _, attr = key.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = view
    return True


def served_state(model) -> dict:
    """The model's weights in HF checkpoint names (what ``save_pretrained`` writes)."""
    return targets(model)


class WorkerSync:
    """The worker's end: the group and the receive (runs inside the engine process). Received
    buckets land in buffers kept from one version to the next, in two sets (module docstring):
    the model's weights become views of one set, or are copied from it."""

    def __init__(self, worker):
        self.worker = worker
        self.group = None
        self.sets: tuple[list, list] = ([], [])  # receive buffers, one per bucket, reused
        self.bound: tuple[int, weakref.ref] | None = None  # the set the model's weights view

    def join(self, req: dict) -> dict:
        from sat_cli.weightsync.group import open_group

        self.abort()
        self.group = open_group(
            master_addr=req["master_addr"],
            port=req["port"],
            rank=req["rank"],
            world_size=req["world_size"],
            group_name=req["group_name"],
            backend=req["backend"],
            timeout_s=req["timeout_s"],
        )
        return {"group": req["group_name"]}

    def _free_set(self) -> int:
        """The set of buffers the model's weights are not views of."""
        if self.bound is not None and self.bound[1]() is self.worker.model:
            return 1 - self.bound[0]
        return 0

    def _buffer(self, s: int, k: int, bucket: B.Bucket):
        buffers = self.sets[s]
        while len(buffers) <= k:
            buffers.append(None)
        if buffers[k] is None or buffers[k].numel() != bucket.nbytes:
            buffers[k] = B.empty_bucket(bucket, self.worker.device)
        return buffers[k]

    def receive(self, req: dict) -> dict:
        import torch
        import torch.distributed as dist

        if self.group is None:
            raise WeightSyncError("receive before the weight-sync group was joined")
        buckets = [
            B.Bucket(tuple(B.TensorMeta.from_json(r) for r in rows)) for rows in req["buckets"]
        ]
        received: list = []
        s = self._free_set()
        try:
            for k, bucket in enumerate(buckets):
                flat = self._buffer(s, k, bucket)
                dist.broadcast(flat, src=0, group=self.group.pg)
                received += B.unflatten(flat, bucket)
        except (RuntimeError, ValueError) as exc:
            self.abort()
            raise WeightSyncError(f"receive failed: {str(exc).splitlines()[0]}") from None
        dest = targets(self.worker.model)
        names = [n for n, _ in received]
        if sorted(names) != sorted(dest):
            missing, extra = sorted(set(dest) - set(names)), sorted(set(names) - set(dest))
            raise WeightSyncError(
                f"received weights do not fit the model: missing {missing[:3]}, "
                f"unexpected {extra[:3]}"
            )
        flats = self.sets[s][: len(buckets)]
        located = {m.name: (k, off, m) for k, b in enumerate(buckets) for m, off in B.offsets(b)}
        own = {f.untyped_storage().data_ptr() for f in self.sets[0] + self.sets[1] if f is not None}
        with torch.no_grad():
            zero_copy = bind_views(self.worker.model, flats, located, own)
            if zero_copy:
                self.bound = (s, weakref.ref(self.worker.model))
            else:
                for name, t in received:
                    dest[name].copy_(t)
        self.worker.version = int(req["version"])
        return {"weight_version": self.worker.version, "zero_copy": zero_copy}

    def checksums(self) -> dict:
        return {k: B.tensor_hash(v) for k, v in targets(self.worker.model).items()}

    def abort(self) -> dict:
        group, self.group = self.group, None
        if group is not None:
            group.close()
        return {}


# --- the client's side (LocalEngine) --------------------------------------------------------------
class LocalSync:
    """The distributed weight sync's part of ``LocalEngine`` (a mixin: the engine holds the
    request lock, the request thread and ``sync_channel``); it runs :func:`run_sync`."""

    # served_checksums() names: HF checkpoint names (weightsync/layouts.py)
    weight_verification = Checksums("hf")

    def distributed_sync_unsupported(self) -> str | None:
        """Why this engine cannot take ``engine.weight_sync=distributed`` (None: it can)."""
        if self.inflight_updates:
            return "the local engine takes in-flight updates (lag.inflight_updates=true) from disk only"
        return None

    def sync_weights(self, sender, version: int, spec) -> dict[str, float]:
        """Receive ``version`` from ``sender``'s broadcast (after the requests already queued);
        ``WeightSyncError`` if it did not arrive (the worker keeps its weights and version)."""

        def job():
            with self._lock:
                self._check_usable()
                return run_sync(self.sync_channel, sender, int(version), spec)

        self._check_usable()
        return self._executor.submit(job).result()

    def served_checksums(self) -> dict[str, dict[str, str]]:
        """``{"the local engine": {tensor: checksum}}`` of the served weights (in HF names, the
        engine's dtype: ``local_sync.WorkerSync.checksums``), after the queued requests."""
        self._check_usable()
        sums = self._executor.submit(self._call, "weight_checksums", None, 600.0).result()
        return {"the local engine": sums}


def run_sync(channel, sender, version: int, spec) -> dict[str, float]:
    """Bring ``version`` from ``sender`` into the engine's worker (module docstring) through
    the engine's ``channel`` (``engine.SyncChannel``); returns ``{"pause_s", "wire_s",
    "assemble_s", "bytes"}``. ``spec``: a ``loop.weightsync.GroupSpec``. The caller holds the
    engine's request lock."""
    t0 = time.perf_counter()
    deadline = spec.timeout_s + 30.0  # the worker's own waits end within the group timeout
    try:
        if not sender.connected or channel.group is None:
            port = sender.listen(spec.master_addr, spec.port, 2, spec.timeout_s)
            name = f"sat_weights_local_{next(_names)}"
            channel.send(
                "join_group",
                {
                    "master_addr": spec.master_addr,
                    "port": port,
                    "rank": 1,
                    "world_size": 2,
                    "group_name": name,
                    "backend": spec.backend,
                    "timeout_s": spec.timeout_s,
                },
            )
            _together(
                channel, sender, "join_group", deadline, lambda: sender.connect(name, spec.backend)
            )
            channel.group = name
        t1 = time.perf_counter()
        plan = sender.plan(version)
        rows = [[m.as_json() for m in b.metas] for b in plan]
        channel.send("receive_weights", {"version": int(version), "buckets": rows})
        sent = {"wire": 0.0, "assemble": 0.0, "bytes": 0}

        def broadcast() -> None:
            for k in range(len(plan)):
                sent["bytes"] += sender.send(version, k)
                sent["wire"] += sender.last_send_s
                sent["assemble"] += sender.last_flatten_s

        reply = _together(channel, sender, f"receive_weights(v{version})", deadline, broadcast)
    except (WeightSyncError, EngineError) as exc:
        sender.abort()
        channel.group = None
        if channel.dead:
            raise
        raise WeightSyncError(f"distributed sync of weights v{version} failed: {exc}") from None
    channel.took(reply["weight_version"], bool(reply.get("zero_copy")))
    took = time.perf_counter() - t1
    return {
        "pause_s": t1 - t0,
        "wire_s": took - sent["assemble"],
        "assemble_s": sent["assemble"],
        "bytes": float(sent["bytes"]),
    }


def _together(channel, sender, what: str, deadline: float, act):
    """Run the sender's half (``act``) while the worker runs its half, then take the worker's
    reply. A failing sender closes the group first, so the worker's wait ends at once."""
    try:
        act()
    except WeightSyncError:
        sender.abort()
        try:
            channel.reply(what, deadline)
        except EngineError:
            pass  # the worker's own failure follows from ours
        raise
    return channel.reply(what, deadline)
