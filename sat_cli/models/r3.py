"""Rollout Routing Replay (R3) for HF Qwen3-MoE models: capture and replay hooks on ``mlp.gate``.

Capture (engine side): a forward hook on every MoE router records the top-K expert indices it
chose, ``[tokens, K]`` per call (the prefill call, then one call per decode step). The engine
stitches them into SGLang's per-sample layout ``[prompt_len + response_len - 1, L, K]`` int32:
row ``i`` is the routing of the token at position ``i`` when it was fed to the model; the last
token of a sample is never fed, so it has no row.

Replay (trainer side, ALGORITHMS.md §6): a forward hook replaces the router's output by the
recorded index set ``I`` and gate weights recomputed from the *current* router logits ``z``:
``g_e = 1[e in I] exp(z_e) / sum_{e' in I} exp(z_e')`` (for ``norm_topk_prob=True`` models such as
the tiny model and Qwen3-30B-A3B; with ``norm_topk_prob=False`` the model's own un-renormalised
softmax probabilities at ``I`` are used, as its router would). The weights are computed with the
router's own operations (softmax over all experts in fp32, gather, renormalise), so when the
recorded set equals the router's own top-K the output is bit-identical to no replay. The router
weight stays in the autograd graph, so it still gets gradients through ``g``.

Routes are given batch-major ``[B, S, L, K]`` aligned with the training ``input_ids [B, S]``
(HF/SGLang order, token ``b*S + s`` in the router's flattened input). Missing or mis-shaped routes
raise ``R3Error``; there is no silent fallback to the router's own choice.
"""

from __future__ import annotations

import contextlib

import torch

from sat_cli.errors import TrainerError
from sat_cli.models.tiny_moe import moe_gates


class R3Error(TrainerError):
    """Recorded routes are missing, mis-shaped or out of range for the forward pass."""


def check_routes(routed_experts: torch.Tensor | None, input_ids: torch.Tensor) -> None:
    """A training batch under R3 must carry routes ``[B, S, L, K]`` matching ``input_ids [B, S]``
    (both trainers check this before their forward); raises ``R3Error`` otherwise."""
    if routed_experts is None:
        raise R3Error("R3 is on but the batch has no routed experts (engine started without r3?)")
    if tuple(routed_experts.shape[:2]) != tuple(input_ids.shape):
        raise R3Error(
            f"routed experts {tuple(routed_experts.shape)} do not match input_ids "
            f"{tuple(input_ids.shape)}"
        )


class _GateHooks:
    """A context manager that holds one forward hook per MoE router (``self._hook(layer)``)."""

    gates: list
    _handles: list

    def _hook(self, layer: int):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class RouteCapture(_GateHooks):
    """Records the experts chosen by every router call while active (a context manager).

    ``calls[l]`` is the list of ``[tokens, K]`` int32 CPU tensors recorded by layer ``l``, one
    per forward call, in call order.
    """

    def __init__(self, model):
        self.gates = moe_gates(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.gates]
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, output):
            indices = output[2]  # [tokens, K]
            self.calls[layer].append(indices.detach().to(torch.int32).cpu())

        return hook

    def clear(self) -> None:
        self.calls = [[] for _ in self.gates]

    def last_call(self) -> torch.Tensor:
        """The most recent call of every layer stacked: ``[tokens, L, K]`` int32."""
        return torch.stack([c[-1] for c in self.calls], dim=1)


def replay_gate_output(logits: torch.Tensor, indices: torch.Tensor, norm_topk_prob: bool):
    """Router output ``(logits, weights, indices)`` forced to ``indices`` ``[N, K]``.

    ``weights[n, j] = softmax(logits[n])[indices[n, j]]``, renormalised over the set when
    ``norm_topk_prob`` (then equal to the softmax of ``logits[n]`` restricted to the set).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
    weights = probs.gather(1, indices)  # [N, K]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


class RouteReplay(_GateHooks):
    """Forces every MoE router to recorded experts while active (a context manager).

    ``routes``: integer tensor ``[B, S, L, K]`` for the next forward over ``input_ids [B, S]``.
    Positions whose route does not matter (padding, a sample's last token) still need valid
    expert ids; ``collate`` fills them with ``0..K-1``.
    """

    def __init__(self, model, routes: torch.Tensor):
        self.gates = moe_gates(model)
        self.num_experts = model.config.num_experts
        self.top_k = model.config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(model.config, "norm_topk_prob", True))
        if routes is None:
            raise R3Error("R3 replay is on but the batch carries no routed experts")
        if routes.dim() != 4 or routes.shape[2] != len(self.gates) or routes.shape[3] != self.top_k:
            raise R3Error(
                f"routed experts have shape {tuple(routes.shape)}; expected [B, S, "
                f"{len(self.gates)} layers, top_k={self.top_k}]"
            )
        if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= self.num_experts):
            raise R3Error(f"routed expert ids out of range [0, {self.num_experts})")
        self.routes = routes.long()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits = output[0]  # [B*S, E]
            forced = self.routes[:, :, layer, :].reshape(-1, self.top_k).to(logits.device)
            if forced.shape[0] != logits.shape[0]:
                raise R3Error(
                    f"layer {layer}: the router saw {logits.shape[0]} tokens but the recorded "
                    f"routes cover {forced.shape[0]} (B*S of the routes tensor)"
                )
            return replay_gate_output(logits, forced, self.norm_topk_prob)

        return hook


def maybe_replay(model, routes: torch.Tensor | None, enabled: bool):
    """``RouteReplay(model, routes)`` when ``enabled``, else a no-op context."""
    return RouteReplay(model, routes) if enabled else contextlib.nullcontext()


class RouteAudit:
    """Counts the (token, layer) rows where the experts a forward used differ from ``routes``
    (``[B, S, L, K]``, checked where ``valid [B, S]``); ``rows`` and ``mismatched`` accumulate
    over the forwards run inside the context (``trainer.r3_audit``).

    This class hooks HF Qwen3-MoE: a forward pre-hook on every layer's ``mlp.experts`` reads the
    expert indices the experts actually receive (after any replay). Subclasses for other models
    override :meth:`_attach` and :meth:`_used`."""

    def __init__(self, model, routes: torch.Tensor, valid: torch.Tensor):
        self.model = model
        self.routes = routes.long()
        self.valid = valid.bool()
        self.rows = 0
        self.mismatched = 0
        self._handles = []

    def _attach(self, on_layer) -> list:
        """Register hooks that call ``on_layer(layer, module_args, module_output)``."""
        return [
            layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: on_layer(i, a, None))
            for i, layer in enumerate(self.model.model.layers)
        ]

    def _used(self, args, output) -> torch.Tensor:
        """``[B, S, E]`` bool: the experts each token went to (HF order: token ``b*S + s``)."""
        indices = args[1].detach().cpu()  # [B*S, K]
        b, s = self.valid.shape
        used = torch.zeros(b * s, self.model.config.num_experts, dtype=torch.bool)
        return used.scatter(-1, indices.long(), True).view(b, s, -1)

    def _check(self, layer: int, args, output) -> None:
        used = self._used(args, output)
        want = torch.zeros_like(used).scatter(-1, self.routes[:, :, layer], True)
        bad = (used != want).any(-1)[self.valid]
        self.rows += int(bad.numel())
        self.mismatched += int(bad.sum())

    def __enter__(self) -> RouteAudit:
        self._handles = self._attach(self._check)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
