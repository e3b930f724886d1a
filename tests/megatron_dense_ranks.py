"""One rank of tests/test_megatron_dense.py's model-parallel check, run under torchrun (gloo).

``python -m torch.distributed.run --nproc-per-node 2 megatron_dense_ranks.py OUT DIR...``: for
each layout (tp 2, then pp 2) and each HF model folder ``DIR``, a ``MegatronActor`` (the
worker's state: the lazy per-rank load of the HF checkpoint) computes the full logits of a fixed
batch (pp: the first stage sends its hidden states to the last) and gathers its weights back
into HF naming (``hf_state``: the tensor-parallel gather, the stages' gather). At tp 2 each
rank also takes the training path: its vocabulary shard of the logits and the log-probs taken
across the shards (``runtime.vocab_parallel_logprobs``, temperature ``T``), with the gradient
of ``sum(W * logp)`` reaching its shard, written to ``OUT/tp2-<n>-vp<rank>.pt``. The last rank
writes ``OUT/<layout>-<n>.pt`` with the logits, the batch and the gathered HF state.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
B, S = 3, 24
T = 0.9


def loss_weights() -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, B * S).reshape(B, S)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 100, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S)


def logits(actor, ids, pos) -> torch.Tensor | None:
    """Full logits ``[B, S, V]`` on the last stage (None on the others)."""
    import torch.distributed as dist

    from sat_cli.trainers.megatron import runtime

    model, stage = actor.model, actor.stage
    if stage is None:
        return runtime.forward_logits(model, ids, pos)
    cfg = model.config
    if not stage.is_first:
        hidden = torch.empty((S, B, cfg.hidden_size), dtype=cfg.params_dtype)
        dist.recv(hidden, src=stage.prev)
        model.set_input_tensor(hidden)
    out = runtime.forward_logits(model, ids, pos)
    if not stage.is_last:
        dist.send(out.contiguous(), dst=stage.next)
        return None
    return out


def vocab_parallel(actor, ids, pos) -> dict:
    """This rank's shard of the logits, the log-probs across shards and its shard's gradient."""
    from megatron.core import parallel_state

    from sat_cli.trainers.megatron import runtime

    shard = runtime.forward_logits_shard(actor.model, ids, pos).detach().requires_grad_(True)
    logp, entropy = runtime.vocab_parallel_logprobs(shard, ids, T)
    (logp * loss_weights()).sum().backward()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return {"rank": rank, "logp": logp.detach(), "entropy": entropy, "grad": shard.grad}


def main(out: Path, dirs: list[str]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from sat_cli.trainers.megatron import runtime
    from sat_cli.trainers.megatron.actor import MegatronActor

    ids, pos = batch()
    for layout, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        runtime.init_distributed(tp=tp, pp=pp)
        for n, model_dir in enumerate(dirs):
            actor = MegatronActor(model_dir)
            actor.model.eval()
            with torch.no_grad():
                got = logits(actor, ids, pos)
            vp = vocab_parallel(actor, ids, pos) if tp > 1 else {}
            state = actor.hf_state()  # a collective: every rank
            if vp:
                torch.save(vp, out / f"{layout}-{n}-vp{vp['rank']}.pt")
            if dist.get_rank() == dist.get_world_size() - 1:
                torch.save({"logits": got, "ids": ids, "state": state}, out / f"{layout}-{n}.pt")
            del actor
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
