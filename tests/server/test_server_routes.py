"""Server routes beyond generation: Prometheus metrics count exactly what a speculative request reports, /v1/models,
/server_info, /tokenize and /detokenize, and the native /generate route (single, batched, streamed, prompt logprobs).
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread, scrape, sse_events


def test_metrics_count_exactly_what_the_request_reports(srv: ServerThread) -> None:
    """Counters move by exactly the request's own numbers (usage and speculative meta), per-token
    histograms by one observation per token, and gauges return to idle. Fails if a counter is fed twice
    (e.g. per step and per request), misses the bonus token, counts drafts that were cut by the window,
    or observes ITL per emission instead of per token."""
    before = scrape(srv.url)
    j = httpx.post(f"{srv.url}/generate", json={"input_ids": [1, 2, 3, 1, 2, 3, 1, 2],
                                               "sampling_params": {"max_new_tokens": 32, "temperature": 0}},
                   timeout=60).json()
    after = scrape(srv.url)
    meta = j["meta_info"]
    assert meta["spec_accepted_tokens"] > 0 and meta["completion_tokens"] == 32

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    expect = {
        "specserve:spec_decode_num_drafts_total": meta["spec_verify_ct"],
        "specserve:spec_decode_num_draft_tokens_total": meta["spec_draft_tokens"],
        "specserve:spec_decode_num_accepted_tokens_total": meta["spec_accepted_tokens"],
        'specserve:request_success_total{finished_reason="length"}': 1,
        "specserve:prompt_tokens_total": meta["prompt_tokens"],
        "specserve:generation_tokens_total": meta["completion_tokens"],
        "specserve:e2e_request_latency_seconds_count": 1, "specserve:time_to_first_token_seconds_count": 1,
        "specserve:inter_token_latency_seconds_count": meta["completion_tokens"] - 1,
    }
    expect.update({f'specserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}': c
                   for i, c in enumerate(meta["spec_accepted_per_pos"])})
    assert {k: delta(k) for k in expect} == expect
    for gauge in ("specserve:num_requests_running", "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc"):
        assert after[gauge] == 0, gauge  # idle again: nothing running, waiting or holding KV pages


def test_models_server_info_tokenize(client: openai.OpenAI, srv: ServerThread) -> None:
    m = client.models.list().data
    assert [x.id for x in m] == ["tiny"] and m[0].model_extra["max_model_len"] == 512
    info = httpx.get(f"{srv.url}/server_info").json()
    assert info["engine_config"]["speculative_algorithm"] == "NGRAM"
    assert info["resolved"]["speculative"]["num_draft_tokens"] == 3 and info["resolved"]["dtype"] == "float64"
    assert info["resolved"]["speculative"]["accept_rule"] == "onehot"  # NGRAM drafts are deterministic
    t = httpx.post(f"{srv.url}/tokenize", json={"prompt": "w1 w2 w3"}).json()
    assert t == {"tokens": [1, 2, 3], "count": 3, "max_model_len": 512}
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "w9"}]}).json()
    assert chat["tokens"] == [2, 9, 5, 3]
    assert httpx.post(f"{srv.url}/detokenize", json={"tokens": [1, 2, 3]}).json()["prompt"] == "w1 w2 w3"


def test_native_generate(client: openai.OpenAI, srv: ServerThread) -> None:
    ref = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=8, temperature=0).choices[0].text
    body = {"text": "w1 w2 w3", "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True}
    j = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
    assert j["text"] == ref and len(j["output_ids"]) == 8
    meta = j["meta_info"]
    assert meta["finish_reason"] == "length" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 8
    assert {"spec_verify_ct", "spec_accept_length", "spec_accepted_tokens"} <= set(meta)
    assert [x[1] for x in meta["output_token_logprobs"]] == j["output_ids"]
    many = httpx.post(f"{srv.url}/generate", json={"input_ids": [[1, 2, 3], [4, 5]],
                                                   "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert isinstance(many, list) and many[0]["output_ids"] == j["output_ids"][:4]
    events = sse_events(httpx.post(f"{srv.url}/generate", json={**body, "stream": True}, timeout=60).text)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == ref and last["meta_info"]["finish_reason"] == "length"


def test_native_generate_input_logprobs(srv: ServerThread, model_dir: str) -> None:
    """SGLang's logprob_start_len: meta_info.input_token_logprobs [[logprob, id, text]] from that prompt position
    (logprob None at position 0) and input_top_logprobs, the offline engine's prompt logprobs; streamed too."""
    from specserve import LLM, SamplingParams

    ids = [1, 2, 3, 4, 5]
    ref = LLM(model_dir, dtype="float64").generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2}
    assert "input_token_logprobs" not in httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()["meta_info"]
    for start in (0, 3):
        meta = httpx.post(f"{srv.url}/generate", json={**body, "logprob_start_len": start}, timeout=60).json()["meta_info"]
        got, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [x[1:] for x in got] == [[t, f"w{t}"] for t in ids[start:]] and len(tops) == len(got)
        for (v, _, _), top, lp in zip(got, tops, ref.prompt_logprobs[start:]):
            if lp is None:
                assert v is None and top is None
            else:
                assert v == pytest.approx(lp.logprob, abs=1e-9) and [x[1] for x in top] == [i for i, _ in lp.top]
    events = sse_events(httpx.post(f"{srv.url}/generate", json={**body, "logprob_start_len": 0, "stream": True},
                                   timeout=60).text)
    assert [x[1] for x in json.loads(events[-2])["meta_info"]["input_token_logprobs"]] == ids
    bad = httpx.post(f"{srv.url}/generate", json={**body, "logprob_start_len": 5}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"
