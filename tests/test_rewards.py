"""Reward plugins (sat_cli/rewards): the built-ins, a user's function in real worker processes
(errors, NaN, time limits, a batched form, a function that cannot load), a reward server on
127.0.0.1 that stops for a few seconds, and the bounds of every reward.* setting."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from sat_cli.config import ConfigError, load
from sat_cli.errors import UserError
from sat_cli.rewards import BadReward, build_reward, check_reward, combine

USER_REWARD = """
import math, time

def score(prompt, response, row):
    if response == "raise":
        raise KeyError("no such thing")
    if response == "nan":
        return math.nan
    if response == "hang":
        time.sleep(60)
    if response == "parts":
        return {"correct": 1.0, "format": 0.5}
    return float(len(response)) + row["bonus"]

def batch(prompts, responses, rows):
    return [float(len(r)) for r in responses]

def short(prompts, responses, rows):
    return [1.0]
"""


def settings(**kw):
    base = dict(
        name="math",
        fn=None,
        batched=False,
        pattern=None,
        url=None,
        weights={},
        timeout_s=10.0,
        deadline_s=60.0,
        on_error=-1.0,
        max_error_frac=0.5,
        workers=2,
    )
    return SimpleNamespace(**{**base, **kw})


def test_combine_numbers_and_components():
    assert combine(0.25, {}) == (0.25, {})
    assert combine(3, {}) == (3.0, {})
    assert combine({"a": 1, "b": 0.5}, {}) == (1.5, {"a": 1.0, "b": 0.5})
    assert combine({"a": 1, "b": 0.5}, {"a": 2.0, "b": -4.0}) == (0.0, {"a": 1.0, "b": 0.5})
    for bad, why in [
        (math.nan, "nan"),
        (True, "bool"),
        ("1", "str"),
        ({"a": math.inf}, "inf"),
        ({"a": 1}, "missing"),
    ]:
        with pytest.raises(BadReward, match=why):
            combine(bad, {"a": 1.0, "b": 1.0} if why == "missing" else {})


def test_builtin_rewards():
    row = {"answer": "42", "prompt": "p"}
    exact = build_reward(settings(name="exact"), task=None)
    got = exact.score(["p"] * 4, ["\\boxed{42}", "Answer: 42", " 42 ", "\\boxed{42.0}"], [row] * 4)
    assert got.values == [1.0, 1.0, 1.0, 0.0] and got.errors == [None] * 4
    regex = build_reward(settings(name="regex", pattern=r"ANSWER=(\d+)"), task=None)
    got = regex.score(["p"] * 3, ["ANSWER=41 ANSWER=42", "ANSWER=41", "42"], [row] * 3)
    assert got.values == [1.0, 0.0, 0.0]
    task = SimpleNamespace(reward=lambda resp, gold: 1.0 if resp == gold else 0.0)
    math_ = build_reward(settings(), task=task)
    assert math_.score(["p", "p"], ["42", "41"], [row, row]).values == [1.0, 0.0]


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def test_python_reward_in_worker_processes(user_file):
    s = settings(name="python", fn=f"{user_file}:score", timeout_s=2.0, weights={})
    scorer = build_reward(s, task=None)
    try:
        row = {"bonus": 0.5}
        t0 = time.monotonic()
        got = scorer.score(["p"] * 6, ["abc", "raise", "nan", "hang", "parts", "xy"], [row] * 6)
        took = time.monotonic() - t0
        assert got.values == [3.5, -1.0, -1.0, -1.0, 1.5, 2.5]  # on_error = -1
        assert got.errors[0] is None and got.errors[4] is None and got.errors[5] is None
        assert got.errors[1] == "KeyError: 'no such thing'"
        assert got.errors[2] == f"reward.fn={user_file}:score returned nan"  # names the plug-in
        assert got.errors[3] == "timed out after 2 s"
        assert got.components[4] == {"correct": 1.0, "format": 0.5}
        assert got.error_frac == 0.5 and got.first_error() == got.errors[1]
        assert took < 20  # the hung call was abandoned, not waited for
        # the killed worker was replaced: the pool still answers
        assert scorer.score(["p"], ["abcd"], [row]).values == [4.5]
    finally:
        scorer.close()


def test_python_reward_by_module_name_and_batched(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)  # pkg.module:function resolves from the current folder
    scorer = build_reward(settings(name="python", fn="my_reward:batch", batched=True), task=None)
    try:
        got = scorer.score(["p"] * 5, ["a", "bb", "ccc", "dddd", "e"], [{}] * 5)
        assert got.values == [1.0, 2.0, 3.0, 4.0, 1.0] and got.error_frac == 0.0
    finally:
        scorer.close()
    short = build_reward(settings(name="python", fn="my_reward:short", batched=True), task=None)
    try:
        got = short.score(["p"] * 4, ["a"] * 4, [{}] * 4)
        assert got.values == [-1.0] * 4
        assert got.errors[0] == "the batched reward returned 1 values for 2 samples"
    finally:
        short.close()


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("nope.py:score", "nope.py is not a file"),
        ("{file}:missing", "has no function 'missing'"),
        ("no_such_module_xyz:f", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ],
)
def test_a_reward_that_cannot_load_is_refused(user_file, monkeypatch, fn, message):
    monkeypatch.chdir(user_file.parent)
    with pytest.raises(UserError, match=message):
        check_reward(settings(name="python", fn=fn.format(file=user_file)))


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "items" in body:
            answer = [len(it["response"]) for it in body["items"]]
        else:
            n = len(body["response"])
            answer = {"components": {"length": n, "bonus": body["row"]["bonus"]}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_reward_survives_its_server_stopping_for_a_few_seconds():
    server = _serve()
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/score"
    s = settings(name="http", url=url, timeout_s=2.0, deadline_s=20.0, weights={"length": 1.0})
    scorer = build_reward(s, task=None)
    try:
        row = {"bonus": 3}
        got = scorer.score(["p", "p"], ["ab", "abcd"], [row, row])
        assert got.values == [2.0, 4.0]
        assert got.components == [{"length": 2.0, "bonus": 3.0}, {"length": 4.0, "bonus": 3.0}]
        server.shutdown()
        server.server_close()  # connections refused from now on
        restarted: list[ThreadingHTTPServer] = []
        timer = threading.Timer(3.0, lambda: restarted.append(_serve(port)))
        timer.start()
        t0 = time.monotonic()
        got = scorer.score(["p"], ["abc"], [row])
        assert got.values == [3.0] and got.errors == [None]
        assert time.monotonic() - t0 >= 2.5  # it waited for the server, then scored
        restarted[0].shutdown()
        restarted[0].server_close()
        # past the deadline the sample's reward has failed, with the reason
        s.deadline_s = 2.0
        got = scorer.score(["p"], ["abc"], [row])
        assert got.values == [-1.0]
        assert got.errors[0].startswith(f"reward server {url} did not answer within")
    finally:
        scorer.close()


def test_http_reward_batched():
    server = _serve()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    scorer = build_reward(settings(name="http", url=url, batched=True), task=None)
    try:
        assert scorer.score(["p"] * 3, ["a", "bb", "ccc"], [{}] * 3).values == [1.0, 2.0, 3.0]
    finally:
        scorer.close()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward=python"], "reward=python needs reward.fn"),
        (["reward=python", "reward.fn=nocolon"], "expected pkg.module:function"),
        (["reward=http"], "reward=http needs reward.url"),
        (["reward=http", "reward.url=ftp://x"], "expected http://host:port/path"),
        (["reward=regex", "reward.pattern='(a)(b)'"], "has 2 groups"),
        (["reward=regex", "reward.pattern='('"], "is not a regex"),
        (["reward.timeout_s=0"], "reward.timeout_s=0.0 is out of range"),
        (["reward.timeout_s=30", "reward.deadline_s=10"], "reward.deadline_s=10.0 is out of range"),
        (["reward.max_error_frac=1.5"], "reward.max_error_frac=1.5 is out of range"),
        (["reward.workers=0"], "reward.workers=0 is out of range"),
        (["reward.on_error=nan"], "not a finite number"),
        (["+reward.weights.Bad=1"], "is not a component name"),
        (["reward.name=llm"], "reward.name='llm' is not valid"),
        (["reward=llm"], "reward='llm' is not a known option"),
    ],
)
def test_reward_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(overrides)


def test_default_reward_is_the_tasks_grader():
    _, obj = load([])
    assert obj.reward.name == "math" and obj.reward.on_error == 0.0
    _, obj = load(["reward=python", f"reward.fn={Path('r.py')}:f", "+reward.weights.ok=2"])
    assert obj.reward.weights == {"ok": 2.0}


HOSTILE_PLUGIN = """
import gc, os, time
from multiprocessing.connection import Connection

