"""The ``env`` section (``conf/env/*.yaml``): multi-turn rollouts against an environment
(docs/environments.md). ``env=none`` (the default) is the single-turn path, unchanged; another
name is a registered environment (``sat_cli.envs.registry``) that every rollout of the run is a
trajectory of (``sat_cli.envs.trajectory``), rewarded by the environment."""

from __future__ import annotations

from dataclasses import dataclass, fields

from sat_cli.validate import ConfigError, check_choice, check_range

NONE = "none"
PARTIAL_MODES = ("resume", "abort")  # as sat_cli.envs.trajectory.PARTIAL_MODES (tested equal)
MAX_TURNS = 64  # as sat_cli.envs.base (tested equal)
MAX_TOKENS = 1 << 20
SANDBOX_MODES = ("strict", "unsafe_local")  # as sat_cli.envs.sandbox.MODES (tested equal)


@dataclass
class EnvConfig:
    name: str = NONE  # none | a registered environment (calculator, ...)
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 4096  # tokens per trajectory: the prompt, the turns and the observations
    # a trajectory whose weights changed while it ran (in-flight updates): resume it (each token
    # keeps its version) | abort it and run it again from the new weights
    partial: str = "resume"
    parser: str = "hermes"  # the tool-call format (sat_cli.envs.toolcalls)
    # how an environment's tools are confined (sat_cli.envs.sandbox): strict (another uid, its
    # own namespaces, read-only root; refused where the kernel cannot) | unsafe_local (what the
    # machine permits, maybe much less; only on a machine you trust)
    sandbox: str = "strict"

    def __post_init__(self) -> None:
        from sat_cli.envs.registry import ENVIRONMENTS
        from sat_cli.envs.toolcalls import PARSERS

        check_choice("env", self.name, (NONE, *sorted(ENVIRONMENTS.names())))
        for key, hi in (("max_turns", MAX_TURNS), ("max_tokens", MAX_TOKENS)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"env.{key}={value!r} must be an integer")
            check_range(f"env.{key}", value, 1, hi)
        check_choice("env.partial", self.partial, PARTIAL_MODES)
        check_choice("env.parser", self.parser, tuple(sorted(PARSERS)))
        check_choice("env.sandbox", self.sandbox, SANDBOX_MODES)
        if self.name == NONE:  # no environment: its settings would be ignored
            for f in fields(self):
                if f.name != "name" and getattr(self, f.name) != f.default:
                    raise ConfigError(
                        f"env.{f.name} is a setting of a multi-turn environment "
                        f"(env={' or env='.join(sorted(ENVIRONMENTS.names()))}); with env={NONE} "
                        "it would be ignored"
                    )


def check_env(c) -> None:
    """The rules between ``env`` and other sections (``c``: a ``SatConfig``)."""
    if c.env.name != NONE and c.lag.profile is not None and c.env.partial == "abort":
        raise ConfigError(
            "env.partial=abort cannot be combined with lag.profile: the profile draws a "
            "version for every turn, so a trajectory whose turns differ would be run again "
            "until it is dropped; use env.partial=resume (docs/lag-profiles.md)"
        )
