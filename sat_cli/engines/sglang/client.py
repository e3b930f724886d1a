"""JSON over HTTP to SGLang servers: the stdlib client the engine uses (no new dependency).

Error policy: connection refused/reset and connect timeouts are retried (``retries`` times,
exponential backoff, moving to the next URL); HTTP 4xx/5xx, malformed JSON and read timeouts are
not retried and raise :class:`EngineError` with the status and a body excerpt (a read timeout
means the server is alive but slow: retrying would double the wait and the work). SGLang's error
bodies are ``{"error": "..."}`` (request validation, e.g. an unknown sampling key) or
``{"detail": "..."}`` (FastAPI: unknown route); the excerpt shows either as sent.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from sat_cli.engines.sglang.wire import wire_excerpt
from sat_cli.errors import EngineError

# Errors before any response byte arrives: safe to retry on this or another server.
_RETRYABLE = (
    ConnectionRefusedError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
    http.client.RemoteDisconnected,
)


class _ConnectTimeout(Exception):
    pass


class SGLangClient:
    """JSON-over-HTTP to one or more SGLang servers (or a router), round-robin, thread-safe.

    Stdlib ``http.client`` (no new dependency). Each call opens its own connection, so calls
    from many threads run concurrently; ``concurrency`` sizes the pool used by :meth:`map_post`.
    ``abort_inflight()`` closes the sockets of running calls (used when a server is seen dead,
    so blocked reads fail at once instead of waiting for ``timeout_s``).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        concurrency: int = 8,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("SGLangClient needs at least one URL")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or not parts.port:
                raise ValueError(f"expected http://host:port, got {url!r}")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._cycle = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self._active: set[socket.socket] = set()  # the sockets of calls in flight
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sglang-http")
        self.abort_reason: Callable[[], str | None] = lambda: None

    def next_url(self) -> str:
        with self._lock:
            return self.urls[next(self._cycle)]

    # -- one request ------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        url: str | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> tuple[int, bytes]:
        """Send one request with retries on connection errors; return (status, body)."""
        status, body, _ = self._request(method, path, payload, url, timeout_s, retries)
        return status, body

    def _request(self, method, path, payload, url, timeout_s, retries) -> tuple[int, bytes, str]:
        retries = self.retries if retries is None else retries
        body = json.dumps(payload).encode() if payload is not None else None
        attempt = 0
        while True:
            target = url or self.next_url()
            try:
                status, answer = self._once(method, target, path, body, timeout_s or self.timeout_s)
                return status, answer, target
            except (*_RETRYABLE, _ConnectTimeout) as e:
                reason = self.abort_reason()
                if reason is not None:
                    raise EngineError(reason) from e
                if attempt >= retries:
                    raise EngineError(
                        f"{method} {target}{path}: cannot reach the server after "
                        f"{attempt + 1} attempts ({type(e).__name__}: {e})"
                    ) from e
                time.sleep(self.backoff_s * (2**attempt))
                attempt += 1
            except TimeoutError as e:
                reason = self.abort_reason()
                raise EngineError(
                    reason
                    or f"{method} {target}{path}: no answer within {timeout_s or self.timeout_s}"
                    " s (read timeout; not retried)"
                ) from e
            except (OSError, http.client.HTTPException) as e:
                reason = self.abort_reason()
                raise EngineError(
                    reason or f"{method} {target}{path}: {type(e).__name__}: {e}"
                ) from e

    def _once(
        self, method: str, url: str, path: str, body: bytes | None, timeout_s: float
    ) -> tuple[int, bytes]:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        sock = None
        try:
            try:
                sock = socket.create_connection(
                    (parts.hostname, parts.port), timeout=self.connect_timeout_s
                )
            except TimeoutError as e:
                raise _ConnectTimeout(f"connect timeout after {self.connect_timeout_s} s") from e
            sock.settimeout(timeout_s)
            conn.sock = sock
            # the socket itself, not the connection: http.client drops conn.sock once an answer
            # says Connection: close (HTTP/1.0) and the response reads on, which an abort must reach
            with self._lock:
                self._active.add(sock)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            with self._lock:
                if sock is not None:
                    self._active.discard(sock)
            conn.close()
            if sock is not None:
                sock.close()

    def post_json(self, path: str, payload: Any, *, url: str | None = None, **kw) -> Any:
        """POST JSON, demand 200 and a JSON answer; EngineError with a body excerpt otherwise."""
        status, body, target = self._request(
            "POST", path, payload, url, kw.get("timeout_s"), kw.get("retries")
        )
        return self.json_or_raise("POST", target, path, status, body)

    def get_json(self, path: str, *, url: str | None = None, **kw) -> Any:
        status, body, target = self._request(
            "GET", path, None, url, kw.get("timeout_s"), kw.get("retries")
        )
        return self.json_or_raise("GET", target, path, status, body)

    @staticmethod
    def json_or_raise(method: str, url: str, path: str, status: int, body: bytes) -> Any:
        text = body.decode("utf-8", errors="replace")
        where = f"{method} {url}{path}"
        if status != 200:
            raise EngineError(f"{where} answered HTTP {status}: {wire_excerpt(text)}")
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineError(f"{where} answered malformed JSON ({e}): {wire_excerpt(text)}") from e

    def map_post(self, path: str, payloads: Sequence[Any]) -> list[Future]:
        """Submit one POST per payload on the pool (round-robin URLs); futures in order."""
        return [self._pool.submit(self.post_json, path, p) for p in payloads]

    def abort_inflight(self) -> None:
        """Shut down the sockets of running calls so their blocked reads fail now."""
        with self._lock:
            socks = list(self._active)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.abort_inflight()
        self._pool.shutdown(wait=False, cancel_futures=True)
