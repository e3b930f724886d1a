"""The Megatron actor's checkpoints (``MegatronActor.save`` / ``load``).

``save(dir)`` writes ``model/`` (HF, ``export_hf``), an ``optimizer.safetensors`` with the AdamW
moments keyed by megatron parameter name (``state/<name>/<key>``) and the torch RNG state, and
``trainer_state.json``; the layout matches the local trainer's, but the optimizer tensors are
keyed by megatron names, so a checkpoint resumes only on the backend that wrote it
(``"backend": "megatron"`` in the JSON), and only with the same parallel layout and dtype.
With several ranks each writes ``optimizer_rank{r}.safetensors`` (expert moments are sharded).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sat_cli.models.tiny_moe import torch_dtype
from sat_cli.trainers.optim_state import load_optimizer_tensors, optimizer_tensors


class CheckpointMixin:
    """``save`` and ``load`` of a ``MegatronActor`` (its model, optimizer, ranks and dtype)."""

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _optimizer_file(self) -> str:
        return (
            "optimizer.safetensors" if self.world == 1 else f"optimizer_rank{self.rank}.safetensors"
        )

    def save(self, dir: str | os.PathLike) -> None:
        """Checkpoint to ``dir`` (atomic: written to a temporary sibling, then renamed).

        With several ranks each writes ``optimizer_rank{r}.safetensors`` (expert moments are
        sharded); rank 0 writes the rest.
        """
        final = Path(dir)
        tmp = final.parent / f".{final.name}.tmp-save"
        if self.rank == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        try:
            self.export_hf(tmp / "model", main=True)
            if self.core is not None:  # this rank's main-weight and Adam-state shards
                tensors = self.core.state_tensors(self.model.named_parameters())
                tensors["rng/torch"], param_groups = torch.get_rng_state(), []
            else:
                names = [n for n, _ in self.model.named_parameters()]
                tensors, param_groups = optimizer_tensors(self.opt, names.__getitem__)
            save_file(tensors, str(tmp / self._optimizer_file()))
            self._barrier()
            if self.rank == 0:
                meta: dict[str, Any] = {
                    "backend": "megatron",
                    "world_size": self.world,
                    "ep": self.ep,
                    "tp": self.tp,
                    "pp": self.pp,
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "step_count": self.step_count,
                    "param_groups": param_groups,
                }
                (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            self._barrier()
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(self, dir: str | os.PathLike) -> None:
        d = Path(dir)
        meta = json.loads((d / "trainer_state.json").read_text())
        if meta.get("backend") != "megatron":
            raise ValueError(
                f"{d} was written by the {meta.get('backend', 'local')!r} trainer; the megatron "
                "trainer resumes only its own checkpoints (start from its model/ folder instead)"
            )
        keys = ("world_size", "ep", "tp", "pp")
        layout = {k: int(meta.get(k, 1)) for k in keys}
        ours = dict(zip(keys, (self.world, self.ep, self.tp, self.pp), strict=True))
        if layout != ours:
            raise ValueError(
                f"{d} was saved with {layout}; this run has {ours} (optimizer shards do not match)"
            )
        dtype = meta.get("dtype", "float32")
        if torch_dtype(dtype) != self.dtype:
            raise ValueError(f"{d} was saved with dtype {dtype}; this run has {self.dtype}")
        tensors = load_file(str(d / self._optimizer_file()))
        self._load_weights(self.model, d / "model")
        self.step_count = int(meta["step_count"])
        if self.core is not None:
            self.core.load_state_tensors(self.model.named_parameters(), tensors)
            torch.set_rng_state(tensors["rng/torch"])
            return
        if self.main is not None:  # model/ holds the fp32 main weights
            self.main.load(self._hf_main_state(d / "model"))
        index = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        # rank 0 wrote the hyperparameters; the parameter indices are this rank's own (pipeline
        # stages hold different numbers of parameters)
        groups = [
            {**saved, "params": own["params"]}
            for saved, own in zip(
                meta["param_groups"], self.opt.state_dict()["param_groups"], strict=True
            )
        ]
        load_optimizer_tensors(self.opt, tensors, groups, index.__getitem__, device=self.device)
