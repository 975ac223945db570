"""Tool calling on /v1/chat/completions through the official `openai` client, on a tiny fp64 model with a
one-character-per-token tokenizer (grammars run on it) and Qwen2.5's chat template:

- named and required tool_choice: the grammar holds the answer, so the arguments parse and fit the schema;
  greedy answers are the same with NGRAM speculation and without; streamed tool_calls join to the whole ones
- auto: answers scripted by replacing the model's logits (a call in each parser's format, text around it,
  reasoning before it) are parsed, whole and streamed, with markers split across chunks
- none, the history (assistant tool_calls, tool results) rendered by the real template, the fallback prompt for a
  template without tools, and 400s naming the field
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import jsonschema
import openai
import pytest
import torch

from specserve.server.common import Server, render_chat
from specserve.server.config import ServerConfig
from specserve.server.protocol import ChatCompletionRequest
from specserve.tokenizer.tokenizer import Tokenizer
from tests.grammar_setup import EOS, tiny_tokenizer
from tests.server_utils import ServerThread
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

# Qwen2.5-Instruct's chat template (tokenizer_config.json), as published
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# a template with no tool support: the server describes the tools in the system prompt itself
PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TIME_PARAMS = {"type": "object", "additionalProperties": False, "required": ["hour"],
               "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Time of day",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather?"}]
# Without spaces and newlines the random model's JSON stays short (the grammar's whitespace is free).
COMPACT = {"0": -100, "95": -100}

# Scripted answers: a prompt holding a key is answered with its text (then EOS).
SCRIPTS = {
    "say:two-calls": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"hour": 7}}\n</tool_call>',
    "say:not-a-call": "I use <tool_ and <tool_call>{broken}</tool_call> here.",
    "say:llama3": '{"name": "get_time", "parameters": {"hour": 7}}; {"name": "get_weather", "parameters": '
                  '{"city": "Oslo", "unit": "f"}}',
    "say:mistral": 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"hour": 7}}, '
                   '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}]',
    "say:think": '<think>the user wants the time</think>\n\n<tool_call>\n{"name": "get_time", "arguments": '
                 '{"hour": 7}}\n</tool_call>',
}
SCRIPTED_CALLS = {
    "say:two-calls": [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"hour": 7})],
    "say:llama3": [("get_time", {"hour": 7}), ("get_weather", {"city": "Oslo", "unit": "f"})],
    "say:mistral": [("get_time", {"hour": 7}), ("get_weather", {"city": "Oslo", "unit": "f"})],
    "say:think": [("get_time", {"hour": 7})],
}
TOK = tiny_tokenizer()


def _tool_dir(root: Path, template: str) -> str:
    cfg = tiny_config("llama", max_position_embeddings=4096)
    d = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=1), root)
    TOK.backend.save(str(Path(d) / "tokenizer.json"))
    (Path(d) / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
    return d


def scripted(cfg: Any) -> Callable[[], Any]:
    """An engine that answers prompts holding a SCRIPTS key with that text: the target's logits at the positions
    the script covers become one-hot rows (under speculation too: a row's position says which token it
    predicts). Other prompts get the model's own answer."""
    from specserve.engine.build import build_engine

    ids = {k: TOK.encode(v, add_special_tokens=False) for k, v in SCRIPTS.items()}

    def build() -> Any:
        eng = build_engine(cfg)
        fwd = eng.runner.forward
        keys: dict[str, str | None] = {}

        def key(r: Any) -> str | None:
            if r.request_id not in keys:
                text = TOK.decode(r.prompt_ids)
                keys[r.request_id] = next((k for k in SCRIPTS if k in text), None)
            return keys[r.request_id]

        def forward(page_tables, starts, tokens, offsets, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            logits, hidden = fwd(page_tables, starts, tokens, offsets, *args, **kw)
            positions = args[1] if len(args) > 1 else kw.get("positions")
            by_table = {id(r.page_table): r for r in list(eng.requests.values())}
            out = []
            for b, (x, pt) in enumerate(zip(logits, page_tables)):
                r = by_table.get(id(pt))
                k = key(r) if r is not None else None
                if k is not None:
                    x = x.clone()
                    for j, off in enumerate(offsets[b]):
                        pos = positions[b][off] if positions is not None else starts[b] + off
                        n = pos + 1 - len(r.prompt_ids)  # the output index this row predicts
                        if n >= 0:
                            x[j] = -1e4
                            x[j, ids[k][n] if n < len(ids[k]) else EOS] = 0.0
                out.append(x)
            return out, hidden

        eng.runner.forward = forward
        return eng

    return build


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tool_dir(tmp_path_factory.mktemp("tools") / "m", QWEN25_TEMPLATE)


def _start(model_dir: str, spec: str = "NGRAM", **server_options: Any) -> ServerThread:
    return ServerThread(model_dir, engine_factory=scripted, server_options=server_options,
                        speculative_algorithm=spec, speculative_num_draft_tokens=3).start()


@pytest.fixture(scope="module")
def srv(tool_dir: str):  # noqa: ANN201
    s = _start(tool_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_client(tool_dir: str):  # noqa: ANN201
    """The same model decoding without speculation (no script is asked of it)."""
    s = ServerThread(tool_dir, speculative_algorithm="NONE").start()
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
    s.stop()


def _chat(client: openai.OpenAI, messages: list = ASK, **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                          **{"temperature": 0, "max_tokens": 200, "logit_bias": COMPACT, **kw})


def _streamed(client: openai.OpenAI, messages: list = ASK, **kw: Any) -> tuple[str, list[dict], list[str | None]]:
    """(content, tool calls joined from their deltas, finish reasons) of a streamed answer; checks that each
    call's first delta carries its id, type and name and that later ones carry only argument pieces."""
    content, calls, finishes = "", [], []
    for ch in _chat(client, messages, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        finishes.append(ch.choices[0].finish_reason)
        for tc in d.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                assert tc.index == len(calls) - 1 and tc.id is None and tc.function.name is None
                calls[-1]["arguments"] += tc.function.arguments
    return content, calls, [f for f in finishes if f]


def _calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _check_fit(calls: list[tuple[str, dict]]) -> None:
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


# ---- named and required: the grammar holds the answer ------------------------------------------------------------

def test_named_function_arguments_fit_and_match_plain_decoding(client: openai.OpenAI,
                                                               plain_client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    _check_fit(_calls(c.message))
    assert r.usage.model_extra["speculative"]["spec_verify_ct"] > 0  # speculation ran
    assert _chat(plain_client, tool_choice=choice).choices[0].message.tool_calls[0].function.arguments == \
        tc.function.arguments
    content, calls, finishes = _streamed(client, tool_choice=choice)
    assert content == "" and finishes == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", tc.function.arguments)]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_fit_and_match_plain_decoding(client: openai.OpenAI, plain_client: openai.OpenAI,
                                                     parallel: bool) -> None:
    kw = dict(tool_choice="required", parallel_tool_calls=parallel)
    c = _chat(client, **kw).choices[0]
    calls = _calls(c.message)
    assert c.finish_reason == "tool_calls" and c.message.content is None and calls, c
    assert len(calls) == 1 or parallel
    _check_fit(calls)
    assert _calls(_chat(plain_client, **kw).choices[0].message) == calls
    content, streamed, finishes = _streamed(client, **kw)
    assert content == "" and finishes == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in streamed] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_required_with_n_samples_each_fit(client: openai.OpenAI) -> None:
    r = _chat(client, tool_choice="required", temperature=0.8, seed=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        if c.finish_reason == "tool_calls":  # a sample may run into max_tokens
            _check_fit(_calls(c.message))


# ---- auto: the parser on the model's text -----------------------------------------------------------------------

def _say(key: str) -> list[dict]:
    return [{"role": "user", "content": key}]


def test_auto_parses_calls_out_of_the_text(client: openai.OpenAI) -> None:
    c = _chat(client, _say("say:two-calls")).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert _calls(c.message) == SCRIPTED_CALLS["say:two-calls"]
    assert len({t.id for t in c.message.tool_calls}) == 2
    content, calls, finishes = _streamed(client, _say("say:two-calls"))
    assert content == "Let me check." and finishes == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    one = _chat(client, _say("say:two-calls"), parallel_tool_calls=False).choices[0]
    assert _calls(one.message) == SCRIPTED_CALLS["say:two-calls"][:1]


def test_auto_text_without_a_valid_call_is_content(client: openai.OpenAI) -> None:
    c = _chat(client, _say("say:not-a-call")).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content == SCRIPTS["say:not-a-call"]
    assert _streamed(client, _say("say:not-a-call")) == (SCRIPTS["say:not-a-call"], [], ["stop"])


def test_tool_choice_none_leaves_the_text_alone(client: openai.OpenAI) -> None:
    c = _chat(client, _say("say:two-calls"), tool_choice="none").choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == SCRIPTS["say:two-calls"]
    assert _streamed(client, _say("say:two-calls"), tool_choice="none") == (SCRIPTS["say:two-calls"], [], ["stop"])


@pytest.mark.parametrize("parser,key", [("llama3", "say:llama3"), ("mistral", "say:mistral"),
                                        ("hermes", "say:two-calls")])
def test_parser_flag(tool_dir: str, parser: str, key: str) -> None:
    s = _start(tool_dir, "NONE", tool_call_parser=parser)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        c = _chat(client, _say(key)).choices[0]
        assert c.finish_reason == "tool_calls" and _calls(c.message) == SCRIPTED_CALLS[key]
        content, calls, _ = _streamed(client, _say(key))
        assert (content or None) == c.message.content and [x["arguments"] for x in calls] == \
            [t.function.arguments for t in c.message.tool_calls]
    finally:
        s.stop()


def test_reasoning_then_tool_calls(tool_dir: str) -> None:
    s = _start(tool_dir, "NONE", reasoning_parser="qwen3")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        m = _chat(client, _say("say:think")).choices[0].message
        assert m.model_extra["reasoning_content"] == "the user wants the time" and m.content is None
        assert _calls(m) == SCRIPTED_CALLS["say:think"]
        reasoning, content, calls = "", "", []
        for ch in _chat(client, _say("say:think"), stream=True):
            d = ch.choices[0].delta
            reasoning += d.model_extra.get("reasoning_content") or ""
            content += d.content or ""
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in d.tool_calls or []]
        assert (reasoning, content, calls) == ("the user wants the time", "", SCRIPTED_CALLS["say:think"])
    finally:
        s.stop()


# ---- the prompt -------------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]


class _Srv:
    """What render_chat reads of a Server."""

    tool_format = Server.tool_format

    def __init__(self, template: str, **server_options: Any) -> None:
        self.tokenizer = Tokenizer(TOK.backend, bos_token_id=None, eos_token_ids=(EOS,), chat_template=template)
        self.server_config = ServerConfig(**server_options)

    def ready_engine(self) -> Any:
        return SimpleNamespace(tokenizer=self.tokenizer)


def _render(template: str, body: dict, **server_options: Any) -> str:
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, **body})
    srv = _Srv(template, **server_options)
    return srv.tokenizer.decode(render_chat(srv, req.messages, True, req.tool_plan()))


