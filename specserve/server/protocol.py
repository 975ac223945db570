"""Request bodies of the HTTP API (pydantic) and their mapping onto SamplingParams.

Shapes follow the OpenAI API (and vLLM's extras passed through `extra_body`: top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, prompt_logprobs), and structured output: OpenAI
`response_format` (json_object, json_schema), SGLang's json_schema / regex / ebnf on the native endpoint.
Fields we cannot honour yet are refused with a 400 naming the field, never silently ignored.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from ..core import SamplingParams
from .tools import ToolPlan

MAX_LOGPROBS = 20
_SEED_MAX = 2**63 - 1
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow to inf.
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01  # far below any useful value; smaller ones overflow the logits


# Ranges as SamplingParams.validate checks them, so the OpenAPI schema (and the fuzz test built on it)
# says what is valid; values outside get a 400 naming the field either way.
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0, le=100)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0, le=1)]
RepPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=10)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=0, le=_SEED_MAX)]
TokenId = Annotated[int, Field(ge=0)]
N = Annotated[int, Field(ge=1, le=64)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
# Known OpenAI / vLLM fields we cannot honour yet: refused with a 400 unless left neutral, and left
# out of the schema (it lists what works).
Hidden = SkipJsonSchema


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    return 0.0 if 0.0 <= t < SAMPLING_EPS else t


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is refused by name (the
    ranges are checked with the other sampling fields)."""
    out = []
    for k, v in (bias or {}).items():
        try:
            out.append((int(k), float(v)))
        except (TypeError, ValueError):
            raise RequestError("logit_bias", f"keys must be token ids, got {k!r}") from None
    return tuple(sorted(out))


def _check_repetition_penalty(v: float, name: str = "repetition_penalty") -> None:
    if not MIN_REPETITION_PENALTY <= v <= 10.0:
        raise RequestError(name, f"must be in [{MIN_REPETITION_PENALTY}, 10], got {v}")


class RequestError(ValueError):
    """A 4xx answer: `param` names the offending field (OpenAI error `param`)."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status = param, status


class _Body(BaseModel):
    # Unknown fields are accepted (clients send vendor extras) and logged by the route.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI `response_format.json_schema`: the schema under `schema` (output is always held to it,
    `strict` or not: a grammar masks every token)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any] | None:
        """For SamplingParams.response_format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise RequestError("response_format", "type json_schema needs json_schema.schema")
            return {"type": "json_schema", "json_schema": {"name": self.json_schema.name,
                                                           "schema": self.json_schema.schema_}}
        return {"type": self.type}


class _Knobs(_Body):
    """Sampling fields shared by the OpenAI bodies and the native `sampling_params`."""

    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: N = 1
    ignore_eos: bool = False


