"""GPU defaults resolved at compose time (issue 54 item 5): ``engine.dtype`` and the local
trainer's ``trainer.dtype`` are bfloat16 when their device is cuda, float32 on the CPU (the
default CPU run composes exactly as before); an explicit dtype always wins. Composed on this
CPU machine: nothing here needs a GPU."""

from __future__ import annotations

import pytest

from sat_cli.config import load


@pytest.mark.parametrize(
    ("overrides", "engine", "trainer"),
    [
        ([], "float32", "float32"),  # the default CPU run: unchanged
        (["engine.device=cuda", "trainer.device=cuda"], "bfloat16", "bfloat16"),
        (["engine.device=cuda"], "bfloat16", "float32"),
        (["trainer.device=cuda"], "float32", "bfloat16"),
        (
            ["engine.device=cuda", "trainer.device=cuda", "engine.dtype=float32"],
            "float32",
            "bfloat16",
        ),
        (
            ["engine.device=cuda", "trainer.device=cuda", "trainer.dtype=float32"],
            "bfloat16",
            "float32",
        ),
        (["engine.dtype=bfloat16"], "bfloat16", "float32"),  # the CPU mismatch study's setting
        (["trainer=megatron"], "float32", "float32"),  # its yaml states float32 (gloo on CPU)
        (["engine=sglang"], "bfloat16", "float32"),  # its yaml states bfloat16
    ],
)
def test_dtype_follows_the_device_unless_given(overrides, engine, trainer):
    cfg, obj = load(overrides, "train")
    assert (obj.engine.dtype, obj.trainer.dtype) == (engine, trainer)
    # the config a run records and logs holds the resolved values, not null
    assert (cfg.engine.dtype, cfg.trainer.dtype) == (engine, trainer)


def test_default_cpu_run_composes_as_before():
    """The default run's composed config: every dtype float32, as the yaml said before."""
    from omegaconf import OmegaConf

    cfg, _ = load([], "train")
    c = OmegaConf.to_container(cfg, resolve=True)
    assert c["engine"]["dtype"] == "float32" and c["trainer"]["dtype"] == "float32"
