"""The SGLang client and engine over real HTTP, against the loopback stand-in (tests/sglang_standin.py).

The stand-in speaks SGLang's wire format with deterministic fake outputs and records what it
received, so these tests check what goes over the wire (batches, seeds, versions) and that what
comes back is decoded exactly (token ids, log-probs, routed experts bit for bit).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from sglang_standin import Standin

from sat_cli.engines.base import EngineError, RolloutEngine, SamplingParams
from sat_cli.engines.sglang import SGLangClient, SGLangEngine
from sat_cli.engines.sglang.runtime import SGLangRuntime
from sat_cli.engines.sglang.settings import SGLangEngineSettings
from sat_cli.util.procs import free_port

DIMS = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_experts": 4, "vocab_size": 50}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DIMS))
    return d


@pytest.fixture
def standin(model_dir):
    # a server started with --enable-deterministic-inference (sampling seeds honoured)
    with Standin(str(model_dir), deterministic=True) as s:
        yield s


def entry_params(call: dict) -> list[dict]:
    """The sampling params of every entry of a /generate body (one dict applies to all)."""
    sp = call["sampling_params"]
    return sp if isinstance(sp, list) else [sp] * len(call["input_ids"])


def make_engine(model_dir, urls, *, r3=False, retries=0, backoff_s=0.5, **settings):
    """An engine on servers started elsewhere; ``settings``: ``engine.*`` keys (deterministic
    unless told)."""
    settings.setdefault("deterministic", True)
    s = SGLangEngineSettings(urls=list(urls), **settings)
    return SGLangEngine(s, SGLangRuntime(str(model_dir), r3, retries=retries, backoff_s=backoff_s))


def test_is_a_rollout_engine(model_dir, standin):
    with make_engine(model_dir, [standin.url]) as engine:
        assert isinstance(engine, RolloutEngine)


def test_batched_generate_keeps_order_and_round_trips_routed_experts(model_dir, standin):
    prompts = [[1, 2, 3], [4, 5], [6]]
    sampling = SamplingParams(temperature=0.8, max_new_tokens=5, seed=100)
    with make_engine(model_dir, [standin.url], r3=True, max_batch_size=4) as engine:
        samples = engine.generate(prompts, n=3, sampling=sampling)

    # 9 entries in batches of 4 -> 3 /generate requests of 4, 4 and 1 entries.
    calls = sorted(standin.calls("/generate"), key=lambda c: entry_params(c)[0]["sampling_seed"])
    assert [len(c["input_ids"]) for c in calls] == [4, 4, 1]
    sent = [ids for c in calls for ids in c["input_ids"]]
    assert sent == [[1, 2, 3]] * 3 + [[4, 5]] * 3 + [[6]] * 3  # prompt-major repetition
    seeds = [sp["sampling_seed"] for c in calls for sp in entry_params(c)]
    assert seeds == list(range(100, 109))
    assert all(c["return_logprob"] and c["logprob_start_len"] == -1 for c in calls)
    assert all(c["return_routed_experts"] is True for c in calls)
    assert entry_params(calls[0])[0]["temperature"] == 0.8

    sent_items = {item["meta_info"]["id"]: item for item in standin.state.generated}
    assert [len(group) for group in samples] == [3, 3, 3]
    for prompt, group in zip(prompts, samples, strict=True):
        for s in group:
            item = sent_items[s.meta["sglang_id"]]
            assert s.prompt_ids == prompt
            assert s.response_ids == item["output_ids"]
            assert s.rollout_logp == [lp for lp, _, _ in item["meta_info"]["output_token_logprobs"]]
            assert s.weight_version == 0
            assert s.finish_reason == "length"
            # Routed experts: exactly the int32 values the server encoded, in [T-1, L, K].
            t = len(prompt) + len(s.response_ids) - 1
            assert s.routed_experts.shape == (t, 2, 2)
            assert (
                s.routed_experts.reshape(-1).tolist()
                == standin.state.routed_by_id[item["meta_info"]["id"]]
            )


def test_stop_token_ends_sample_with_stop(model_dir, standin):
    # Stop on every token id: each sample ends after its first token with finish "stop".
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=tuple(range(50)), seed=1)
    with make_engine(model_dir, [standin.url]) as engine:
        (group,) = engine.generate([[1, 2]], n=2, sampling=sampling)
    assert [s.finish_reason for s in group] == ["stop", "stop"]
    assert [len(s.response_ids) for s in group] == [1, 1]
    assert entry_params(standin.calls("/generate")[0])[0]["stop_token_ids"] == list(range(50))


def test_generate_async_returns_a_future(model_dir, standin):
    sampling = SamplingParams(max_new_tokens=3, seed=5)
    with make_engine(model_dir, [standin.url]) as engine:
        future = engine.generate_async([[1], [2]], 2, sampling)
        result = future.result(timeout=30)
        again = engine.generate([[1], [2]], 2, sampling)
    # Same seeds, same (stand-in) weights -> same tokens.
    assert [[s.response_ids for s in g] for g in result] == [
        [s.response_ids for s in g] for g in again
    ]


def test_update_weights_sends_version_and_tags_later_samples(model_dir, standin, tmp_path):
    weights = tmp_path / "weights" / "v5"
    weights.mkdir(parents=True)
    with make_engine(model_dir, [standin.url]) as engine:
        engine.update_weights(str(weights), 5)
        assert engine.version == 5
        (group,) = engine.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="backwards"):
            engine.update_weights(str(weights), 4)
        with pytest.raises(EngineError, match="does not exist"):
            engine.update_weights(str(tmp_path / "missing"), 6)
    assert standin.calls("/update_weights_from_disk") == [
        {"model_path": str(weights), "weight_version": "5", "flush_cache": True}
    ]
    assert [s.weight_version for s in group] == [5, 5]


def test_version_not_set_by_engine_is_an_error(model_dir, standin):
    standin.configure(report_version="9")
    with make_engine(model_dir, [standin.url]) as engine:
        with pytest.raises(EngineError, match="weight_version 9 but this engine set versions 0..0"):
            engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_http_500_is_an_engine_error_with_body_and_no_retry(model_dir, standin):
    standin.configure(status_code=500)
    with make_engine(model_dir, [standin.url], retries=3, backoff_s=0.01) as engine:
        with pytest.raises(
            EngineError,
            match=r"POST http://127.0.0.1:\d+/generate answered HTTP 500: .*stand-in failure",
        ):
            engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
    assert len(standin.calls("/generate")) == 1


def test_read_timeout_is_an_engine_error(model_dir, standin):
    standin.configure(delay_s=10.0)
    with make_engine(model_dir, [standin.url], request_timeout_s=0.5) as engine:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="no answer within 0.5 s"):
            engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
        assert time.monotonic() - t0 < 5.0  # well before the 10 s answer


@pytest.mark.parametrize(
    "malformed, message",
    [
        ("not_json", "malformed JSON"),
        ("wrong_count", "answered 1 items for a batch of 2"),
        ("bad_routed_size", "not divisible by num_layers"),
        ("bad_routed_rows", "expected prompt_len \\+ completion_len - 1"),
        ("no_logprobs", "lacks output_token_logprobs"),
        ("version_text", "'default' is not an integer"),
        ("logprob_ids", "disagree"),
    ],
)
def test_malformed_answers_are_engine_errors(model_dir, standin, malformed, message):
    standin.configure(malformed=malformed)
    with make_engine(model_dir, [standin.url], r3=True) as engine:
        with pytest.raises(EngineError, match=message):
            engine.generate([[1, 2]], 2, SamplingParams(max_new_tokens=3))


def test_r3_without_server_support_fails_loudly(model_dir):
    with Standin(str(model_dir), routed_experts_enabled=False) as s:
        with make_engine(model_dir, [s.url], r3=True) as engine:
            with pytest.raises(EngineError, match="no routed_experts"):
                engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3))


def test_aborted_entries_come_back_as_abort_samples(model_dir, standin):
    standin.configure(abort_entries=[1])
    with make_engine(model_dir, [standin.url], r3=True) as engine:
        (group,) = engine.generate([[1, 2]], 3, SamplingParams(max_new_tokens=3))
    assert [s.finish_reason for s in group] == ["length", "abort", "length"]
    assert group[1].routed_experts is None and group[0].routed_experts is not None


def test_connection_refused_is_retried_then_fails(model_dir):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens here
    client = SGLangClient(url, retries=2, backoff_s=0.01)
    with pytest.raises(EngineError, match="after 3 attempts .*ConnectionRefusedError"):
        client.post_json("/generate", {"input_ids": [[1]]})
    client.close()


def test_round_robin_over_servers_and_updates_reach_all(model_dir, tmp_path):
    weights = tmp_path / "v1"
    weights.mkdir()
    with Standin(str(model_dir)) as a, Standin(str(model_dir)) as b:
        with make_engine(model_dir, [a.url, b.url], max_batch_size=1) as engine:
            engine.generate([[1], [2], [3], [4]], 1, SamplingParams(max_new_tokens=2))
            engine.update_weights(str(weights), 1)
            engine.flush_cache()
        assert len(a.calls("/generate")) == 2 and len(b.calls("/generate")) == 2
        for s in (a, b):
            assert s.calls("/update_weights_from_disk")[0]["weight_version"] == "1"
            assert len(s.calls("/flush_cache")) == 1


def test_pause_holds_requests_until_resume(model_dir, standin):
    with make_engine(model_dir, [standin.url]) as engine:
        engine.pause()
        future = engine.generate_async([[1]], 1, SamplingParams(max_new_tokens=2))
        time.sleep(0.5)
        assert not future.done()
        engine.resume()
        (group,) = future.result(timeout=30)
    assert group[0].finish_reason == "length"
    assert standin.calls("/pause_generation") == [{"mode": "in_place"}]
    assert standin.calls("/continue_generation") == [{}]


def test_health_while_paused_asks_model_info_not_the_blocking_probe(model_dir, standin):
    # Paused, SGLang's /health_generate blocks 20 s and answers 503 (captured); the engine asks
    # /model_info instead, so a paused engine is healthy at once.
    with make_engine(model_dir, [standin.url]) as engine:
        engine.pause()
        t0 = time.monotonic()
        assert engine.health()
        assert time.monotonic() - t0 < 5.0
        engine.resume()
        assert engine.health()


def test_health(model_dir, standin):
    with make_engine(model_dir, [standin.url]) as engine:
        assert engine.health()
        standin.configure(healthy=False)
        assert not engine.health()
    assert not engine.health()  # closed


def _blocked_call(client):
    """A ``/generate`` call on its own thread (not started) whose EngineError text is kept; the
    client reports the watchdog's reason for an aborted call."""
    client.abort_reason = lambda: "SGLang server died; log: /x/sglang_0.log"
    errors: list[str] = []

    def call():
        try:
            client.post_json("/generate", {"input_ids": [[1]]})
        except EngineError as e:
            errors.append(str(e))

    return threading.Thread(target=call), errors


