"""POST /v1/completions, /v1/chat/completions (OpenAI shapes, SSE streaming) and /v1/embeddings."""
from __future__ import annotations

import base64
import logging
import struct
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .common import (SSE_DONE, SSE_HEADERS, Server, check_api_key, collect, deltas, encode_prompts, expand,
                     field_error, render_chat, server, sse, submit, usage)
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RequestError, error_body
from .reasoning import REASONING_PARSERS, ReasoningFormat, ReasoningSplitter, split_reasoning
from .tool_parsers import ToolFormat, hidden_markers
from .tools import ToolCallStream, ToolPlan, split_tool_calls
from .text import TextStream, chat_logprobs, completion_logprobs, prompt_logprobs, stop_reason

log = logging.getLogger("specserve.server")
router = APIRouter(dependencies=[Depends(check_api_key)])


# SGLang's router re-serializes every body it forwards with these SGLang fields at these values, which change
# nothing here (no reasoning parser, stop strings trimmed): no warning for them on every routed request.
_SGLANG_NOOPS = {"no_stop_trim": False, "continue_final_message": False, "return_hidden_states": False,
                 "stream_reasoning": True}


def _reasoning(srv: Server, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> ReasoningFormat | None:
    """The think-block format to split this chat answer by (--reasoning-parser, unless the request opts out; not
    when a grammar makes the whole answer a tool call)."""
    name = srv.server_config.reasoning_parser
    constrained = plan is not None and plan.choice in ("required", "function")
    return REASONING_PARSERS[name] if name and body.separate_reasoning and not constrained else None


def _tool_parsing(srv: Server, plan: ToolPlan | None) -> tuple[ToolFormat | None, dict[int, str]]:
    """The format tool calls are parsed in (None: not parsed), and the special tokens of its markers that the
    text must spell out."""
    if plan is None or not plan.parses:
        return None, {}
    fmt = srv.tool_format()
    return fmt, hidden_markers(srv.tokenizer, fmt) if plan.choice == "auto" and srv.tokenizer is not None else {}


def _warn_extra(body: Any) -> None:
    extra = [k for k, v in (body.model_extra or {}).items() if not (k in _SGLANG_NOOPS and v is _SGLANG_NOOPS[k])]
    if extra:
        log.warning("ignoring unknown request fields: %s", ", ".join(sorted(extra)))


def _echo_logprobs(tok: Any, body: CompletionRequest, prompt: list[int], plps: list | None) -> dict[str, Any]:
    """The logprobs object of an echoed prompt (echo with logprobs): its text offsets start at 0."""
    return completion_logprobs(tok, plps or [], 0, prompt, body.logprobs)


def _offset_after(lps: dict[str, Any], offset: int) -> int:
    """The text offset of the token after a logprobs object's last (`offset` when it is empty)."""
    return lps["text_offset"][-1] + len(lps["tokens"][-1]) if lps["tokens"] else offset


def _final_text(tok: Any, sp: Any, o: dict, keep: dict[int, str] | None = None) -> str:
    """Whole text of a collected (non-streamed) output, cut before a matched stop string."""
    ts = TextStream(tok, sp.stop, keep)
    ts.ids = o["ids"]
    return ts.final_text(o["delta"].stop_text)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    srv = server(request)
    eng = srv.ready_engine()
    _warn_extra(body)
    params = body.sampling_params(default_max=16)
    prompts = encode_prompts(srv, body.prompt)
    seqs = expand(srv, prompts, params)
    q, ids = await submit(srv, seqs, "cmpl")
    rid, created, tok = f"cmpl-{uuid.uuid4().hex}", int(time.time()), eng.tokenizer
    echo = [tok.decode(p) if body.echo and tok is not None else "" for p, _ in seqs]
    if body.stream:
        return StreamingResponse(_stream_completion(srv, body, seqs, prompts, q, ids, rid, created, echo),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await collect(srv, request, q, ids)
    choices = []
    for i, ((p, sp), o) in enumerate(zip(seqs, outs)):
        d = o["delta"]
        text = _final_text(tok, sp, o)
        full = tok.decode(o["ids"]) if tok is not None else ""
        lps = None
        if body.echo_logprobs:  # one object over prompt and output, offsets continuous
            head = _echo_logprobs(tok, body, p, o["prompt_logprobs"])
            tail = completion_logprobs(tok, o["logprobs"], _offset_after(head, 0))
            lps = {k: head[k] + tail[k] for k in head}
        elif sp.logprobs is not None:
            lps = completion_logprobs(tok, o["logprobs"], len(echo[i]))
        choices.append({
            "index": i, "text": echo[i] + text, "finish_reason": d.finish_reason, "logprobs": lps,
            "stop_reason": stop_reason(o["ids"], sp.stop_token_ids, d.stop_text, full, sp.stop),
            **({} if body.prompt_logprobs is None else
               {"prompt_logprobs": prompt_logprobs(tok, o["prompt_logprobs"] or [], body.prompt_logprobs)}),
        })
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                         "choices": choices, "usage": usage(prompts, [o["delta"].meta for o in outs]),
                         "system_fingerprint": None})


