"""Text from a remote peer escaped of control sequences before it is printed or stored (issue 53,
class 12): a reward server's status line and error, a reward plug-in's exception, an SGLang
server's error body, every ``sat: error:`` paragraph. Real servers on 127.0.0.1 and a real
reward worker process; the test text holds ``ESC [`` / ``ESC ]`` sequences, a C1 ``CSI``, BEL,
NUL, DEL, a carriage return and a bidirectional override."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from sat_cli.tracking.remote_text import escape_controls

HOSTILE = "a\x1b[2J\x1b]0;owned\x07b\x9b31m\x00\x7f\rc\u202ed"
CONTROLS = "\x1b\x9b\x07\x00\x7f\r\u202e"


def clean(text: str) -> bool:
    return not any(ch in text for ch in CONTROLS)


def test_escape_controls_hand_cases():
    assert escape_controls(HOSTILE) == (
        "a\\x1b[2J\\x1b]0;owned\\x07b\\x9b31m\\x00\\x7f\\x0dc\\u202ed"
    )
    assert escape_controls("π ≈ 3.14, naïve é") == "π ≈ 3.14, naïve é"  # printable: unchanged
    assert escape_controls("one\ntwo\t", keep="\n") == "one\ntwo\\x09"
    assert escape_controls("\ud800") == "\\ud800"  # a lone surrogate (cannot be encoded)
    assert escape_controls(escape_controls(HOSTILE)) == escape_controls(HOSTILE)  # idempotent


class Hostile(BaseHTTPRequestHandler):
    """``/reason``: HTTP 418 with control characters in the reason phrase; ``/keys``: 200 with
    an answer whose only key holds them."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/reason":
            self.send_response(418, "tea\x1b[31m\x9b2J\x07")
            body = b"{}"
        else:
            self.send_response(200)
            body = json.dumps({"\x1b[2Jx": 1}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _settings(**kw):
    base = dict(batched=False, pattern=None, weights={}, on_error=-1.0, max_error_frac=0.5)
    base |= dict(timeout_s=5.0, deadline_s=10.0, workers=1, memory_mb=16384, fn=None, url=None)
    return SimpleNamespace(**{**base, **kw})


def test_a_reward_servers_text_is_escaped(server):
    from sat_cli.rewards import build_reward

    for path in ("/reason", "/keys"):
        scorer = build_reward(_settings(name="http", url=server + path), task=None)
        try:
            got = scorer.score(["p"], ["r"], [{}])
        finally:
            scorer.close()
        (error,) = got.errors
        assert error is not None and clean(error), repr(error)
        assert ("tea\\x1b[31m\\x9b2J\\x07" if path == "/reason" else "\\x1b[2Jx") in error


def test_a_plugins_error_string_is_escaped(tmp_path):
    """A real worker process whose function raises with a hostile message: the sample's error
    (printed in the failure message and stored in the samples table) is escaped."""
    from sat_cli.rewards import build_reward

    path = tmp_path / "plugin.py"
    path.write_text(f"def score(p, r, row):\n    raise ValueError({HOSTILE!r})\n")
    scorer = build_reward(_settings(name="python", fn=f"{path}:score"), task=None)
    try:
        got = scorer.score(["p"], ["r"], [{}])
    finally:
        scorer.close()
    first_line = HOSTILE.split("\r")[0]  # an error is its first line
    assert got.errors == ["ValueError: " + escape_controls(first_line)]


def test_an_sglang_servers_error_body_is_escaped():
    from sat_cli.engines.sglang.client import SGLangClient
    from sat_cli.errors import EngineError

    for status, body in [(500, HOSTILE.encode()), (200, b"\x1b[2J{not json")]:
        with pytest.raises(EngineError) as info:
            SGLangClient.json_or_raise("POST", "http://127.0.0.1:1", "/generate", status, body)
        assert clean(str(info.value)), repr(str(info.value))
        assert "\\x1b[2J" in str(info.value)


def test_a_plugin_that_fails_to_load_reaches_the_terminal_escaped(tmp_path):
    """A real ``sat train`` whose ``reward.fn`` raises with a hostile message on import: one
    ``sat: error:`` line with the sequences escaped, exit 2, nothing written."""
    (tmp_path / "plug.py").write_text(
        f"raise RuntimeError({HOSTILE.replace(chr(13), '')!r})\ndef score(p, r, row):\n    return 1.0\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "train", "reward=python", "reward.fn=plug.py:score"]
        + ["tracking.uri=none", f"run.dir={tmp_path / 'runs'}", "max_steps=1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("sat: error:") == 1 and "Traceback" not in r.stderr
    assert clean(r.stderr), repr(r.stderr)
    assert "RuntimeError: a\\x1b[2J\\x1b]0;owned\\x07b\\x9b31m" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_every_sat_error_paragraph_is_escaped(capsys):
    """The last line of defence: ``cli.guard.fail`` escapes what a message quotes (its lines
    stay lines)."""
    import typer

    from sat_cli.cli.guard import fail

    with pytest.raises(typer.Exit):
        fail(f"server said: {HOSTILE}\nsecond line")
    err = capsys.readouterr().err
    assert clean(err) and err.endswith("\nsecond line\n"), repr(err)
    assert "\\x1b]0;owned\\x07" in err


@pytest.mark.parametrize(
    "record",
    [
        {"pid": 999999, "start": "1", "host": HOSTILE, "argv": ["sat", HOSTILE], "since": HOSTILE},
        {"pid": 999999, "start": "1", "host": 7, "argv": [1, 2]},
    ],
)
def test_a_planted_lock_is_named_escaped(tmp_path, record):
    """Probe (issue 53 v5): a run folder's ``.sat.lock`` is another process's file; the next
    ``sat train`` printed its host, time and command as they were ("taking over the stale lock
    of …": raw ESC sequences on the terminal), and a command of numbers raised ``TypeError``."""
    from sat_cli.commands.runlock import LOCK_NAME, RunLock

    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    said = []
    with RunLock(tmp_path, log=said.append):
        pass
    (line,) = said
    assert line.startswith("taking over the stale lock of pid 999999 on ")
    assert not set(line) & set(CONTROLS), line
    if record["argv"] == [1, 2]:
        assert (
            line
            == "taking over the stale lock of pid 999999 on 7 since ? (1 2): that process is gone"
        )
    else:
        assert line.count(escape_controls(HOSTILE)) == 3
