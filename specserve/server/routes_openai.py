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
from .text import TextStream, chat_logprobs, completion_logprobs, stop_reason

log = logging.getLogger("specserve.server")
router = APIRouter(dependencies=[Depends(check_api_key)])


# SGLang's router re-serializes every body it forwards with these SGLang fields at these values, which change
# nothing here (no reasoning parser, stop strings trimmed): no warning for them on every routed request.
_SGLANG_NOOPS = {"no_stop_trim": False, "continue_final_message": False, "return_hidden_states": False,
                 "stream_reasoning": True}


def _reasoning(srv: Server, body: ChatCompletionRequest) -> ReasoningFormat | None:
    """The think-block format to split this chat answer by (--reasoning-parser, unless the request opts out)."""
    name = srv.server_config.reasoning_parser
    return REASONING_PARSERS[name] if name and body.separate_reasoning else None


def _warn_extra(body: Any) -> None:
    extra = [k for k, v in (body.model_extra or {}).items() if not (k in _SGLANG_NOOPS and v is _SGLANG_NOOPS[k])]
    if extra:
        log.warning("ignoring unknown request fields: %s", ", ".join(sorted(extra)))


def _final_text(tok: Any, sp: Any, o: dict) -> str:
    """Whole text of a collected (non-streamed) output, cut before a matched stop string."""
    ts = TextStream(tok, sp.stop)
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
    for i, ((_, sp), o) in enumerate(zip(seqs, outs)):
        d = o["delta"]
        text = _final_text(tok, sp, o)
        full = tok.decode(o["ids"]) if tok is not None else ""
        choices.append({
            "index": i, "text": echo[i] + text, "finish_reason": d.finish_reason,
            "logprobs": completion_logprobs(tok, o["logprobs"], len(echo[i])) if sp.logprobs is not None else None,
            "stop_reason": stop_reason(o["ids"], sp.stop_token_ids, d.stop_text, full, sp.stop),
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
    offsets = [len(e) for e in echo]
    metas: list[dict] = []
    extra = {"usage": None} if body.include_usage else {}

    def chunk(i: int, text: str, lps: Any, finish: str | None = None, stop: Any = None) -> str:
        c = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish, "stop_reason": stop}
        return sse({"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                    "choices": [c], **extra})

    for i, e in enumerate(echo):
        if e:
            yield chunk(i, e, None)
    try:
        async for d, sp, ts, text in _text_deltas(srv, q, ids, seqs, streams):
            i, lps = d.index, None
            if sp.logprobs is not None and d.logprobs:
                lps = completion_logprobs(tok, d.logprobs, offsets[i])
                offsets[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
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
    prompt = render_chat(srv, body.messages, body.add_generation_prompt)
    seqs = expand(srv, [prompt], params)
    q, ids = await submit(srv, seqs, "chatcmpl")
    rid, created, tok = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), eng.tokenizer
    if body.stream:
        return StreamingResponse(_stream_chat(srv, body, seqs, prompt, q, ids, rid, created),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await collect(srv, request, q, ids)
    choices, fmt = [], _reasoning(srv, body)
    for i, ((_, sp), o) in enumerate(zip(seqs, outs)):
        d = o["delta"]
        message: dict[str, Any] = {"role": "assistant", "content": _final_text(tok, sp, o)}
        if fmt is not None:
            message["reasoning_content"], message["content"] = split_reasoning(message["content"], fmt)
        choices.append({
            "index": i, "message": message,
            "logprobs": chat_logprobs(tok, o["logprobs"]) if sp.logprobs is not None else None,
            "finish_reason": d.finish_reason,
        })
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": srv.model_name,
                         "choices": choices, "usage": usage([prompt], [o["delta"].meta for o in outs]),
                         "system_fingerprint": None})


async def _stream_chat(srv: Server, body: ChatCompletionRequest, seqs: list, prompt: list[int], q: Any,
                       ids: list[str], rid: str, created: int) -> AsyncIterator[str]:
    tok = srv.tokenizer
    streams = [TextStream(tok, sp.stop) for _, sp in seqs]
    fmt = _reasoning(srv, body)
    splitters = [ReasoningSplitter(fmt) if fmt else None for _ in seqs]
    metas: list[dict] = []
    extra = {"usage": None} if body.include_usage else {}

    def delta(i: int, text: str, finished: bool) -> dict:
        """The text as content, or split into reasoning_content and content."""
        s = splitters[i]
        if s is None:
            return {"content": text} if text else {}
        r, c = s.feed(text)
        if finished:
            r2, c2 = s.finish()
            r, c = r + r2, c + c2
        return {**({"reasoning_content": r} if r else {}), **({"content": c} if c else {})}

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
                yield chunk(d.index, delta(d.index, text, True), lps, d.finish_reason)
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
