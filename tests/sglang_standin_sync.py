"""The stand-in's weight-sync routes (``tests/sglang_standin.py`` dispatches to them).

As SGLang 0.5.23 answers them, checked against a real CPU server (its answers are in
``tests/data/sglang_captured/ws_*.json``, ``scripts/sglang_capture.py --weight-sync``):
``POST /init_weights_update_group`` (joins a real gloo group as ``rank_offset``, the way SGLang
does: ``sat_cli.weightsync.group``), ``/destroy_weights_update_group``,
``/begin_weight_update`` / ``/end_weight_update`` (one session at a time),
``/update_weights_from_distributed`` (only inside a session; receives the broadcast bucket —
``load_format: "flattened_bucket"`` — or one broadcast per tensor, and keeps the tensors),
``/weights_checker`` (``checksum``: SGLang's per-tensor hashes of what it holds, under SGLang's
fused names; other actions answer 400 as ``compare`` does on a CPU server).

The stand-in holds real weights for the checksums: the model folder's at start (in the server's
dtype), replaced by what ``/update_weights_from_disk`` loads and what a broadcast brings.

Faults (``Standin.configure``), not SGLang: ``sync_fault`` = ``"stale"`` (receive, answer
success, keep the old weights: a sync that reports success while the server serves the old
weights), ``"wrong_bytes"`` (corrupt one received tensor), ``"skip_receive"`` (never join the
broadcast; answer 400 after ``skip_receive_s``), ``"fail"`` (answer 400 at once);
``disk_stale`` (disk updates answer success and keep the old weights); ``no_sync_routes``
(404 for every route here, as a server without them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROUTES = (
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/weights_checker",
)
SWITCHES = {
    "sync_fault": None,
    "skip_receive_s": 30.0,
    "disk_stale": False,
    "no_sync_routes": False,
}


class SyncState:
    """What the stand-in holds for the weight-sync routes."""

    def __init__(self, model_path: str, dtype: str = "bfloat16") -> None:
        self.model_path, self.dtype = model_path, dtype
        self.weights: dict | None = None  # HF name -> tensor (server dtype), loaded lazily
        self.groups: dict = {}
        self.session = False

    def load(self, folder: str) -> None:
        import torch

        from sat_cli.trainers.megatron.hf_io import read_all

        cast = getattr(torch, self.dtype)
        self.weights = {k: v.to(cast) for k, v in read_all(folder).items()}

    def loaded_from(self, folder: str) -> None:
        """A disk update: the folder's weights, read when a checksum asks for them."""
        self.model_path, self.weights = folder, None

    def held(self) -> dict:
        if self.weights is None:
            self.load(self.model_path)
        return self.weights


def handle(handler, path: str, body: dict) -> None:
    """Answer one of :data:`ROUTES` on ``handler`` (the stand-in's request handler)."""
    st = handler.state
    sw = st.switches
    if sw.get("no_sync_routes"):
        handler._send(404, {"detail": "Not Found"})
        return
    sync: SyncState = st.sync
    if path == "/init_weights_update_group":
        _init(handler, sync, body)
    elif path == "/destroy_weights_update_group":
        name = body.get("group_name", "weight_update_group")
        if name in sync.groups:
            sync.groups.pop(name).close()
            handler._send(
                200, {"success": True, "message": "Succeeded to destroy custom process group."}
            )
        else:
            handler._send(
                400, {"success": False, "message": "The group to be destroyed does not exist."}
            )
    elif path == "/begin_weight_update":
        if sync.session:
            msg = "a weight-update session is already open; call end_weight_update() first"
            handler._send(400, {"success": False, "message": msg})
        else:
            sync.session = True
            handler._send(200, {"success": True, "message": "Success"})
    elif path == "/end_weight_update":
        if not sync.session:
            msg = "no weight-update session is open; call begin_weight_update() first"
            handler._send(400, {"success": False, "message": msg})
        else:
            sync.session = False
            handler._send(200, {"success": True, "message": "Success"})
    elif path == "/update_weights_from_distributed":
        _update(handler, st, sync, body)
    else:
        _checker(handler, sync, body)


def _init(handler, sync: SyncState, body: dict) -> None:
    from sat_cli.engines.base import WeightSyncError
    from sat_cli.weightsync.group import open_group

    name = body.get("group_name", "weight_update_group")
    try:
        sync.groups[name] = open_group(
            master_addr=body["master_address"],
            port=body["master_port"],
            rank=body["rank_offset"],
            world_size=body["world_size"],
            group_name=name,
            backend=body.get("backend", "nccl"),
            timeout_s=60.0,
        )
    except WeightSyncError as exc:
        msg = f"Failed to initialize custom process group: {exc}."
        handler._send(400, {"success": False, "message": msg})
        return
    handler._send(
        200, {"success": True, "message": "Succeeded to initialize custom process group."}
    )


