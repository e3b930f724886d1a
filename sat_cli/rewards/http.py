"""``reward=http``: a reward server at ``reward.url``.

One JSON POST per sample, ``{"prompt", "response", "row"}`` (``reward.batched=true``: one per
batch, ``{"items": [...]}``, answered with a list), sent from ``reward.workers`` threads. The
answer is a number, ``{"reward": x}`` or ``{"components": {name: x}}`` (combined by
``reward.weights``). A request that fails — refused connection, a reset, no answer within
``reward.timeout_s``, an HTTP 429 or 5xx — is retried with a growing pause (0.2 s doubling to
2 s) until ``reward.deadline_s`` has passed since its first try, so a server that restarts or
stops for a few seconds costs time, not rewards; past the deadline, or on any other HTTP status,
the sample's reward has failed (``reward.on_error``). ``reward.timeout_s`` bounds a whole
attempt (connection, headers and body), redirects to another host are refused, and closing the
scorer aborts what is in flight at once (``http_client.py``). Before the run starts, ``check``
refuses a server whose host and port do not accept a connection (exit 2).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sat_cli.errors import UserError
from sat_cli.rewards import ReportedError, Scorer, Scores, require
from sat_cli.rewards.http_client import Client, health_check
from sat_cli.validate import ConfigError

HEALTH_CHECK_S = 10.0  # at most this long (and at most reward.deadline_s) for the check


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
        self.client = Client()

    def _ask(self, body: Any) -> Any:
        s = self.settings
        return self.client.post(s.url, body, s.timeout_s, s.deadline_s)

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
        self.client.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


def _raise(exc: Exception):
    def call():
        raise exc

    return call


def build(settings, runtime: dict) -> HttpScorer:
    return HttpScorer(settings)


def check(settings) -> None:
    """The server at ``reward.url`` accepts a connection (``health_check``), else ``UserError``."""
    why = health_check(settings.url, min(HEALTH_CHECK_S, settings.deadline_s))
    if why is not None:
        raise UserError(f"{why}; start it first, or check reward.url")


def validate(settings) -> None:
    """``reward.url`` is an http(s) address."""
    require(settings, "url")
    if not re.match(r"https?://[^/\s]+", settings.url):
        raise ConfigError(f"reward.url={settings.url!r}: expected http://host:port/path")


def label(settings) -> str:
    """``reward.url=<url>`` with its secrets masked."""
    if not getattr(settings, "url", None):
        return ""
    from sat_cli.tracking.params import redact_uri

    return f"reward.url={redact_uri(str(settings.url))}"
