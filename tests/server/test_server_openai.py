"""OpenAI-compatible generation through the official `openai` client: completions and chat, streaming and
not (stream equals non-stream, raw SSE framing, usage with the speculative extension), logprobs, prompt logprobs
and echo with logprobs, n and seeds, stop strings and stop token ids — greedy output equals the offline engine's.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams

from tests.server_fixtures import _text
from tests.server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread, sse_events


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


def test_logit_bias_and_min_tokens_match_the_offline_engine(client: openai.OpenAI, model_dir: str) -> None:
    """OpenAI's logit_bias (token ids as strings) and vLLM's min_tokens (through extra_body) reach the engine."""
    sp = SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 5.0, 9: -100.0}, min_tokens=12)
    offline = LLM(model_dir, dtype="float64").generate("w1 w2 w3 w4", sp)[0]
    r = client.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=12, temperature=0,
                                  logit_bias={"7": 5.0, "9": -100.0}, extra_body={"min_tokens": 12})
    assert r.choices[0].text == offline.text and 9 not in offline.token_ids


def test_embeddings_are_mean_pooled_last_hidden_states(client: openai.OpenAI, model_dir: str) -> None:
    """/v1/embeddings against transformers on the same checkpoint: the mean over the input's positions of the
    last hidden state (after the final norm), L2-normalised; the client's default base64 and plain floats."""
    import torch
    import transformers

    hf = transformers.LlamaModel.from_pretrained(model_dir, dtype=torch.float64).eval()
    inputs = [[5, 6, 7, 8], [9]]
    for fmt in ("float", "base64"):
        r = client.embeddings.create(model="tiny", input=inputs, encoding_format=fmt) if fmt == "float" else \
            client.embeddings.create(model="tiny", input=inputs)  # the client asks for base64 and decodes it
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == 5 and r.model == "tiny"
        for ids, d in zip(inputs, r.data):
            with torch.no_grad():
                h = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
            assert torch.allclose(torch.tensor(d.embedding, dtype=torch.float64), h / h.norm(), atol=1e-6)
    text = client.embeddings.create(model="tiny", input="w1 w2", encoding_format="float").data[0].embedding
    assert len(text) == hf.config.hidden_size
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny", input="w1", dimensions=4)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="tiny", input=[])


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


# ---- prompt logprobs and echo -------------------------------------------------------------------------
def _prompt_ref(model_dir: str, prompt: str | list[int], top_n: int) -> list:
    """The offline engine's prompt logprobs (its TokenLogprobs) for one prompt."""
    return LLM(model_dir, dtype="float64").generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=top_n))[0] \
        .prompt_logprobs


def test_prompt_logprobs_shape_and_values(client: openai.OpenAI, model_dir: str) -> None:
    """vLLM's extra field: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}} for the
    prompt token and its top-N; on the choice (completions) or beside the choices (chat); the offline engine's."""
    r = client.completions.create(model="tiny", prompt="w1 w2 w3 w4 w5", max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got, ref = r.choices[0].model_extra["prompt_logprobs"], _prompt_ref(model_dir, "w1 w2 w3 w4 w5", 2)
    assert got[0] is None and len(got) == len(ref) == 5
    for pos, (g, lp) in enumerate(zip(got[1:], ref[1:]), 1):
        own = g[str(lp.token_id)]
        assert own == {"logprob": pytest.approx(lp.logprob, abs=1e-9), "rank": lp.rank, "decoded_token": f"w{pos + 1}"}
        assert len(g) == 2 + (lp.rank > 2)  # the top 2, and the prompt token when it is not among them
        tops = sorted((e for k, e in g.items() if k != str(lp.token_id) or lp.rank <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in tops] == [1, 2]
        assert [e["logprob"] for e in tops] == pytest.approx([v for _, v in lp.top], abs=1e-9)
    plain = client.completions.create(model="tiny", prompt="w1 w2 w3 w4 w5", max_tokens=3, temperature=0)
    assert r.choices[0].text == plain.choices[0].text and "prompt_logprobs" not in plain.choices[0].model_extra
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3 w4"}], max_tokens=2,
                                          temperature=0, n=2, extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat.usage.prompt_tokens and all(len(e) == 1 for e in pl[1:])


@pytest.mark.parametrize("body,field", [({"prompt_logprobs": 21}, "prompt_logprobs"),
                                        ({"prompt_logprobs": -1}, "prompt_logprobs"),
                                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")])
def test_prompt_logprobs_errors_name_the_field(srv: ServerThread, body: dict, field: str) -> None:
    for path, base in (("/v1/completions", {"prompt": "w1 w2"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]})):
        r = httpx.post(f"{srv.url}{path}", json={**base, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI, model_dir: str) -> None:
    """OpenAI's echo + logprobs: the prompt's tokens first (the first with null logprob and top_logprobs), text
    offsets continuous from 0; streamed, the chunks join to the same object."""
    kw = dict(model="tiny", prompt="w1 w2 w3 w4", max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    r = client.completions.create(**kw, echo=True).choices[0]
    lp, ref = r.logprobs, _prompt_ref(model_dir, "w1 w2 w3 w4", 2)
    assert r.text == "w1 w2 w3 w4" + plain.text
    assert lp.tokens == ["w1", "w2", "w3", "w4"] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:4] == pytest.approx([x.logprob for x in ref[1:]], abs=1e-9)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # the output's as without echo (to rounding: the first token's row came from a forward of more rows)
    assert lp.token_logprobs[4:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-9)
    assert [list(t) for t in lp.top_logprobs[4:]] == [list(t) for t in plain.logprobs.top_logprobs]
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert _text(chunks) == r.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, name)] == getattr(lp, name)


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
