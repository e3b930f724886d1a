"""clip=ppo_tight, the "smaller step" control: 0.75 x the algorithm's own radii
(clip.radius_scale, applied once when the config is composed), refused where there are none."""

import subprocess
import sys

import pytest

from sat_cli.build.parts import loss_config
from sat_cli.config import ConfigError, load


@pytest.mark.parametrize(
    "overrides,want",
    [
        (["algo=grpo"], (0.15, 0.15)),  # 0.2 x 0.75, exactly 0.15
        (["algo=gspo"], (0.15, 0.15)),
        (["algo=gspo_paper"], (2.25e-4, 3e-4)),  # 3e-4 / 4e-4 x 0.75: below the algorithm's
        (["algo=grpo", "algo.eps_low=0.1", "algo.eps_high=0.28"], (0.075, 0.21)),
        (["algo=grpo", "clip.radius_scale=0.5"], (0.1, 0.1)),
    ],
)
def test_ppo_tight_scales_the_algorithms_own_radii(overrides, want):
    cfg, obj = load(["clip=ppo_tight", *overrides])
    assert (obj.algo.eps_low, obj.algo.eps_high) == want
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == want  # the recorded config: what it trains with
    lc = loss_config(obj)
    assert (lc.eps_low, lc.eps_high) == want and not lc.adaptive


def test_other_clips_keep_the_radii_and_bad_scales_are_refused():
    for clip in ("sat", "ppo", "sat_anchored"):
        obj = load(["algo=gspo_paper", f"clip={clip}"])[1]
        assert (obj.algo.eps_low, obj.algo.eps_high, obj.clip.radius_scale) == (3e-4, 4e-4, 1.0)
    for bad in ("0", "1.5", "-0.5"):
        with pytest.raises(ConfigError, match="clip.radius_scale"):
            load(["clip=ppo_tight", f"clip.radius_scale={bad}"])
    for algo in ("m2po", "vcpo"):
        with pytest.raises(ConfigError, match=f"algo={algo} has no clip interval"):
            load([f"algo={algo}", "clip=ppo_tight"])


def test_sat_config_composes_below_the_algorithms_radii_or_exits_2():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "sat_cli.cli", "config", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = run("algo=gspo_paper", "clip=ppo_tight")
    assert r.returncode == 0, r.stderr
    assert "  eps_low: 0.000225\n  eps_high: 0.0003\n" in r.stdout
    r = run("algo=m2po", "clip=ppo_tight")
    assert r.returncode == 2 and "has no clip interval" in r.stderr
    assert "Traceback" not in r.stderr
