"""Entry points behind `sat train`, `sat pretrain` and `sat eval` (placeholder until the loop lands)."""

from __future__ import annotations

from sat_cli.errors import RunFailed


def train(cfg, obj, overrides):
    from sat_cli.config import to_yaml

    print(to_yaml(cfg))
    raise RunFailed("training is not implemented yet (the training-loop issue adds it)")


def pretrain(obj):
    raise RunFailed("warm start is not wired yet (the embedded model stack issue adds it)")


def evaluate(cfg, obj):
    raise RunFailed("evaluation is not wired yet (the evaluation issue adds it)")
