"""`specserve bench serving`: load against any OpenAI-compatible server, or servers it starts itself.

Streams /v1/chat/completions at fixed concurrencies or a Poisson request rate and reports TTFT,
TPOT, per-token ITL (a chunk of n tokens counts as n gaps; tokens per chunk come from streamed
logprobs, which vLLM/SGLang/specserve all return) percentiles and throughput. Acceptance comes from
the server's Prometheus counters (specserve:/vllm: spec_decode_*), scraped before and after.
With --launch, each configuration's server is started on the same GGUF with the same threads (bench/launch.py:
llama-server, llama-server+draft, llama-server+ngram, or a specserve configuration ALGO[+WINDOW][:flag=value...]),
timed to ready, run at one concurrency, and stopped (a fresh server per concurrency); greedy texts are compared
with plain decoding's on the same engine (`plain`, `llama-server`). With `--repeat N` the servers take turns N
times and each reports its median run per concurrency, every run's tok/s beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from typing import Any

from tqdm import tqdm

from .common import record, workloads
from .launch import free_port, is_llama_server, launch, llama_server_argv, specserve_argv
from .metrics import per_token_itl, percentiles, tpot


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name for requests (default: the first of /v1/models)")
    p.add_argument("--workload", nargs="+", default=["humaneval"])
    p.add_argument("--prompts", default=None)
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4],
                   help="requests in flight; several values: one run each (ignored with --request-rate)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-new-tokens tokens")
    p.add_argument("--api-key", default=None)
    p.add_argument("--output", default=None)
    g = p.add_argument_group("servers it starts (instead of --base-url)")
    g.add_argument("--launch", nargs="+", default=None, metavar="CONFIG",
                   help="llama-server, llama-server+draft, llama-server+ngram, plain, or ALGO[+WINDOW][:flag=value...]")
    g.add_argument("--model-path", default=None, help="the GGUF every launched server loads")
    g.add_argument("--speculative-draft-model-path", default=None, help="llama-server+draft's draft model (-md)")
    g.add_argument("--num-threads", type=int, default=None, help="threads of every launched server (default: all)")
    g.add_argument("--repeat", type=int, default=1,
                   help="the servers take turns this many times; each reports its median run per concurrency")


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
    text: list[str] = []
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
                text.append(ch.get("delta", {}).get("content") or "")
                lp = (ch.get("logprobs") or {}).get("content")
                n = len(lp) if lp is not None else int(bool(ch.get("delta", {}).get("content")))
                if n:
                    times.append(time.perf_counter())
                    counts.append(n)
    end = time.perf_counter()
    n = sum(counts)
    return {"error": error, "tokens": n, "text": "".join(text), "e2e": end - start,
            "ttft": times[0] - start if times else None,
            "itl": per_token_itl(times, counts), "tpot": tpot(end - start, times[0] - start, n) if times else None}


async def _run(a: argparse.Namespace, base_url: str, concurrency: int) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    convs = [c for cs in workloads(a).values() for c in cs]
    # NOTE: a connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few
    # requests, and a POST sent on it as it closes fails ("Server disconnected without sending a response")
    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        model = a.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        before = parse_spec_metrics((await client.get("/metrics")).text)
        sem = asyncio.Semaphore(concurrency if a.request_rate is None else len(convs))
        bar = tqdm(total=len(convs), desc="requests", leave=False)

        async def go(conv: list[dict], delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)
            async with sem:
                body = {"model": model, "messages": conv, "max_tokens": a.max_new_tokens, "temperature": a.temperature,
                        "stream": True, "logprobs": True, "top_logprobs": 0, **({"ignore_eos": True} if a.ignore_eos
                                                                               else {})}
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
        "texts": [r.get("text") for r in res],
        "errors": sorted({str(r["error"]) for r in res if r.get("error")}),
    }


def _report(r: dict[str, Any], mode: str) -> None:
    print(f"\n{r['requests']} requests ({r['failed']} failed), {mode}, {r['wall_s']:.1f} s: "
          f"{r['output_tok_s']:.1f} output tok/s, {r['request_s']:.2f} req/s, accept length "
          f"{r['accept_length'] if r['accept_length'] is None else round(r['accept_length'], 3)}")
    for e in r["errors"][:3]:
        print(f"  error: {e[:300]}")
    for k in ("ttft_s", "tpot_s", "itl_s"):
        print(f"  {k[:-2].upper():5s} ms  " + "  ".join(f"{p} {v * 1000:7.1f}" for p, v in r[k].items()))


def _load(a: argparse.Namespace, base_url: str, concurrency: list[int | None] | None = None) -> dict[str, Any]:
    """Each of `concurrency` (default: every --concurrency, or the request rate as None) against one server: result
    per mode."""
    out = {}
    for c in concurrency or _modes(a):
        mode = f"rate {a.request_rate}/s" if c is None else f"concurrency {c}"
        out[mode] = asyncio.run(_run(a, base_url, c or 0))
        _report(out[mode], mode)
    return out


def _modes(a: argparse.Namespace) -> list[int | None]:
    return [None] if a.request_rate else a.concurrency


def _launched(a: argparse.Namespace) -> dict[str, Any]:
    """--launch: for each concurrency, each configuration's server started, timed to ready, loaded, stopped; --repeat
    times, the servers taking turns."""
    from .common import config_flags, median_run

    if not a.model_path:
        raise ValueError("--launch needs --model-path (the GGUF every server loads)")
    if a.repeat < 1:
        raise ValueError("--repeat: at least 1")
    threads = a.num_threads or os.cpu_count() or 1
    batch = max([1] if a.request_rate else a.concurrency)
    results: dict[str, Any] = {}
    measured: dict[str, list[dict[str, Any]]] = {}  # name → one {ready_s, peak_rss_gib, runs} per repeat
    # NOTE: turns, not one server's repeats in a row: a shared host's speed drifts over minutes
    for rep in range(a.repeat):
        for name in (n for n in a.launch if "error" not in results.get(n, {})):
            one: dict[str, Any] = {"ready_s": [], "peak_rss_gib": 0.0, "runs": {}}
            # NOTE: a fresh server per concurrency: the same prompts again would hit the prefix cache an earlier
            # concurrency filled, and the suffix index would draft its answers (AUTO, NGRAM) word for word
            for c in _modes(a):
                port = free_port()
                argv = (llama_server_argv(name, a.model_path, port, threads, a.speculative_draft_model_path,
                                          parallel=batch)
                        if is_llama_server(name) else specserve_argv(a.model_path, port, threads,
                                                                     config_flags(name, "--launch")))
                print(f"== {name}{f' (repeat {rep + 1})' if a.repeat > 1 else ''}: {' '.join(argv)}")
                try:
                    srv = launch(argv, port, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
                except RuntimeError as e:  # one server that does not start: the others still run
                    print(f"{name}: failed\n{e}")
                    results[name] = {"error": str(e), "argv": argv}
                    break
                with srv:
                    one["runs"].update(_load(a, srv.url, [c]))
                    one["ready_s"].append(srv.ready_s)
                    one["peak_rss_gib"] = max(one["peak_rss_gib"], srv.peak_rss_gib())
                results[name] = {"argv": argv}
            else:
                measured.setdefault(name, []).append({**one, "ready_s": statistics.median(one["ready_s"])})
    for name, reps in measured.items():
        if "error" in results[name]:
            continue
        results[name].update(ready_s=statistics.median(r["ready_s"] for r in reps),
                             peak_rss_gib=max(r["peak_rss_gib"] for r in reps),
                             runs={m: median_run([r["runs"][m] for r in reps]) for m in reps[0]["runs"]})
    for name, r in results.items():  # greedy texts against plain decoding on the same engine
        ref = results.get("llama-server" if is_llama_server(name) else "plain")
        if ref is not None and ref is not r and "runs" in ref and "runs" in r and a.temperature == 0:
            for mode, run in r["runs"].items():
                run["text_equals_plain"] = run["texts"] == ref["runs"][mode]["texts"]
    _summarize(results)
    return results


def _summarize(results: dict[str, Any]) -> None:
    ok = {n: r for n, r in results.items() if "runs" in r}
    if not ok:
        return
    base = results.get("llama-server", {}).get("runs", {})
    modes = list(next(iter(ok.values()))["runs"])
    print(f"\n{'config':<28}{'ready s':>8}{'GiB':>6}" + "".join(f"{m:>22}" for m in modes))
    for name, r in ok.items():
        cells = []
        for m in modes:
            run, b = r["runs"][m], base.get(m)
            ratio = f" {run['output_tok_s'] / b['output_tok_s']:.2f}x" if b and b["output_tok_s"] else ""
            same = {True: " =", False: " !=", None: ""}[run.get("text_equals_plain")]
            cells.append(f"{run['output_tok_s']:.1f} tok/s{ratio}{same}")
        print(f"{name:<28}{r['ready_s']:>8.1f}{r['peak_rss_gib']:>6.2f}" + "".join(f"{c:>22}" for c in cells))


def run(a: argparse.Namespace) -> dict[str, Any]:
    r = _launched(a) if a.launch else _load(a, a.base_url)
    path = record("serving", a, r)
    print(f"wrote {path}")
    return r
