"""Native routes: POST /generate (SGLang-style), /tokenize, /detokenize, GET /server_info, GET /model_info."""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import __version__
from ..speculative.accept import choose_rule
from .common import (SSE_DONE, SSE_HEADERS, Server, check_api_key, collect, deltas, encode_prompts, expand,
                     render_chat, server, sse, submit)
from .protocol import DetokenizeRequest, GenerateRequest, RequestError, TokenizeRequest
from .text import TextStream, finite, token_str

router = APIRouter(dependencies=[Depends(check_api_key)])


def _logprob_meta(tok: Any, lps: list, kind: str = "output", ids: list[int] | None = None) -> dict[str, Any]:
    """SGLang's (logprob, token_id, text) triples of the output tokens, or (kind "input") of the prompt's from
    logprob_start_len: the first prompt position has logprob None and top None (`ids`: the tokens of `lps`)."""
    def triple(logprob: float | None, token_id: int) -> list:
        return [None if logprob is None else finite(logprob), token_id, token_str(tok, token_id)]

    return {f"{kind}_token_logprobs": [triple(None, ids[j]) if lp is None else triple(lp.logprob, lp.token_id)
                                       for j, lp in enumerate(lps)],
            f"{kind}_top_logprobs": [None if lp is None else [triple(v, i) for i, v in lp.top] for lp in lps]}