def test_abort_inflight_fails_blocked_calls_at_once(standin):
    # The watchdog's mechanism: a dead server is reported to calls blocked on a read.
    standin.configure(delay_s=10.0)
    client = SGLangClient(standin.url, retries=0)
    thread, errors = _blocked_call(client)
    t0 = time.monotonic()
    thread.start()
    time.sleep(0.3)
    client.abort_inflight()
    thread.join(timeout=9)
    assert time.monotonic() - t0 < 5.0  # well before the 10 s answer
    assert errors == ["SGLang server died; log: /x/sglang_0.log"]
    client.close()


def test_close_fails_requests_in_flight(model_dir, standin):
    standin.configure(delay_s=10.0)
    engine = make_engine(model_dir, [standin.url])
    future = engine.generate_async([[1]], 1, SamplingParams(max_new_tokens=2))
    time.sleep(0.3)
    t0 = time.monotonic()
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        future.result(timeout=9)
    assert time.monotonic() - t0 < 5.0  # well before the 10 s answer
    with pytest.raises(EngineError, match="closed"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_update_during_a_paused_request_gives_per_token_versions(model_dir, standin, tmp_path):
    weights = tmp_path / "v1"
    weights.mkdir()
    standin.configure(delay_s=1.0, pause_at_token=2)  # the request runs 1 s, paused at token 2
    with make_engine(model_dir, [standin.url]) as engine:
        future = engine.generate_async([[1, 2]], 1, SamplingParams(max_new_tokens=5))
        time.sleep(0.3)
        engine.pause(mode="in_place")
        engine.update_weights(str(weights), 1)
        engine.resume()
        ((sample,),) = future.result(timeout=30)
        # SGLang refuses a cache flush while requests run, and only after loading the weights:
        # paused in place, the update goes without one, and the next generate flushes first.
        assert standin.calls("/update_weights_from_disk")[0]["flush_cache"] is False
        assert standin.calls("/flush_cache") == []
        engine.generate([[3]], 1, SamplingParams(max_new_tokens=2))
        assert len(standin.calls("/flush_cache")) == 1
        engine.generate([[3]], 1, SamplingParams(max_new_tokens=2))
        assert len(standin.calls("/flush_cache")) == 1  # once
    # Submitted at v0, first 2 tokens by v0, the rest by v1 (the scheduler's spans).
    assert sample.weight_version == 0
    assert sample.token_versions == [0, 0, 1, 1, 1]
    assert sample.meta["version_at_submit"] == 0


def test_seeds_are_sent_only_to_deterministic_servers(model_dir):
    sampling = SamplingParams(max_new_tokens=3, seed=7)
    with Standin(str(model_dir)) as s:  # no --enable-deterministic-inference
        with make_engine(model_dir, [s.url], deterministic=False) as engine:
            engine.generate([[1]], 2, sampling)
        sent = s.calls("/generate")[0]["sampling_params"]
        assert isinstance(sent, dict) and "sampling_seed" not in sent  # one dict for all entries
    with Standin(str(model_dir), deterministic=True) as s:
        with make_engine(model_dir, [s.url]) as engine:
            first = engine.generate([[1]], 2, sampling)
            again = engine.generate([[1]], 2, sampling)
        seeds = [entry_params(p)[0]["sampling_seed"] for p in s.calls("/generate")]
    assert seeds == [7, 7]
    assert [x.response_ids for x in first[0]] == [x.response_ids for x in again[0]]


def test_top_k_top_p_use_the_behaviour_logprobs_of_the_sampling_mask(model_dir, standin):
    plain = SamplingParams(max_new_tokens=4, seed=3)
    cut = SamplingParams(max_new_tokens=4, seed=3, top_k=5, top_p=0.9)
    with make_engine(model_dir, [standin.url]) as engine:
        (g_plain,) = engine.generate([[1]], 1, plain)
        (g_cut,) = engine.generate([[1]], 1, cut)
    calls = standin.calls("/generate")
    assert "return_sampling_mask" not in calls[0]
    assert calls[1]["return_sampling_mask"] is True
    item = standin.state.generated[1]["meta_info"]
    assert g_cut[0].rollout_logp == item["output_token_sampling_logprobs"]
    assert g_cut[0].rollout_logp != [lp[0] for lp in item["output_token_logprobs"]]
    first = standin.state.generated[0]["meta_info"]
    assert g_plain[0].rollout_logp == [lp[0] for lp in first["output_token_logprobs"]]


def test_kept_sets_and_the_sampler_top_k_come_back_per_token(model_dir, standin):
    # filtered: the kept sets, and the top-k from the support's log-probs (support mode)
    cut = SamplingParams(max_new_tokens=4, seed=3, top_k=5, sampling_mask=True, topk_logprobs=2)
    plain = SamplingParams(max_new_tokens=4, seed=3, topk_logprobs=2)  # no filter: top_logprobs
    with make_engine(model_dir, [standin.url]) as engine:
        ((s_cut,),) = engine.generate([[1]], 1, cut)
        ((s_plain,),) = engine.generate([[1]], 1, plain)
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=4, seed=3))
    calls = standin.calls("/generate")
    assert calls[0]["sampling_logprobs_mode"] == "support" and "top_logprobs_num" not in calls[0]
    assert calls[1]["top_logprobs_num"] == 2 and "return_sampling_mask" not in calls[1]
    extra = ("return_sampling_mask", "sampling_logprobs_mode", "top_logprobs_num")
    assert not any(k in calls[2] for k in extra)  # the default request is unchanged
    meta = standin.state.generated[0]["meta_info"]
    assert [k.tolist() for k in s_cut.sampling_mask] == meta["output_token_sampling_mask"]
    for t, (tok, ids, lps) in enumerate(
        zip(
            s_cut.response_ids,
            meta["output_token_sampling_mask"],
            meta["output_token_sampling_logprobs"],
            strict=True,
        )
    ):
        assert s_cut.rollout_logp[t] == lps[ids.index(tok)]  # the sampled token's entry
        best = sorted(zip(lps, ids, strict=True), key=lambda e: -e[0])[:2]
        assert s_cut.topk_ids[t].tolist() == [i for _, i in best]
        assert s_cut.topk_logp[t].tolist() == pytest.approx([lp for lp, _ in best])
    top = standin.state.generated[1]["meta_info"]["output_top_logprobs"]
    assert s_plain.topk_ids.tolist() == [[e[1] for e in row] for row in top]
    for got, row in zip(s_plain.topk_logp.tolist(), top, strict=True):
        assert got == pytest.approx([e[0] for e in row])
    assert s_plain.sampling_mask is None


