"""One GPU without the cluster stack: ``engine=local`` / ``trainer=local`` with
``engine.device=cuda trainer.device=cuda`` and bf16 (``engine.dtype`` / ``trainer.dtype``).

Tested here on the CPU, everything but the CUDA device itself: the config composes, the builders
hand the device and dtype to the engine and the trainer, the trainer's bf16 mode (autocast, fp32
weights and AdamW states) computes what it should, and a run on a machine without a GPU is
refused in one line before anything is written. The GPU run itself: scripts/gpu_check_local.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml
from cli_helpers import run_sat

from sat_cli.config import ConfigError, load
from sat_cli.engines.base import Sample
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

CUDA = ["engine=local", "trainer=local", "engine.device=cuda", "trainer.device=cuda"]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


def _sat_without_gpu(*args, cwd):
    """`sat <args>` with no GPU visible (also on a GPU machine)."""
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"},
    )


def test_cuda_devices_and_bf16_compose(tmp_path):
    out = run_sat("config", *CUDA, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert (cfg["engine"]["name"], cfg["engine"]["device"]) == ("local", "cuda")
    assert (cfg["trainer"]["name"], cfg["trainer"]["device"]) == ("local", "cuda")
    _, obj = load([*CUDA, "engine.dtype=bfloat16", "trainer.dtype=bfloat16"])
    assert (obj.engine.device, obj.trainer.device) == ("cuda", "cuda")
    assert (obj.engine.dtype, obj.trainer.dtype) == ("bfloat16", "bfloat16")
    _, obj = load([])  # the default stays on the CPU in fp32
    assert (obj.engine.device, obj.trainer.device, obj.trainer.dtype) == ("cpu", "cpu", "float32")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.device=gpu"], "trainer.device='gpu' is not valid"),
        (["trainer=megatron", "trainer.device=cuda"], "trainer.device=cuda needs trainer=local"),
    ],
)
def test_device_settings_that_cannot_work_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load(overrides)


@no_gpu
@pytest.mark.parametrize(
    "command, keys",
    [
        (["train", *CUDA], "engine.device=cuda and trainer.device=cuda"),
        pytest.param(  # the train case above keeps the class; ~3 s
            ["train", "trainer.device=cuda"], "trainer.device=cuda", marks=pytest.mark.slow
        ),
        (["eval", "toy", "engine.device=cuda", "trainer.device=cuda"], "engine.device=cuda"),
    ],
)
def test_a_run_without_a_gpu_is_refused_before_writing(tmp_path, command, keys):
    out = _sat_without_gpu(*command, "run.dir=runs", cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"sat: error: {keys}: no CUDA GPU is visible to torch "), (
        out.stderr
    )
    assert list(tmp_path.iterdir()) == []  # no run folder, no MLflow store


def test_builders_hand_device_and_dtype_to_engine_and_trainer(monkeypatch, tmp_path):
    import sat_cli.engines.local.engine as engine_mod  # where the registry's build imports it
    import sat_cli.trainers.local as trainer_mod
    from sat_cli.build.components import build_engine, build_trainer

    seen = {}

    def recorder(name):
        return lambda path, **kw: seen.setdefault(name, kw)

    def engine(settings, runtime):  # LocalEngine(settings, runtime): the device the plan gave
        seen["engine"] = {"device": runtime.device, "dtype": settings.dtype}

    monkeypatch.setattr(engine_mod, "LocalEngine", engine)
    monkeypatch.setattr(trainer_mod, "LocalTrainer", recorder("trainer"))
    _, obj = load([*CUDA, "engine.dtype=bfloat16", "trainer.dtype=bfloat16"])
    build_engine(obj, "model", tmp_path, r3=False)
    build_trainer(obj, "model", tmp_path)
    # the device plan's GPUs (tests/test_device_plan.py): the engine's, then the trainer's
    assert (seen["engine"]["device"], seen["engine"]["dtype"]) == ("cuda:0", "bfloat16")
    assert (seen["trainer"]["device"], seen["trainer"]["dtype"]) == ("cuda:1", "bfloat16")
    seen.clear()
    _, obj = load([])
    build_engine(obj, "model", tmp_path, r3=False)
    build_trainer(obj, "model", tmp_path)
    assert (seen["engine"]["device"], seen["engine"]["dtype"]) == ("cpu", "float32")
    assert (seen["trainer"]["device"], seen["trainer"]["dtype"]) == ("cpu", "float32")


def _batch():
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        ids = torch.randint(3, 100, (6 + 2 * i,), generator=g).tolist()
        logp = (-4.6 + 0.1 * torch.randn(4 + i, generator=g)).tolist()
        samples.append(
            Sample(ids, torch.randint(3, 100, (4 + i,), generator=g).tolist(), logp, "length", 0)
        )
    return collate(samples, [1.0, -1.0, 0.5, -0.5], pad_id=0)


def _linear_dtypes(trainer, batch) -> set:
    seen = set()
    hooks = [
        m.register_forward_hook(lambda m, a, o: seen.add(o.dtype))
        for m in trainer.model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    trainer.logprobs(batch)
    for h in hooks:
        h.remove()
    return seen


def test_bf16_trainer_autocasts_the_forward_and_keeps_fp32_weights(tiny_dir):
    batch = _batch()
    kw = dict(lr=1e-3, loss=LossConfig(algo="grpo"), seed=0)
    fp32 = LocalTrainer(str(tiny_dir), **kw)
    bf16 = LocalTrainer(str(tiny_dir), dtype="bfloat16", **kw)
    assert _linear_dtypes(fp32, batch) == {torch.float32}  # no autocast at all by default
    assert _linear_dtypes(bf16, batch) == {torch.bfloat16}
    lp32, lp16 = fp32.logprobs(batch), bf16.logprobs(batch)
    m = batch.loss_mask.bool()
    d = (lp32 - lp16)[m].abs()
    assert lp16.dtype == torch.float32
    assert 0 < d.max() < 0.05  # bf16 matmuls: close to fp32, not equal
    # the default path is plain fp32: a second fp32 trainer gives the same bits
    assert torch.equal(LocalTrainer(str(tiny_dir), **kw).logprobs(batch), lp32)
    before = {k: v.detach().clone() for k, v in bf16.model.named_parameters()}
    metrics = bf16.step(batch)
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("loss/total", "loss/grad_norm"))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    states = [t for st in bf16.opt.state.values() for t in st.values() if t.dim() > 0]
    assert states and all(t.dtype == torch.float32 for t in states)
    moved = max((p.detach() - before[k]).abs().max() for k, p in bf16.model.named_parameters())
    assert 0.5e-3 < moved <= 1.01e-3  # Adam's first step moves a weight by at most lr


def test_trainer_refuses_an_unknown_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype='float16': use float32 or bfloat16"):
        LocalTrainer(str(tiny_dir), dtype="float16", lr=1e-3)
