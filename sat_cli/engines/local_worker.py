"""The local engine's worker process: an HF causal LM and a batched sampling loop with a KV cache.

``worker_main`` runs in a process started by ``sat_cli.engines.local.LocalEngine`` (multiprocessing
``spawn`` context) and serves commands received on a pipe; every message is plain data (dicts,
lists, numbers, numpy arrays). ``sample_batch`` is the sampling loop, importable on its own.

Sampling (per step, on fp32 logits of the last position):
``z = logits / temperature``; top-k keeps the ``k`` largest (``top_k = -1``: all); top-p keeps the
smallest prefix of the sorted distribution whose mass reaches ``top_p``; the kept logits are
renormalised, ``logp = log_softmax(z_kept)``, the token is drawn from ``exp(logp)`` with the
request's seeded ``torch.Generator``, and ``rollout_logp`` is ``logp`` of the drawn token: the
log-prob of the distribution actually sampled from (for ``top_p=1, top_k=-1`` it is
``log_softmax(logits / T)``). ``temperature = 0`` is greedy and reports ``logp = 0`` (a point mass).

Batches are left-padded with explicit ``position_ids`` (``cumsum(mask) - 1``), so a token's
position does not depend on the batch it was generated in. Generation stops on a stop token —
SGLang's rule, ``sat_cli/models/stopping.py``: the request's ``stop_token_ids`` and the EOS ids of
config.json, generation_config.json and the tokenizer — (the stop token is part of the response
and has a log-prob) or after ``max_new_tokens``.
With route capture on, each sample gets SGLang's layout ``[prompt_len + response_len - 1, L, K]``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np
import torch


def filtered_logprobs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """Log-probs ``[B, V]`` of the distribution sampled from (``-inf`` on filtered tokens)."""
    z = logits.float() / temperature  # [B, V]
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p  # keep the prefix that first reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def _forward(model, cache_kw: str, **kwargs):
    cache = kwargs.pop("cache")
    return model(**kwargs, **{cache_kw: cache}, use_cache=True, logits_to_keep=1)


def _cache_kwarg(model) -> str:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def sample_batch(
    model,
    prompts: list[list[int]],
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    stop_token_ids: set[int],
    pad_id: int,
    generator: torch.Generator,
    capture=None,
) -> list[dict]:
    """Sample one response per prompt. Returns dicts ``{response_ids, rollout_logp, finish_reason,
    routed_experts (np.int32 or None)}``. ``capture``: an active ``RouteCapture`` or None."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    B = len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("empty prompt")
    P = max(lens)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)

    cache_kw = _cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    if capture is not None:
        capture.clear()
    out = _forward(
        model, cache_kw, input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache
    )
    prefill_routes = None
    if capture is not None:
        first = capture.last_call()  # [B*P, L, K]
        prefill_routes = first.view(B, P, *first.shape[1:])

    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    decode_routes: list[torch.Tensor] = []  # per step [B, L, K]
    finish = ["length"] * B
    done = torch.zeros(B, dtype=torch.bool)
    next_pos = pos[:, -1:] + 1  # [B, 1]
    stop = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()  # [B, V]
        if temperature <= 0:
            tok = logits.argmax(-1)
            tok_logp = torch.zeros(B)
        else:
            logp = filtered_logprobs(logits, temperature, top_p, top_k)  # [B, V]
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1).cpu()
        tok = tok.cpu()
        for b in range(B):
            if done[b]:
                continue
            tokens[b].append(int(tok[b]))
            logps[b].append(float(tok_logp[b]))
        hit = torch.isin(tok, stop) & ~done
        for b in torch.nonzero(hit).flatten().tolist():
            finish[b] = "stop"
        done |= hit
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        feed = torch.where(done, torch.full_like(tok, pad_id), tok).to(device)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        out = _forward(
            model,
            cache_kw,
            input_ids=feed[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            cache=cache,
        )
        next_pos = next_pos + 1
        if capture is not None:
            decode_routes.append(capture.last_call())  # [B, L, K]

    results = []
    for b in range(B):
        routes = None
        if capture is not None:
            R = len(tokens[b])
            rows = [prefill_routes[b, P - lens[b] :]] + [
                r[b : b + 1] for r in decode_routes[: R - 1]
            ]
            routes = torch.cat(rows, dim=0).numpy().astype(np.int32)  # [lens[b] + R - 1, L, K]
        results.append(
            {
                "response_ids": tokens[b],
                "rollout_logp": logps[b],
                "finish_reason": finish[b],
                "routed_experts": routes,
            }
        )
    return results


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
        capture = RouteCapture(self.model) if self.cfg["r3"] else None
        for start in range(0, len(flat), max_batch):
            chunk = flat[start : start + max_batch]
            kw = dict(
                temperature=float(s["temperature"]),
                top_p=float(s["top_p"]),
                top_k=int(s["top_k"]),
                max_new_tokens=int(s["max_new_tokens"]),
                stop_token_ids=stop,
                pad_id=self.pad_id,
                generator=gen,
            )
            if capture is not None:
                with capture:
                    results += sample_batch(self.model, chunk, capture=capture, **kw)
            else:
                results += sample_batch(self.model, chunk, **kw)
        elapsed = time.perf_counter() - t0
        return {"samples": results, "weight_version": self.version, "gen_s": elapsed}

    def update_weights(self, req: dict) -> dict:
        from sat_cli.models.tiny_moe import load_model

        self.model = load_model(req["path"], self.dtype, self.device)
        self._set_special_ids(req["path"])
        self.version = int(req["version"])
        return {"weight_version": self.version}


def worker_main(conn, cfg: dict) -> None:
    """Process entry point: load the model, say ``ready``, then serve commands until ``close``.

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
    conn.send(("ok", {"pid": os.getpid(), "weight_version": worker.version}))
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            return
        if cmd == "close":
            conn.send(("ok", None))
            return
        try:
            if cmd == "generate":
                reply = worker.generate(payload)
            elif cmd == "update_weights":
                reply = worker.update_weights(payload)
            elif cmd == "ping":
                reply = {"weight_version": worker.version}
            else:
                raise ValueError(f"unknown engine command {cmd!r}")
            conn.send(("ok", reply))
        except Exception:
            conn.send(("error", traceback.format_exc()))
