"""One rank of tests/test_megatron_dense.py's model-parallel check, run under torchrun (gloo).

``python -m torch.distributed.run --nproc-per-node 2 megatron_dense_ranks.py OUT DIR...``: for
each layout (tp 2, then pp 2) and each HF model folder ``DIR``, a ``MegatronActor`` (the
worker's state: the lazy per-rank load of the HF checkpoint) computes the full logits of a fixed
batch (pp: the first stage sends its hidden states to the last) and gathers its weights back
into HF naming (``hf_state``: the tensor-parallel gather, the stages' gather). The last rank
writes ``OUT/<layout>-<n>.pt`` with the logits, the batch and the gathered HF state.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
B, S = 3, 24


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
            state = actor.hf_state()  # a collective: every rank
            if dist.get_rank() == dist.get_world_size() - 1:
                torch.save({"logits": got, "ids": ids, "state": state}, out / f"{layout}-{n}.pt")
            del actor
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
