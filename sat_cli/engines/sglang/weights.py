"""How published trainer weights reach the SGLang workers.

:class:`DiskWeightSync` posts ``/update_weights_from_disk`` to every worker (an HF checkpoint
directory on a file system the servers can read). SGLang 0.5.23's scheduler loads the weights and
moves its version stamp first, then flushes the prefix cache when asked; a flush refused because
requests still run (an ``in_place`` pause) fails the call *after* the weights changed
(``scheduler_components/weight_updater.py``). The engine therefore never sends
``flush_cache=true`` while requests may be running, and it reads the served version back from
``GET /model_info`` after a failed update instead of assuming a rollback. The same refusal for a
request the scheduler has not yet retired (answered, gone at its next loop turn) is waited out:
the flush is retried until accepted, then the weights are loaded again so that the tokenizer
manager's version stamp moves too.

The path without the disk (``/init_weights_update_group`` + ``/update_weights_from_distributed``
between ``/begin_weight_update`` and ``/end_weight_update``; gloo on CPU, NCCL on GPUs) is
``dist_sync.py`` (``engine.weight_sync=distributed``, docs/sglang.md "Weight sync").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sat_cli.engines.sglang.client import SGLangClient
from sat_cli.engines.sglang.control import flush_settled
from sat_cli.engines.sglang.wire import update_weights_payload, wire_excerpt
from sat_cli.errors import EngineError

# SGLang 0.5.23's answer when it loaded the weights but refused the flush (requests running)
UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"


class DiskWeightSync:
    """``POST /update_weights_from_disk`` on every worker (an HF checkpoint directory).

    Unpaused, SGLang waits for running requests, loads the safetensors, sets ``weight_version``
    and (with ``flush_cache``) drops the prefix cache, whose KV entries were computed by the old
    weights. A 400 answer (``success: false``) becomes an EngineError quoting SGLang's message.
    """

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s

    def push(
        self,
        client: SGLangClient,
        worker_urls: Sequence[str],
        path: str,
        version: int,
        *,
        flush_cache: bool = True,
    ):
        if not Path(path).is_dir():
            raise EngineError(f"weights directory {path} does not exist")
        payload = update_weights_payload(path, version, flush_cache=flush_cache)
        for url in worker_urls:
            status, body = client.request(
                "POST", "/update_weights_from_disk", payload, url=url, timeout_s=self.timeout_s
            )
            if flush_cache and status == 400 and UPDATED_NOT_FLUSHED in body.decode("latin-1"):
                # loaded, but the flush met a request not yet retired, and SGLang's tokenizer
                # kept the old version stamp: once a flush is accepted (idle), load it again
                flush_settled(client, url)
                status, body = client.request(
                    "POST", "/update_weights_from_disk", payload, url=url, timeout_s=self.timeout_s
                )
            answer = client.json_or_raise("POST", url, "/update_weights_from_disk", status, body)
            if not isinstance(answer, dict) or answer.get("success") is not True:
                raise EngineError(
                    f"{url}/update_weights_from_disk({path}, v{version}) failed: {wire_excerpt(answer)}"
                )
