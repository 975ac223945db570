"""Tool calls in a chat answer's text (`--tool-call-parser`; SGLang's names, vLLM's in brackets):

  qwen25 (hermes)        `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>` blocks anywhere in the answer
                         (Qwen2.5, Qwen3, Hermes)
  llama3 (llama3_json)   `{"name": …, "parameters": {…}}` at the start of the answer or after `<|python_tag|>`,
                         several joined by `;` (Llama 3.1–3.3)
  mistral                `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]` (Mistral's v3 tokenizers), or one call
                         per marker, `[TOOL_CALLS]name[ARGS]{…}` (v11 on: Mistral Small 3.2, Devstral, Magistral;
                         `name[CALL_ID]id[ARGS]{…}` too)

Without the flag the format follows the chat template's text (`detect_format`). A call names a function of the
request's `tools` and carries an object as `arguments` (or `parameters`; a JSON string of an object is taken
too). Everything else is content: text before, between and after the calls, with the whitespace that touches
a call dropped and the pieces a call separated joined by a newline; a region that holds no valid call (bad
JSON, an unknown name) stays in the content verbatim; one left open at the end is read as if closed.
`ToolCallParser` takes the text in pieces and returns what each piece settles; the pieces of any split join to
`parse_tool_calls` of the whole (which is that parser fed once), so streamed and whole answers agree.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .reasoning import partial_tail

_WS = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Read:
    """A call region read from its start: `calls` None when it holds none (its text is content); `end` is
    where it ends in the text read."""

    calls: list[ParsedCall] | None
    end: int


def call_from(obj: Any, names: frozenset[str] | None) -> ParsedCall | None:
    """A decoded call object → ParsedCall, or None when it is not a call of one of `names`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _skip_ws(text: str, i: int = 0) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _decode_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[i] and where it ends; None while it is incomplete (or invalid: only
    the end of the answer tells those apart)."""
    try:
        return json.JSONDecoder().raw_decode(text, i)
    except ValueError:
        return None


def _read_json(text: str, final: bool, names: frozenset[str] | None, opening: str, many: bool) -> Read | None:
    """One JSON value after optional whitespace: an object (`many` False) or a list of call objects."""
    i = _skip_ws(text)
    if i == len(text):
        return Read(None, i) if final else None
    if text[i] != opening:
        return Read(None, 0)
    got = _decode_at(text, i)
    if got is None:
        return Read(None, len(text)) if final else None
    value, end = got
    if not many:
        value = [value]
    calls = [c for v in value if (c := call_from(v, names))] if isinstance(value, list) else []
    return Read(calls if calls and len(calls) == len(value) else None, end)


class ToolFormat(ABC):
    """How one model family writes calls, and how the fallback prompt asks for that."""

    name: str
    opens: tuple[str, ...] = ()  # text that opens a call region anywhere (consumed)
    opens_at_start: tuple[str, ...] = ()  # text that opens one only at the answer's start (part of the region)
    inner: tuple[str, ...] = ()  # markers inside a region (like `opens`, single special tokens in some vocabularies)
    separator: str | None = None  # after a region, this (past whitespace) opens the next one
    instructions: str  # the fallback system prompt's part on how to call

    @abstractmethod
    def read(self, text: str, final: bool, names: frozenset[str] | None) -> Read | None:
        """The region at the start of `text` (just past its opener); None = not settled yet (never when final)."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) calls as this format writes them (history in the fallback prompt)."""


class Qwen25Format(ToolFormat):
    name = "qwen25"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    instructions = ("For each function call, return a json object with function name and arguments within "
                    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def read(self, text: str, final: bool, names: frozenset[str] | None) -> Read | None:
        i = text.find(self.close)
        if i < 0 and not final:
            return None
        body, end = (text, len(text)) if i < 0 else (text[:i], i + len(self.close))
        try:
            call = call_from(json.loads(body), names)
        except ValueError:
            call = None
        return Read([call] if call else None, end)

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)


class Llama3Format(ToolFormat):
    name = "llama3"
    opens = ("<|python_tag|>",)
    opens_at_start = ("{",)
    separator = ";"
    instructions = ('To call functions, answer with only JSON objects of the form {"name": <function-name>, '
                    '"parameters": <args-json-object>}, separated by "; ".')

    def read(self, text: str, final: bool, names: frozenset[str] | None) -> Read | None:
        return _read_json(text, final, names, "{", many=False)

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralFormat(ToolFormat):
    name = "mistral"
    opens = ("[TOOL_CALLS]",)
    inner = ("[ARGS]", "[CALL_ID]")
    instructions = ('To call functions, answer with [TOOL_CALLS] followed by a JSON list of objects of the form '
                    '{"name": <function-name>, "arguments": <args-json-object>}.')

    def read(self, text: str, final: bool, names: frozenset[str] | None) -> Read | None:
        head = text.lstrip(_WS)
        if head.startswith("[") or (text and not head):  # a list, after optional whitespace (or not yet known)
            return _read_json(text, final, names, "[", many=True)
        return self._read_named(text, final, names)

    def _read_named(self, text: str, final: bool, names: frozenset[str] | None) -> Read | None:
        """name[ARGS]{…} or name[CALL_ID]id[ARGS]{…}, right after the marker (after whitespace it is none)."""
        m = _NAME.match(text)
        if m is None:
            return Read(None, 0) if text or final else None
        i = m.end()
        if text.startswith("[CALL_ID]", i):
            cid = _NAME.match(text, i + len("[CALL_ID]"))
            i = cid.end() if cid else i + len("[CALL_ID]")
        if not text.startswith("[ARGS]", i):
            rest = text[i:]  # the name or call id may still be coming, or a marker be cut short
            pending = not rest or any(k.startswith(rest) for k in self.inner)
            return None if pending and not final else Read(None, 0)
        got = _decode_at(text, i + len("[ARGS]"))
        if got is None:
            return Read(None, len(text)) if final else None
        call = call_from({"name": m.group(), "arguments": got[0]}, names) if isinstance(got[0], dict) else None
        return Read([call] if call else None, got[1])

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


