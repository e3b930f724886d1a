"""``sat_cli.util.procs.exit_process``: `sat`'s exit without the interpreter's teardown once torch
is loaded. Each case is a real child interpreter; the fast path is taken when ``torch`` is in
``sys.modules`` (a placeholder module here: the teardown is what is measured in bench/README.md,
not what is tested)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time, types
    from pathlib import Path
    from sat_cli.util.procs import exit_process

    out = Path(sys.argv[1])
    if sys.argv[2] == "torch":
        sys.modules["torch"] = types.ModuleType("torch")

    class Finalised:
        def __del__(self):
            (out / "del").write_text("ran")

    keep = Finalised()  # alive until the interpreter's teardown

    def late_writer():
        time.sleep(0.2)
        (out / "thread").write_text("joined")

    threading.Thread(target=late_writer).start()  # non-daemon: joined before exit
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.stdout.write("no newline, still flushed")
    code = sys.argv[3]
    exit_process(int(code) if code.isdigit() else None if code == "none" else code)
    """
)


def _child(tmp_path: Path, mode: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), mode, code],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "mode,code,status,stderr",
    [
        ("torch", "143", 143, ""),
        ("torch", "sat: bye", 1, "sat: bye\n"),  # sys.exit("message"): printed, exit 1
        ("light", "none", 0, ""),  # no torch: the usual sys.exit
    ],
)
def test_exit_keeps_what_an_exit_promises(tmp_path, mode, code, status, stderr):
    res = _child(tmp_path, mode, code)
    assert (res.returncode, res.stderr) == (status, stderr)
    assert res.stdout == "no newline, still flushed"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    # the teardown (what costs 1-1.5 s with torch loaded) is skipped only on the fast path
    assert (tmp_path / "del").exists() == (mode == "light")
