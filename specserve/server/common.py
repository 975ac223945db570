"""State shared by the routes: the server object, auth, prompt encoding, running a group of
sequences (abort on disconnect), SSE framing and the usage object."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import Request

from ..config import EngineConfig
from ..core import SamplingParams
from .async_engine import AsyncEngine, Delta
from .config import ServerConfig
from .metrics import Metrics
from .protocol import ChatMessage, RequestError
from .tool_parsers import ToolFormat, detect_format, tool_format
from .tools import ToolPlan, chat_prompt


class Server:
    def __init__(self, config: EngineConfig, server_config: ServerConfig, engine: AsyncEngine, metrics: Metrics,
                 model_name: str) -> None:
        self.config, self.server_config, self.engine, self.metrics = config, server_config, engine, metrics
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    def ready_engine(self) -> Any:
        if self.engine.state == "failed":
            raise RequestError(None, f"model not available: {self.engine.load_error}", 503)
        if not self.engine.ready:
            raise RequestError(None, "Loading model", 503)
        return self.engine.engine

    def default_max_tokens(self) -> int:
        return self.engine.engine.max_model_len

    def tool_format(self) -> ToolFormat:
        """--tool-call-parser, else the format the chat template writes calls in."""
        name = self.server_config.tool_call_parser
        tok = self.tokenizer
        return tool_format(name) if name else detect_format(tok.chat_template if tok is not None else None)


def default_model_name(model: str) -> str:
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name or model)


def server(request: Request) -> Server:
    return request.app.state.server


def check_api_key(request: Request) -> None:
    """FastAPI dependency: with --api-key set, require `Authorization: Bearer <key>`."""
    key = server(request).server_config.api_key
    if key and not secrets.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
        raise RequestError(None, "invalid or missing API key (send 'Authorization: Bearer <key>')", 401)


def encode_prompts(srv: Server, prompt: Any, field: str = "prompt") -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] → token id lists (one per prompt)."""
    eng = srv.ready_engine()
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt or [])
    if not prompts:
        raise RequestError(field, "must not be empty")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if eng.tokenizer is None:
                raise RequestError(field, "this model has no tokenizer: send token ids")
            p = eng.tokenizer.encode(p)
        if not p:
            raise RequestError(field, "empty prompt (no tokens)")
        out.append(list(p))
    return out


def render_chat(srv: Server, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: ToolPlan | None = None) -> list[int]:
    """The prompt: the template gets the tools when it reads them (HF's `tools` variable); otherwise the tools,
    the history's calls and their results go in as text (tools.fallback_messages)."""
    import jinja2

    tok = srv.ready_engine().tokenizer
    if tok is None:
        raise RequestError("messages", "this model has no tokenizer")
    try:
        text = chat_prompt(tok, [m.as_template_dict() for m in messages], add_generation_prompt, tools,
                           srv.tool_format())
    except (ValueError, jinja2.TemplateError) as e:
        raise RequestError("messages", f"chat template: {e}") from None
    return tok.encode(text, add_special_tokens=False)


def _param(field: str, where: str) -> str:
    """A SamplingParams field as the body names it (`where` = "sampling_params." on /generate)."""
    return where + field if field in SamplingParams.__dataclass_fields__ else field


def expand(srv: Server, prompts: list[list[int]], params: SamplingParams,
           where: str = "") -> list[tuple[list[int], SamplingParams]]:
    """n samples per prompt; a seeded request gives sample j the seed seed + j (as the offline LLM)."""
    from dataclasses import replace

    try:  # pure: safe outside the engine thread; add_request checks again
        params.validate(srv.ready_engine().model.cfg.vocab_size)
    except ValueError as e:
        field, _, msg = str(e).partition(": ")
        raise RequestError(_param(field, where), msg) from None
    total = len(prompts) * params.n
    limit = srv.server_config.max_sequences_per_request
    if total > limit:
        raise RequestError("n", f"{len(prompts)} prompt(s) x n={params.n} exceeds {limit} sequences per request")
    return [(p, params if params.n == 1 or params.seed is None else replace(params, seed=params.seed + j))
            for p in prompts for j in range(params.n)]


