"""What a ``/generate`` request asks of SGLang beyond the plain log-probs, and its parsing: the
behaviour log-probs and kept sets of top-p/top-k sampling, and the top-k of the sampled
distribution (score centering's channel).

Read against SGLang 0.5.23 (``srt/managers/io_struct.py`` GenerateReqInput,
``srt/sampling/sampling_mask.py`` SamplingMaskChunk, ``srt/layers/sampler.py``,
``srt/managers/tokenizer_manager.py``) and checked against a real server on the CPU
(``tests/test_sglang_real.py``):

- ``return_sampling_mask: true`` (sent whenever a filter is active): ``meta_info`` gets
  ``output_token_sampling_mask``, per output token the list of ids the filters kept (the
  scheduler's chunks are concatenated by the tokenizer manager; the ids come most probable first),
  and ``output_token_sampling_logprobs``, per token the log-prob of the sampled token under the
  filtered, renormalised distribution (mode ``"selected"``, the default).
- ``sampling_logprobs_mode: "support"`` (allowed only with the mask): each entry of
  ``output_token_sampling_logprobs`` is instead the list of log-probs of the whole kept set,
  aligned with its ids. The top-k of the sampled distribution are the k largest of them; the
  sampled token's own entry is the behaviour log-prob.
- ``top_logprobs_num: k``: ``output_top_logprobs``, per token ``[[logprob, id, null], ...]`` of
  ``log_softmax(logits / T)`` *before* filtering; used only without filters, where it is the
  distribution sampled from. With filters the support mode above is used instead (no
  renormalisation by hand, the server's own numbers).

A kept set wider than the server's ``--sampling-mask-max-tokens`` (4096) aborts the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sat_cli.errors import EngineError
from sat_cli.samples import SamplingParams


@dataclass(frozen=True)
class Extras:
    """What one request asks for besides the plain log-probs (:meth:`of` a ``SamplingParams``)."""

    filtering: bool = False  # top-p/top-k active: return_sampling_mask, behaviour log-probs
    keep_mask: bool = False  # keep each token's kept set on the Sample
    topk: int = 0  # the sampled distribution's top-k per token

    @classmethod
    def of(cls, sampling: SamplingParams) -> Extras:
        f = sampling.filtering
        return cls(f, f and sampling.sampling_mask, int(sampling.topk_logprobs))

    @property
    def support(self) -> bool:
        """The top-k comes from the kept set's log-probs (``sampling_logprobs_mode=support``)."""
        return self.filtering and self.topk > 0

    def payload_fields(self) -> dict[str, Any]:
        """The top-level fields of ``GenerateReqInput`` this request adds."""
        out: dict[str, Any] = {}
        if self.filtering:
            out["return_sampling_mask"] = True
        if self.support:
            out["sampling_logprobs_mode"] = "support"
        elif self.topk > 0:
            out["top_logprobs_num"] = int(self.topk)
        return out


def parse_extras(meta: dict, response_ids: list[int], extras: Extras) -> dict[str, Any]:
    """``meta_info`` → the ``Sample`` fields ``extras`` asked for: ``rollout_logp`` (with
    filters: the behaviour log-probs), ``sampling_mask``, ``topk_ids``, ``topk_logp``."""
    out: dict[str, Any] = {}
    n = len(response_ids)
    if extras.filtering:
        kept = _kept_sets(meta, response_ids) if (extras.keep_mask or extras.support) else None
        values = _sampling_logprobs(meta, n)
        if extras.support:
            out["rollout_logp"], top = _from_support(values, kept, response_ids, extras.topk)
            out["topk_ids"], out["topk_logp"] = top
        else:
            out["rollout_logp"] = [_number(v, "output_token_sampling_logprobs") for v in values]
        if extras.keep_mask:
            out["sampling_mask"] = kept
    elif extras.topk > 0:
        out["topk_ids"], out["topk_logp"] = _top_logprobs(meta, n, extras.topk)
    return out


def _number(v: Any, what: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError) as e:
        raise EngineError(f"malformed {what}: {v!r} is not a number") from e


