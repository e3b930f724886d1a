"""The sampling loop of the local engine (:mod:`sat_cli.engines.local.worker`) and of the warm
start's held-out accuracy: an HF causal LM, batched, with a KV cache.

Sampling (per step, on fp32 logits of the last position):
``z = logits / temperature``; top-k keeps the ``k`` largest (``top_k = -1``: all); top-p keeps the
smallest prefix of the sorted distribution whose mass reaches ``top_p``; the kept logits are
renormalised, ``logp = log_softmax(z_kept)``, the token is drawn from ``exp(logp)`` with the
request's seeded ``torch.Generator``, and ``rollout_logp`` is ``logp`` of the drawn token: the
log-prob of the distribution actually sampled from (for ``top_p=1, top_k=-1`` it is
``log_softmax(logits / T)``). ``temperature = 0`` is greedy and reports ``logp = 0`` (a point mass).

On request (``record_mask``, ``topk``) each result also carries, per sampled token, the kept set
(the ids where ``filtered_logprobs`` is finite, most probable first; a greedy step keeps the
argmax) and the top-k ids and log-probs of that same distribution (:func:`support_and_topk`).

Batches are left-padded with explicit ``position_ids`` (``cumsum(mask) - 1``), so a token's
position does not depend on the batch it was generated in. Generation stops on a stop token —
SGLang's rule, ``sat_cli/models/stopping.py``: the request's ``stop_token_ids`` and the EOS ids of
config.json, generation_config.json and the tokenizer — (the stop token is part of the response
and has a log-prob) or after ``max_new_tokens``.
With route capture on, each sample gets SGLang's layout ``[prompt_len + response_len - 1, L, K]``.
"""

from __future__ import annotations

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


def support_and_topk(logp: torch.Tensor, want_mask: bool, k: int):
    """From ``logp [B, V]`` of the distribution sampled from (``-inf`` off its support): per row
    the support's ids (int32 numpy, most probable first, ties by id) if ``want_mask``, and with
    ``k > 0`` the top-k ids (int32 ``[B, k]``) and log-probs (float32 ``[B, k]``); a support
    smaller than ``k`` is padded with id -1 and log-prob 0."""
    srt, order = torch.sort(logp, dim=-1, descending=True, stable=True)  # [B, V]
    n = torch.isfinite(srt).sum(-1).cpu()  # [B]: the finite entries are a prefix
    srt, order = srt.cpu(), order.cpu()
    kept = [order[b, : int(n[b])].numpy().astype(np.int32) for b in range(len(n))]
    ids = vals = None
    if k > 0:
        ids = torch.full((len(n), k), -1, dtype=torch.int32)
        vals = torch.zeros((len(n), k), dtype=torch.float32)
        kk = min(k, logp.shape[-1])
        valid = torch.arange(kk)[None, :] < n[:, None]  # [B, kk]
        ids[:, :kk] = torch.where(valid, order[:, :kk].int(), -1)
        vals[:, :kk] = torch.where(valid, srt[:, :kk].float(), 0.0)
        ids, vals = ids.numpy(), vals.numpy()
    return (kept if want_mask else None), ids, vals


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
    switch=None,
    record_mask: bool = False,
    topk: int = 0,
) -> list[dict]:
    """Sample one response per prompt. Returns dicts ``{response_ids, rollout_logp, finish_reason,
    routed_experts (np.int32 or None)}``. ``capture``: an active ``RouteCapture`` or None.
    ``record_mask``: each dict also has ``sampling_mask`` (per token, the kept ids, int32);
    ``topk > 0``: ``topk_ids`` / ``topk_logp`` (``[R, topk]``; :func:`support_and_topk`).

    ``switch``: in-flight weight updates (``sat_cli.engines.local.inflight.WeightSwitch``) or None.
    When given, ``switch.poll(k)`` is asked at every token boundary (``k`` tokens sampled, before
    the last one is fed) whether new weights arrived; if so, sampling continues with
    ``switch.model`` / ``switch.capture``, either re-prefilling prompt + tokens so far under the
    new weights (``switch.cache_mode == "recompute"``) or decoding on from the old KV cache
    (``"keep"``), and each result also carries ``token_versions`` (``switch.version`` when each
    token was sampled). Without it, the loop is exactly the plain one."""
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
    fed: list[torch.Tensor] = []  # in-flight updates: the tokens fed so far (for a re-prefill)
    versions = None if switch is None else [[] for _ in range(B)]
    kept: list[list] = [[] for _ in range(B)]  # record_mask: per token the kept ids
    top: list[list] = [[] for _ in range(B)]  # topk: per token (ids, log-probs)
    routes_lk = () if prefill_routes is None else tuple(prefill_routes.shape[2:])
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()  # [B, V]
        if temperature <= 0:
            tok = logits.argmax(-1)
            tok_logp = torch.zeros(B)
            if record_mask or topk > 0:  # a point mass on the argmax
                logp = torch.full_like(logits, float("-inf")).scatter(-1, tok[:, None], 0.0)
        else:
            logp = filtered_logprobs(logits, temperature, top_p, top_k)  # [B, V]
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1).cpu()
        tok = tok.cpu()
        if record_mask or topk > 0:
            step_kept, step_ids, step_vals = support_and_topk(logp, record_mask, topk)
        for b in range(B):
            if done[b]:
                continue
            tokens[b].append(int(tok[b]))
            logps[b].append(float(tok_logp[b]))
            if record_mask:
                kept[b].append(step_kept[b])
            if topk > 0:
                top[b].append((step_ids[b], step_vals[b]))
            if versions is not None:
                versions[b].append(switch.version)
        hit = torch.isin(tok, stop) & ~done
        for b in torch.nonzero(hit).flatten().tolist():
            finish[b] = "stop"
        done |= hit
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        feed = torch.where(done, torch.full_like(tok, pad_id), tok).to(device)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        if switch is not None:
            fed.append(feed)
            if switch.poll(step + 1):  # new weights at this token boundary
                model, capture = switch.model, switch.capture
                if switch.cache_mode == "recompute":
                    out, cache = _reprefill(model, cache_kw, ids, pos, fed, mask)
                    next_pos = next_pos + 1
                    if capture is not None:  # keep the earlier rows: the forwards that sampled
                        decode_routes.append(capture.last_call().view(B, -1, *routes_lk)[:, -1])
                    continue
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
        if versions is not None:
            results[-1]["token_versions"] = versions[b]
        if record_mask:
            results[-1]["sampling_mask"] = kept[b]
        if topk > 0:
            results[-1]["topk_ids"] = np.stack([i for i, _ in top[b]]).astype(np.int32)
            results[-1]["topk_logp"] = np.stack([v for _, v in top[b]]).astype(np.float32)
    return results


def _reprefill(model, cache_kw: str, ids, pos, fed: list[torch.Tensor], mask):
    """Forward prompt + the tokens fed so far under ``model`` into a fresh cache (the KV cache
    recomputed under new weights): ``(output, cache)``. Positions continue the prompt's."""
    from transformers import DynamicCache

    seq = torch.cat([ids, torch.stack(fed, dim=1)], dim=1)  # [B, P + k]
    steps = torch.arange(1, len(fed) + 1, device=pos.device)
    seq_pos = torch.cat([pos, pos[:, -1:] + steps], dim=1)
    cache = DynamicCache(config=model.config)
    out = _forward(
        model, cache_kw, input_ids=seq, attention_mask=mask, position_ids=seq_pos, cache=cache
    )
    return out, cache