class _EngineError(Exception):
    """A choice failed in the engine mid-stream: the stream ends with an error event, no usage chunk."""


async def _text_deltas(srv: Server, q: Any, ids: list[str], seqs: list, streams: list[TextStream]
                       ) -> AsyncIterator[tuple[Any, Any, TextStream, str]]:
    """(delta, its choice's params, its text stream, the delta's new text) for each engine delta."""
    async for d in deltas(srv, q, ids):
        if d.finish_reason == "error":
            raise _EngineError(d.error or "engine error")
        ts = streams[d.index]
        yield d, seqs[d.index][1], ts, ts.step(d.token_ids, d.finished, d.stop_text)


async def _stream_completion(srv: Server, body: CompletionRequest, seqs: list, prompts: list, q: Any, ids: list[str],
                             rid: str, created: int, echo: list[str]) -> AsyncIterator[str]:
    tok = srv.tokenizer
    streams = [TextStream(tok, sp.stop) for _, sp in seqs]
    offsets = [0 if body.echo_logprobs else len(e) for e in echo]
    metas: list[dict] = []
    extra = {"usage": None} if body.include_usage else {}

    def chunk(i: int, text: str, lps: Any, finish: str | None = None, stop: Any = None) -> str:
        c = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish, "stop_reason": stop}
        return sse({"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                    "choices": [c], **extra})

    for i, e in enumerate(echo):
        if e and not body.echo_logprobs:  # with logprobs, the echo waits for the prompt's (the first delta)
            yield chunk(i, e, None)
    try:
        async for d, sp, ts, text in _text_deltas(srv, q, ids, seqs, streams):
            i, lps = d.index, None
            if body.echo_logprobs and d.prompt_logprobs is not None:
                head = _echo_logprobs(tok, body, seqs[i][0], d.prompt_logprobs)
                offsets[i] = _offset_after(head, 0)
                yield chunk(i, echo[i], head)
            if sp.logprobs is not None and d.logprobs:
                lps = completion_logprobs(tok, d.logprobs, offsets[i])
                offsets[i] = _offset_after(lps, offsets[i])
            if d.finished:
                metas.append(d.meta)
                full = tok.decode(ts.ids) if tok is not None else ""
                yield chunk(i, text, lps, d.finish_reason, stop_reason(ts.ids, sp.stop_token_ids, d.stop_text, full, sp.stop))
            elif text or lps:
                yield chunk(i, text, lps)
    except _EngineError as e:
        yield sse(error_body(str(e), 500))
    else:
        if body.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                       "choices": [], "usage": usage(prompts, metas)})
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    srv = server(request)
    eng = srv.ready_engine()
    _warn_extra(body)
    params = body.sampling_params(default_max=srv.default_max_tokens())
    plan = body.tool_plan()
    prompt = render_chat(srv, body.messages, body.add_generation_prompt, plan)
    seqs = expand(srv, [prompt], params)
    try:
        q, ids = await submit(srv, seqs, "chatcmpl")
    except RequestError as e:
        if plan is not None and params.json_schema is not None and e.param == "json_schema":
            raise RequestError("tools", str(e).partition(": ")[2]) from None  # the grammar was built from tools
        raise
    rid, created, tok = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), eng.tokenizer
    if body.stream:
        return StreamingResponse(_stream_chat(srv, body, plan, seqs, prompt, q, ids, rid, created),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await collect(srv, request, q, ids)
    choices, fmt = [], _reasoning(srv, body, plan)
    tool_fmt, keep = _tool_parsing(srv, plan)
    for i, ((_, sp), o) in enumerate(zip(seqs, outs)):
        d = o["delta"]
        message: dict[str, Any] = {"role": "assistant", "content": _final_text(tok, sp, o, keep)}
        if fmt is not None:
            message["reasoning_content"], message["content"] = split_reasoning(message["content"], fmt)
        finish = d.finish_reason
        if tool_fmt is not None:
            assert plan is not None
            content, calls = split_tool_calls(message["content"], plan, tool_fmt)
            message["content"] = content or (None if calls else "")  # OpenAI: null beside tool calls
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        choices.append({
            "index": i, "message": message,
            "logprobs": chat_logprobs(tok, o["logprobs"]) if sp.logprobs is not None else None,
            "finish_reason": finish,
        })
    # vLLM: one prompt, so its prompt logprobs sit beside the choices
    extra = {} if body.prompt_logprobs is None else {
        "prompt_logprobs": prompt_logprobs(tok, outs[0]["prompt_logprobs"] or [], body.prompt_logprobs)}
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": srv.model_name,
                         "choices": choices, "usage": usage([prompt], [o["delta"].meta for o in outs]),
                         "system_fingerprint": None, **extra})


