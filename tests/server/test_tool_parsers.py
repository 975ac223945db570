"""The tool-call parsers on text: each format's calls and content, whole; any split of the text (markers cut
across pieces, one character at a time) streams to the same; the format read off a chat template; the grammar
of required / named tool_choice; tool-call deltas joining to the message's calls; and marker tokens that
decoding would skip kept in the text."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from specserve.server.text import TextStream
from specserve.server.tool_parsers import (TOOL_PARSERS, ParsedCall, ToolCallParser, detect_format, hidden_markers,
                                           parse_tool_calls, tool_format)
from specserve.server.tools import ToolCallStream, ToolPlan, split_tool_calls
from specserve.tokenizer.tokenizer import Tokenizer
from tests.grammar_setup import CHARS, _byte_char

Q, L, M = TOOL_PARSERS["qwen25"], TOOL_PARSERS["llama3"], TOOL_PARSERS["mistral"]
NAMES = frozenset({"f", "g"})
F = ParsedCall("f", '{"city": "Paris"}')
G = ParsedCall("g", "{}")


def qcall(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


CASES = [
    (Q, "plain text, kept exactly  \n", "plain text, kept exactly  \n", []),
    (Q, qcall("f", '{"city": "Paris"}'), "", [F]),
    (Q, "Let me check.\n" + qcall("f", '{"city": "Paris"}') + "\n" + qcall("g", "{}") + "\n", "Let me check.", [F, G]),
    (Q, "A " + qcall("f", '{"city": "Paris"}') + " B", "A\nB", [F]),  # text on both sides: one line break
    (Q, '<tool_call>{"name": "f", "parameters": {"city": "Paris"}}</tool_call>', "", [F]),
    (Q, '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', "", [F]),  # JSON string
    (Q, '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}', "", [F]),  # unclosed at the end
    (Q, "x <tool_call>{bad}</tool_call> y", "x <tool_call>{bad}</tool_call> y", []),
    (Q, qcall("unknown", "{}"), qcall("unknown", "{}"), []),
    (Q, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}'
        "</tool_call>", []),
    (Q, '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut by max_tokens
    (Q, "hello <tool_ca", "hello <tool_ca", []),
    (Q, qcall("g", "{}") + "<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", [G]),
    (L, '{"name": "f", "parameters": {"city": "Paris"}}', "", [F]),
    (L, '  <|python_tag|>{"name": "f", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {}};', "",
     [F, G]),
    (L, 'Sure: <|python_tag|>{"name": "g", "parameters": {}}', "Sure:", [G]),
    (L, 'Hello {"name": "f", "parameters": {}}', 'Hello {"name": "f", "parameters": {}}', []),  # not at the start
    (L, '{"answer": 1}', '{"answer": 1}', []),
    (L, '{"name": "g", "parameters": {}} and then', "and then", [G]),
    (M, '[TOOL_CALLS] [{"name": "f", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": {}}]', "", [F, G]),
    (M, 'Sure.\n[TOOL_CALLS][{"name": "g", "arguments": {}}]\nDone.', "Sure.\nDone.", [G]),
    (M, "ok [TOOL_CALLS] not a list", "ok [TOOL_CALLS] not a list", []),
    (M, '[TOOL_CALLS] [{"name": "f", "arguments": {}}', '[TOOL_CALLS] [{"name": "f", "arguments": {}}', []),
    (M, '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "x"}]',
     '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "x"}]', []),  # one bad call: the list is text
    # v11 on: one call per marker, name[ARGS]{…} (or name[CALL_ID]id[ARGS]{…})
    (M, '[TOOL_CALLS]f[ARGS]{"city": "Paris"}', "", [F]),
    (M, 'Sure.[TOOL_CALLS]f[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS]{}\nDone.', "Sure.\nDone.", [F, G]),
    (M, "[TOOL_CALLS]g[CALL_ID]a1B2c3D4e[ARGS]{}", "", [G]),
    (M, '[TOOL_CALLS]f[ARGS]{"city": ', '[TOOL_CALLS]f[ARGS]{"city": ', []),  # cut by max_tokens
    (M, "[TOOL_CALLS]x[ARGS]{}", "[TOOL_CALLS]x[ARGS]{}", []),  # not a tool of the request
    (M, "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[ARGS][1]", []),  # arguments not an object
    (M, "[TOOL_CALLS]f[AR", "[TOOL_CALLS]f[AR", []),
    (M, "[TOOL_CALLS]f(1)", "[TOOL_CALLS]f(1)", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_text(fmt, text: str, content: str, calls: list) -> None:  # noqa: ANN001
    assert parse_tool_calls(text, fmt, NAMES) == (content, calls)


def _pieces(p: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for x in pieces:
        c, k = p.feed(x)
        content, calls = content + c, calls + k
    c, k = p.finish()
    return content + c, calls + k


@pytest.mark.parametrize("fmt,text", [(f, t) for f, t, _, _ in CASES])
def test_any_split_streams_to_the_whole(fmt, text: str) -> None:  # noqa: ANN001
    whole = parse_tool_calls(text, fmt, NAMES)
    assert _pieces(ToolCallParser(fmt, NAMES), list(text)) == whole
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(8, len(text)))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _pieces(ToolCallParser(fmt, NAMES), pieces) == whole, pieces


def test_content_is_released_before_the_call_and_held_at_a_partial_marker() -> None:
    p = ToolCallParser(Q, NAMES)
    assert p.feed("Let me check. <tool") == ("Let me check.", [])  # " <tool" may open a call: held
    assert p.feed("_call>\n") == ("", [])
    assert p.feed('{"name": "g", "arguments": {}}\n</tool_call>') == ("", [G])  # the call once closed
    assert p.feed(" <tool_") == ("", [])  # whitespace after a call is dropped
    assert p.feed("x") == ("\n<tool_x", [])  # text after calls that follow text: a line break between
    assert p.finish() == ("", [])


def test_detect_format_and_names() -> None:
    assert detect_format("... <tool_call>\\n{{ tool_call.name }} ...") is Q
    assert detect_format("{{ '[TOOL_CALLS] ' + tool_calls|tojson }}") is M
    assert detect_format("{{ '<|start_header_id|>ipython<|end_header_id|>' }}") is L
    assert detect_format("{{ messages }}") is Q and detect_format(None) is Q
    assert tool_format("hermes") is Q and tool_format("llama3_json") is L and tool_format("mistral") is M


WEATHER = {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "$defs": {"city": {"type": "string"}}}


def _plan(choice: str = "auto", function: str | None = None, parallel: bool = True, tools: dict | None = None
          ) -> ToolPlan:
    tools = tools or {"f": WEATHER, "g": {"type": "object", "properties": {}}}
    return ToolPlan(tuple({"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools.items()),
                    choice, function, parallel)


def test_grammars() -> None:
    assert _plan("auto").grammar() is None and _plan("none").grammar() is None
    assert _plan("function", "f").grammar() == WEATHER
    g = _plan("required").grammar()
    assert g["type"] == "array" and g["minItems"] == 1 and "maxItems" not in g
    assert g["$defs"] == {"city": {"type": "string"}}  # hoisted to the root, where the $ref points
    f, g_ = g["items"]["anyOf"]
    assert f["properties"] == {"name": {"type": "string", "enum": ["f"]},
                               "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}}}
    assert f["required"] == ["name", "parameters"] and not f["additionalProperties"]
    assert g_["properties"]["name"]["enum"] == ["g"]
    assert _plan("required", parallel=False).grammar()["maxItems"] == 1
    clash = {"f": WEATHER, "g": {**WEATHER, "$defs": {"city": {"type": "integer"}}}}
    with pytest.raises(ValueError, match="city"):
        _plan("required", tools=clash).grammar()


def _stream(plan: ToolPlan, fmt, pieces: list[str]) -> tuple[str, dict[int, dict]]:  # noqa: ANN001
    """Content and the calls joined from their deltas."""
    s, content, joined = ToolCallStream(plan, fmt), "", {}
    for i, x in enumerate([*pieces, None]):
        c, deltas = s.feed(x) if x is not None else s.finish()
        content += c
        for d in deltas:
            if d["index"] not in joined:
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
                joined[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                joined[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, joined


def _strip_ids(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("plan,text", [
    (_plan("function", "f"), '{"city": "Paris"}'),
    (_plan("function", "f"), ""),  # nothing decoded: still the call, with empty arguments
    (_plan("required"), '[{"name": "f", "parameters": {"city": "Paris"}}, {"name": "g", "parameters": {}}]'),
    (_plan("required", parallel=False), '[{"name": "g", "parameters": {}}]'),
    (_plan("required"), '[{"name": "f", "parameters": {"ci'),  # cut by max_tokens: the text stays content
    (_plan("auto"), "Hi " + qcall("f", "{}") + qcall("g", "{}")),
    (_plan("auto", parallel=False), "Hi " + qcall("f", "{}") + qcall("g", "{}")),  # the first call only
])
def test_deltas_join_to_the_message(plan: ToolPlan, text: str) -> None:
    content, calls = split_tool_calls(text, plan, Q)
    if plan.choice == "function":
        assert content == "" and [c["function"] for c in calls] == [{"name": "f", "arguments": text}]
    if plan.choice == "required" and text.endswith("]"):
        assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == \
            [c["parameters"] for c in json.loads(text)]
    if not plan.parallel:
        assert len(calls) == 1
    for cut in range(len(text) + 1):
        got_content, joined = _stream(plan, Q, [text[:cut], text[cut:]])
        assert got_content == content and _strip_ids([joined[i] for i in sorted(joined)]) == _strip_ids(calls)
    assert _stream(plan, Q, list(text))[0] == content


def _marker_tokenizer() -> Tokenizer:
    """One token per character, plus the special tokens <eos>, [TOOL_CALLS] and [ARGS] (decoding skips them)."""
    tok = HFTokenizer(models.BPE(vocab={_byte_char(ord(c)): i for i, c in enumerate(CHARS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>", "[TOOL_CALLS]", "[ARGS]"])
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(len(CHARS),))


def test_special_marker_tokens_are_kept_in_the_text() -> None:
    tok = _marker_tokenizer()
    marker = tok.token_to_id("[TOOL_CALLS]")
    args = tok.token_to_id("[ARGS]")
    assert tok.decode([marker]) == "" and hidden_markers(tok, M) == {marker: "[TOOL_CALLS]", args: "[ARGS]"}
    assert hidden_markers(tok, Q) == {}  # <tool_call> is plain text here
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    whole = 'Sure. [TOOL_CALLS] [{"name": "g", "arguments": {}}]'
    eos = [len(CHARS)]
    # the engine cuts the text it sees (markers skipped) before the stop string; the kept text is cut alike
    for stop, ids in [((), enc("Sure. ") + [marker] + enc(' [{"name": "g", "arguments": {}}]') + eos),
                      ((" stop",), enc("Sure. ") + [marker] + enc(' [{"name": "g", "arguments": {}}] stop'))]:
        stop_text = tok.decode(ids).split(" stop")[0] if stop else None
        ts = TextStream(tok, stop, hidden_markers(tok, M))
        streamed = "".join(ts.step([t], i == len(ids) - 1, stop_text) for i, t in enumerate(ids))
        final = TextStream(tok, stop, hidden_markers(tok, M))
        final.ids = ids
        assert streamed == final.final_text(stop_text) == whole, stop
    assert parse_tool_calls(whole, M, NAMES) == ("Sure.", [G])
    ids = enc("Sure.") + [marker] + enc("g") + [args] + enc("{}")  # v11: name[ARGS]{…}, both markers special
    ts = TextStream(tok, (), hidden_markers(tok, M))
    text = "".join(ts.step([t], i == len(ids) - 1, None) for i, t in enumerate(ids))
    assert text == "Sure.[TOOL_CALLS]g[ARGS]{}" and parse_tool_calls(text, M, NAMES) == ("Sure.", [G])
