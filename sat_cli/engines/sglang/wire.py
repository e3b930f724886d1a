"""SGLang's native wire format: request building and response parsing (pure functions).

Read against SGLang 0.5.23's source (``srt/managers/io_struct.py`` GenerateReqInput,
``srt/sampling/sampling_params.py``, ``srt/entrypoints/http_server.py``) and checked against a
real server on this machine's CPU (captured answers in ``tests/data/sglang_captured/``):

- ``POST /generate`` takes a batch: ``input_ids`` is a list of token-id lists (one entry per
  sample, prompt-major) and ``sampling_params`` a list of dicts, one per entry. Unknown sampling
  keys and float-typed integers (``max_new_tokens: 5.0``) are refused with HTTP 400 and a body
  ``{"error": "..."}``, so every value is cast here.
- Each answer item is ``{"text", "output_ids", "meta_info"}``; ``meta_info`` carries
  ``output_token_logprobs`` (``[[logprob, token_id, null], ...]``: ``log_softmax(logits / T)``
  *before* top-k/top-p filtering), with ``return_sampling_mask`` also
  ``output_token_sampling_logprobs`` (the log-prob under the filtered, renormalised distribution
  actually sampled from), ``finish_reason`` (``{"type": "stop", "matched": id}`` /
  ``{"type": "length", "length": n}`` / ``{"type": "abort", "message": ...}``),
  ``weight_version`` (a string: the tokenizer manager's version), ``weight_versions`` (spans
  ``[{"version", "start", "end"}]`` over the output tokens, stamped by the scheduler, on every
  finished output) and, with R3, ``routed_experts``: base64 of little-endian int32
  ``[prompt_len + completion_len - 1, num_layers, top_k]`` (decoded in
  :mod:`sat_cli.engines.sglang.routes`). The kept sets of top-p/top-k
  sampling and the sampled distribution's top-k (``output_token_sampling_mask``, support-mode
  log-probs, ``output_top_logprobs``) are parsed in :mod:`sat_cli.engines.sglang.masks`.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "flush_cache"}`` →
  ``{"success", "message", "num_paused_requests"}`` (400 when ``success`` is false).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sat_cli.engines.sglang.masks import Extras, parse_extras
from sat_cli.engines.sglang.routes import MoEDims, decode_routed_experts
from sat_cli.errors import EngineError
from sat_cli.samples import Sample, SamplingParams

BODY_EXCERPT_CHARS = 500
FINISH_TYPES = ("stop", "length", "abort")


# -- requests --------------------------------------------------------------------------------
def sampling_params_to_wire(sampling: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """One ``sampling_params`` dict (keys of sglang/srt/sampling/sampling_params.py).

    Every value is cast to the type the server's strict validation expects (it answers 400 to
    ``max_new_tokens: 5.0`` or an unknown key). ``sampling_seed`` is honoured only by a server
    started with ``--enable-deterministic-inference``; pass ``seed=None`` otherwise.
    """
    params: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_new_tokens": int(sampling.max_new_tokens),
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def build_generate_payload(
    input_ids: Sequence[Sequence[int]],
    sampling_params: Sequence[dict[str, Any]],
    *,
    return_routed_experts: bool,
    return_sampling_mask: bool = False,
) -> dict[str, Any]:
    """The JSON body of one batched ``POST /generate`` (fields of io_struct.GenerateReqInput).

    Equal sampling params for every entry go as one dict (the server applies it to each entry;
    ``sglang_router`` 0.3.2 refuses a list with 422), different ones (per-entry seeds) as a list.

    ``return_sampling_mask``: SGLang's ``output_token_logprobs`` are ``log_softmax(logits / T)``
    before top-k/top-p filtering (``srt/layers/sampler.py``); with the mask requested the server
    also reports ``output_token_sampling_logprobs``, the log-prob of each token under the
    filtered, renormalised distribution it was drawn from (the behaviour policy ``mu``). A
    support wider than the server's ``--sampling-mask-max-tokens`` (4096) aborts the request.
    """
    if len(input_ids) != len(sampling_params):
        raise ValueError(f"{len(input_ids)} inputs but {len(sampling_params)} sampling params")
    if not input_ids:
        raise ValueError("empty batch")
    shared = all(p == sampling_params[0] for p in sampling_params)
    payload: dict[str, Any] = {
        "input_ids": [[int(t) for t in ids] for ids in input_ids],
        # one dict applies to every entry; sglang_router 0.3 accepts only that form
        "sampling_params": dict(sampling_params[0]) if shared else list(sampling_params),
        "return_logprob": True,
        "logprob_start_len": -1,  # log-probs of output tokens only
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if return_sampling_mask:
        payload["return_sampling_mask"] = True
    return payload


def entry_seeds(seed: int | None, num_prompts: int, n: int) -> list[int | None]:
    """Per-entry seeds (prompt-major): ``seed + i*n + j``, so the n copies of a prompt differ."""
    if seed is None:
        return [None] * (num_prompts * n)
    return [seed + k for k in range(num_prompts * n)]


def parse_finish_reason(raw: Any) -> str:
    """``{"type": "stop"|"length"|"abort", ...}`` (or a bare string) → that type."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind not in FINISH_TYPES:
        raise EngineError(f"unknown finish_reason {raw!r} (expected type in {FINISH_TYPES})")
    return kind


