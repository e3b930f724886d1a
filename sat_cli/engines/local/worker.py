"""The local engine's worker process: an HF causal LM and a batched sampling loop with a KV cache.

``worker_main`` runs in a process started by ``sat_cli.engines.local.engine.LocalEngine`` (multiprocessing
``spawn`` context) and serves commands received on a pipe; every message is plain data (dicts,
lists, numbers, numpy arrays). ``sample_batch`` is the sampling loop, importable on its own
(it lives in :mod:`sat_cli.models.sampling`, which describes it, and is re-exported here).
With ``cfg["inflight"]`` the worker also serves a control pipe and takes weight updates between
decode steps of a running request (:mod:`sat_cli.engines.local.inflight`).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from sat_cli.models.sampling import filtered_logprobs, sample_batch  # noqa: F401

# commands of the distributed weight sync -> WorkerSync methods (engines/local/sync.py)
SYNC_COMMANDS = {
    "join_group": "join",
    "receive_weights": "receive",
    "weight_checksums": "checksums",
    "abort_group": "abort",
}


class _Worker:
    def __init__(self, cfg: dict):
        from sat_cli.models.tiny_moe import load_model

        torch.set_num_threads(int(cfg["num_threads"]))
        self.cfg = cfg
        self.device = torch.device(cfg["device"])
        self.dtype = cfg["dtype"]
        self.model = load_model(cfg["model_path"], cfg["dtype"], self.device)
        self.version = int(cfg.get("version", 0))
        self.requests = 0
        self.tokenizer = None
        self.control = None  # in-flight updates: a ControlChannel (worker_main sets it)
        self.sync = None  # distributed weight sync: a local_sync.WorkerSync, made when asked
        self.adapters = None  # trainer.lora: an adapters.EngineAdapters, made at the first one
        self.full_loads = 0  # full weight loads after the start (update_weights of a model)
        self._set_special_ids(cfg["model_path"])

    def _set_special_ids(self, model_dir: str):
        from transformers import AutoTokenizer

        from sat_cli.models.stopping import model_stop_ids

        config = self.model.config
        eos = config.eos_token_id
        gen = getattr(self.model, "generation_config", None)
        if gen is not None and gen.eos_token_id is not None:
            eos = gen.eos_token_id
        gen_eos = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        pad = config.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(gen_eos) if gen_eos else 0))
        if getattr(self, "tokenizer", None) is None:  # the tokenizer does not change with updates
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # SGLang's stop rule (sat_cli/models/stopping.py), so both engines stop alike
        self.eos_ids = set(model_stop_ids(model_dir, self.tokenizer))

    def generate(self, req: dict) -> dict:
        if req.get("adapters") is not None:
            return self._generate_per_sample(req)
        if self.adapters is not None or req.get("adapter") is not None:
            return self._generate_with_adapter(req)
        return self._generate(req)

    def _generate_per_sample(self, req: dict) -> dict:
        """One request whose prompt ``i`` names adapter ``adapters[i]`` (a mixed-version batch):
        every row takes its version's adapter; each sample carries that version."""
        from sat_cli.engines.local.adapters import AdapterMissing

        if self.adapters is None:
            raise AdapterMissing("the request names adapters per prompt; the engine holds none")
        n = int(req["n"])
        rows = [int(v) for v in req["adapters"] for _ in range(n)]
        if len(req["adapters"]) != len(req["prompts"]):
            raise ValueError("a request's adapters must name one version per prompt")
        self.adapters.activate_rows(rows, self.base_version)  # refuses what is not held
        try:
            reply = self._generate(req, rows)
        finally:
            self.adapters.activate(self.adapters.active)
        for r, v in zip(reply["samples"], rows, strict=True):
            r["weight_version"] = v
        reply["weight_version"] = min(rows)
        return reply

    def _generate_with_adapter(self, req: dict) -> dict:
        """A request that names its adapter (``None``: the base): made active for this request
        only; the samples carry the adapter's version (engines/local/adapters.py)."""
        from sat_cli.engines.local.adapters import AdapterMissing

        named = req.get("adapter")
        if named is not None and self.adapters is None:
            raise AdapterMissing(f"the request names adapter v{named}; the engine holds none")
        self.adapters.activate(named)
        reply = self._generate(req)
        version = self.adapters.active if named is not None else self.base_version
        reply["weight_version"] = version
        for r in reply["samples"]:
            r["weight_version"] = version
        return reply

    def _generate(self, req: dict, rows: list[int] | None = None) -> dict:
        """``rows``: the adapter version of every row (prompt x n), activated per chunk."""
        from sat_cli.models.r3 import RouteCapture

        s = req["sampling"]
        n = int(req["n"])
        seed = s.get("seed")
        if seed is None:
            seed = int(self.cfg["seed"]) * 1_000_003 + self.requests
        self.requests += 1
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        flat = [list(p) for p in req["prompts"] for _ in range(n)]
        stop = set(self.eos_ids) | set(int(t) for t in s.get("stop_token_ids", ()))
        max_batch = int(self.cfg["max_batch_size"])
        t0 = time.perf_counter()
        results: list[dict] = []
        if self.cfg.get("inflight"):
            from sat_cli.engines.local.inflight import WeightSwitch

            cache_mode = self.cfg.get("inflight_cache", "recompute")
            switch = WeightSwitch(self, req.get("updates") or [], cache_mode, self.cfg["r3"])
            for start in range(0, len(flat), max_batch):
                results += self._sample_switching(
                    switch, flat[start : start + max_batch], s, stop, gen
                )
            switch.finish()
            elapsed = time.perf_counter() - t0
            return {"samples": results, "weight_version": self.version, "gen_s": elapsed}
        capture = RouteCapture(self.model) if self.cfg["r3"] else None
        for start in range(0, len(flat), max_batch):
            chunk = flat[start : start + max_batch]
            if rows is not None:
                self.adapters.activate_rows(rows[start : start + len(chunk)], self.base_version)
            kw = self._sampling_kwargs(s, stop, gen)
            if capture is not None:
                with capture:
                    results += sample_batch(self.model, chunk, capture=capture, **kw)
            else:
                results += sample_batch(self.model, chunk, **kw)
        elapsed = time.perf_counter() - t0
        return {"samples": results, "weight_version": self.version, "gen_s": elapsed}

    def _sampling_kwargs(self, s: dict, stop: set, gen) -> dict:
        """``sample_batch``'s sampling keywords from a request's sampling dict; kept sets are
        recorded only when a filter cuts the distribution (else the support is everything)."""
        top_p, top_k = float(s["top_p"]), int(s["top_k"])
        return dict(
            temperature=float(s["temperature"]),
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=int(s["max_new_tokens"]),
            stop_token_ids=stop,
            pad_id=self.pad_id,
            generator=gen,
            record_mask=bool(s.get("sampling_mask")) and (top_p < 1.0 or top_k >= 1),
            topk=int(s.get("topk_logprobs") or 0),
        )

    def _sample_switching(self, switch, chunk, s: dict, stop: set, gen) -> list[dict]:
        """One batch with in-flight updates; each result gets its first token's version."""
        switch.poll(0)  # updates waiting before the prefill
        version = self.version
        with switch.capturing():
            out = sample_batch(
                switch.model,
                chunk,
                capture=switch.capture,
                switch=switch,
                **self._sampling_kwargs(s, stop, gen),
            )
        for r in out:
            r["weight_version"] = r["token_versions"][0] if r["token_versions"] else version
        return out

    def load_version(self, path: str, version: int) -> None:
        """In-flight update: check, load and switch to ``version`` (the model is unchanged if
        anything fails)."""
        from sat_cli.engines.local.inflight import check_update
        from sat_cli.models.tiny_moe import load_model

        check_update(path, version, self.version)
        self.model = load_model(path, self.dtype, self.device)
        self._set_special_ids(path)
        self.version = int(version)

    def serve_control(self) -> bool:
        """Apply the updates waiting on the control pipe; True if the weights changed."""
        return self.control is not None and self.control.serve(self.load_version)

    def sync_command(self, cmd: str, payload) -> dict:
        """Distributed weight sync (``sat_cli.engines.local.sync``)."""
        if self.sync is None:
            from sat_cli.engines.local.sync import WorkerSync

            self.sync = WorkerSync(self)
        return getattr(self.sync, SYNC_COMMANDS[cmd])(*([payload] if payload is not None else []))

    def update_weights(self, req: dict) -> dict:
        from sat_cli.models.tiny_moe import load_model
        from sat_cli.weightsync.adapters import is_adapter

        if is_adapter(req["path"]):
            return self.load_adapter(req["path"], int(req["version"]))
        self.model = load_model(req["path"], self.dtype, self.device)
        self._set_special_ids(req["path"])
        self.version = int(req["version"])
        self.full_loads += 1
        self.adapters = None  # a new model: the adapters of the old one are gone
        return {"weight_version": self.version, "full_loads": self.full_loads}

    def load_adapter(self, path: str, version: int) -> dict:
        """Hold ``version``'s adapter (checked on arrival; the base is not reloaded)."""
        from sat_cli.engines.local.adapters import EngineAdapters
        from sat_cli.models.tiny_moe import torch_dtype

        if self.adapters is None:
            keep = int(self.cfg.get("adapters_kept") or 0)
            self.adapters = EngineAdapters(keep, torch_dtype(self.dtype), self.device)
            self.base_version = self.version  # what a request naming no adapter serves
        read = self.adapters.load(self.model, path, version)
        self.adapters.activate(version)
        self.version = int(version)
        return {
            "weight_version": self.version,
            "adapter": True,
            "adapter_read": read,
            "adapters": self.adapters.versions(),
            "full_loads": self.full_loads,
        }


