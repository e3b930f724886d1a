"""One loss configuration: every loss setting of the config schema reaches ``LossConfig``, which
round-trips through JSON (the Megatron worker's channel); the algorithm names are defined once
(``sat_cli.rl.names``, torch-free) and the schema and the registry agree with them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from sat_cli.build.parts import loss_config
from sat_cli.config import load, sat_scope, schema
from sat_cli.rl import names, registry
from sat_cli.rl.config import LossConfig
from sat_cli.rl.loss_io import LossInputs, LossOutputs

# schema field -> LossConfig field; every other field of algo.* / clip.* is named in LOOP_OWNED
ALGO_FIELDS = {
    "name": "algo",
    "correction": "correction",
    "eps_low": "eps_low",
    "eps_high": "eps_high",
    "dual_clip_c": "dual_clip_c",
    "loss_agg": "agg",
    "ratio_denominator": "ratio_denominator",
    "kl_coef": "kl_coef",
    "tis_cap": "tis_cap",
    "icepop_low": "icepop_low",
    "icepop_high": "icepop_high",
    "dppo_delta": "dppo_delta",
    "m2po_tau": "m2po_tau",
    "behav_cap": "behav_cap",
    "behav_mode": "behav_mode",
    "vcpo_is_cap": "vcpo_is_cap",
    "vcpo_ess_base": "vcpo_ess_base",
    "vcpo_opob": "vcpo_opob",
    "str_delta": "str_delta",
    "score_centering": "score_centering",
}
CLIP_FIELDS = {
    "adaptive": "adaptive",
    "quantile": "quantile",
    "exponent": "exponent",
    "anchor": "anchor",
    "q_scope": "q_rows",  # with micro_batch_size: q_rows = micro_batch_size at micro_batch scope
    "micro_batch_size": "q_rows",
}
# read by the loop or the trainer's step, not by the loss
LOOP_OWNED = {
    "algo": {"adv_std_norm", "drop_zero_adv_groups", "num_minibatches", "ledger"}
    | {"replay_sampling_mask", "score_centering_topk"}  # the trainer's: kept sets, top-k
    | {"dynamic_sampling"},  # the loop's: loop/dynamic.py
    "clip": {"name", "schedule", "final_scale"}
    | {"radius_scale"},  # applied to algo.eps_low/eps_high when the config is composed
}
# non-default values of every loss setting (one valid config)
NON_DEFAULT = {
    "algo.name": "gspo",
    "algo.correction": "tis",
    "algo.eps_low": 0.15,
    "algo.eps_high": 0.28,
    "algo.dual_clip_c": 3.0,
    "algo.loss_agg": "seq-mean-token-sum",
    "algo.ratio_denominator": "recompute",
    "algo.kl_coef": 0.05,
    "algo.tis_cap": 3.5,
    "algo.icepop_low": 0.4,
    "algo.icepop_high": 6.0,
    "algo.dppo_delta": 0.002,
    "algo.m2po_tau": 0.05,
    "algo.behav_cap": 4.0,
    "algo.behav_mode": "mask",
    "algo.vcpo_is_cap": 9.0,
    "algo.vcpo_ess_base": 0.5,
    "algo.vcpo_opob": False,
    "algo.str_delta": 0.05,
    "algo.score_centering": True,
    "algo.score_centering_topk": 4,  # trainer-owned; score centering needs it
    "clip.adaptive": True,
    "clip.quantile": 0.8,
    "clip.exponent": 3.0,
    "clip.anchor": "min_q_eps",
    "clip.q_scope": "micro_batch",
    "clip.micro_batch_size": 3,
    "task.samples_per_prompt": 5,
}


def _override(key, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


def test_every_loss_setting_of_the_schema_is_mapped():
    for group, mapped, cls in (
        ("algo", ALGO_FIELDS, schema.AlgoConfig),
        ("clip", CLIP_FIELDS, schema.ClipConfig),
    ):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == set(mapped) | LOOP_OWNED[group], group
        assert set(mapped.values()) <= {f.name for f in dataclasses.fields(LossConfig)}


def test_every_loss_setting_reaches_loss_config():
    _, obj = load([_override(k, v) for k, v in NON_DEFAULT.items()])
    loss = loss_config(obj)
    default = LossConfig()
    expected = {
        ALGO_FIELDS[f]: v
        for k, v in NON_DEFAULT.items()
        if "algo." in k and (f := k.split(".", 1)[1]) in ALGO_FIELDS
    }
    expected |= {CLIP_FIELDS[k.split(".", 1)[1]]: v for k, v in NON_DEFAULT.items() if "clip." in k}
    expected["q_rows"] = NON_DEFAULT["clip.micro_batch_size"]
    expected["group_size"] = NON_DEFAULT["task.samples_per_prompt"]
    assert set(expected) == {f.name for f in dataclasses.fields(LossConfig)}
    for name, value in expected.items():
        assert getattr(loss, name) == value, name
        assert getattr(default, name) != value, f"{name}: pick a non-default value"
    # SAT's micro-batch scope only with SAT on; the batch scope is None
    _, obj = load(["clip.q_scope=micro_batch", "clip.micro_batch_size=3", "clip.adaptive=false"])
    assert loss_config(obj).q_rows is None
    _, obj = load(["clip.micro_batch_size=3"])
    assert loss_config(obj).q_rows is None


def test_loss_config_json_round_trip():
    _, obj = load([_override(k, v) for k, v in NON_DEFAULT.items()])
    for loss in (LossConfig(), loss_config(obj), LossConfig(eps_high=float("inf"), q_rows=2)):
        back = LossConfig.from_dict(json.loads(json.dumps(loss.to_dict())))
        assert back == loss and type(back.eps_low) is float
    with pytest.raises(TypeError, match="unknown loss settings"):
        LossConfig.from_dict({"eps": 0.1})


@pytest.mark.parametrize(
    "kw", [{"algo": "gspo"}, {"loss_agg": "token-mean"}, {"loss_kwargs": {"q_rows": 2}}]
)
def test_trainers_take_loss_settings_only_as_a_loss_config(kw, tmp_path):
    """The older keyword form is gone: a loss setting passed as a keyword is refused before any
    model is loaded (the path does not exist), naming where it goes."""
    from sat_cli.trainers.local import LocalTrainer

    with pytest.raises(TypeError, match=r"unknown trainer options .*loss=LossConfig"):
        LocalTrainer(str(tmp_path / "absent"), **kw)


def test_compute_is_the_one_entry_point():
    """``registry.compute(LossConfig, LossInputs) -> LossOutputs``; the keyword form is gone."""
    assert not hasattr(registry, "compute_loss")
    g = torch.Generator().manual_seed(0)
    logp = (-2 + 0.3 * torch.randn(4, 7, generator=g)).requires_grad_()
    rollout = -2 + 0.3 * torch.randn(4, 7, generator=g)
    inputs = LossInputs(
        logp=logp,
        rollout_logp=rollout,
        advantages=torch.randn(4, generator=g),
        mask=(torch.rand(4, 7, generator=g) > 0.3).float(),
        old_logp=rollout + 0.01,
    )
    cfg = LossConfig(
        "grpo", "tis", eps_low=0.1, eps_high=0.3, adaptive=True, quantile=0.7, tis_cap=1.5, q_rows=2
    )
    a, b = registry.compute(cfg, inputs), registry.compute(cfg, inputs)
    assert isinstance(a, LossOutputs) and a.diag is None
    assert torch.equal(a.loss, b.loss) and a.metrics == b.metrics
    ga = torch.autograd.grad(a.loss, logp)[0]
    gb = torch.autograd.grad(b.loss, logp)[0]
    assert torch.equal(ga, gb)
    d = registry.compute(cfg, dataclasses.replace(inputs, diagnostics=True)).diag
    assert {"abs_d", "gate", "contraction", "q", "n_active", "abs_d_mu"} <= set(d)


def test_names_agree_with_schema_and_registry():
    assert schema.ALGOS == names.ALGOS
    assert sat_scope.UNCLIPPED_ALGOS == names.UNCLIPPED_ALGOS
    assert schema.CORRECTIONS == names.CORRECTIONS
    assert schema.LOSS_AGGS == names.LOSS_AGGS
    assert schema.DENOMINATORS == names.DENOMINATORS
    assert schema.ANCHORS == names.ANCHORS
    assert schema.Q_SCOPES == names.Q_SCOPES
    assert schema.BEHAV_MODES == names.BEHAV_MODES
    assert set(registry.ALGORITHMS) == set(names.ALGOS)
    assert set(registry.CORRECTIONS) == set(names.CORRECTIONS)
    unclipped = {n for n, spec in registry.ALGORITHMS.items() if not spec.clip}
    assert unclipped == set(names.UNCLIPPED_ALGOS)
    assert registry.DENOMINATORS == names.DENOMINATORS


def test_names_and_loss_config_import_without_torch():
    code = (
        "import sys; import sat_cli.rl.names, sat_cli.rl.config; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
