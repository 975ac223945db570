"""Tool calling on /v1/chat/completions: what a request's `tools` / `tool_choice` ask for (`ToolPlan`), the grammar
that holds the answer to a call, the prompt (the chat template's own `tools`, or a system-prompt fallback), and
the answer turned into OpenAI `tool_calls`, whole or streamed (`ToolCallStream`).

tool_choice (vLLM's behaviour):
  auto      the model decides; `--tool-call-parser`'s format is parsed out of its text
  none      the tools still reach the template, but the text is not parsed (and the fallback adds no tool prompt)
  required  the grammar makes the answer a JSON list of {"name", "parameters"} objects, one of the tools each
            (at least one; exactly one when parallel_tool_calls is false)
  named     the grammar makes the answer that function's arguments, an object of its `parameters` schema
"""
from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any

from .tool_parsers import CallListFormat, ParsedCall, ToolCallParser, ToolFormat

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_CALL_LIST = CallListFormat()


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, description, parameters}}
    choice: str  # auto | none | required | function
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """The answer is turned into tool calls."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        f = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return f.get("parameters") or EMPTY_PARAMETERS

    def grammar(self) -> dict[str, Any] | None:
        """The JSON schema the answer is held to (required, named), else None. Raises ValueError for `$defs`
        that two tools define differently (they are hoisted to the root, where `$ref`s point)."""
        if self.choice == "function":
            assert self.function is not None
            return self.parameters(self.function)
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for name in sorted(self.names):
            params = dict(self.parameters(name))
            for key in ("$defs", "definitions"):
                for k, v in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(k, v) != v:
                        raise ValueError(f"two tools define {key} {k!r} differently")
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params}})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


@functools.lru_cache(maxsize=16)
def template_uses_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (else the fallback prompt describes them)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as templates are compiled
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return "tools" in template


def fallback_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, fmt: ToolFormat) -> list[dict[str, Any]]:
    """For a template without tool support: the tools described in the system prompt (not under tool_choice
    none), the history's calls written in `fmt` as assistant text and tool results as user turns wrapped in
    <tool_response> tags."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")])
            m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if plan is None or not plan.parses:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    prompt = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
              f"</tools>\n\n{fmt.instructions}")
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def chat_prompt(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, plan: ToolPlan | None,
                fmt: ToolFormat) -> str:
    """The prompt text of template-shaped messages: the template gets the tools when it reads them (HF's `tools`
    variable); otherwise the tools, the history's calls and their results go in as text (fallback_messages)."""
    extra: dict[str, Any] = {}
    if template_uses_tools(tok.chat_template):
        if plan is not None:
            extra["tools"] = list(plan.tools)
    elif plan is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = fallback_messages(messages, plan, fmt)
    return tok.apply_chat_template(messages, add_generation_prompt, **extra)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's answer text in pieces → (content, `delta.tool_calls` entries) per piece; `calls` gathers the
    message's `tool_calls`. The whole answer fed at once gives the non-streamed message, so both agree: a
    call's entries join (arguments concatenated) to its entry in `calls`."""

    def __init__(self, plan: ToolPlan, fmt: ToolFormat) -> None:
        self.plan = plan
        self.calls: list[dict[str, Any]] = []
        self.parser: ToolCallParser | None = None
        if plan.choice == "auto":
            self.parser = ToolCallParser(fmt, plan.names)
        elif plan.choice == "required":
            self.parser = ToolCallParser(_CALL_LIST, plan.names)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.parser is None:  # named: the answer is the arguments, streamed as they come
            return "", self._arguments(text)
        content, calls = self.parser.feed(text)
        return content, self._add(calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.parser is None:
            return "", self._arguments("", finish=True)
        content, calls = self.parser.finish()
        return content, self._add(calls)

    def _arguments(self, text: str, finish: bool = False) -> list[dict[str, Any]]:
        """Named: the first piece opens the call (id, type, name), later ones add to its arguments; an answer
        that decoded to no text still makes the call, at the end."""
        if self.calls:
            if not text:
                return []
            self.calls[0]["function"]["arguments"] += text
            return [{"index": 0, "function": {"arguments": text}}]
        if not text and not finish:
            return []
        call = {"id": _call_id(), "type": "function", "function": {"name": self.plan.function, "arguments": text}}
        self.calls.append(call)
        return [{"index": 0, **call, "function": dict(call["function"])}]

    def _add(self, parsed: list[ParsedCall]) -> list[dict[str, Any]]:
        out = []
        for c in parsed:
            if self.calls and not self.plan.parallel:
                break  # parallel_tool_calls false: the first call only
            call = {"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            out.append({"index": len(self.calls), **call, "function": dict(call["function"])})
            self.calls.append(call)
        return out


def split_tool_calls(text: str, plan: ToolPlan, fmt: ToolFormat) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole answer."""
    s = ToolCallStream(plan, fmt)
    c1, _ = s.feed(text)
    c2, _ = s.finish()
    return c1 + c2, s.calls
