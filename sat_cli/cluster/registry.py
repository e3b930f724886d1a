"""Where a run's processes go, ``launcher=<name>``: name → settings class and functions
(:class:`sat_cli.registry.Component`). Ray-free: Ray is imported when a launcher is built."""

from __future__ import annotations

from sat_cli.cluster import settings as s
from sat_cli.registry import Component, Registry


def build_local(settings, runtime):
    """``launcher=local``: nothing to start; the trainer and engine launch their processes."""
    return None


LAUNCHERS = Registry("launcher", "launcher")
LAUNCHERS.add("local", Component(s.LauncherSettings, build_local))
LAUNCHERS.add("ray", Component(s.RayLauncherSettings, s.build, check=s.check))
