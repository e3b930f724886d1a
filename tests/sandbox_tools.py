"""What the sandbox tests share: a Python the sandbox's uid can run, and running ``run_tool`` as
an ordinary user (the tests run as root in CI; the guarantees must hold for both callers)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sat_cli.envs.sandbox import run_tool

REPO = Path(__file__).resolve().parent.parent
ORDINARY_UID = 4242  # any uid without a process or a file here: setpriv needs no account
RUNNERS = ("caller", "ordinary_user")


@functools.cache
def sandbox_python() -> str:
    """An interpreter the strict sandbox's uid can execute (as root, the tool runs as
    ``nobody``, who cannot enter a ``/root`` that holds a venv's interpreter); skip without."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and run_tool([cand, "-S", "-c", "print(6*7)"]).text == "42\n":
            return cand
    pytest.skip("no Python that the sandbox's uid may run (a world-readable python3 is needed)")


SELF_CHECK = (  # imports this checkout and can start itself again (the sandbox's launcher)
    "import subprocess, sys, sat_cli.envs.sandbox; subprocess.run([sys.executable, '-c', ''],"
    " check=True)"
)


def _user_python() -> str | None:
    """A Python an ordinary user can run that imports this checkout's ``sat_cli``."""
    if not shutil.which("setpriv"):
        return None
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(cand):
            continue
        ok = subprocess.run(
            ["setpriv", f"--reuid={ORDINARY_UID}", f"--regid={ORDINARY_UID}", "--clear-groups"]
            + [cand, "-S", "-c", SELF_CHECK],
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            timeout=30,
            cwd="/",
        )
        if ok.returncode == 0:
            return cand
    return None


def run_as(
    runner: str,
    args: list[str],
    mode: str = "strict",
    env: dict | None = None,
    visible: tuple[str, ...] = (),
    **limits,
):
    """``run_tool(args, ToolLimits(**limits), mode=mode, visible=visible)`` called by
    ``runner``: this process's user (``caller``; in this process unless ``env`` is given) or
    ``ORDINARY_UID`` (``ordinary_user``: needs root and ``setpriv``). With ``env``, the caller is a child process
    started with ``env`` added to its environment (what ``/proc/<pid>/environ`` shows: a
    variable set later in this process is not there). Returns ``(kind, text)``."""
    if runner == "caller" and env is None:
        from sat_cli.envs.sandbox import ToolLimits

        r = run_tool(args, ToolLimits(**limits), mode=mode, visible=tuple(visible))
        return r.kind, r.text
    prefix, python = [], sys.executable
    if runner == "ordinary_user":
        if os.geteuid() != 0:
            pytest.skip("the caller is an ordinary user already (the 'caller' case covers it)")
        python = _user_python()
        if python is None:
            pytest.skip(f"cannot run this checkout as uid {ORDINARY_UID} (setpriv, readable path)")
        prefix = ["setpriv", f"--reuid={ORDINARY_UID}", f"--regid={ORDINARY_UID}"]
        prefix.append("--clear-groups")
    code = (
        "import json, sys\n"
        "from sat_cli.envs.sandbox import ToolLimits, run_tool\n"
        "a = json.loads(sys.argv[1])\n"
        "r = run_tool(a['args'], ToolLimits(**a['limits']), mode=a['mode'],"
        " visible=tuple(a['visible']))\n"
        "print(json.dumps([r.kind, r.text]))\n"
    )
    spec = json.dumps({"args": args, "limits": limits, "mode": mode, "visible": list(visible)})
    done = subprocess.run(
        [*prefix, python, "-c", code, spec],
        env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        | (env or {}),
        capture_output=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return tuple(json.loads(done.stdout.decode().strip().splitlines()[-1]))
