"""One ``generate`` of an :class:`~sat_cli.engines.sglang.engine.SGLangEngine`, as a mixin of the
engine: the entries (prompt-major, ``n`` per prompt, each with its own seed when the servers are
deterministic) cut into ``/generate`` batches of ``max_batch_size`` (one entry per request
through the router when seeded), sent at once, each answer parsed (``wire.py``; R3's routes,
the kept sets and top-k asked for) and every sample's weight version checked against the
versions this engine set while the request ran."""

from __future__ import annotations

from sat_cli.engines.sglang.masks import Extras
from sat_cli.engines.sglang.wire import (
    build_generate_payload,
    entry_seeds,
    parse_generate_item,
    sampling_params_to_wire,
    wire_excerpt,
)
from sat_cli.errors import EngineError
from sat_cli.samples import Sample, SamplingParams


class Batching:
    """``_generate`` and ``_check_version`` of ``SGLangEngine`` (which holds the client, the
    router, ``max_batch_size``, ``moe``, ``deterministic`` and the version range)."""

    def _generate(
        self, prompts, n: int, sampling: SamplingParams, adapters: list[int] | None = None
    ) -> list[list[Sample]]:
        """``adapters`` (LoRA, ``lora.py``): each prompt's version, named per entry as its
        ``lora_path``; its samples are stamped with it (the servers stay at the base)."""
        version_at_submit = self._version
        entries = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]  # prompt-major
        seeds = entry_seeds(sampling.seed if self.deterministic else None, len(prompts), n)
        params = [sampling_params_to_wire(sampling, s) for s in seeds]
        extras = Extras.of(sampling)  # kept sets / top-k asked for (masks.py)
        # sglang_router takes one sampling_params dict per request: entries with their own
        # seeds go one per request through it
        size = 1 if self.router is not None and seeds[0] is not None else self.max_batch_size
        chunks = [
            range(start, min(start + size, len(entries))) for start in range(0, len(entries), size)
        ]
        payloads = [
            build_generate_payload(
                [entries[k][1] for k in chunk],
                [params[k] for k in chunk],
                return_routed_experts=self.moe is not None,
                return_sampling_mask=extras.filtering,
            )
            | extras.payload_fields()
            | self._lora_fields(chunk, entries, adapters)
            for chunk in chunks
        ]
        futures = self.client.map_post("/generate", payloads)
        out: list[list[Sample]] = [[] for _ in prompts]
        try:
            for chunk, future in zip(chunks, futures, strict=True):
                answer = future.result()
                if not isinstance(answer, list) or len(answer) != len(chunk):
                    got = len(answer) if isinstance(answer, list) else type(answer).__name__
                    raise EngineError(
                        f"/generate answered {got} items for a batch of {len(chunk)}: "
                        f"{wire_excerpt(answer)}"
                    )
                for k, item in zip(chunk, answer, strict=True):
                    prompt_index, prompt_ids = entries[k]
                    sample = parse_generate_item(item, prompt_ids, moe=self.moe, extras=extras)
                    if adapters is None:
                        self._check_version(sample, version_at_submit)
                        sample.meta["version_at_submit"] = version_at_submit
                    else:  # the servers serve the base; the entry's adapter is its version
                        self._check_base(sample)
                        sample.weight_version = adapters[prompt_index]
                        sample.meta["version_at_submit"] = adapters[prompt_index]
                    out[prompt_index].append(sample)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return out

    def _lora_fields(self, chunk, entries, adapters) -> dict:
        if adapters is None:
            return {}
        return {"lora_path": [self.lora_path(adapters[entries[k][0]]) for k in chunk]}

    def _check_base(self, sample: Sample) -> None:
        """LoRA: the servers' own version never moves from the base they started on."""
        versions = sample.token_versions or [sample.weight_version]
        if sample.finish_reason != "abort" and set(versions) != {self._base_version}:
            raise EngineError(
                f"SGLang reports weight_version {sorted(set(versions))} with LoRA adapters; the "
                f"servers serve the base (version {self._base_version}) under them"
            )
        sample.token_versions = None

    def _check_version(self, sample: Sample, version_at_submit: int) -> None:
        if sample.finish_reason == "abort":
            return
        current = self._max_version
        versions = sample.token_versions or [sample.weight_version]
        if not version_at_submit <= min(versions) <= max(versions) <= current:
            reported = sorted(set(versions))
            reported = reported[0] if len(reported) == 1 else reported
            raise EngineError(
                f"SGLang reports weight_version {reported} but this engine set "
                f"versions {version_at_submit}..{current} while the request ran (did a server "
                "restart from the base checkpoint, or an update go elsewhere?)"
            )