async def _stream_chat(srv: Server, body: ChatCompletionRequest, plan: ToolPlan | None, seqs: list, prompt: list[int],
                       q: Any, ids: list[str], rid: str, created: int) -> AsyncIterator[str]:
    tok = srv.tokenizer
    tool_fmt, keep = _tool_parsing(srv, plan)
    streams = [TextStream(tok, sp.stop, keep) for _, sp in seqs]
    fmt = _reasoning(srv, body, plan)
    splitters = [ReasoningSplitter(fmt) if fmt else None for _ in seqs]
    tool_streams = [ToolCallStream(plan, tool_fmt) if plan is not None and tool_fmt else None for _ in seqs]
    metas: list[dict] = []
    extra = {"usage": None} if body.include_usage else {}

    def delta(i: int, text: str, finished: bool) -> dict:
        """The text as content, or split into reasoning_content and content; tool calls parsed out of content."""
        s, t = splitters[i], tool_streams[i]
        r, c = s.feed(text) if s is not None else ("", text)
        if finished and s is not None:
            r2, c2 = s.finish()
            r, c = r + r2, c + c2
        calls: list = []
        if t is not None:
            c, calls = t.feed(c)
            if finished:
                c2, calls2 = t.finish()
                c, calls = c + c2, calls + calls2
        return {**({"reasoning_content": r} if r else {}), **({"content": c} if c else {}),
                **({"tool_calls": calls} if calls else {})}

    def chunk(i: int, delta: dict, lps: Any = None, finish: str | None = None) -> str:
        c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name,
                    "choices": [c], **extra})

    for i in range(len(seqs)):  # the first delta of every choice carries the role
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for d, sp, _, text in _text_deltas(srv, q, ids, seqs, streams):
            lps = chat_logprobs(tok, d.logprobs) if sp.logprobs is not None and d.logprobs else None
            if d.finished:
                metas.append(d.meta)
                piece, t = delta(d.index, text, True), tool_streams[d.index]
                finish = "tool_calls" if t is not None and t.calls and d.finish_reason == "stop" else d.finish_reason
                yield chunk(d.index, piece, lps, finish)
            elif text or lps:
                piece = delta(d.index, text, False)
                if piece or lps:
                    yield chunk(d.index, piece or {"content": ""}, lps)
    except _EngineError as e:
        yield sse(error_body(str(e), 500))
    else:
        if body.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name,
                       "choices": [], "usage": usage([prompt], metas)})
    yield SSE_DONE


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    """The mean of the target's final-normed last hidden state over each input's tokens, L2-normalised (a decoder
    LM has no pooling head; see Engine.embed)."""
    srv = server(request)
    srv.ready_engine()
    _warn_extra(body)
    if body.dimensions is not None:
        raise RequestError("dimensions", "not supported: the embedding has the model's hidden size")
    prompts = encode_prompts(srv, body.input, "input")
    try:
        vectors = await srv.engine.embed(prompts)
    except ValueError as e:
        raise field_error(e) from None
    data = []
    for i, v in enumerate(vectors):
        emb: Any = v if body.encoding_format == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(map(len, prompts))
    return JSONResponse({"object": "list", "data": data, "model": srv.model_name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
