"""`specserve bench serving`: load against any OpenAI-compatible server.

Streams /v1/chat/completions at a fixed concurrency or Poisson request rate and reports TTFT,
TPOT, per-token ITL (a chunk of n tokens counts as n gaps; tokens per chunk come from streamed
logprobs, which vLLM/SGLang/specserve all return) percentiles and throughput. Acceptance comes from
the server's Prometheus counters (specserve:/vllm: spec_decode_*), scraped before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from typing import Any

from tqdm import tqdm

from .common import record, workloads
from .metrics import per_token_itl, percentiles, tpot


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name for requests (default: the first of /v1/models)")
    p.add_argument("--workload", nargs="+", default=["humaneval"])
    p.add_argument("--prompts", default=None)
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (ignored with --request-rate)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--output", default=None)


_METRIC = re.compile(r"^(\w+:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens))(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def parse_spec_metrics(text: str) -> dict[str, float]:
    """Sum the speculative counters of a Prometheus scrape (any prefix, e.g. specserve: or vllm:)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            key = m.group(1).split(":")[1]
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


async def _one(client: Any, url: str, body: dict, headers: dict) -> dict[str, Any]:
    start = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    error = None
    async with client.stream("POST", url, json=body, headers=headers, timeout=600) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            for ch in chunk.get("choices", []):
                lp = (ch.get("logprobs") or {}).get("content")
                n = len(lp) if lp is not None else int(bool(ch.get("delta", {}).get("content")))
                if n:
                    times.append(time.perf_counter())
                    counts.append(n)
    end = time.perf_counter()
    n = sum(counts)
    return {"error": error, "tokens": n, "e2e": end - start, "ttft": times[0] - start if times else None,
            "itl": per_token_itl(times, counts), "tpot": tpot(end - start, times[0] - start, n) if times else None}


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    convs = [c for cs in workloads(a).values() for c in cs]
    async with httpx.AsyncClient(base_url=a.base_url) as client:
        model = a.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        before = parse_spec_metrics((await client.get("/metrics")).text)
        sem = asyncio.Semaphore(a.concurrency if a.request_rate is None else len(convs))
        bar = tqdm(total=len(convs), desc="requests", leave=False)

        async def go(conv: list[dict], delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)
            async with sem:
                body = {"model": model, "messages": conv, "max_tokens": a.max_new_tokens, "temperature": a.temperature,
                        "stream": True, "logprobs": True, "top_logprobs": 0}
                r = await _one(client, "/v1/chat/completions", body, headers)
                bar.update()
                return r

        rng, t, delays = random.Random(0), 0.0, []
        for _ in convs:
            delays.append(t)
            if a.request_rate:
                t += rng.expovariate(a.request_rate)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(go(c, d) for c, d in zip(convs, delays)))
        wall = time.perf_counter() - t0
        after = parse_spec_metrics((await client.get("/metrics")).text)
    ok = [r for r in res if not r.get("error")]
    drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    acc = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
    return {
        "requests": len(res), "failed": len(res) - len(ok), "wall_s": wall,
        "output_tok_s": sum(r["tokens"] for r in ok) / wall, "request_s": len(ok) / wall,
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "accept_length": 1 + acc / drafts if drafts else None,
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    r = asyncio.run(_run(a))
    mode = f"rate {a.request_rate}/s" if a.request_rate else f"concurrency {a.concurrency}"
    print(f"\n{r['requests']} requests ({r['failed']} failed), {mode}, {r['wall_s']:.1f} s: "
          f"{r['output_tok_s']:.1f} output tok/s, {r['request_s']:.2f} req/s, accept length "
          f"{r['accept_length'] if r['accept_length'] is None else round(r['accept_length'], 3)}")
    for k in ("ttft_s", "tpot_s", "itl_s"):
        print(f"  {k[:-2].upper():5s} ms  " + "  ".join(f"{p} {v * 1000:7.1f}" for p, v in r[k].items()))
    path = record("serving", a, r)
    print(f"wrote {path}")
    return r