def test_retract_pause_is_refused_with_r3(model_dir, standin):
    with make_engine(model_dir, [standin.url], r3=True) as engine:
        with pytest.raises(EngineError, match="retract.*routed experts"):
            engine.pause(mode="retract")
        assert standin.calls("/pause_generation") == []
        engine.pause(mode="in_place")
        engine.resume()
    with make_engine(model_dir, [standin.url]) as engine:
        engine.pause(mode="retract")
        engine.resume()


def test_served_versions_come_from_model_info(model_dir, standin, tmp_path):
    weights = tmp_path / "v3"
    weights.mkdir()
    with make_engine(model_dir, [standin.url]) as engine:
        assert engine.served_versions() == [0]
        engine.update_weights(str(weights), 3)
        assert engine.served_versions() == [3]


def test_a_bad_request_quotes_the_servers_error_body(model_dir, standin):
    client = SGLangClient(standin.url, retries=0)
    with pytest.raises(EngineError, match=r"HTTP 400: .*unknown field `bogus`"):
        client.post_json("/generate", {"input_ids": [[1]], "sampling_params": {"bogus": 1}})
    client.close()


def test_servers_started_elsewhere_must_serve_version_0(model_dir):
    # engine.urls: servers started elsewhere; one left at another version (an earlier run's
    # weights) would mislabel every sample, so the engine refuses it at start.
    with Standin(str(model_dir), weight_version="3") as s:
        with pytest.raises(EngineError, match=r"report weight versions \[3\]"):
            make_engine(model_dir, [s.url])
    with Standin(str(model_dir)) as s:
        with make_engine(model_dir, [s.url]) as engine:
            assert engine.served_versions() == [0]