def _exit_now() -> None:
    """Exit at once, logs flushed: the worker holds nothing else to write, and the interpreter's
    teardown with torch and transformers loaded costs ~0.8 s (CPU) that every run waited for at
    close."""
    from sat_cli.util.procs import flush_std_streams

    flush_std_streams()
    os._exit(0)


def worker_main(conn, cfg: dict, ctrl=None) -> None:
    """Process entry point: load the model, say ``ready``, then serve commands until ``close``.

    ``ctrl``: the control pipe of in-flight updates, served first whenever the worker is idle
    and at every token boundary of a running request.

    SIGHUP is ignored: a closed terminal hangs up the whole process group, and the orchestrator,
    which handles it, closes this process in order (it also exits when the pipe closes)."""
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if cfg.get("log_file"):
        fd = os.open(cfg["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        worker = _Worker(cfg)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    from sat_cli.tracking.environment import process_numerics

    ready = {"pid": os.getpid(), "weight_version": worker.version, "numerics": process_numerics()}
    conn.send(("ok", ready))
    if ctrl is not None:
        from sat_cli.engines.local.inflight import ControlChannel

        worker.control = ControlChannel(ctrl)
    while True:
        if worker.control is not None and worker.control.conn is not None:
            from multiprocessing.connection import wait

            ready = wait([conn, worker.control.conn])
            if worker.control.conn in ready:
                worker.serve_control()
                continue
        try:
            cmd, payload = conn.recv()
        except EOFError:
            _exit_now()  # the orchestrator is gone
        if cmd == "close":
            conn.send(("ok", None))
            _exit_now()
        try:
            if cmd == "generate":
                reply = worker.generate(payload)
            elif cmd == "update_weights":
                reply = worker.update_weights(payload)
            elif cmd == "weight_checksums" and worker.adapters is not None:
                reply = worker.adapters.checksums()  # the active adapter's tensors
            elif cmd in SYNC_COMMANDS:
                reply = worker.sync_command(cmd, payload)
            elif cmd == "ping":
                reply = {
                    "weight_version": worker.version,
                    "full_loads": worker.full_loads,
                    "requests": worker.requests,
                }
            else:
                raise ValueError(f"unknown engine command {cmd!r}")
            conn.send(("ok", reply))
        except Exception:
            conn.send(("error", traceback.format_exc()))
