"""The reward server's HTTP client: one POST with a total deadline, retried until another.

``Client.post(url, body, timeout_s, deadline_s)`` sends a JSON POST and returns the decoded
answer. Each attempt has one deadline for all of it: the connection, the request, the status
line and headers, and the whole body (``timeout_s``, or less where ``deadline_s`` ends first).
It is kept by a timer that shuts the attempt's socket down when it passes, so a server that
trickles its answer a byte at a time cannot hold a call longer (a socket timeout alone bounds
each read, not their sum). A refused or reset connection, a missed deadline, HTTP 408, 425,
429 or 5xx is retried with a growing pause (0.2 s doubling to 2 s) until ``deadline_s`` has
passed since the first try. Any other status is the call's failure.

Redirects (301, 302, 303, 307, 308) are followed, up to ``MAX_REDIRECTS``, only to the same
scheme, host and port as ``reward.url``; one to another host is refused (the request, with the
rows it carries, is not sent there). The answer is at most ``MAX_ANSWER_BYTES``.

``Client.close()`` (the scorer's close: the run's ``finally``, so also after Ctrl-C and
SIGTERM) shuts every attempt in flight down and ends every retry pause at once, so no thread
of the client keeps ``sat`` alive: Ctrl-C is honoured within a second.

``health_check(url, seconds)`` (``reward=http``'s start-up check) connects to the server's
host and port, retrying until ``seconds``, so an unreachable server is refused before the run
starts. URLs in messages have their password and secret-looking query values masked
(``tracking.params.redact_uri``).

Every failure is a ``ReportedError`` with one line naming the URL and what went wrong.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any
from urllib.parse import urljoin, urlsplit

from sat_cli.rewards import ReportedError
from sat_cli.tracking.remote_text import escape_controls
from sat_cli.util.procs import abort_connection

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
REDIRECT_STATUS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 3
MAX_ANSWER_BYTES = 16 << 20
READ_CHUNK = 65536


def shown(url: str) -> str:
    """``url`` as messages show it: secrets masked."""
    from sat_cli.tracking.params import redact_uri

    return redact_uri(url)


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


class _Retry(Exception):
    """An attempt that may be tried again (its reason)."""


class _Attempt:
    """One connection and its socket, kept once connected: ``http.client`` drops ``conn.sock``
    when the answer closes the connection (HTTP/1.0, ``Connection: close``), and the response
    then reads from that socket, which ``abort`` must still reach."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn, self.sock = conn, None

    def abort(self) -> None:
        abort_connection(self.conn)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Client:
    def __init__(self) -> None:
        self.closed = threading.Event()
        self._live: set[_Attempt] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Abort every attempt in flight and every retry pause (module docstring)."""
        self.closed.set()
        with self._lock:
            live = list(self._live)
        for attempt in live:
            attempt.abort()

    def post(self, url: str, body: Any, timeout_s: float, deadline_s: float) -> Any:
        """The decoded JSON answer to ``body`` (module docstring)."""
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        end, pause, last = time.monotonic() + deadline_s, 0.2, "no attempt"
        while not self.closed.is_set():
            left = end - time.monotonic()
            try:
                return self._attempt(url, data, min(timeout_s, max(left, 0.05)))
            except _Retry as exc:
                last = str(exc)
            left = end - time.monotonic()
            if left <= 0:
                raise ReportedError(
                    f"reward server {shown(url)} did not answer within "
                    f"reward.deadline_s={deadline_s:g} s (last: {last})"
                )
            if self.closed.wait(min(pause, left)):
                break
            pause = min(pause * 2, 2.0)
        raise ReportedError(f"reward server {shown(url)}: the reward client was closed")

    def _attempt(self, url: str, data: bytes, seconds: float) -> Any:
        """One POST (following same-origin redirects) within ``seconds`` in all."""
        end = time.monotonic() + seconds
        target = url
        for _ in range(MAX_REDIRECTS + 1):
            status, reason, location, raw = self._exchange(target, data, end)
            if status in REDIRECT_STATUS and location:
                try:
                    nxt = urljoin(target, location)
                    elsewhere = _origin(nxt) != _origin(url)
                except ValueError:  # a port out of range, a broken IPv6 address
                    raise ReportedError(
                        f"reward server {shown(url)} redirected to an invalid address "
                        f"({escape_controls(location[:200])}); not followed"
                    ) from None
                if elsewhere:
                    raise ReportedError(
                        f"reward server {shown(url)} redirected to another host "
                        f"({shown(nxt)}); not followed"
                    )
                target = nxt
                continue
            if status in RETRY_STATUS:
                raise _Retry(f"HTTP {status}")
            if not 200 <= status < 300:
                raise ReportedError(
                    f"reward server {shown(url)}: HTTP {status} {escape_controls(reason)}"
                )
            try:
                return json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nested past the parser's limit
                raise ReportedError(f"reward server {shown(url)}: the answer is not JSON") from None
        raise ReportedError(f"reward server {shown(url)}: more than {MAX_REDIRECTS} redirects")

    def _exchange(self, url: str, data: bytes, end: float) -> tuple[int, str, str | None, bytes]:
        parts = urlsplit(url)
        left = end - time.monotonic()
        if left <= 0:
            raise _Retry("timed out")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "", parts.port, timeout=left)
        attempt = _Attempt(conn)
        timer = threading.Timer(left, attempt.abort)
        timer.daemon = True
        with self._lock:
            self._live.add(attempt)
        timer.start()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            attempt.sock = conn.sock
            resp = conn.getresponse()
            raw = bytearray()
            while len(raw) <= MAX_ANSWER_BYTES:
                chunk = resp.read1(READ_CHUNK)
                if not chunk:
                    break
                raw += chunk
            if time.monotonic() >= end:
                raise _Retry("no whole answer within the call's deadline")
            if len(raw) > MAX_ANSWER_BYTES:
                raise ReportedError(
                    f"reward server {shown(url)}: answer over {MAX_ANSWER_BYTES} bytes"
                )
            return resp.status, resp.reason, resp.getheader("Location"), bytes(raw)
        except (OSError, http.client.HTTPException) as exc:
            if time.monotonic() >= end or self.closed.is_set():
                raise _Retry("no whole answer within the call's deadline") from None
            # http.client's messages quote the server's status line: its text, escaped
            raise _Retry(escape_controls(str(exc)) or type(exc).__name__) from None
        finally:
            timer.cancel()
            with self._lock:
                self._live.discard(attempt)
            conn.close()


def health_check(url: str, seconds: float) -> str | None:
    """None once a TCP connection to ``url``'s host and port opens within ``seconds``
    (retried); else why not, one line."""
    _, host, port = _origin(url)
    end, last = time.monotonic() + seconds, "no attempt"
    while True:
        left = end - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(left, 0.05)).close()
            return None
        except OSError as exc:
            last = str(exc) or type(exc).__name__
        left = end - time.monotonic()
        if left <= 0:
            return f"reward server {shown(url)} is not reachable within {seconds:g} s ({last})"
        time.sleep(min(0.2, left))