def _input_meta(tok: Any, prompt: list[int], plps: list | None, start: int) -> dict[str, Any]:
    return _logprob_meta(tok, (plps or [])[start:], "input", prompt[start:])


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    """{text | input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len, stream} →
    {text, output_ids, meta_info} (a list when several prompts or n > 1)."""
    srv = server(request)
    tok = srv.ready_engine().tokenizer
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("text", "send exactly one of text and input_ids")
    params = body.params()
    field = "text" if body.text is not None else "input_ids"
    prompts = encode_prompts(srv, body.text if body.text is not None else body.input_ids, field)
    if body.input_logprobs and any(body.logprob_start_len >= len(p) for p in prompts):
        raise RequestError("logprob_start_len", f"must be less than the prompt's length ({min(map(len, prompts))} tokens)")
    seqs = expand(srv, prompts, params, "sampling_params.")
    q, ids = await submit(srv, seqs, "gen", "sampling_params.")
    single = len(seqs) == 1 and (isinstance(body.text, str) or (body.input_ids and isinstance(body.input_ids[0], int)))
    if body.stream:
        return StreamingResponse(_stream(srv, seqs, q, ids, body), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    outs = await collect(srv, request, q, ids)
    results = []
    for (p, sp), o in zip(seqs, outs):
        ts = TextStream(tok, sp.stop)
        ts.ids = o["ids"]
        d = o["delta"]
        meta = {**d.meta, "finish_reason": d.finish_reason}
        if body.return_logprob:
            meta.update(_logprob_meta(tok, o["logprobs"]))
        if body.input_logprobs:
            meta.update(_input_meta(tok, p, o["prompt_logprobs"], body.logprob_start_len))
        results.append({"text": ts.final_text(d.stop_text), "output_ids": o["ids"], "meta_info": meta})
    return JSONResponse(results[0] if single else results)


async def _stream(srv: Server, seqs: list, q: Any, ids: list[str], body: GenerateRequest) -> AsyncIterator[str]:
    """SSE events carry the cumulative text and output_ids of one sequence (SGLang's convention)."""
    tok = srv.tokenizer
    streams = [TextStream(tok, sp.stop) for _, sp in seqs]
    lps: list[list] = [[] for _ in seqs]
    plps: list[list | None] = [None for _ in seqs]
    async for d in deltas(srv, q, ids):
        ts = streams[d.index]
        ts.step(d.token_ids, d.finished, d.stop_text)
        lps[d.index] += d.logprobs
        plps[d.index] = d.prompt_logprobs if d.prompt_logprobs is not None else plps[d.index]
        if d.finished:
            if d.finish_reason == "error":
                yield sse({"error": {"message": d.error, "type": "internal_server_error", "code": 500}})
                break
        meta = {**(d.meta or {"prompt_tokens": len(seqs[d.index][0]), "completion_tokens": len(ts.ids)}),
                "finish_reason": d.finish_reason}
        if body.return_logprob:
            meta.update(_logprob_meta(tok, lps[d.index]))
        if body.input_logprobs:
            meta.update(_input_meta(tok, seqs[d.index][0], plps[d.index], body.logprob_start_len))
        yield sse({"index": d.index, "text": ts.sent, "output_ids": list(ts.ids), "meta_info": meta})
    yield SSE_DONE


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Any:
    srv = server(request)
    eng = srv.ready_engine()
    if body.messages is not None:
        ids = render_chat(srv, body.messages, body.add_generation_prompt)
    else:
        text = body.prompt if body.prompt is not None else body.text
        if text is None:
            raise RequestError("prompt", "send prompt (or text) or messages")
        if eng.tokenizer is None:
            raise RequestError("prompt", "this model has no tokenizer")
        ids = eng.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
    eng = server(request).ready_engine()
    vocab = eng.model.cfg.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise RequestError("tokens", f"token ids must be in [0, {vocab})")
    if eng.tokenizer is None:
        raise RequestError("tokens", "this model has no tokenizer")
    text = eng.tokenizer.decode(body.tokens)
    return {"prompt": text, "text": text}


@router.get("/server_info")
async def server_info(request: Request) -> Any:
    """The resolved configuration: flags as given, plus what the engine chose (dtype, context, KV pages…)."""
    srv = server(request)
    scfg = dataclasses.asdict(srv.server_config)
    scfg["api_key"] = "***" if scfg["api_key"] else None
    # served_model_name at the top level, where SGLang has it: SGLang's router names a worker's model from it
    # (else the replica is registered as model "unknown"). No top-level model_path: from that the router
    # would try to load a tokenizer (a Hugging Face download) that HTTP routing never uses.
    info: dict[str, Any] = {"version": __version__, "model_name": srv.model_name, "state": srv.engine.state,
                            "served_model_name": srv.model_name,
                            "engine_config": dataclasses.asdict(srv.config), "server_config": scfg}
    eng = srv.engine.engine if srv.engine.ready else None
    if eng is not None:
        info["resolved"] = {
            "dtype": str(eng.model.dtype).replace("torch.", ""), "device": str(eng.model.embed.device),
            "max_model_len": eng.max_model_len, "vocab_size": eng.model.cfg.vocab_size,
            "architecture": eng.model.cfg.architecture, "kv_pages": eng.kv.allocator.num_pages,
            "page_size": eng.kv.page_size, "kv_slots": eng.kv.num_slots,
            "max_running_requests": srv.config.max_running_requests,
            "speculative": None if eng.drafter is None else {
                "algorithm": eng.config.speculative_algorithm, "drafter": eng.drafter.label,
                "num_draft_tokens": eng.num_draft_tokens, "accept": srv.config.speculative_accept,
                # what verifies sampled requests (temperature 0: greedy, always)
                "accept_rule": "tree walk" if eng.settings.topk > 1 else
                choose_rule(False, eng.drafter.supplies_q, eng.config.speculative_accept),
                "verify_mode": eng.verify_mode, "supplies_q": eng.drafter.supplies_q,
                "draft_model_path": str(getattr(eng.drafter, "path", "") or "") or None,
            },
        }
        if srv.engine.load_error is None and eng.drafter is not None:
            s = eng.stats
            info["spec_stats"] = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                                  "num_accepted_tokens": s.num_accepted_tokens,
                                  "accepted_tokens_per_pos": list(s.accepted_tokens_per_pos),
                                  "acceptance_length": s.acceptance_length}
    return JSONResponse(info)


@router.get("/model_info")
async def model_info(request: Request) -> Any:
    """SGLang's /model_info shape; SGLang's router asks each worker for it when it registers the worker.
    tokenizer_path stays null: the tokenizer is inside the model, and a router that got a path would try to
    load a tokenizer from a path that may exist only on the replica's machine."""
    return {"model_path": server(request).config.model, "tokenizer_path": None, "is_generation": True}