def _receive(sync: SyncState, body: dict) -> list:
    import torch
    import torch.distributed as dist

    from sat_cli.weightsync import buckets as B

    group = sync.groups[body.get("group_name", "weight_update_group")]
    metas = tuple(
        B.TensorMeta(n, d, tuple(s), 0)
        for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
    )
    if body.get("load_format") == "flattened_bucket":
        metas = tuple(
            B.TensorMeta(
                m.name,
                m.dtype,
                m.shape,
                getattr(torch, m.dtype).itemsize * int(torch.Size(m.shape).numel()),
            )
            for m in metas
        )
        bucket = B.Bucket(metas)
        flat = B.empty_bucket(bucket)
        dist.broadcast(flat, src=0, group=group.pg)
        return [(n, t.clone()) for n, t in B.unflatten(flat, bucket)]
    out = []
    for m in metas:
        t = torch.empty(m.shape, dtype=getattr(torch, m.dtype))
        dist.broadcast(t, src=0, group=group.pg)
        out.append((m.name, t))
    return out


def _update(handler, st, sync: SyncState, body: dict) -> None:
    import torch

    fault = st.switches.get("sync_fault")
    if not sync.session:
        msg = (
            "update_weights_from_distributed must run between begin_weight_update() and "
            "end_weight_update()"
        )
        handler._send(400, {"success": False, "message": msg})
        return
    name = body.get("group_name", "weight_update_group")
    if fault == "fail" or name not in sync.groups:
        why = (
            "stand-in failure"
            if fault == "fail"
            else (
                f"Group {name} not in {list(sync.groups)}. Please call `init_weights_update_group` "
                "first."
            )
        )
        handler._send(400, {"success": False, "message": f"Failed to receive weights: {why}"})
        return
    if fault == "skip_receive":  # never joins the broadcast (a receive that times out)
        time.sleep(float(st.switches.get("skip_receive_s", 30.0)))
        handler._send(400, {"success": False, "message": "Failed to receive weights: timed out"})
        return
    try:
        received = _receive(sync, body)
    except (RuntimeError, ValueError, KeyError) as exc:
        msg = f"Failed to receive weights: {str(exc).splitlines()[0]}"
        handler._send(400, {"success": False, "message": msg})
        return
    cast = getattr(torch, sync.dtype)
    if fault == "wrong_bytes":
        received[0] = (received[0][0], received[0][1] + 1)
    if fault != "stale":
        sync.held().update({n: t.to(cast) for n, t in received})
    new = body.get("weight_version")
    with st.lock:
        if new is not None:
            st.version = st.sched_version = str(new)
    msg = "Succeeded to update parameter online." + (
        f" Weight version updated to {new}." if new is not None else ""
    )
    handler._send(200, {"success": True, "message": msg})


def _checker(handler, sync: SyncState, body: dict) -> None:
    from sat_cli.weightsync.layouts import expected_checksums

    if (body or {}).get("action", "checksum") != "checksum":
        handler._send(400, {"success": False, "message": ""})  # compare on a CPU server
        return
    sums = expected_checksums(sync.held().items(), "sglang")
    overall = hashlib.sha256()
    for n in sorted(sums):
        overall.update(n.encode())
        overall.update(sums[n].encode())
    per_gpu = overall.hexdigest()
    info = {
        "role": "target",
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "rank": 0,
        "size": 1,
    }
    rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}
    handler._send(
        200,
        {
            "success": True,
            "message": "Success.",
            "ranks": [rank],
            "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
        },
    )


@contextlib.contextmanager
def standin_process(model, log: Path, *extra: str, timeout_s: float = 60.0):
    """The stand-in as its own process (as sat launches it) on a free port; yields its URL,
    healthy, and stops it. ``extra``: more flags (``--standin-sync-fault stale``, ...)."""
    from sat_cli.util.procs import free_port

    port = free_port()
    script = Path(__file__).with_name("sglang_standin.py")
    cmd = [
        sys.executable,
        str(script),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-version",
        "0",
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(url + "/model_info", timeout=2) as resp:
                        json.loads(resp.read())
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the stand-in did not start: {log.read_text()}"
                        ) from None
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
