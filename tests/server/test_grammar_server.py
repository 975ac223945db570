"""Structured output through the HTTP API on the embedded SmolLM2, with the shipped drafter speculating
(the default AUTO): the `openai` client gets schema-valid JSON (nested objects, enums, arrays, numbers),
streamed or not; SGLang's regex / ebnf / json_schema work on /generate; bad grammars get a 400 with the
reason."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import ServerThread

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string", "maxLength": 40}}}
SCHEMAS = {
    "person": PERSON,
    "nested": {"type": "object", "required": ["user", "active"], "additionalProperties": False,
               "properties": {"user": PERSON, "active": {"type": "boolean"}}},
    "enum_array": {"type": "object", "required": ["colors", "size"], "additionalProperties": False,
                   "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                             "minItems": 1, "maxItems": 3},
                                  "size": {"enum": ["S", "M", "L"]}}},
    "numbers": {"type": "object", "required": ["price", "qty"], "additionalProperties": False,
                "properties": {"price": {"type": "number"}, "qty": {"type": "integer", "maximum": 99}}},
}
ASK = "Reply with a JSON object only. Describe a customer of a small shop."


@pytest.fixture(scope="module")
def srv():  # noqa: ANN201
    s = ServerThread("smollm2-135m", dtype="auto", kv_cache_memory="256MiB", speculative_algorithm="AUTO",
                     speculative_window="fixed").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, fmt: dict, ask: str = ASK, **kw) -> openai.types.chat.ChatCompletion:  # noqa: ANN003
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ask}],
                                          response_format=fmt, max_tokens=160, temperature=0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_openai_json_schema_is_valid(client: openai.OpenAI, name: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    r = _chat(client, fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    assert r.usage.completion_tokens > 0


@pytest.mark.slow
def test_openai_json_object_and_stream(client: openai.OpenAI) -> None:
    r = _chat(client, {"type": "json_object"}, "Give a JSON object with keys name and city for a person.")
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    whole = _chat(client, fmt).choices[0].message.content
    chunks = list(_chat(client, fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.slow
def test_openai_sampled_json_with_n(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum_array"]}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}], response_format=fmt,
                                       max_tokens=80, temperature=0.9, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2], r.choices  # n choices, each index once
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["enum_array"])


@pytest.mark.slow
def test_native_regex_ebnf_json_schema(srv: ServerThread) -> None:
    cases = [({"regex": r"[A-Z][a-z]+ (is|was) [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]+ (is|was) [0-9]{1,3}", t)),
             ({"ebnf": 'root ::= "answer: " ("yes" | "no")'}, lambda t: t in ("answer: yes", "answer: no")),
             ({"json_schema": json.dumps(SCHEMAS["numbers"])},
              lambda t: jsonschema.validate(json.loads(t), SCHEMAS["numbers"]) is None)]
    for grammar, check in cases:
        body = {"text": "Question: how old is the tower? Answer:", "sampling_params":
                {"max_new_tokens": 48, "temperature": 0, **grammar}}
        out = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
        assert check(out["text"]), (grammar, out)
        assert out["meta_info"]["finish_reason"] == "stop", out


@pytest.mark.slow
@pytest.mark.parametrize("fmt,why", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
     "nope"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
])
def test_bad_schema_is_400(client: openai.OpenAI, fmt: dict, why: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, fmt)
    assert why in str(e.value) and "response_format" in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("params,field", [({"regex": "a(b"}, "regex"), ({"ebnf": "root ::= ("}, "ebnf"),
                                          ({"json_schema": "{not json"}, "json_schema"),
                                          ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")])
def test_bad_native_grammar_is_400(srv: ServerThread, params: dict, field: str) -> None:
    r = httpx.post(f"{srv.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4, **params}},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
