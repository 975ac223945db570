"""The HTTP server, driven through the official `openai` client and raw HTTP, over a tiny fp64 model
with NGRAM speculation on (greedy outputs are exact; seeded sampling is reproducible)."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams

from .server_utils import ServerThread, make_tiny_dir, scrape, sse_events, wait_healthy

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3}
POISON, CRASH = 96, 95  # prompt tokens that make the faulty engine below misbehave


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_dir(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def srv(model_dir: str):  # noqa: ANN201
    s = ServerThread(model_dir, **SPEC).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _text(chunks: list, index: int = 0) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)


# ---- completions / chat, streaming and not ----------------------------------------------------
def test_completion_matches_offline_engine_and_reports_usage(client: openai.OpenAI, model_dir: str) -> None:
    r = client.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=24, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert c.finish_reason == "length" and c.index == 0
    offline = LLM(model_dir, dtype="float64").generate("w1 w2 w3 w4", SamplingParams(temperature=0, max_tokens=24))
    assert c.text == offline[0].text
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (4, 24, 28)
    spec = u.model_extra["speculative"]
    assert spec["algorithm"] == "NGRAM" and spec["spec_verify_ct"] > 0 and spec["spec_accepted_tokens"] > 0
    assert spec["spec_accept_length"] == pytest.approx(1 + spec["spec_accepted_tokens"] / spec["spec_verify_ct"])
    assert sum(spec["spec_accepted_per_pos"]) == spec["spec_accepted_tokens"]
    echo = client.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=24, temperature=0, echo=True)
    assert echo.choices[0].text == "w1 w2 w3 w4" + c.text


def test_completion_stream_equals_non_stream(client: openai.OpenAI, srv: ServerThread) -> None:
    kw = dict(model="tiny", prompt="w7 w8 w9", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert _text(chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # raw framing: `data: {json}\n\n` events, then `data: [DONE]\n\n`
    raw = httpx.post(f"{srv.url}/v1/completions", json={**kw, "stream": True}, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw.text)
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w10 w11 w12"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens == 6  # "w2 w10 w11 w12 w5 w3" from the toy template
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    # max_completion_tokens is the newer name of max_tokens
    r = client.chat.completions.create(**{**kw, "max_tokens": None}, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3


# ---- logprobs -----------------------------------------------------------------------------------
def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.tokens == r.choices[0].text.split()
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert top[tok] == pytest.approx(chosen) == pytest.approx(max(top.values()))  # greedy: the argmax


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[1].logprob <= e.logprob
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3"}], max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=2, stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


# ---- n, seeds, stop ---------------------------------------------------------------------------------
def test_seed_reproducible_and_n2(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="w1 w2", max_tokens=16, temperature=1.0)
    a = client.completions.create(**kw, seed=42).choices[0].text
    assert client.completions.create(**kw, seed=42).choices[0].text == a
    b = client.completions.create(**kw, seed=43).choices[0].text
    assert a != b
    r = client.completions.create(**kw, seed=42, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [a, b]  # sample j is seeded seed + j
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens == 2
    chunks = list(client.completions.create(**kw, seed=42, n=2, stream=True))
    assert [_text(chunks, 0), _text(chunks, 1)] == [a, b]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}], n=2,
                                          max_tokens=4, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


@pytest.mark.parametrize("span", [1, 2])
def test_stop_strings_never_leak(client: openai.OpenAI, span: int) -> None:
    kw = dict(model="tiny", prompt="w1 w2 w3 w4", max_tokens=20, temperature=0)
    base = client.completions.create(**kw).choices[0].text
    stop = " ".join(base.split()[5 : 5 + span])  # span 2: the stop string crosses a token boundary
    cut = base[: base.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "nowhere"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    assert _text(chunks) == cut and not any(stop in c.choices[0].text for c in chunks if c.choices)


def test_stop_token_ids(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="w1 w2 w3 w4", max_tokens=20, temperature=0)
    words = client.completions.create(**kw).choices[0].text.split()
    tid = int(words[3][1:])
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [tid]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text.split() == words[: words.index(words[3]) + 1]
    assert c.model_extra["stop_reason"] == tid


# ---- metrics, models, native routes -------------------------------------------------------------
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


# ---- errors -------------------------------------------------------------------------------------
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
    ("/v1/completions", {"prompt": "w1", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [100000]}, "prompt"),
    ("/v1/completions", {"prompt": "w1 " * 600}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
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


# ---- 32 concurrent streams -------------------------------------------------------------------------
def test_32_concurrent_streams_equal_each_request_alone(client: openai.OpenAI, srv: ServerThread) -> None:
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(97)}" for _ in range(rng.randrange(2, 20))) for _ in range(32)]
    kw = dict(model="tiny", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(p: str) -> str:
            text, finish = "", []
            async for c in await ac.completions.create(prompt=p, stream=True, **kw):
                text += c.choices[0].text
                finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
            assert finish == ["length"]
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await ac.close()

    together = asyncio.run(run())
    assert [i for i, (a, b) in enumerate(zip(alone, together)) if a != b] == []
    assert all(len(t.split()) == 20 for t in together)


# ---- loading, auth, failures ------------------------------------------------------------------------
def test_health_503_while_loading_then_200_and_api_key(model_dir: str) -> None:
    from specserve.engine.engine import Engine

    gate = threading.Event()

    def factory(cfg):  # noqa: ANN001, ANN202
        return lambda: (gate.wait(60), Engine(cfg))[1]

    s = ServerThread(model_dir, engine_factory=factory, api_key="sekret").start(wait_ready=False)
    try:
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error", "param": None}}
        auth = {"Authorization": "Bearer sekret"}
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w1"}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        gate.set()
        wait_healthy(s.url, 60)
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{s.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="w1", max_tokens=2).usage.completion_tokens == 2
    finally:
        gate.set()
        s.stop()


def _faulty(cfg):  # noqa: ANN001, ANN202
    """An engine whose logits are NaN for prompts containing POISON, and whose step() raises while a
    prompt containing CRASH is in flight."""
    from specserve.engine.engine import Engine

    def build() -> Engine:
        eng = Engine(cfg)
        fwd, step = eng.runner.forward, eng.step

        def forward(page_tables, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            logits, hidden = fwd(page_tables, *args, **kw)
            bad = {id(r.page_table) for r in list(eng.requests.values()) if POISON in r.prompt_ids}
            return [x.fill_(float("nan")) if id(pt) in bad else x for x, pt in zip(logits, page_tables)], hidden

        def crashing_step():  # noqa: ANN202
            if any(CRASH in r.prompt_ids for r in eng.requests.values()):
                raise RuntimeError("boom")
            return step()

        eng.runner.forward, eng.step = forward, crashing_step
        return eng

    return build


def test_engine_failure_fails_only_that_request(model_dir: str) -> None:
    s = ServerThread(model_dir, engine_factory=_faulty, **SPEC).start()
    try:
        good = {"prompt": "w1 w2 w3", "max_tokens": 16, "temperature": 0}
        ref = httpx.post(f"{s.url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]

        async def pair() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                return await asyncio.gather(ac.post("/v1/completions", json={**good, "prompt": f"w1 w{POISON}"}),
                                            ac.post("/v1/completions", json=good))

        bad, ok = asyncio.run(pair())
        assert bad.status_code == 500 and "NaN" in bad.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref
        events = sse_events(httpx.post(f"{s.url}/v1/completions", json={**good, "prompt": f"w{POISON}", "stream": True},
                                       timeout=60).text)
        assert "NaN" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        crash = httpx.post(f"{s.url}/v1/completions", json={**good, "prompt": f"w{CRASH}"}, timeout=60)
        assert crash.status_code == 500 and "boom" in crash.json()["error"]["message"]
        after = httpx.post(f"{s.url}/v1/completions", json=good, timeout=60)  # still serving
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == ref
    finally:
        s.stop()


# ---- the real default model, through the real command ------------------------------------------------
@pytest.mark.slow
def test_specserve_serve_smollm2_ngram_chat(tmp_path) -> None:  # noqa: ANN001
    """`specserve serve --speculative-algorithm NGRAM` on the embedded SmolLM2, driven by the openai
    client; the answer equals the offline LLM's, and the speculative usage extension is filled."""
    import os
    import subprocess
    import sys

    from .server_utils import free_port

    port = free_port()
    env = {**os.environ, "SPECSERVE_PORT": str(port)}  # the port through the environment, the rest as flags
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--speculative-algorithm", "NGRAM",
                             "--speculative-num-draft-tokens", "4", "--dtype", "float32", "--log-interval", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=64, temperature=0)
        offline = LLM("smollm2-135m", dtype="float32").chat(messages, SamplingParams(temperature=0, max_tokens=64))
        assert r.choices[0].message.content == offline[0].text and "def" in offline[0].text
        spec = r.usage.model_extra["speculative"]
        assert spec["spec_verify_ct"] > 0 and spec["spec_accepted_tokens"] > 0 and spec["spec_accept_length"] > 1
        info = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
        assert info["resolved"]["speculative"]["algorithm"] == "NGRAM" and info["server_config"]["port"] == port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert "mean acceptance length" in (tmp_path / "serve.log").read_text()