class CallListFormat(MistralFormat):
    """`tool_choice: "required"`: the grammar makes the whole answer a JSON list of {"name", "parameters"}."""

    name = "call-list"
    opens = ()
    opens_at_start = ("[",)


TOOL_PARSERS: dict[str, ToolFormat] = {"qwen25": Qwen25Format(), "llama3": Llama3Format(), "mistral": MistralFormat()}
TOOL_PARSER_ALIASES = {"hermes": "qwen25", "llama3_json": "llama3"}  # vLLM's names
TOOL_PARSER_NAMES = (*TOOL_PARSERS, *TOOL_PARSER_ALIASES)


def tool_format(name: str) -> ToolFormat:
    return TOOL_PARSERS[TOOL_PARSER_ALIASES.get(name, name)]


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template writes calls in (qwen25 when it shows none: the fallback prompt's format)."""
    t = template or ""
    if "<tool_call>" in t:
        return TOOL_PARSERS["qwen25"]
    if "[TOOL_CALLS]" in t:
        return TOOL_PARSERS["mistral"]
    if "<|python_tag|>" in t or "ipython" in t:
        return TOOL_PARSERS["llama3"]
    return TOOL_PARSERS["qwen25"]


def hidden_markers(tokenizer: Any, fmt: ToolFormat) -> dict[int, str]:
    """The format's markers that are single special tokens, which decoding would skip ([TOOL_CALLS], [ARGS],
    <|python_tag|>): token id → text, for the decoder to keep."""
    out = {}
    for m in fmt.opens + fmt.inner:
        i = tokenizer.token_to_id(m)
        if i is not None and tokenizer.decode([i]) == "":
            out[i] = m
    return out


class ToolCallParser:
    """Answer text in pieces → (content, calls) each piece settles. Text that may still turn out to open a call
    (a partial marker, whitespace that would touch a call) is held back until it is settled."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str] | None = None) -> None:
        self.fmt, self.names = fmt, names
        self.buf = ""
        self.mode = "text"  # text → region → (between →) text
        self.opener = ""  # the text that opened the current region (content if it holds no call)
        self.ws = ""  # whitespace before the current region (content if it holds no call)
        self.at_start = True  # only whitespace so far: opens_at_start applies
        self.after_calls = False  # the last thing settled was a call region
        self.said = False  # some content was released

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        return self._run(final=True)

    def _say(self, text: str, out: list[str]) -> None:
        if text:
            if self.after_calls and self.said:
                text = "\n" + text  # text on both sides of calls: one line break where they were
            self.after_calls, self.said = False, True
            out.append(text)

    def _run(self, final: bool) -> tuple[str, list[ParsedCall]]:
        out: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self.mode == "text":
                if not self._text(final, out):
                    break
            elif self.mode == "region":
                r = self.fmt.read(self.buf, final, self.names)
                if r is None:
                    break
                if r.calls is None:
                    if self.opener != self.fmt.separator or self.buf[: r.end].strip(_WS):
                        self._say(self.ws + self.opener + self.buf[: r.end], out)  # a trailing separator is dropped
                    self.mode = "text"
                else:
                    calls += r.calls
                    self.after_calls = True
                    self.mode = "between" if self.fmt.separator else "text"
                self.buf, self.ws, self.opener = self.buf[r.end:], "", ""
            else:  # between: the separator opens the next region, anything else is text
                i = _skip_ws(self.buf)
                if i == len(self.buf) and not final:
                    self.buf = ""  # whitespace after calls is dropped either way
                    break
                if i < len(self.buf) and self.buf[i] == self.fmt.separator:
                    self.opener, self.buf, self.mode = self.fmt.separator, self.buf[i + 1:], "region"
                else:
                    self.mode = "text"
        return "".join(out), calls

    def _text(self, final: bool, out: list[str]) -> bool:
        """Release what is settled as content; True when a region opened."""
        if self.after_calls:
            self.buf = self.buf.lstrip(_WS)
        if not self.buf:
            return False
        if self.at_start:
            head = self.buf.lstrip(_WS)
            for o in self.fmt.opens_at_start:
                if head.startswith(o):
                    self.ws, self.opener = self.buf[: len(self.buf) - len(head)], ""
                    self.buf, self.mode, self.at_start = head, "region", False
                    return True
            if head and not final and any(o.startswith(head) for o in self.fmt.opens_at_start):
                return False
            self.at_start = not head
        hits = [(i, o) for o in self.fmt.opens if (i := self.buf.find(o)) >= 0]
        if hits:
            i, o = min(hits)
            before = self.buf[:i].rstrip(_WS)
            self._say(before, out)
            self.ws, self.opener = self.buf[len(before): i], o
            self.buf, self.mode, self.at_start = self.buf[i + len(o):], "region", False
            return True
        keep = 0 if final else self._holdback()
        self._say(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _holdback(self) -> int:
        """A partial marker at the end, and the whitespace before it (it would touch a call)."""
        j = len(self.buf) - max((partial_tail(self.buf, o) for o in self.fmt.opens), default=0)
        while j > 0 and self.buf[j - 1] in _WS:
            j -= 1
        return len(self.buf) - j


def parse_tool_calls(text: str, fmt: ToolFormat, names: frozenset[str] | None = None) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole answer."""
    p = ToolCallParser(fmt, names)
    c1, k1 = p.feed(text)
    c2, k2 = p.finish()
    return c1 + c2, k1 + k2
