"""run.portable_numerics's optimizer (issue 58 item 2): the trainer's AdamW takes torch's fused
CPU kernel, whose square root is the processor's exact one.

Why: torch.sqrt on a float32 CPU tensor goes to MKL's vector math (VML), and the branch VML
takes on an AMD CPU (and under ``MKL_CBWR=COMPATIBLE``) refines the approximate ``rsqrtps``,
whose bits differ between Intel and AMD: about one element in five is one ulp off the correctly
rounded root, and which ones depends on the vendor. The numerics fingerprint found it
(``adamw`` was the one class that differed between an Intel and an AMD kind under the pins;
bench/README.md). The references here are machine-independent: AdamW's update written out in
torch ops with a correctly rounded square root (float64 root, rounded once: exact for float32).
"""

from __future__ import annotations

import math

import pytest
import torch

from sat_cli.trainers.optim_state import load_optimizer_tensors, optimizer_tensors
from sat_cli.trainers.step import PolicyTrainer, StepSettings

LR, BETAS, WD, EPS = 3e-4, (0.9, 0.98), 0.01, 1e-8


def _optimizer(params, portable: bool):
    trainer = PolicyTrainer.__new__(PolicyTrainer)  # _new_optimizer reads the settings only
    trainer.settings = StepSettings(lr=LR, betas=BETAS, weight_decay=WD, portable_numerics=portable)
    return trainer._new_optimizer(params)


def _exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 root: math.sqrt (IEEE, exact in float64; not torch's, which
    may go to VML) rounded once to float32, which is innocuous for sqrt (53 >= 2 * 24 + 2)."""
    roots = [math.sqrt(v) for v in t.double().flatten().tolist()]
    return torch.tensor(roots, dtype=torch.float64).float().view_as(t)


def _reference_step(p, g, m, v, step: int) -> None:
    """torch's single-tensor AdamW update, in its order, with the exact square root."""
    b1, b2 = BETAS
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    step_size = LR / (1 - b1**step)
    denom = (_exact_sqrt(v) / math.sqrt(1 - b2**step)).add_(EPS)
    p.addcdiv_(m, denom, value=-step_size)


def _data(seed: int, shape=(96, 40)):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) * 10.0 ** (k - 2) for k in range(4)]
    return p0, grads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_portable_adamw_equals_the_update_with_an_exact_square_root(seed):
    p0, grads = _data(seed)
    p = torch.nn.Parameter(p0.clone())
    opt = _optimizer([p], portable=True)
    assert opt.param_groups[0]["fused"] is True
    ref, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        _reference_step(ref, g, m, v, step)
        assert torch.equal(p.detach(), ref), step  # bit for bit, on any CPU
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_the_default_run_keeps_torchs_default_adamw():
    """Only the portable mode changes the optimizer: the default run's numbers stay as they
    were (its AdamW is torch's default path, not fused)."""
    opt = _optimizer([torch.nn.Parameter(torch.zeros(3))], portable=False)
    assert opt.param_groups[0]["fused"] is None
    assert opt.defaults["fused"] is None


def test_a_checkpoint_resumes_with_this_runs_optimizer_path():
    """The optimizer's implementation flags are this process's choice: a checkpoint written by
    the default path resumes under the portable mode on the fused kernel (and back), with the
    moments and hyperparameters of the checkpoint."""
    p0, grads = _data(7)
    a = torch.nn.Parameter(p0.clone())
    plain = _optimizer([a], portable=False)
    for g in grads[:2]:
        a.grad = g.clone()
        plain.step()
    tensors, groups = optimizer_tensors(plain)
    b = torch.nn.Parameter(a.detach().clone())
    fused = _optimizer([b], portable=True)
    load_optimizer_tensors(fused, tensors, [dict(g) for g in groups])
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["lr"] == LR
    assert torch.equal(fused.state[b]["exp_avg_sq"], plain.state[a]["exp_avg_sq"])
    ref, m = b.detach().clone(), fused.state[b]["exp_avg"].clone()
    v = fused.state[b]["exp_avg_sq"].clone()
    b.grad = grads[2].clone()
    fused.step()
    _reference_step(ref, grads[2], m, v, 3)
    assert torch.equal(b.detach(), ref)
    back = _optimizer([torch.nn.Parameter(b.detach().clone())], portable=False)
    load_optimizer_tensors(back, *optimizer_tensors(fused))
    assert back.param_groups[0]["fused"] is None


@pytest.mark.parametrize("portable", [True, False])
def test_the_run_setting_reaches_the_trainers_optimizer(tmp_path, portable):
    """``run.portable_numerics`` is what decides it: the trainer a run builds from its config."""
    from pathlib import Path

    from sat_cli.build.components import build_trainer
    from sat_cli.config import load

    _, obj = load([f"run.portable_numerics={str(portable).lower()}"])
    model = Path(__file__).resolve().parents[1] / "sat_cli" / "assets" / "tiny_moe_warm"
    tr = build_trainer(obj, str(model), tmp_path)
    assert tr.opt.param_groups[0]["fused"] is (True if portable else None)