def field_error(e: ValueError, where: str = "") -> RequestError:
    """The engine's "field: message" ValueError as a 400 naming the field (`where`: its prefix in the body)."""
    field, _, msg = str(e).partition(": ")
    return RequestError(_param(field, where), msg) if msg and " " not in field else RequestError(None, str(e))


async def submit(srv: Server, seqs: list[tuple[list[int], SamplingParams]], prefix: str,
                 where: str = "") -> tuple[asyncio.Queue, list[str]]:
    ids = srv.engine.new_ids(prefix, len(seqs))
    try:
        q = await srv.engine.submit(seqs, ids)
    except ValueError as e:  # SamplingParams / add_request (a grammar that does not compile)
        raise field_error(e, where) from None
    except asyncio.CancelledError:
        srv.engine.abort(ids)
        raise
    return q, ids


async def deltas(srv: Server, q: asyncio.Queue, ids: list[str]) -> AsyncIterator[Delta]:
    """Deltas until every sequence finished; leaving early (client gone, error) aborts the rest."""
    left = len(ids)
    try:
        while left:
            d = await q.get()
            left -= d.finished
            yield d
    finally:
        if left:
            srv.engine.abort(ids)


async def collect(srv: Server, request: Request, q: asyncio.Queue, ids: list[str]) -> list[dict[str, Any]]:
    """Non-streaming: gather each sequence's tokens; abort if the client disconnects meanwhile."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        srv.engine.abort(ids)

    watcher = asyncio.create_task(watch())
    out = [{"ids": [], "logprobs": [], "prompt_logprobs": None, "delta": None} for _ in ids]
    try:
        async for d in deltas(srv, q, ids):
            o = out[d.index]
            o["ids"] += d.token_ids
            o["logprobs"] += d.logprobs
            if d.prompt_logprobs is not None:
                o["prompt_logprobs"] = d.prompt_logprobs
            if d.finished:
                o["delta"] = d
    finally:
        watcher.cancel()
    errors = [o["delta"].error for o in out if o["delta"].finish_reason == "error"]
    if errors:
        raise RequestError(None, errors[0], 500)
    return out


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _cached(prompts: list[list[int]], metas: list[dict[str, Any]]) -> int:
    """Cached prompt tokens counted once per prompt, as prompt_tokens counts them (sample 0 of each prompt's
    n, which `expand` lays out prompt by prompt)."""
    n = len(metas) // len(prompts) if prompts and len(metas) % len(prompts) == 0 else 1
    return sum(m.get("cached_tokens", 0) for m in metas[::n])


def usage(prompts: list[list[int]], metas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI usage (with prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served) plus a
    `speculative` extension summed over the sequences (bonus token included
    in spec_accept_length = 1 + accepted / verify passes)."""
    metas = [m for m in metas if m is not None]
    prompt = sum(len(p) for p in prompts)
    completion = sum(m["completion_tokens"] for m in metas)
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                         "prompt_tokens_details": {"cached_tokens": _cached(prompts, metas)}}
    if metas and "spec_verify_ct" in metas[0]:
        ct = sum(m["spec_verify_ct"] for m in metas)
        acc = sum(m["spec_accepted_tokens"] for m in metas)
        per_pos: list[int] = []
        for m in metas:
            for i, v in enumerate(m["spec_accepted_per_pos"]):
                per_pos += [0] * (i + 1 - len(per_pos))
                per_pos[i] += v
        u["speculative"] = {
            "algorithm": metas[0]["speculative_algorithm"], "spec_verify_ct": ct,
            "spec_draft_tokens": sum(m["spec_draft_tokens"] for m in metas), "spec_accepted_tokens": acc,
            "spec_accept_length": 1.0 + acc / ct if ct else 1.0, "spec_accepted_per_pos": per_pos,
        }
    return u
