"""Log-probs and entropy from the final hidden states and the LM head, a bounded chunk of
positions at a time: full-vocabulary logits (``[tokens, V]``) are never held for more than
``chunk`` positions (STYLE.md 15, in the manner of Liger's fused linear cross-entropy).

:func:`head_scores` takes the decoder's last hidden states ``[B, S, H]`` and the LM head (an
``nn.Linear``) and returns what ``token_logprobs`` / ``topk_logprobs`` return for
``head(hidden)``: per chunk of flattened positions it forms the chunk's logits, applies the
per-position rules of ``trainers/logprobs.py`` (``scores_at``, ``topk_at``: kept-set replay and
the sampler's top-k included) and drops the logits. With gradient it runs as one
``torch.autograd.Function`` that keeps only the hidden states and, in backward, recomputes each
chunk's logits and takes that chunk's gradients w.r.t. the hidden states and the head (the
head's summed over chunks).

When every position fits one chunk the plain autograd graph is built instead (no recompute):
its logits are within the bound, and the arithmetic is the unchunked one op for op, so a run
whose minibatches fit one chunk (the CPU default: 128-token vocabulary) is bit-identical to
scoring ``head(hidden)`` whole. Several chunks give the same values position by position; the
head's gradient is then a sum of per-chunk products, equal up to float summation order.

:func:`chunk_positions` is the default chunk: as many positions as keep one fp32 copy of the
chunk's logits within ``CHUNK_LOGIT_ELEMENTS`` (128 MiB), unless ``trainer.logprob_chunk_tokens``
sets it.
"""

from __future__ import annotations

import torch

from sat_cli.trainers.logprobs import scores_at, topk_at, upcast

CHUNK_LOGIT_ELEMENTS = 2**25  # logits per chunk by default: 128 MiB as fp32