def _sampling_logprobs(meta: dict, num_tokens: int) -> list:
    values = meta.get("output_token_sampling_logprobs")
    if not isinstance(values, list):
        raise EngineError(
            "meta_info lacks output_token_sampling_logprobs although return_sampling_mask was "
            "sent: this SGLang cannot report the behaviour log-probs of top-p/top-k sampling "
            "(SGLang 0.5.23 can); set task.top_p=1 and task.top_k=-1"
        )
    if len(values) != num_tokens:
        raise EngineError(
            f"output_token_sampling_logprobs has {len(values)} entries for {num_tokens} tokens"
        )
    return values


def _kept_sets(meta: dict, response_ids: list[int]) -> list[np.ndarray]:
    rows = meta.get("output_token_sampling_mask")
    if not isinstance(rows, list) or len(rows) != len(response_ids):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise EngineError(
            f"output_token_sampling_mask has {got} entries for {len(response_ids)} tokens "
            "(was return_sampling_mask sent?)"
        )
    out = []
    for t, (row, tok) in enumerate(zip(rows, response_ids, strict=True)):
        try:
            ids = np.asarray([int(x) for x in row], dtype=np.int32)
        except (TypeError, ValueError) as e:
            raise EngineError(f"malformed output_token_sampling_mask at token {t}: {e}") from e
        if tok not in ids:
            raise EngineError(
                f"token {t} (id {tok}) is not in its own kept set {ids.tolist()[:8]}…"
            )
        out.append(ids)
    return out


def _pad(rows: list[list[tuple[float, int]]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token ``[(logprob, id), ...]`` (most probable first) → ``[R, k]`` ids and log-probs,
    id -1 and log-prob 0 padding a shorter list."""
    ids = np.full((len(rows), k), -1, dtype=np.int32)
    vals = np.zeros((len(rows), k), dtype=np.float32)
    for t, row in enumerate(rows):
        for j, (lp, tok) in enumerate(row[:k]):
            ids[t, j], vals[t, j] = tok, lp
    return ids, vals


def _from_support(values: list, kept: list[np.ndarray], response_ids: list[int], k: int):
    """Support mode: (behaviour log-probs of the sampled tokens, top-k ids and log-probs)."""
    logp, rows = [], []
    for t, (row, ids, tok) in enumerate(zip(values, kept, response_ids, strict=True)):
        if not isinstance(row, list) or len(row) != len(ids):
            raise EngineError(
                f"output_token_sampling_logprobs at token {t} is not the list of its kept set's "
                f"{len(ids)} log-probs (was sampling_logprobs_mode=support sent?)"
            )
        lps = [_number(v, "output_token_sampling_logprobs") for v in row]
        logp.append(lps[int(np.flatnonzero(ids == tok)[0])])
        order = sorted(range(len(lps)), key=lambda j: -lps[j])  # stable: ties keep SGLang's
        rows.append([(lps[j], int(ids[j])) for j in order])
    return logp, _pad(rows, k)


def _top_logprobs(meta: dict, num_tokens: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``output_top_logprobs`` (no filter active) → ``[R, k]`` ids and log-probs."""
    top = meta.get("output_top_logprobs")
    if not isinstance(top, list) or len(top) != num_tokens:
        got = len(top) if isinstance(top, list) else type(top).__name__
        raise EngineError(
            f"output_top_logprobs has {got} entries for {num_tokens} tokens "
            "(was top_logprobs_num sent?)"
        )
    rows = []
    for t, entries in enumerate(top):
        try:
            row = [(float(e[0]), int(e[1])) for e in (entries or [])]
        except (TypeError, ValueError, IndexError) as e:
            raise EngineError(f"malformed output_top_logprobs at token {t}: {e}") from e
        if not all(math.isfinite(lp) for lp, _ in row):
            raise EngineError(f"output_top_logprobs at token {t} has a non-finite value")
        rows.append(sorted(row, key=lambda e: -e[0]))
    return _pad(rows, k)
