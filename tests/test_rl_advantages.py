"""Group advantages (sat_cli.rl.advantages): hand case, float64 loop reference, edge cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sat_cli.rl.advantages import ADV_EPS, group_advantages, zero_adv_groups

F64 = torch.float64


def test_hand_case():
    # group 0: R = [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.577350
    #          A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    # group 1: R = [1, 1, 1, 1] -> all equal -> A = 0 exactly
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    a = group_advantages(r, 4)
    s = math.sqrt(1 / 3)
    v = 0.5 / (s + 1e-6)
    torch.testing.assert_close(a, torch.tensor([v, -v, -v, v, 0, 0, 0, 0], dtype=F64))
    assert v == pytest.approx(0.866024, abs=1e-6)
    # Dr.GRPO: no std division -> [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    torch.testing.assert_close(
        group_advantages(r, 4, std_norm=False),
        torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], dtype=F64),
    )
    assert zero_adv_groups(r, 4).tolist() == [False] * 4 + [True] * 4


def test_against_loop_reference():
    g = torch.Generator().manual_seed(0)
    for G, std_norm in ((2, True), (5, True), (8, False), (16, True)):
        r = torch.randn(6 * G, generator=g, dtype=F64)
        r[:G] = 0.1  # one constant group; 0.1 * G / G is not exactly 0.1 in binary
        a = group_advantages(r, G, std_norm=std_norm)
        expected = []
        for p in range(6):
            grp = [float(x) for x in r[p * G : (p + 1) * G]]
            if len(set(grp)) == 1:
                expected += [0.0] * G
                continue
            mu = statistics.fmean(grp)
            sd = statistics.stdev(grp)  # unbiased
            expected += [(x - mu) / (sd + ADV_EPS) if std_norm else x - mu for x in grp]
        torch.testing.assert_close(a, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
        assert torch.equal(a[:G], torch.zeros(G, dtype=F64))


def test_group_size_one_and_float32():
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1), torch.zeros(3))
    a = group_advantages(torch.tensor([0.0, 1.0]), 2)
    assert a.dtype == torch.float32
    # std = sqrt(0.5) -> A = -+0.5 / 0.707107
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0]) * 0.5 / (math.sqrt(0.5) + 1e-6))


@pytest.mark.parametrize(
    "rewards,G", [(torch.zeros(5), 2), (torch.zeros(2, 2), 2), (torch.zeros(4), 0)]
)
def test_invalid(rewards, G):
    with pytest.raises(ValueError):
        group_advantages(rewards, G)