def test_history_is_rendered_by_the_template() -> None:
    """The template gets the tools and the calls in HF's shape: Qwen2.5's dumps the arguments as an object."""
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    assert _render(QWEN25_TEMPLATE, {"tools": TOOLS}) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        f"signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return "
        "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_history_through_the_server(client: openai.OpenAI) -> None:
    """The same history over HTTP: one token per character, so the prompt is the rendered text's length."""
    r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == len(_render(QWEN25_TEMPLATE, {"tools": TOOLS}))


def test_fallback_prompt_for_a_template_without_tools() -> None:
    text = _render(PLAIN_TEMPLATE, {"tools": TOOLS})
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    assert text.startswith(f"<system># Tools\n\nYou may call one or more functions to assist with the user query."
                           f"\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                           f"<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object")
    assert text.endswith('<user>Weather in Paris?\n<assistant><tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<user><tool_response>\n18 degrees\n'
                         "</tool_response>\n<assistant>")
    llama = _render(PLAIN_TEMPLATE, {"tools": TOOLS}, tool_call_parser="llama3")
    assert '"parameters": <args-json-object>}, separated by "; "' in llama
    assert '<assistant>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}\n' in llama
    none = _render(PLAIN_TEMPLATE, {"tools": TOOLS, "tool_choice": "none"})
    assert "# Tools" not in none and none.endswith(text[text.index("<user>"):])
    assert _render(PLAIN_TEMPLATE, {}) == none  # a history of calls needs no tools to render


# ---- errors -----------------------------------------------------------------------------------------------------

BAD_SCHEMA = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "nope"}}}}}]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "my tool"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": BAD_SCHEMA, "tool_choice": "required"}, "tools"),
    ({"tools": BAD_SCHEMA, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "$defs": {"x": {"type": t}}, "properties": {"a": {"$ref": "#/$defs/x"}}}}}
        for n, t in (("f", "string"), ("g", "integer"))], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": HISTORY[1]["tool_calls"]}]},
     "messages[0].tool_calls"),
])
def test_bad_requests_are_400_naming_the_field(srv: ServerThread, body: dict, param: str) -> None:
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_smollm2_fallback_prompt_named_and_required() -> None:
    """SmolLM2's template has no tool support: the tools go into the system prompt, and the grammar still makes
    the answer a call that fits (with the shipped drafter speculating)."""
    s = ServerThread("smollm2-135m", dtype="auto", kv_cache_memory="256MiB", speculative_algorithm="AUTO").start()
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        for kw in ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                   {"tool_choice": "required", "parallel_tool_calls": False}):
            c = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, temperature=0, max_tokens=96,
                                               **kw).choices[0]
            assert c.finish_reason == "tool_calls", c
            _check_fit(_calls(c.message))
    finally:
        s.stop()