class Score(float):  # a class only the plug-in's own module has
    pass

def own_class(prompt, response, row):
    return Score(0.5) if response == "plain" else {"parts": Score(0.25)}

def garbage(prompt, response, row):
    if response == "garbage":  # a message on the answer pipe that is no answer
        for o in gc.get_objects():
            if isinstance(o, Connection):
                os.write(o.fileno(), (8).to_bytes(4, "big") + b"\\x80\\x05junk!!")
        time.sleep(0.5)
    return 1.0
"""


def test_a_plugins_own_value_types_and_garbage_are_results_not_exceptions(tmp_path):
    """Probe (issue 53 v5): the worker's answer was unpickled in ``sat``, so a float subclass
    defined in the plug-in file raised ``ModuleNotFoundError: sat_reward_…`` out of ``score``
    (the run ended with a traceback; ``pkg.module:function`` would have imported the plug-in into
    ``sat``), and bytes written on the pipe raised ``UnpicklingError``. Answers are JSON now."""
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_PLUGIN)
    scorer = build_reward(settings(name="python", fn=f"{path}:own_class", workers=1), task=None)
    try:
        got = scorer.score(["p", "p"], ["plain", "parts"], [{}, {}])
        assert got.values == [0.5, 0.25] and got.errors == [None, None]
        assert got.components == [{}, {"parts": 0.25}]
    finally:
        scorer.close()
    scorer = build_reward(settings(name="python", fn=f"{path}:garbage", workers=1), task=None)
    try:
        got = scorer.score(["p"] * 2, ["garbage", "ok"], [{}, {}])
        assert got.values == [-1.0, 1.0]
        assert got.errors[0] == (
            "the reward process sent an unreadable answer (UnicodeDecodeError); it was stopped"
        )
        assert scorer.score(["p"], ["ok"], [{}]).values == [1.0]  # a fresh worker answers
    finally:
        scorer.close()