def parse_weight_version(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError) as e:
        raise EngineError(
            f"weight_version {raw!r} is not an integer; launch SGLang with --weight-version 0 "
            "and update weights through this engine"
        ) from e


def parse_weight_version_spans(spans: Any, num_tokens: int) -> tuple[int, list[int] | None]:
    """``meta_info["weight_versions"]`` → (version of the first token, per-token versions).

    Newer SGLang reports ``[{"version", "start", "end"}, ...]`` over the output tokens when
    weights changed during a request (sglang/srt/utils/weight_versions.py). The spans must tile
    ``[0, num_tokens)``; per-token versions are returned only when they actually mix.
    """
    if not isinstance(spans, list) or not spans:
        raise EngineError(f"weight_versions must be a non-empty list, got {wire_excerpt(spans)}")
    token_versions: list[int] = []
    try:
        for span in spans:
            start, end = int(span["start"]), int(span["end"])
            if start != len(token_versions) or end < start:
                raise EngineError(f"weight_versions spans do not tile the output: {spans}")
            token_versions += [parse_weight_version(span["version"])] * (end - start)
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"malformed weight_versions {wire_excerpt(spans)}: {e}") from e
    if len(token_versions) != num_tokens:
        raise EngineError(
            f"weight_versions cover {len(token_versions)} tokens, the output has {num_tokens}"
        )
    first = parse_weight_version(spans[0]["version"])
    mixed = len(set(token_versions)) > 1
    return first, (token_versions if mixed else None)


