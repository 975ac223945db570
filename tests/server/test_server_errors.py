"""Server errors: every bad field of every route gets a 400 whose message and param name the field; error
shapes through the `openai` client, malformed JSON and unknown routes; a client that disconnects or
times out aborts its requests.
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread, scrape


MSG = [{"role": "user", "content": "w1"}]
BAD = [
    ("/v1/completions", {"prompt": "w1", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "w1", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "w1", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "w1", "n": 65}, "n"),
    ("/v1/completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "w1", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "w1", "stop_token_ids": [100000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "w1", "stop": [""]}, "stop.0"),
    ("/v1/completions", {"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "w1", "response_format": {"type": "xml"}}, "response_format.type"),
    # the tiny model has no EOS token: structured output is refused for it, naming the field
    ("/v1/completions", {"prompt": "w1", "response_format": {"type": "json_object"}}, "response_format"),
    ("/generate", {"text": "w1", "sampling_params": {"regex": "a+", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [100000]}, "prompt"),
    ("/v1/completions", {"prompt": "w1 " * 600}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/generate", {"text": "w1", "sampling_params": {"temperature": -2}}, "sampling_params.temperature"),
    ("/generate", {"text": "w1", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ("/generate", {}, "text"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_fields_get_400_naming_the_field(srv: ServerThread, path: str, body: dict, field: str) -> None:
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"].startswith(field) and err["param"] == field, err


def test_error_shapes_through_openai_client(client: openai.OpenAI, srv: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, response_format={"type": "json_object"})
    assert e.value.status_code == 400 and "response_format" in e.value.message
    ok = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, response_format={"type": "text"})
    assert ok.usage.completion_tokens == 2
    r = httpx.post(f"{srv.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{srv.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_client_disconnect_aborts(srv: ServerThread) -> None:
    key = 'specserve:request_success_total{finished_reason="abort"}'
    before = scrape(srv.url).get(key, 0)
    body = {"prompt": "w1", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 8}  # seconds of work
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():  # read the first event, then hang up
            if line.startswith("data:"):
                break
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = scrape(srv.url)
        if m.get(key, 0) >= before + 2 and m["specserve:num_requests_running"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"requests not aborted: {scrape(srv.url).get(key)} (before {before})")
