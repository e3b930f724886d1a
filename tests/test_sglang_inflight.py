"""In-flight weight updates of the SGLang engine (``inflight_updates=True``), against the stand-in:
each update pauses the workers (``in_place`` for ``inflight_cache="keep"``, ``retract`` for
``"recompute"``), so a running request continues under the new weights with per-token versions."""

from __future__ import annotations

import json
import time

import pytest
from sglang_standin import Standin

from sat_cli.engines.base import SamplingParams
from sat_cli.engines.sglang import SGLangEngine
from sat_cli.engines.sglang.runtime import SGLangRuntime
from sat_cli.engines.sglang.settings import SGLangEngineSettings

DIMS = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_experts": 4, "vocab_size": 50}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DIMS))
    return d


@pytest.fixture
def standin(model_dir):
    with Standin(str(model_dir), deterministic=True) as s:
        yield s


def engine_for(model_dir, standin, **runtime):
    s = SGLangEngineSettings(urls=[standin.url], deterministic=True)
    return SGLangEngine(s, SGLangRuntime(str(model_dir), retries=0, **runtime))


@pytest.mark.parametrize(
    ("cache", "mode", "flush_with_update"),
    [("keep", "in_place", False), ("recompute", "retract", True)],
)
def test_an_update_mid_request_pauses_and_gives_per_token_versions(
    model_dir, standin, tmp_path, cache, mode, flush_with_update
):
    weights = tmp_path / "v1"
    weights.mkdir()
    standin.configure(delay_s=1.0, pause_at_token=2)  # the request runs 1 s, held at token 2
    with engine_for(model_dir, standin, inflight_updates=True, inflight_cache=cache) as engine:
        future = engine.generate_async([[1, 2]], 1, SamplingParams(max_new_tokens=5))
        time.sleep(0.3)
        engine.update_weights(str(weights), 1)
        ((sample,),) = future.result(timeout=30)
        assert standin.calls("/pause_generation") == [{"mode": mode}]
        assert standin.calls("/continue_generation") == [{}]
        (update,) = standin.calls("/update_weights_from_disk")
        assert update["flush_cache"] is flush_with_update
        engine.generate([[3]], 1, SamplingParams(max_new_tokens=2))
        # in place, SGLang refuses the flush while the request runs: it comes before the next
        # generate instead; retracted, the update flushed
        assert len(standin.calls("/flush_cache")) == (0 if flush_with_update else 1)
        # already paused by the caller: no second pause around the update
        engine.pause(mode="in_place")
        engine.update_weights(str(weights), 2)
        engine.resume()
        assert len(standin.calls("/pause_generation")) == 2
    assert sample.weight_version == 0
    assert sample.token_versions == [0, 0, 1, 1, 1]


def test_recompute_is_refused_with_r3_and_unknown_modes(model_dir, standin):
    with pytest.raises(ValueError, match="inflight_cache='keep'"):
        engine_for(model_dir, standin, r3=True, inflight_updates=True)
    with pytest.raises(ValueError, match="inflight_cache='stale'"):
        engine_for(model_dir, standin, inflight_updates=True, inflight_cache="stale")
    with engine_for(model_dir, standin, r3=True, inflight_updates=True, inflight_cache="keep"):
        pass
    assert standin.calls("/pause_generation") == []


def test_without_the_flag_updates_do_not_pause(model_dir, standin, tmp_path):
    weights = tmp_path / "v1"
    weights.mkdir()
    with engine_for(model_dir, standin) as engine:
        engine.update_weights(str(weights), 1)
    assert standin.calls("/pause_generation") == []
    assert standin.calls("/update_weights_from_disk")[0]["flush_cache"] is True