class _SamplingFields(_Knobs):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # one model per server: accepted, responses report the served name
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) → bias in [-100, 100]
    min_tokens: int = 0
    include_stop_str_in_output: Hidden[bool] = False
    skip_special_tokens: Hidden[bool] = True
    best_of: Hidden[int | None] = None
    prompt_logprobs: NumLogprobs | None = None  # vLLM: per prompt position the logprob of its token + top-N

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "only allowed when stream is true")
        if self.include_stop_str_in_output:
            raise RequestError("include_stop_str_in_output", "not supported")
        if not self.skip_special_tokens:
            raise RequestError("skip_special_tokens", "only true is supported")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of", "not supported (use n)")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs", "not available when stream is true (as vLLM)")
        _check_repetition_penalty(self.repetition_penalty)

    def _prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: how many alternatives each prompt position needs (None = off)."""
        return self.prompt_logprobs

    def _params(self, max_tokens: int | None, default_max: int, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=_temperature(self.temperature),
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, n=self.n,
            logit_bias=_logit_bias(self.logit_bias), min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(),
            response_format=self.response_format.as_dict() if self.response_format else None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: Hidden[str | None] = None

    def sampling_params(self, default_max: int) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise RequestError("suffix", "not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self._params(self.max_tokens, default_max, self.logprobs)

    @property
    def echo_logprobs(self) -> bool:
        """The logprobs object covers the echoed prompt too (OpenAI, vLLM)."""
        return self.echo and self.logprobs is not None

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs needs the prompt's: enough alternatives for both fields (each response cuts its own)
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None


class TextPart(_Body):
    type: Literal["text"]
    text: str


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object (none: no arguments)
    strict: bool | None = None  # accepted: under required / a named function the grammar always holds the arguments


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class MessageFunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text


class MessageToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def as_template_dict(self) -> dict[str, Any]:
        """HF's shape: templates dump `arguments` with tojson, so JSON text becomes the object it spells."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # not JSON: the template gets the text as it came
        out: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        if self.id is not None:
            out["id"] = self.id
        return out


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made (content may be null)
    tool_call_id: str | None = None  # tool: the call this message answers

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    """The shape OpenAI requires of a function's `parameters` (whether the rest compiles is the grammar's to say)."""
    if schema.get("type", "object") != "object":
        raise RequestError(param, f"must be a JSON schema of type object, got type {schema['type']!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise RequestError(param, "properties must map names to schemas")
    req = schema.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise RequestError(param, "required must be a list of property names")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default auto with tools
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    separate_reasoning: bool = True  # SGLang: with --reasoning-parser, false keeps the think block in content

    def sampling_params(self, default_max: int) -> SamplingParams:
        self._check_common()
        plan = self.tool_plan()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs", "requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestError("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise RequestError("max_completion_tokens", f"must be an integer >= 1, got {self.max_completion_tokens}")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self._params(mt, default_max, lp)
        try:
            schema = plan.grammar() if plan is not None else None
        except ValueError as e:
            raise RequestError("tools", str(e)) from None
        if schema is None:
            return params
        if params.response_format is not None and params.response_format.get("type") != "text":
            raise RequestError("tool_choice", "required or a named function cannot be combined with response_format")
        return replace(params, json_schema=json.dumps(schema))

    def tool_plan(self) -> ToolPlan | None:
        """The checked tools, tool_choice and tool messages (None: no tools)."""
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            if m.role == "tool" and not m.tool_call_id:
                raise RequestError(f"messages[{i}].tool_call_id", "required for a tool message")
        if self.tools is None:
            if self.tool_choice is not None:
                raise RequestError("tool_choice", "only allowed when tools are given")
            return None
        if not self.tools:
            raise RequestError("tools", "must not be empty (leave it out for no tools)")
        names: set[str] = set()
        for i, t in enumerate(self.tools):
            f = t.function
            if not _TOOL_NAME.fullmatch(f.name):
                raise RequestError(f"tools[{i}].function.name",
                                   f"must be 1-64 letters, digits, '_', '.' or '-', got {f.name!r}")
            if f.name in names:
                raise RequestError(f"tools[{i}].function.name", f"duplicate function name {f.name!r}")
            names.add(f.name)
            if f.parameters is not None:
                _check_parameters(f.parameters, f"tools[{i}].function.parameters")
        choice = self.tool_choice or "auto"
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise RequestError("tool_choice", f"function {named!r} is not in tools")
        return ToolPlan(tuple(t.model_dump(exclude_none=True) for t in self.tools),
                        "function" if named is not None else str(choice), named, self.parallel_tool_calls)


class GenerateSamplingParams(_Knobs):
    """SGLang-style `sampling_params` of the native /generate."""

    max_new_tokens: MaxTokens = 128
    temperature: Temperature = 1.0
    json_schema: str | dict[str, Any] | None = None  # a JSON schema (as JSON text, or an object)
    regex: str | None = None
    ebnf: str | None = None  # GBNF: root ::= ...


class GenerateRequest(_Body):
    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: NumLogprobs = 0
    # SGLang: with return_logprob, the prompt position from which input_token_logprobs start (-1: none)
    logprob_start_len: Annotated[int, Field(ge=-1)] = -1
    stream: bool = False

    @property
    def input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def params(self) -> SamplingParams:
        s = self.sampling_params
        if not 0 <= self.top_logprobs_num <= MAX_LOGPROBS:
            raise RequestError("top_logprobs_num", f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check_repetition_penalty(s.repetition_penalty, "sampling_params.repetition_penalty")
        stop = (s.stop,) if isinstance(s.stop, str) else tuple(s.stop or ())
        return SamplingParams(
            max_tokens=s.max_new_tokens, temperature=_temperature(s.temperature), top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, seed=s.seed, stop=stop, stop_token_ids=tuple(s.stop_token_ids or ()),
            ignore_eos=s.ignore_eos, n=s.n, logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num if self.input_logprobs else None,
            json_schema=s.json_schema, regex=s.regex, ebnf=s.ebnf)


class EmbeddingRequest(_Body):
    """OpenAI /v1/embeddings: `input` a string, strings, token ids or lists of them."""

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    text: str | None = None  # SGLang spelling of `prompt`
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    tokens: list[TokenId]


def error_body(message: str, status: int, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    if type_ is None:
        type_ = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 503: "unavailable_error"}.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}
