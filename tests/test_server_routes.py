"""Server routes beyond generation: Prometheus metrics move after a speculative request, /v1/models,
/server_info, /tokenize and /detokenize, and the native /generate route (single, batched, streamed).
"""
from __future__ import annotations

import json

import httpx
import openai

from .server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from .server_utils import ServerThread, scrape, sse_events


def test_metrics_move_after_speculative_request(client: openai.OpenAI, srv: ServerThread) -> None:
    before = scrape(srv.url)
    client.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=32, temperature=0)
    after = scrape(srv.url)
    for name in ("specserve:spec_decode_num_drafts_total", "specserve:spec_decode_num_draft_tokens_total",
                 "specserve:spec_decode_num_accepted_tokens_total",
                 'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 'specserve:request_success_total{finished_reason="length"}', "specserve:prompt_tokens_total",
                 "specserve:e2e_request_latency_seconds_count", "specserve:time_to_first_token_seconds_count",
                 "specserve:inter_token_latency_seconds_count"):
        assert after[name] > before.get(name, 0), name
    assert after["specserve:generation_tokens_total"] - before.get("specserve:generation_tokens_total", 0) == 32
    for gauge in ("specserve:num_requests_running", "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc"):
        assert gauge in after


def test_models_server_info_tokenize(client: openai.OpenAI, srv: ServerThread) -> None:
    m = client.models.list().data
    assert [x.id for x in m] == ["tiny"] and m[0].model_extra["max_model_len"] == 512
    info = httpx.get(f"{srv.url}/server_info").json()
    assert info["engine_config"]["speculative_algorithm"] == "NGRAM"
    assert info["resolved"]["speculative"]["num_draft_tokens"] == 3 and info["resolved"]["dtype"] == "float64"
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