@pytest.mark.parametrize("settle_s", [10.0, 0.3])
def test_a_flush_refused_for_a_request_not_yet_retired_is_retried(
    model_dir, standin, tmp_path, monkeypatch, settle_s
):
    """A request this engine did not send (or one whose answer it has read, which SGLang's
    scheduler retires only at its next loop turn) runs while the engine updates with a flush:
    SGLang loads the weights and answers 400 "Weights were updated, but the cache was not
    flushed", its tokenizer keeping the old version stamp. The engine retries /flush_cache until
    it is accepted (the request finished), then loads the weights again so that the stamp moves;
    after FLUSH_SETTLE_S the refusal counts (EngineError quoting SGLang's answer). A real run once
    failed this way in tests/test_sglang_real.py, an update right after a /generate answered."""
    from sat_cli.engines.sglang import control

    monkeypatch.setattr(control, "FLUSH_SETTLE_S", settle_s)
    weights = tmp_path / "v1"
    weights.mkdir()
    standin.configure(delay_s=1.0)
    other = SGLangClient(standin.url)
    busy = threading.Thread(target=other.post_json, args=("/generate", {"input_ids": [[1]]}))
    with make_engine(model_dir, [standin.url]) as engine:
        busy.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        if settle_s < 1.0:  # the request outlives the window: the refusal counts
            with pytest.raises(
                EngineError, match="/flush_cache answered HTTP 400: Flush cache failed"
            ):
                engine.update_weights(str(weights), 1)
            assert time.monotonic() - t0 < 0.3 + 0.5 + 0.5  # the window and one last pause
        else:
            engine.update_weights(str(weights), 1)
            assert 0.3 < time.monotonic() - t0 < settle_s  # it waited for the request, no more
        busy.join(timeout=30)
        flushes = standin.calls("/flush_cache")
        assert len(flushes) >= 2  # refused at least once, retried
        updates = standin.calls("/update_weights_from_disk")
        if settle_s >= 1.0:  # loaded again once idle: the served stamp is the new version
            assert len(updates) == 2 and engine.served_versions() == [1]
            engine.flush_cache()  # idle: accepted at once
            assert len(standin.calls("/flush_cache")) == len(flushes) + 1
        else:  # SGLang's tokenizer kept the old stamp; the engine reports the failure
            assert len(updates) == 1 and engine.served_versions() == [0]
    other.close()


def test_abort_inflight_reaches_a_call_whose_answer_closes_the_connection():
    """Probe (issue 53 v5): an answer with ``Connection: close`` (HTTP/1.0 servers, proxies)
    makes http.client drop the connection's socket while the body is still read; the abort
    must reach the socket itself. The body trickles a byte every 0.2 s (20 s in all); the
    aborted call fails within a second or two, with the watchdog's reason."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Trickle(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass  # the client gave up: that is the point

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", retries=0)
    thread, errors = _blocked_call(client)
    thread.start()
    time.sleep(0.6)  # the headers have come; the body is being read
    t0 = time.monotonic()
    client.abort_inflight()
    thread.join(timeout=25)
    took = time.monotonic() - t0
    client.close()
    server.shutdown()
    server.server_close()
    assert errors == ["SGLang server died; log: /x/sglang_0.log"]
    assert took < 3.0, took  # not the 20 s of the trickled body