def chunk_positions(vocab: int, tokens: int | None = None) -> int:
    """Positions per chunk: ``tokens`` when set, else ``CHUNK_LOGIT_ELEMENTS // vocab``."""
    if tokens is not None:
        return max(1, int(tokens))
    return max(1, CHUNK_LOGIT_ELEMENTS // max(1, int(vocab)))


def head_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    temperature: float,
    kept: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    chunk: int | None = None,
):
    """``(logp [B, S], entropy [B, S][, topk_logp [B, S, K]])`` of ``head(hidden)`` with
    ``trainers/logprobs.py``'s alignment (column 0: 0): ``hidden [B, S, H]``, ``head`` an
    ``nn.Linear`` (its weight ``[V, H]``, bias or none), ``input_ids [B, S]``, ``kept`` /
    ``topk_ids`` ``[B, S, K]`` (-1 padding) as ``token_logprobs`` / ``topk_logprobs`` take them;
    ``topk_logp`` only with ``topk_ids``. ``chunk``: positions per chunk (default
    :func:`chunk_positions`). Call it under the same autocast as the model's forward."""
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"chunked log-probs need an nn.Linear LM head, got {type(head).__name__}")
    B, S, H = hidden.shape
    weight, bias = head.weight, head.bias
    n = chunk_positions(weight.shape[0], chunk)
    flat = hidden.reshape(B * S, H)  # [N, H]: position (b, s) scores the token at (b, s + 1)
    targets = _shifted(input_ids, 0).reshape(-1)  # [N]
    kept_f = None if kept is None else _shifted(kept, -1).reshape(B * S, -1)  # [N, K]
    topk_f = None if topk_ids is None else _shifted(topk_ids, -1).reshape(B * S, -1)  # [N, K]
    rest = (targets, kept_f, topk_f, float(temperature))
    grad = torch.is_grad_enabled() and (
        flat.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if B * S <= n or not grad:  # the plain graph, or no graph at all
        outs = _all_chunks(flat, weight, bias, rest, n)
    else:
        bias_t = bias if bias is not None else weight.new_empty(0)
        outs = _ChunkedHead.apply(flat, weight, bias_t, n, *rest)
    lp, ent, *tk = (o.reshape(B, S, *o.shape[1:]) for o in outs)
    return (_unshift(lp), _unshift(ent.detach()), *(_unshift(t) for t in tk))


def _shifted(x: torch.Tensor, fill: int) -> torch.Tensor:
    """``x[:, 1:]`` moved onto the position that scores it, the last column filled (no token
    follows it; its scores are dropped)."""
    pad = x.new_full((x.shape[0], 1, *x.shape[2:]), fill)
    return torch.cat([x[:, 1:], pad], dim=1)


def _unshift(x: torch.Tensor) -> torch.Tensor:
    """The scores of positions ``0 .. S-2`` onto the tokens ``1 .. S-1``; column 0 is 0."""
    return torch.cat([x.new_zeros((x.shape[0], 1, *x.shape[2:])), x[:, :-1]], dim=1)


def _chunk(h, weight, bias, targets, kept, topk, temperature):
    """One chunk's ``(logp, entropy[, topk_logp])`` from its hidden states ``h [n, H]``."""
    logits = torch.nn.functional.linear(h, weight, bias)  # [n, V]
    return _scored(upcast(logits) / temperature, targets, kept, topk)


def _scored(z, targets, kept, topk):
    """``(logp, entropy[, topk_logp])`` of ``z [n, V]`` (logits / T, upcast)."""
    lp, ent = scores_at(z, targets, kept)  # [n], [n]
    return (lp, ent) if topk is None else (lp, ent, topk_at(z, topk, kept))


def _piece(x: torch.Tensor | None, i: int, j: int):
    return None if x is None else x[i:j]


def _all_chunks(flat, weight, bias, rest, n: int) -> list[torch.Tensor]:
    """Every chunk's scores, concatenated (with the autograd graph when grad is on)."""
    targets, kept, topk, temperature = rest
    N = flat.shape[0]
    if N <= n:
        return list(_chunk(flat, weight, bias, targets, kept, topk, temperature))
    parts = [
        _chunk(
            flat[i : i + n],
            weight,
            bias,
            targets[i : i + n],
            _piece(kept, i, i + n),
            _piece(topk, i, i + n),
            temperature,
        )
        for i in range(0, N, n)
    ]
    return [torch.cat(p) for p in zip(*parts, strict=True)]


class _ChunkedHead(torch.autograd.Function):
    """Forward: the chunks' scores without a graph; backward: each chunk recomputed with one,
    under the autocast the forward ran in, and its gradients taken (module docstring)."""

    @staticmethod
    def forward(ctx, flat, weight, bias, n, targets, kept, topk, temperature):
        dev = flat.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.n, ctx.rest = n, (targets, kept, topk, temperature)
        ctx.save_for_backward(flat, weight, bias)
        with torch.no_grad():
            outs = _all_chunks(flat, weight, bias if bias.numel() else None, ctx.rest, n)
        ctx.mark_non_differentiable(outs[1])
        return tuple(outs)

    @staticmethod
    def backward(ctx, g_lp, g_ent, *g_topk):
        flat, weight, bias = ctx.saved_tensors
        targets, kept, topk, temperature = ctx.rest
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        b = bias if bias.numel() else None
        want_b = want_b and b is not None
        grads = _Grads(flat, weight, b, want_h, want_w, want_b)
        enabled, dtype = ctx.autocast
        for i in range(0, flat.shape[0], ctx.n):
            j = i + ctx.n
            with torch.autocast(flat.device.type, dtype, enabled=enabled):
                if kept is None and topk is None:
                    grads.add_plain(i, j, targets[i:j], g_lp[i:j], temperature)
                else:
                    pieces = (targets[i:j], _piece(kept, i, j), _piece(topk, i, j), temperature)
                    grads.add_autograd(
                        i, j, pieces, g_lp[i:j], g_topk[0][i:j] if topk is not None else None
                    )
        return grads.h, grads.w, grads.b, None, None, None, None, None


class _Grads:
    """The backward's gradients w.r.t. the hidden states (filled chunk by chunk) and the head's
    weight and bias (summed over chunks in place)."""

    def __init__(self, flat, weight, bias, want_h, want_w, want_b):
        self.flat, self.weight, self.bias = flat, weight, bias
        self.h = torch.zeros_like(flat) if want_h else None
        self.w = torch.zeros_like(weight) if want_w else None
        self.b = torch.zeros_like(bias) if want_b else None

    def add_plain(self, i, j, targets, g, temperature):
        """Log-probs of the plain softmax (no kept set, no top-k): the gradient w.r.t. the
        chunk's logits is ``g * (onehot(y) - softmax(z)) / T``, formed in place."""
        h = self.flat[i:j]
        logits = torch.nn.functional.linear(h, self.weight, self.bias)  # [n, V]
        z = upcast(logits) / temperature  # [n, V]
        gz = torch.softmax(z, dim=-1).mul_(-g[:, None].to(z.dtype))  # [n, V]
        gz.scatter_add_(-1, targets[:, None], g[:, None].to(z.dtype))
        self._apply(i, j, h, gz.div_(temperature).to(logits.dtype))

    def add_autograd(self, i, j, pieces, g_lp, g_topk):
        """Kept sets or top-k: the chunk recomputed with a graph, its logits' gradient taken by
        autograd."""
        h = self.flat[i:j]
        with torch.enable_grad():
            logits = torch.nn.functional.linear(h, self.weight, self.bias).detach()
            logits.requires_grad_(True)
            z = upcast(logits) / pieces[3]
            outs = _scored(z, *pieces[:3])
            pairs = [(outs[0], g_lp)] + ([(outs[2], g_topk)] if g_topk is not None else [])
            (gz,) = torch.autograd.grad([o for o, _ in pairs], [logits], [g for _, g in pairs])
        self._apply(i, j, h, gz)

    def _apply(self, i, j, h, gz):
        """The chunk's logits' gradient ``gz [n, V]`` into the hidden states' and the head's
        (in place where the dtypes agree: no ``[V, H]`` temporary per chunk in fp32)."""
        same = gz.dtype == h.dtype == self.weight.dtype
        if self.h is not None:
            if same:
                torch.mm(gz, self.weight, out=self.h[i:j])
            else:  # autocast: bf16 matmuls, as the whole graph's
                self.h[i:j] = torch.mm(gz, self.weight.to(gz.dtype)).to(self.h.dtype)
        if self.w is not None:
            if same:
                self.w.addmm_(gz.t(), h)
            else:
                self.w += torch.mm(gz.t(), h.to(gz.dtype)).to(self.w.dtype)
        if self.b is not None:
            self.b += gz.sum(0).to(self.b.dtype)