def parse_generate_item(
    item: Any,
    prompt_ids: Sequence[int],
    *,
    moe: MoEDims | None = None,
    sampling_mask: bool = False,
    extras: Extras | None = None,
) -> Sample:
    """One element of the ``/generate`` answer → :class:`Sample`.

    ``moe`` given means R3 is on: ``meta_info["routed_experts"]`` must be present and decode to
    ``[prompt_len + completion_len - 1, L, K]``. ``sampling_mask``: the request asked for
    ``return_sampling_mask``, and ``rollout_logp`` is ``output_token_sampling_logprobs`` (the
    filtered distribution actually sampled from) instead of the unfiltered log-probs.
    ``extras`` (instead of ``sampling_mask``): what else the request asked for, kept sets and
    top-k (:mod:`sat_cli.engines.sglang.masks`). The version comes from the scheduler's ``weight_versions`` spans when present (0.5.23 sends them
    on every finished output), else from ``weight_version``. Aborted samples are parsed leniently
    (the loop drops them) and keep SGLang's reason in ``meta["abort_message"]``.
    """
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise EngineError(f"malformed /generate item (no meta_info): {wire_excerpt(item)}")
    meta = item["meta_info"]
    finish = parse_finish_reason(meta.get("finish_reason"))
    logprobs = meta.get("output_token_logprobs")
    output_ids = item.get("output_ids")
    try:
        if output_ids is None and logprobs is not None:
            output_ids = [int(entry[1]) for entry in logprobs]
        response_ids = [int(t) for t in (output_ids or [])]
        rollout_logp = [float(entry[0]) for entry in (logprobs or [])]
        logprob_ids = [int(entry[1]) for entry in (logprobs or [])]
    except (TypeError, ValueError, IndexError) as e:
        raise EngineError(f"malformed output_ids/output_token_logprobs: {e}") from e

    if finish == "abort":
        if len(rollout_logp) != len(response_ids):
            rollout_logp = [math.nan] * len(response_ids)
        try:
            version = parse_weight_version(meta.get("weight_version"))
        except EngineError:
            version = -1
        reason = meta.get("finish_reason")
        return Sample(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            rollout_logp=rollout_logp,
            finish_reason="abort",
            weight_version=version,
            meta={
                "sglang_id": meta.get("id"),
                "finish": reason,
                "abort_message": reason.get("message") if isinstance(reason, dict) else None,
            },
        )

    if logprobs is None:
        raise EngineError("meta_info lacks output_token_logprobs (was return_logprob sent?)")
    if logprob_ids != response_ids:
        raise EngineError(
            f"output_ids ({len(response_ids)} tokens) disagree with the token ids of "
            f"output_token_logprobs ({len(logprob_ids)} entries)"
        )
    extra = parse_extras(meta, response_ids, extras or Extras(filtering=sampling_mask))
    rollout_logp = extra.pop("rollout_logp", rollout_logp)
    if not all(math.isfinite(x) for x in rollout_logp):
        raise EngineError("the output log-probs contain a non-finite value")
    routed = None
    if moe is not None:
        if "routed_experts" not in meta or meta["routed_experts"] is None:
            raise EngineError(
                "R3 is on but meta_info has no routed_experts: launch SGLang with "
                "--enable-return-routed-experts and send return_routed_experts=true"
            )
        routed = decode_routed_experts(
            meta["routed_experts"],
            num_tokens=len(prompt_ids) + len(response_ids) - 1,
            num_layers=moe.num_layers,
            top_k=moe.top_k,
            num_experts=moe.num_experts,
        )
    if meta.get("weight_versions") is not None:
        version, token_versions = parse_weight_version_spans(
            meta["weight_versions"], len(response_ids)
        )
    else:  # one version per request (older SGLang)
        version, token_versions = parse_weight_version(meta.get("weight_version")), None
    return Sample(
        prompt_ids=list(prompt_ids),
        response_ids=response_ids,
        rollout_logp=rollout_logp,
        finish_reason=finish,
        weight_version=version,
        routed_experts=routed,
        token_versions=token_versions,
        meta={
            "sglang_id": meta.get("id"),
            "cached_tokens": meta.get("cached_tokens"),
            "num_retractions": int(meta.get("num_retractions") or 0),
            "finish": meta.get("finish_reason"),
        },
        **extra,
    )


def update_weights_payload(path: str, version: int, *, flush_cache: bool = True) -> dict:
    """Body of ``POST /update_weights_from_disk`` (io_struct.UpdateWeightFromDiskReqInput)."""
    return {
        "model_path": str(path),
        "weight_version": str(int(version)),
        "flush_cache": flush_cache,
    }


def wire_excerpt(value: Any) -> str:
    """A server's answer quoted in a message: at most ``BODY_EXCERPT_CHARS``, its control
    characters escaped (``tracking.remote_text``)."""
    from sat_cli.tracking.remote_text import escape_controls

    text = escape_controls(value if isinstance(value, str) else repr(value))
    return text if len(text) <= BODY_EXCERPT_CHARS else text[:BODY_EXCERPT_CHARS] + "…"
