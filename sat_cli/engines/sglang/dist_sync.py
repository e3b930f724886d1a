"""Distributed weight sync and weight checksums of :class:`SGLangEngine` (a mixin).

SGLang 0.5.23's routes and order, read in ``srt/entrypoints/http_server.py``,
``srt/managers/scheduler_components/weight_updater.py`` and
``srt/model_executor/model_runner_components/weight_updater.py``, and run against a real CPU
server (gloo):

1. ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
   group_name, backend}`` to every server at once; each joins with its ranks ``rank_offset ..
   rank_offset + tp - 1`` and the call returns when the whole group (the sender as rank 0, then
   the servers' ranks in order: world = 1 + the servers' ranks) has formed. Once per group.
2. per version ``POST /begin_weight_update {}`` (opens the update session; outside one,
   ``/update_weights_from_distributed`` answers 400), then per bucket
   ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
   load_format: "flattened_bucket", flush_cache, weight_version}`` to every server while the
   sender broadcasts the bucket (one flat ``uint8`` tensor from rank 0); ``weight_version`` and
   the cache flush go with the last bucket only; then ``POST /end_weight_update {}``.
3. ``POST /weights_checker {"action": "checksum"}``: per-tensor hashes of what the server holds,
   under its fused names (``weightsync/layouts.py``), one entry per rank in ``ranks``.

Unpaused, each call waits for running requests (SGLang's writer lock), like a disk update.
On any failure (HTTP error, ``success: false``, a broadcast past the timeout) the sender closes
the group, which makes a server's pending receive fail at once ("Connection closed by peer"),
the session is ended, the server's group destroyed (best effort) and ``WeightSyncError`` raised;
the next sync makes a new group. A server that lacks the routes answers 404:
:meth:`distributed_sync_unsupported` names it before the run starts.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

from sat_cli.engines.sglang.wire import wire_excerpt
from sat_cli.engines.verification import Checksums
from sat_cli.errors import EngineError, WeightSyncError

_names = itertools.count()
GRACE_S = 3.0  # after a server failed: how long the sender's half may take to notice


def _failed(answer) -> bool:
    return isinstance(answer, Exception) or not (
        isinstance(answer, dict) and answer.get("success") is True
    )


class DistributedSync:
    """The weight-sync calls of :class:`sat_cli.engines.sglang.engine.SGLangEngine`."""

    weight_verification = Checksums("sglang")  # served_checksums() names (weightsync/layouts.py)
    _sync_group: str | None = None
    server_ranks = 1  # ranks per server (engine.tp)

    def distributed_sync_unsupported(self) -> str | None:
        """Why these servers cannot take ``engine.weight_sync=distributed`` (None: they can):
        a harmless probe of ``/destroy_weights_update_group`` (400 "does not exist" on SGLang
        0.5.23; 404 where the route is missing)."""
        for url in self.worker_urls:
            status, body = self.client.request(
                "POST",
                "/destroy_weights_update_group",
                {"group_name": "sat_probe"},
                url=url,
                timeout_s=30.0,
            )
            if status == 404:
                return (
                    f"the server at {url} has no /destroy_weights_update_group (HTTP 404: "
                    f"{wire_excerpt(body)}): it cannot update weights from a process group "
                    "(SGLang 0.5.23's /init_weights_update_group)"
                )
        return None

    def _post_all(self, path: str, payload, timeout_s: float) -> list:
        """``path`` on every server at once (``payload``: one for all, or a function of the
        server's index); futures of ``(url, answer or exception)``."""
        pool = self._pool()

        def one(i, url):
            body = payload(i) if callable(payload) else payload
            try:
                return url, self.client.post_json(
                    path, body, url=url, timeout_s=timeout_s, retries=0
                )
            except EngineError as exc:
                return url, exc

        return [pool.submit(one, i, url) for i, url in enumerate(self.worker_urls)]

    @staticmethod
    def _check(futures, path: str, deadline_s: float) -> None:
        errors = []
        for f in futures:
            url, answer = f.result(timeout=deadline_s)
            if isinstance(answer, Exception):
                errors.append(f"{url}{path}: {answer}")
            elif _failed(answer):
                errors.append(f"{url}{path}: {wire_excerpt(answer)}")
        if errors:
            raise WeightSyncError("; ".join(errors))

    def _join_group(self, sender, spec) -> None:
        world = 1 + self.server_ranks * len(self.worker_urls)
        port = sender.listen(spec.master_addr, spec.port, world, spec.timeout_s)
        name = f"sat_weights_{next(_names)}"
        path = "/init_weights_update_group"
        posts = self._post_all(
            path,
            lambda i: {
                "master_address": spec.master_addr,
                "master_port": port,
                "rank_offset": 1 + i * self.server_ranks,
                "world_size": world,
                "group_name": name,
                "backend": spec.backend,
            },
            spec.timeout_s + 10.0,
        )
        joined = self._pool().submit(sender.connect, name, spec.backend)
        self._await(sender, joined, posts, spec.timeout_s + 10.0, path)
        self._sync_group = name

    def sync_weights(self, sender, version: int, spec) -> dict[str, float]:
        """Bring ``version`` from ``sender`` to every server (module docstring); returns
        ``{"pause_s", "wire_s", "assemble_s", "bytes"}``."""
        self._check_usable()
        if version < self._version:
            raise ValueError(f"weight version went backwards: {self._version} -> {version}")
        wait = spec.timeout_s + 10.0
        with self._update_lock, self._paused_for_update():
            t0 = time.perf_counter()
            self._max_version = max(self._max_version, int(version))
            flush = self._paused != "in_place"
            try:
                if self._sync_group is None or not sender.connected:
                    self._join_group(sender, spec)
                self._check(self._post_all("/begin_weight_update", {}, wait), "/begin", wait)
                pause = time.perf_counter() - t0
                took = self._send_buckets(sender, int(version), spec, flush)
                t1 = time.perf_counter()
                self._check(self._post_all("/end_weight_update", {}, wait), "/end", wait)
                pause += time.perf_counter() - t1
            except (WeightSyncError, EngineError, TimeoutError) as exc:
                self._abandon(sender, wait)
                raise WeightSyncError(f"distributed sync of weights v{version}: {exc}") from None
            self._cache_stale = self._cache_stale or not flush
            self._version = int(version)
            self._last_weights = None  # a restart reloads from disk only what is on disk
        return {"pause_s": pause, **took}

    def _send_buckets(self, sender, version: int, spec, flush: bool) -> dict[str, float]:
        plan = sender.plan(version)
        wait = spec.timeout_s + 10.0
        wire = assemble = 0.0
        nbytes = 0
        for k, bucket in enumerate(plan):
            last = k == len(plan) - 1
            payload = {
                **bucket.request(),
                "group_name": self._sync_group,
                "load_format": "flattened_bucket",
                "flush_cache": bool(flush and last),
                "weight_version": str(version) if last else None,
            }
            t0 = time.perf_counter()
            posts = self._post_all("/update_weights_from_distributed", payload, wait)
            sent = self._pool().submit(sender.send, version, k)
            self._await(sender, sent, posts, wait, "/update_weights_from_distributed")
            nbytes += sent.result()
            assemble += sender.last_flatten_s
            wire += time.perf_counter() - t0 - sender.last_flatten_s
        return {"wire_s": wire, "assemble_s": assemble, "bytes": float(nbytes)}

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for the calls to every server and the sender's broadcast (made once)."""
        if "_sync_pool" not in self.__dict__:
            self._sync_pool = ThreadPoolExecutor(
                max_workers=len(self.worker_urls) + 1, thread_name_prefix="sglang-sync"
            )
        return self._sync_pool

    def _await(self, sender, sent, posts, wait: float, path: str) -> None:
        """The sender's half (``sent``: joining the group, or a broadcast) and every server's
        answer, within ``wait``: a server that fails first makes the sender close the group
        (a sender still waiting in a collective gets ``GRACE_S`` more, then is left to its own
        timeout on its thread), a failing sender makes the servers' waits fail (their answers
        follow)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_any

        deadline = time.monotonic() + wait
        pending = {sent, *posts}
        while pending:
            left = deadline - time.monotonic()
            done, pending = wait_any(pending, timeout=max(left, 0.0), return_when=FIRST_COMPLETED)
            if not done:
                sender.abort()
                if pending == {sent}:  # every server answered; the sender is stuck
                    break
                raise WeightSyncError(f"no answer within {wait:g} s (broadcast or servers)")
            if any(f is sent and f.exception() is not None for f in done) or any(
                f is not sent and _failed(f.result()[1]) for f in done
            ):
                sender.abort()  # the other side's wait ends now
                deadline = min(deadline, time.monotonic() + GRACE_S)
        self._check(posts, path, 0.0)  # the servers' answers say more than the sender's error
        if not sent.done():
            raise WeightSyncError(f"the sender did not finish {path} within {wait:g} s")
        if sent.exception() is not None:
            raise sent.exception()

    def _abandon(self, sender, wait: float) -> None:
        """After a failure: close the group, end the session, drop the servers' group."""
        sender.abort()
        name, self._sync_group = self._sync_group, None
        for path, payload in (
            ("/end_weight_update", {}),
            ("/destroy_weights_update_group", {"group_name": name}),
        ):
            if path.startswith("/destroy") and name is None:
                continue
            for f in self._post_all(path, payload, wait):
                try:
                    f.result(timeout=wait)
                except Exception:  # noqa: BLE001 - best effort: the next sync starts clean
                    pass

    def served_checksums(self) -> dict[str, dict[str, str]]:
        """``{url: {tensor: checksum}}`` from ``/weights_checker`` (one rank per server)."""
        self._check_usable()
        out = {}
        for url in self.worker_urls:
            answer = self.client.post_json("/weights_checker", {"action": "checksum"}, url=url)
            ranks = answer.get("ranks") if isinstance(answer, dict) else None
            if answer.get("success") is not True or not ranks:
                raise EngineError(f"{url}/weights_checker: {wire_excerpt(answer)}")
            if len(ranks) != 1:
                raise EngineError(
                    f"{url}/weights_checker reports {len(ranks)} ranks; checksums are compared "
                    "for one-rank servers only (engine.verify_weights=off for tp/ep servers)"
                )
            out[url] = dict(ranks[0]["checksums"])
        return out
