"""``reward=http``: a reward server at ``reward.url``.

One JSON POST per sample, ``{"prompt", "response", "row"}`` (``reward.batched=true``: one per
batch, ``{"items": [...]}``, answered with a list), sent from ``reward.workers`` threads. The
answer is a number, ``{"reward": x}`` or ``{"components": {name: x}}`` (combined by
``reward.weights``). A request that fails — refused connection, a reset, no answer within
``reward.timeout_s``, an HTTP 429 or 5xx — is retried with a growing pause (0.2 s doubling to
2 s) until ``reward.deadline_s`` has passed since its first try, so a server that restarts or
stops for a few seconds costs time, not rewards; past the deadline, or on any other HTTP status,
the sample's reward has failed (``reward.on_error``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sat_cli.rewards import ReportedError, Scorer, Scores

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
MAX_ANSWER_BYTES = 16 << 20


def post(url: str, body: Any, timeout_s: float, deadline_s: float) -> Any:
    """The decoded JSON answer to ``body``, retried until ``deadline_s`` (module docstring)."""
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    end, pause, last = time.monotonic() + deadline_s, 0.2, "no attempt"
    while True:
        left = end - time.monotonic()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=max(0.05, min(timeout_s, left))) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                raise ReportedError(f"reward server {url}: answer over {MAX_ANSWER_BYTES} bytes")
            try:
                return json.loads(raw)
            except ValueError:
                raise ReportedError(f"reward server {url}: the answer is not JSON") from None
        except urllib.error.HTTPError as exc:
            if exc.code not in RETRY_STATUS:
                raise ReportedError(f"reward server {url}: HTTP {exc.code} {exc.reason}") from None
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            last = str(getattr(exc, "reason", exc)) or type(exc).__name__
        left = end - time.monotonic()
        if left <= 0:
            raise ReportedError(
                f"reward server {url} did not answer within reward.deadline_s={deadline_s:g} s "
                f"(last: {last})"
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, 2.0)


def _value(answer: Any) -> Any:
    """A number or a dict of components from one answer (module docstring)."""
    if isinstance(answer, dict):
        if "components" in answer:
            return answer["components"]
        if "reward" in answer:
            return answer["reward"]
        raise ReportedError(
            f"the reward server answered {sorted(answer)[:5]}, not reward/components"
        )
    return answer


class HttpScorer(Scorer):
    def __init__(self, settings):
        super().__init__(None, settings)
        self.threads = ThreadPoolExecutor(settings.workers, thread_name_prefix="sat-reward-http")

    def _ask(self, body: Any) -> Any:
        s = self.settings
        return post(s.url, body, s.timeout_s, s.deadline_s)

    def score(self, prompts: list[str], responses: list[str], rows: list[dict]) -> Scores:
        out = Scores([], [], [])
        items = [
            {"prompt": p, "response": r, "row": row}
            for p, r, row in zip(prompts, responses, rows, strict=True)
        ]
        if self.settings.batched:
            try:
                answer = self._ask({"items": items})
                answer = answer.get("rewards") if isinstance(answer, dict) else answer
                if not isinstance(answer, list) or len(answer) != len(items):
                    raise ReportedError(
                        f"the reward server answered a batch of {len(items)} with "
                        f"{len(answer) if isinstance(answer, list) else type(answer).__name__}"
                    )
            except ReportedError as exc:
                for _ in items:
                    self.add(out, _raise(exc))
                return out
            for a in answer:
                self.add(out, lambda a=a: _value(a))
            return out
        futures = [self.threads.submit(self._ask, item) for item in items]
        for fut in futures:
            self.add(out, lambda fut=fut: _value(fut.result()))
        return out

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)


def _raise(exc: Exception):
    def call():
        raise exc

    return call


def build(settings, runtime: dict) -> HttpScorer:
    return HttpScorer(settings)
